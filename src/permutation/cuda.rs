//! CUDA implementations of the permutation primitives: which specialisation
//! of each kernel of `kernels/permutation.cu` a call needs (element type,
//! hidden size, experts as template arguments) and its launches.

use super::{CombineBwd, CombineFwd, DispatchFwd, SortChunks};
use crate::cuda::{arg, grid, int, launch, Instance, Kernel, LaunchConfig, Stream, PERMUTATION};
use crate::ffi::{DataType, Result};
use crate::invalid;

// Each kernel takes the constants of its launch below as template arguments
// (see `kernels/permutation.cu`), and checks what it assumes of them.

/// Threads of the map passes, of `rank_chunks`, of the row kernels (the
/// last checked against the kernels' `ROW_BLOCK`).
const MAP_BLOCK: u32 = 256;
const SCAN_BLOCK: u32 = 1024;
const ROW_BLOCK: u32 = 128;
/// Rows each zeroing block checks and each sort block writes.
const ZERO_ROWS: usize = 32;
const SORT_ROWS: usize = 32;
/// The chunk tables of a sort live in shared memory.
pub const MAX_CHUNKS: usize = 1024;
/// A token's copies are listed in shared memory, one entry per expert.
pub const MAX_EXPERTS: usize = 2048;
/// Threads a map pass aims for (one per (chunk of tokens, expert)), and the
/// fewest tokens of a chunk.
const MAP_THREADS: usize = 1 << 17;
const MIN_CHUNK_TOKENS: usize = 4;

fn check_experts(experts: usize) -> Result<()> {
    if experts > MAX_EXPERTS {
        invalid!("{experts} experts: the CUDA permutation kernels take at most {MAX_EXPERTS}")
    }
    Ok(())
}

/// What `scatter_rows` runs for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Scatter {
    /// A dispatch, on the maps it has just laid out.
    Dispatch,
    /// Combine's backward, on maps from the caller (checked), with or
    /// without merging weights.
    CombineBackward { weighted: bool },
}

/// `scatter_rows` for rows of `hidden` elements.
pub fn scatter_instance(dtype: DataType, hidden: usize, experts: usize, scatter: Scatter) -> Result<String> {
    check_experts(experts)?;
    let (weighted, check_map) = match scatter {
        Scatter::Dispatch => (false, false),
        Scatter::CombineBackward { weighted } => (weighted, true),
    };
    Instance::new("scatter_rows")
        .dtype(dtype)
        .int(hidden)
        .int(experts)
        .flag(weighted)
        .flag(check_map)
        .int(ROW_BLOCK)
        .int(tokens_per_block(experts))
        .int(ZERO_ROWS)
        .build()
}

/// `gather_rows` (combine, and dispatch's backward), its sums started from an
/// `addend` or from zero.
pub fn gather_instance(dtype: DataType, hidden: usize, experts: usize, weighted: bool, addend: bool) -> Result<String> {
    check_experts(experts)?;
    let instance = Instance::new("gather_rows").dtype(dtype).int(hidden).int(experts).flag(weighted).flag(addend);
    instance.int(ROW_BLOCK).int(tokens_per_block(experts)).build()
}

/// `sort_chunks` (or its inverse).
pub fn sort_instance(dtype: DataType, hidden: usize, inverse: bool) -> Result<String> {
    let instance = Instance::new("sort_chunks").dtype(dtype).int(hidden).flag(inverse);
    instance.int(ROW_BLOCK).int(SORT_ROWS).int(MAX_CHUNKS).build()
}

/// The kernels that lay out a dispatch's maps: `[count_routed, rank_chunks, assign_rows]`.
pub fn dispatch_map_instances() -> Result<[String; 3]> {
    Ok([
        Instance::new("count_routed").int(MAP_BLOCK).build()?,
        Instance::new("rank_chunks").int(SCAN_BLOCK).build()?,
        Instance::new("assign_rows").int(MAP_BLOCK).build()?,
    ])
}

