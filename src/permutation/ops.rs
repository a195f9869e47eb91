//! The permutation primitives' calls, decoded (and checked) once into typed
//! structs that the CPU and CUDA backends both take.
//!
//! Routing weights cross the FFI boundary as f32 (the Python side converts).

use super::DispatchLayout;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::float_matrix;

/// Row indices are int32 on both sides of the boundary.
fn check_index_range(what: &str, count: usize) -> Result<()> {
    if count > i32::MAX as usize {
        invalid!("{count} {what}: row indices are int32, so at most {}", i32::MAX)
    }
    Ok(())
}

/// `(tokens, experts)` of a `[T, E]` map (`name`), with at least one expert.
fn token_expert_map(map: &Arg, name: &str) -> Result<(usize, usize)> {
    let (tokens, experts) = map.matrix()?;
    if experts == 0 {
        invalid!("{name} has shape {:?}: no experts, expected at least 1", map.dims())
    }
    check_index_range("tokens", tokens)?;
    Ok((tokens, experts))
}

/// `oxmoe_dispatch_fwd`: tokens [T, H], routing_map [T, E] bool, optional
/// probs [T, E] f32 (attributes `align_size` and, optionally,
/// `zero_unused_rows`) -> tokens [R, H], dest_rows
/// [T, E] s32, source_tokens [R] s32, tokens_per_expert, real_tokens_per_expert,
/// pad_offsets [E] s32, with probs, probs [R] f32, and last the workspace
/// (see [`super::cuda::dispatch_workspace_bytes`]).
pub struct DispatchFwd<'a> {
    pub layout: DispatchLayout,
    pub hidden: usize,
    pub tokens: Arg<'a>,
    pub routing_map: Arg<'a>,
    pub probs: Option<Arg<'a>>,
    pub out_tokens: Ret<'a>,
    pub dest_rows: Ret<'a>,
    pub source_tokens: Ret<'a>,
    pub tokens_per_expert: Ret<'a>,
    pub real_tokens_per_expert: Ret<'a>,
    pub pad_offsets: Ret<'a>,
    pub out_probs: Option<Ret<'a>>,
    pub workspace: Ret<'a>,
    /// Whether the rows of `out_tokens` no copy holds are zeroed (else left unwritten).
    pub zero_unused_rows: bool,
}

impl<'a> DispatchFwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(2, 3)?;
        let tokens = call.arg(0, "tokens")?;
        let (num_tokens, hidden) = float_matrix(&tokens)?;
        let routing_map = call.arg(1, "routing_map")?;
        let (_, experts) = token_expert_map(&routing_map, "routing_map")?;
        routing_map.expect(&[DataType::PRED], &[num_tokens, experts])?;
        let probs = call.optional_arg(2, "probs")?;
        if let Some(probs) = &probs {
            probs.expect(&[DataType::F32], &[num_tokens, experts])?;
        }
        let align = call.count("align_size")?;
        if align == 0 || align > i32::MAX as usize {
            invalid!("align_size is {align}, expected 1 <= align_size <= {} (row indices are int32)", i32::MAX)
        }
        let out_tokens = call.ret(0, "out_tokens")?;
        let (rows, _) = out_tokens.matrix()?;
        out_tokens.expect(&[tokens.dtype()], &[rows, hidden])?;
        check_index_range("output rows", rows)?;
        let dest_rows = call.ret(1, "dest_rows")?;
        dest_rows.expect(&[DataType::S32], &[num_tokens, experts])?;
        let source_tokens = call.ret(2, "source_tokens")?;
        source_tokens.expect(&[DataType::S32], &[rows])?;
        let per_expert = |index, name| -> Result<Ret<'a>> {
            let ret = call.ret(index, name)?;
            ret.expect(&[DataType::S32], &[experts])?;
            Ok(ret)
        };
        let tokens_per_expert = per_expert(3, "tokens_per_expert")?;
        let real_tokens_per_expert = per_expert(4, "real_tokens_per_expert")?;
        let pad_offsets = per_expert(5, "pad_offsets")?;
        let out_probs = match probs {
            Some(_) => {
                let ret = call.ret(6, "out_probs")?;
                ret.expect(&[DataType::F32], &[rows])?;
                Some(ret)
            }
            None => None,
        };
        let workspace = call.workspace(6 + usize::from(out_probs.is_some()), super::cuda::dispatch_workspace_bytes(num_tokens, experts))?;
        Ok(Self {
            layout: DispatchLayout { tokens: num_tokens, experts, rows, align },
            hidden,
            tokens,
            routing_map,
            probs,
            out_tokens,
            dest_rows,
            source_tokens,
            tokens_per_expert,
            real_tokens_per_expert,
            pad_offsets,
            out_probs,
            workspace,
            zero_unused_rows: call.zero_unused_rows()?,
        })
    }
}

/// `oxmoe_combine_fwd`: expert_tokens [R, H], dest_rows [T, E] s32, with the
/// attribute `weighted` merging_probs [T, E] f32, then optionally addend
/// [T, H] f32 (each token's sum starts from its row) -> tokens [T, H].
pub struct CombineFwd<'a> {
    pub tokens: usize,
    pub experts: usize,
    pub rows: usize,
    pub hidden: usize,
    pub expert_tokens: Arg<'a>,
    pub dest_rows: Arg<'a>,
    pub merging_probs: Option<Arg<'a>>,
    pub addend: Option<Arg<'a>>,
    pub out: Ret<'a>,
}