/// Tokens a row-kernel block moves: the copies of up to 4 tokens are listed
/// at once (a warp each), so that only one wait on dest_rows starts their
/// work. Rows of many experts keep one token a block (the lists are E entries).
fn tokens_per_block(experts: usize) -> usize {
    if experts <= 512 {
        4
    } else {
        1
    }
}

/// The blocks of the tokens' rows.
fn token_blocks(tokens: usize, experts: usize) -> usize {
    tokens.div_ceil(tokens_per_block(experts))
}

/// The blocks of the tokens, then the zeroing blocks: one per `ZERO_ROWS` of
/// the `checked_rows` output rows they check (all the rows, or none).
fn token_and_zero_blocks(tokens: usize, experts: usize, checked_rows: usize) -> Result<LaunchConfig> {
    let blocks = token_blocks(tokens, experts) + checked_rows.div_ceil(ZERO_ROWS);
    Ok(LaunchConfig { grid: grid(blocks)?, block: ROW_BLOCK, shared_bytes: 0 })
}

/// How the dispatch's map passes split the tokens: chunks of `chunk_tokens`,
/// a thread per (chunk, expert), at least `MAP_THREADS` of them when there
/// are tokens enough; each (expert, chunk)'s count, then first rank, takes
/// `ranks_bytes` of the workspace, each expert's routed count the rest.
struct MapChunks {
    chunk_tokens: usize,
    num_chunks: usize,
    ranks_bytes: usize,
}

impl MapChunks {
    fn of(tokens: usize, experts: usize) -> Self {
        let chunk_tokens = tokens.saturating_mul(experts).div_ceil(MAP_THREADS).clamp(MIN_CHUNK_TOKENS, tokens.max(MIN_CHUNK_TOKENS));
        let num_chunks = tokens.div_ceil(chunk_tokens);
        let ranks_bytes = experts.saturating_mul(num_chunks).saturating_mul(4).next_multiple_of(16);
        Self { chunk_tokens, num_chunks, ranks_bytes }
    }
}

/// Bytes of `oxmoe_dispatch_fwd`'s workspace (its last result, see
/// [`crate::ffi::Call::workspace`]) for `tokens` tokens and `experts` experts:
/// the map passes' ranks and routed counts.
pub fn dispatch_workspace_bytes(tokens: usize, experts: usize) -> usize {
    MapChunks::of(tokens, experts).ranks_bytes.saturating_add(experts.saturating_mul(4))
}

pub fn dispatch_fwd(stream: Stream, a: &DispatchFwd) -> Result<()> {
    let layout = &a.layout;
    let (t, e, rows) = (layout.tokens, layout.experts, layout.rows);
    check_experts(e)?;
    let [count, rank, assign] = dispatch_map_instances()?;
    let count = Kernel::get(stream, &PERMUTATION, &count)?;
    let rank = Kernel::get(stream, &PERMUTATION, &rank)?;
    let assign = Kernel::get(stream, &PERMUTATION, &assign)?;

    let MapChunks { chunk_tokens, num_chunks, ranks_bytes } = MapChunks::of(t, e);
    let ranks = a.workspace.device_ptr();
    let routed = ranks + ranks_bytes as u64;

    let (map, probs) = (a.routing_map.device_ptr(), a.probs.as_ref().map_or(0, |p| p.device_ptr()));
    let out_probs = a.out_probs.as_ref().map_or(0, |p| p.device_ptr());
    let (dest_rows, source_tokens) = (a.dest_rows.device_ptr(), a.source_tokens.device_ptr());
    let (per_expert, real, pads) =
        (a.tokens_per_expert.device_ptr(), a.real_tokens_per_expert.device_ptr(), a.pad_offsets.device_ptr());
    let (tokens_i, experts_i, rows_i, chunk_tokens_i, num_chunks_i, align_i) =
        (int(t)?, int(e)?, int(rows)?, int(chunk_tokens)?, int(num_chunks)?, int(layout.align)?);

    let map_grid = grid((num_chunks * e).div_ceil(MAP_BLOCK as usize).max(1))?;
    launch(stream, count, LaunchConfig { grid: map_grid, block: MAP_BLOCK, shared_bytes: 0 }, &mut [
        arg(&map), arg(&tokens_i), arg(&experts_i), arg(&chunk_tokens_i), arg(&num_chunks_i), arg(&ranks),
        arg(&source_tokens), arg(&out_probs), arg(&rows_i),
    ])?;
    launch(stream, rank, LaunchConfig { grid: grid(e)?, block: SCAN_BLOCK, shared_bytes: 0 }, &mut [
        arg(&ranks), arg(&num_chunks_i), arg(&routed),
    ])?;
    // Shared memory: the experts' padded starts, and in block 0 their unpadded ones.
    let starts_bytes = u32::try_from(2 * 8 * e).expect("at most MAX_EXPERTS");
    launch(stream, assign, LaunchConfig { grid: map_grid, block: MAP_BLOCK, shared_bytes: starts_bytes }, &mut [
        arg(&map), arg(&probs), arg(&tokens_i), arg(&experts_i), arg(&chunk_tokens_i), arg(&num_chunks_i), arg(&ranks),
        arg(&routed), arg(&align_i), arg(&rows_i), arg(&dest_rows), arg(&source_tokens), arg(&out_probs),
        arg(&per_expert), arg(&real), arg(&pads),
    ])?;
    if a.hidden == 0 {
        return Ok(()); // the maps are laid out; there are no row elements to move
    }
    let scatter = Kernel::get(stream, &PERMUTATION, &scatter_instance(a.tokens.dtype(), a.hidden, e, Scatter::Dispatch)?)?;
    let (src, out, null) = (a.tokens.device_ptr(), a.out_tokens.device_ptr(), 0u64);
    // A dispatch's zeroing blocks write only zeros: none when the caller leaves those rows unwritten.
    let checked_rows = if a.zero_unused_rows { rows } else { 0 };
    let zero_unused = i32::from(a.zero_unused_rows);
    launch(stream, scatter, token_and_zero_blocks(t, e, checked_rows)?, &mut [
        arg(&src), arg(&dest_rows), arg(&source_tokens), arg(&null), arg(&null), arg(&null), arg(&out),
        arg(&tokens_i), arg(&rows_i), arg(&zero_unused),
    ])
}

pub fn combine_fwd(stream: Stream, a: &CombineFwd) -> Result<()> {
    let instance = gather_instance(a.expert_tokens.dtype(), a.hidden, a.experts, a.merging_probs.is_some(), a.addend.is_some())?;
    let kernel = Kernel::get(stream, &PERMUTATION, &instance)?;
    let (src, dest_rows, out) = (a.expert_tokens.device_ptr(), a.dest_rows.device_ptr(), a.out.device_ptr());
    let weights = a.merging_probs.as_ref().map_or(0, |w| w.device_ptr());
    let addend = a.addend.as_ref().map_or(0, |x| x.device_ptr());
    let (tokens, rows) = (int(a.tokens)?, int(a.rows)?);
    let config = LaunchConfig { grid: grid(token_blocks(a.tokens, a.experts))?, block: ROW_BLOCK, shared_bytes: 0 };
    launch(stream, kernel, config, &mut [
        arg(&src), arg(&dest_rows), arg(&weights), arg(&addend), arg(&out), arg(&tokens), arg(&rows),
    ])
}