impl<'a> CombineFwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        // Both optional arguments are f32 and [T, E] may be [T, H]: the attribute tells them apart.
        let weighted: bool = call.attr("weighted")?;
        let first_optional = 2 + usize::from(weighted);
        call.expect_num_args(first_optional, first_optional + 1)?;
        let expert_tokens = call.arg(0, "expert_tokens")?;
        let (rows, hidden) = float_matrix(&expert_tokens)?;
        check_index_range("rows", rows)?;
        let dest_rows = call.arg(1, "dest_rows")?;
        let (tokens, experts) = token_expert_map(&dest_rows, "dest_rows")?;
        dest_rows.expect(&[DataType::S32], &[tokens, experts])?;
        let merging_probs = if weighted {
            let probs = call.arg(2, "merging_probs")?;
            probs.expect(&[DataType::F32], &[tokens, experts])?;
            Some(probs)
        } else {
            None
        };
        let addend = call.optional_arg(first_optional, "addend")?;
        if let Some(addend) = &addend {
            addend.expect(&[DataType::F32], &[tokens, hidden])?;
        }
        let out = call.ret(0, "out")?;
        out.expect(&[expert_tokens.dtype()], &[tokens, hidden])?;
        Ok(Self { tokens, experts, rows, hidden, expert_tokens, dest_rows, merging_probs, addend, out })
    }
}

/// `oxmoe_combine_bwd`: grad_out [T, H], dest_rows [T, E] s32, source_tokens
/// [R] s32, and optionally merging_probs [T, E] f32 with expert_tokens [R, H]
/// (optional attribute `zero_unused_rows`) -> grad_expert_tokens [R, H], and
/// with merging_probs, grad_merging_probs [T, E] f32.
pub struct CombineBwd<'a> {
    pub tokens: usize,
    pub experts: usize,
    pub rows: usize,
    pub hidden: usize,
    pub grad_out: Arg<'a>,
    pub dest_rows: Arg<'a>,
    pub source_tokens: Arg<'a>,
    /// `(merging_probs, expert_tokens, grad_merging_probs)`.
    pub weighted: Option<(Arg<'a>, Arg<'a>, Ret<'a>)>,
    pub grad_expert_tokens: Ret<'a>,
    /// Whether the rows of `grad_expert_tokens` whose `source_tokens` entry is
    /// -1 are zeroed (else left unwritten; rows of maps that disagree are NaN either way).
    pub zero_unused_rows: bool,
}

impl<'a> CombineBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 5)?;
        let grad_out = call.arg(0, "grad_out")?;
        let (tokens, hidden) = float_matrix(&grad_out)?;
        let dest_rows = call.arg(1, "dest_rows")?;
        let (_, experts) = token_expert_map(&dest_rows, "dest_rows")?;
        dest_rows.expect(&[DataType::S32], &[tokens, experts])?;
        let source_tokens = call.arg(2, "source_tokens")?;
        let rows = source_tokens.len();
        source_tokens.expect(&[DataType::S32], &[rows])?;
        check_index_range("rows", rows)?;
        let grad_expert_tokens = call.ret(0, "grad_expert_tokens")?;
        grad_expert_tokens.expect(&[grad_out.dtype()], &[rows, hidden])?;
        let weighted = match call.optional_arg(3, "merging_probs")? {
            Some(probs) => {
                probs.expect(&[DataType::F32], &[tokens, experts])?;
                let expert_tokens = call.arg(4, "expert_tokens")?;
                expert_tokens.expect(&[grad_out.dtype()], &[rows, hidden])?;
                let grad_probs = call.ret(1, "grad_merging_probs")?;
                grad_probs.expect(&[DataType::F32], &[tokens, experts])?;
                Some((probs, expert_tokens, grad_probs))
            }
            None => None,
        };
        Ok(Self {
            tokens,
            experts,
            rows,
            hidden,
            grad_out,
            dest_rows,
            source_tokens,
            weighted,
            grad_expert_tokens,
            zero_unused_rows: call.zero_unused_rows()?,
        })
    }
}

/// `oxmoe_sort_chunks`: tokens [N, H], split_sizes [C] s32, sorted_indices
/// [C] s32 (attribute `inverse`) -> tokens [N, H] with the chunks reordered.
pub struct SortChunks<'a> {
    pub rows: usize,
    pub hidden: usize,
    pub chunks: usize,
    pub inverse: bool,
    pub tokens: Arg<'a>,
    pub split_sizes: Arg<'a>,
    pub sorted_indices: Arg<'a>,
    pub out: Ret<'a>,
}

impl<'a> SortChunks<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 3)?;
        let tokens = call.arg(0, "tokens")?;
        let (rows, hidden) = float_matrix(&tokens)?;
        check_index_range("rows", rows)?;
        let split_sizes = call.arg(1, "split_sizes")?;
        let chunks = split_sizes.len();
        split_sizes.expect(&[DataType::S32], &[chunks])?;
        let sorted_indices = call.arg(2, "sorted_indices")?;
        sorted_indices.expect(&[DataType::S32], &[chunks])?;
        let out = call.ret(0, "out")?;
        out.expect(&[tokens.dtype()], &[rows, hidden])?;
        Ok(Self { rows, hidden, chunks, inverse: call.attr("inverse")?, tokens, split_sizes, sorted_indices, out })
    }
}