pub fn combine_bwd(stream: Stream, a: &CombineBwd) -> Result<()> {
    let scatter = Scatter::CombineBackward { weighted: a.weighted.is_some() };
    let kernel = Kernel::get(stream, &PERMUTATION, &scatter_instance(a.grad_out.dtype(), a.hidden, a.experts, scatter)?)?;
    let (grad, dest_rows, source_tokens, out) =
        (a.grad_out.device_ptr(), a.dest_rows.device_ptr(), a.source_tokens.device_ptr(), a.grad_expert_tokens.device_ptr());
    let (weights, expert_tokens, grad_weights) = match &a.weighted {
        Some((w, x, g)) => (w.device_ptr(), x.device_ptr(), g.device_ptr()),
        None => (0, 0, 0),
    };
    let (tokens, rows, zero_unused) = (int(a.tokens)?, int(a.rows)?, i32::from(a.zero_unused_rows));
    // Every row is checked, zeroed or not: the zeroing blocks also mark the rows of maps that disagree.
    launch(stream, kernel, token_and_zero_blocks(a.tokens, a.experts, a.rows)?, &mut [
        arg(&grad), arg(&dest_rows), arg(&source_tokens), arg(&weights), arg(&expert_tokens), arg(&grad_weights),
        arg(&out), arg(&tokens), arg(&rows), arg(&zero_unused),
    ])
}

pub fn sort_chunks(stream: Stream, a: &SortChunks) -> Result<()> {
    if a.chunks > MAX_CHUNKS {
        invalid!("{} chunks: the CUDA chunk sort takes at most {MAX_CHUNKS}", a.chunks)
    }
    let kernel = Kernel::get(stream, &PERMUTATION, &sort_instance(a.tokens.dtype(), a.hidden, a.inverse)?)?;
    let (src, sizes, order, out) =
        (a.tokens.device_ptr(), a.split_sizes.device_ptr(), a.sorted_indices.device_ptr(), a.out.device_ptr());
    let (rows, chunks) = (int(a.rows)?, int(a.chunks)?);
    let config = LaunchConfig { grid: grid(a.rows.div_ceil(SORT_ROWS))?, block: ROW_BLOCK, shared_bytes: 0 };
    launch(stream, kernel, config, &mut [arg(&src), arg(&sizes), arg(&order), arg(&out), arg(&rows), arg(&chunks)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::assert_family_compiles;

    /// The instances of the real-model shapes (Mixtral, Qwen3-MoE,
    /// DeepSeek-V3), of rows that take the narrow-vector paths, and of the
    /// largest expert count, in each element type of `dtypes`.
    fn instances(dtypes: &[DataType]) -> Vec<String> {
        let shapes = [(1024, 8), (2048, 128), (7168, 256), (4096, 2048), (13, 8), (6, 60), (1, 4)];
        let mut out = dispatch_map_instances().unwrap().to_vec();
        for &dtype in dtypes {
            for (hidden, experts) in shapes {
                out.push(scatter_instance(dtype, hidden, experts, Scatter::Dispatch).unwrap());
                for weighted in [false, true] {
                    out.push(scatter_instance(dtype, hidden, experts, Scatter::CombineBackward { weighted }).unwrap());
                    out.push(gather_instance(dtype, hidden, experts, weighted, false).unwrap());
                }
                // The layer's: dispatch's backward started from the router's token gradient.
                out.push(gather_instance(dtype, hidden, experts, false, true).unwrap());
                for inverse in [false, true] {
                    out.push(sort_instance(dtype, hidden, inverse).unwrap());
                }
            }
            // Rows of no elements: only the weights' gradient is written.
            out.push(scatter_instance(dtype, 0, 8, Scatter::CombineBackward { weighted: true }).unwrap());
            out.push(gather_instance(dtype, 13, 8, true, true).unwrap());
        }
        out
    }

    /// CI has no GPU but has NVRTC (the pip wheel, on LD_LIBRARY_PATH): a
    /// kernel that does not compile for any supported architecture fails here
    /// (`assert_family_compiles`).
    #[test]
    fn permutation_kernels_compile_for_ampere_hopper_and_blackwell() {
        assert_family_compiles(&PERMUTATION, instances);
    }
}
