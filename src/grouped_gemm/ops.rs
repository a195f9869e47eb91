//! The grouped products' calls, decoded (and checked) once into typed
//! structs that the CPU and CUDA backends both take.
//!
//! Both take `group_sizes` and `group_offset [1]` (int32, on the device).

use super::GroupedShape;
use crate::activation::Activation;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::FLOAT_TYPES;

/// The group sizes (`[G]`, or `[C, G]` for a transposed product's chunks) and
/// the window's first group `[1]`, both int32.
fn decode_groups<'a>(call: &Call<'a>, first: usize) -> Result<(Arg<'a>, Arg<'a>)> {
    let group_sizes = call.arg(first, "group_sizes")?;
    group_sizes.expect_dtype(&[DataType::S32])?;
    let group_offset = call.arg(first + 1, "group_offset")?;
    group_offset.expect(&[DataType::S32], &[1])?;
    Ok((group_sizes, group_offset))
}

/// The output: the inputs' dtype or f32.
fn check_out(out: &Ret, input: DataType, shape: &[usize]) -> Result<()> {
    out.expect(&[input, DataType::F32], shape)?;
    Ok(())
}

fn check_window(local_groups: usize, groups: usize) -> Result<()> {
    if local_groups > groups {
        invalid!("{local_groups} local groups, but group_sizes holds only {groups}")
    }
    Ok(())
}

/// Bytes of a grouped product's workspace (its last result, see
/// [`Call::workspace`]) for `chunks` chunks of rows (1 for `ragged_dot`) and a
/// window of `local_groups` groups: each chunk's int32 row bounds of the
/// window's groups, which the CUDA kernels other than the Hopper `ragged_dot`
/// read (the CPU handlers leave it alone).
pub fn workspace_bytes(chunks: usize, local_groups: usize) -> usize {
    chunks.saturating_mul(local_groups.saturating_add(1)).saturating_mul(4)
}

/// A ragged product's weights at argument `index`: `[Gl, K, N]`, or with the
/// attribute `rhs_transposed` `[Gl, N, K]`, of `dtype`. Returns them, the
/// attribute, `Gl` and `N`.
fn decode_weights<'a>(call: &Call<'a>, index: usize, k: usize, dtype: DataType) -> Result<(Arg<'a>, bool, usize, usize)> {
    let rhs_transposed: bool = call.attr("rhs_transposed")?;
    let (rhs, local_groups, n) = decode_laid_out_weights(call, index, k, dtype, rhs_transposed)?;
    Ok((rhs, rhs_transposed, local_groups, n))
}

/// [`decode_weights`] for weights whose layout the target fixes: returns them, `Gl` and `N`.
fn decode_laid_out_weights<'a>(call: &Call<'a>, index: usize, k: usize, dtype: DataType, rhs_transposed: bool)
                               -> Result<(Arg<'a>, usize, usize)> {
    let rhs = call.arg(index, "rhs")?;
    let &[local_groups, d1, d2] = rhs.dims() else {
        invalid!("rhs has shape {:?}, expected [groups, K, N] or [groups, N, K]", rhs.dims())
    };
    let (local_groups, d1, d2) = (local_groups as usize, d1 as usize, d2 as usize);
    let n = if rhs_transposed { d1 } else { d2 };
    let rhs_shape = if rhs_transposed { [local_groups, n, k] } else { [local_groups, k, n] };
    rhs.expect(&[dtype], &rhs_shape)?;
    Ok((rhs, local_groups, n))
}

/// A ragged product's group_sizes `[G]` and group_offset at argument `first`,
/// for a window of `local_groups`; returns them and `G`.
fn decode_ragged_groups<'a>(call: &Call<'a>, first: usize, local_groups: usize) -> Result<(Arg<'a>, Arg<'a>, usize)> {
    let (group_sizes, group_offset) = decode_groups(call, first)?;
    let groups = group_sizes.len();
    group_sizes.expect(&[DataType::S32], &[groups])?;
    check_window(local_groups, groups)?;
    Ok((group_sizes, group_offset, groups))
}

/// `oxmoe_ragged_dot`: lhs [M, K], rhs [Gl, K, N] (attribute
/// `rhs_transposed`: [Gl, N, K]), group_sizes, group_offset -> out [M, N].
pub struct RaggedDot<'a> {
    pub shape: GroupedShape,
    pub rhs_transposed: bool,
    /// Whether out's rows outside `[bounds[0], bounds[local_groups])` are zeroed,
    /// or left unwritten (for callers that read only the groups' rows).
    pub zero_unused_rows: bool,
    pub lhs: Arg<'a>,
    pub rhs: Arg<'a>,
    pub group_sizes: Arg<'a>,
    pub group_offset: Arg<'a>,
    pub out: Ret<'a>,
    pub workspace: Ret<'a>,
}

impl<'a> RaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(4, 4)?;
        let lhs = call.arg(0, "lhs")?;
        let dtype = lhs.expect_dtype(&FLOAT_TYPES)?;
        let (m, k) = lhs.matrix()?;
        let (rhs, rhs_transposed, local_groups, n) = decode_weights(call, 1, k, dtype)?;
        let zero_unused_rows = call.zero_unused_rows()?;
        let (group_sizes, group_offset, groups) = decode_ragged_groups(call, 2, local_groups)?;
        let out = call.ret(0, "out")?;
        check_out(&out, dtype, &[m, n])?;
        let workspace = call.workspace(1, workspace_bytes(1, local_groups))?;
        let shape = GroupedShape { m, k, n, groups, local_groups };
        Ok(Self { shape, rhs_transposed, zero_unused_rows, lhs, rhs, group_sizes, group_offset, out, workspace })
    }
}

/// `oxmoe_ragged_dot_activation`: lhs [M, K], rhs [Gl, K, N], group_sizes,
/// group_offset (attribute `activation`) -> pre_activation [M, N] (the
/// product, as `oxmoe_ragged_dot` gives it) and hidden [M, F], its activation
/// (`N = 2F` for a gated activation, `[gate, up]`; else `N = F`), both in
/// lhs's type.
pub struct RaggedDotActivation<'a> {
    /// The product; its `out` is the pre-activation (its `zero_unused_rows`
    /// holds for both results).
    pub product: RaggedDot<'a>,
    pub activation: Activation,
    pub hidden: Ret<'a>,
}

impl<'a> RaggedDotActivation<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(4, 4)?;
        let activation = Activation::parse(call.attr("activation")?)?;
        let zero_unused_rows = call.zero_unused_rows()?;
        let lhs = call.arg(0, "lhs")?;
        let dtype = lhs.expect_dtype(&FLOAT_TYPES)?;
        let (m, k) = lhs.matrix()?;
        let (rhs, local_groups, n) = decode_laid_out_weights(call, 1, k, dtype, false)?;
        if activation.gated() && n % 2 != 0 {
            invalid!("rhs has {n} columns, but {:?} takes [gate, up]: an even number", activation.name())
        }
        let (group_sizes, group_offset, groups) = decode_ragged_groups(call, 2, local_groups)?;
        let out = call.ret(0, "pre_activation")?;
        out.expect(&[dtype], &[m, n])?;
        let hidden = call.ret(1, "hidden")?;
        let features = activation.hidden_columns(n);
        hidden.expect(&[dtype], &[m, features])?;
        let workspace = call.workspace(2, workspace_bytes(1, local_groups))?;
        let shape = GroupedShape { m, k, n, groups, local_groups };
        let product =
            RaggedDot { shape, rhs_transposed: false, zero_unused_rows, lhs, rhs, group_sizes, group_offset, out, workspace };
        Ok(Self { product, activation, hidden })
    }

    /// `F`: the hidden activation's columns.
    pub fn features(&self) -> usize {
        self.activation.hidden_columns(self.product.shape.n)
    }
}

/// One chunk of a transposed product's rows: `lhs [M_c, K]` and `rhs [M_c, N]`.
pub struct Chunk<'a> {
    pub lhs: Arg<'a>,
    pub rhs: Arg<'a>,
    /// `M_c`.
    pub rows: usize,
}

/// The most chunks a transposed product takes (the CUDA kernels take one
/// pointer or tensor map of each operand per chunk as a launch argument).
pub const MAX_CHUNKS: usize = 8;

/// `oxmoe_transposed_ragged_dot`: `C` chunks of rows, lhs_0 .. lhs_{C-1} [M_c, K]
/// then rhs_0 .. rhs_{C-1} [M_c, N], group_sizes [C, G] ([G] for one chunk),
/// group_offset -> out [Gl, K, N]. Local group `i`'s rows are those of group
/// `g0 + i` in each chunk, chunk after chunk, and `out[i] = lhs_iᵀ · rhs_i`
/// over them. `shape.m` is the rows of all chunks.
pub struct TransposedRaggedDot<'a> {
    pub shape: GroupedShape,
    pub chunks: Vec<Chunk<'a>>,
    pub group_sizes: Arg<'a>,
    pub group_offset: Arg<'a>,
    pub out: Ret<'a>,
    pub workspace: Ret<'a>,
}

impl<'a> TransposedRaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        let count = chunk_count(call, 2)?;
        let (lhs_name, rhs_name) = (chunk_name(&LHS, count), chunk_name(&RHS, count));
        let first = call.arg(0, lhs_name(0))?;
        let dtype = first.expect_dtype(&FLOAT_TYPES)?;
        let (_, k) = first.matrix()?;
        let (_, n) = call.arg(count, rhs_name(0))?.matrix()?;
        let mut chunks = Vec::with_capacity(count);
        for c in 0..count {
            let lhs = call.arg(c, lhs_name(c))?;
            let (rows, _) = lhs.matrix()?;
            lhs.expect(&[dtype], &[rows, k])?;
            let rhs = call.arg(count + c, rhs_name(c))?;
            rhs.expect(&[dtype], &[rows, n])?;
            chunks.push(Chunk { lhs, rhs, rows });
        }
        let (group_sizes, group_offset, groups) = decode_chunk_groups(call, 2 * count, count)?;
        let out = call.ret(0, "out")?;
        let local_groups = out_groups(&out, k, n)?;
        check_out(&out, dtype, &[local_groups, k, n])?;
        check_window(local_groups, groups)?;
        let workspace = call.workspace(1, workspace_bytes(count, local_groups))?;
        let m = chunks.iter().map(|c| c.rows).sum();
        let shape = GroupedShape { m, k, n, groups, local_groups };
        Ok(Self { shape, chunks, group_sizes, group_offset, out, workspace })
    }
}

/// The chunks of a transposed product's call: its arguments are `operands`
/// per chunk, then group_sizes and group_offset.
fn chunk_count(call: &Call, operands: usize) -> Result<usize> {
    call.expect_num_args(operands + 2, operands * MAX_CHUNKS + 2)?;
    if !(call.num_args() - 2).is_multiple_of(operands) {
        invalid!("got {} arguments, expected the {operands} operands of each chunk, group_sizes and group_offset",
                 call.num_args())
    }
    Ok((call.num_args() - 2) / operands)
}

/// Each chunk's operand names: the operand alone, `operand[c]` among chunks.
macro_rules! chunk_names {
    ($operand:literal) => {
        [$operand, concat!($operand, "[0]"), concat!($operand, "[1]"), concat!($operand, "[2]"),
         concat!($operand, "[3]"), concat!($operand, "[4]"), concat!($operand, "[5]"), concat!($operand, "[6]"),
         concat!($operand, "[7]")]
    };
}
type ChunkNames = [&'static str; MAX_CHUNKS + 1];
const LHS: ChunkNames = chunk_names!("lhs");
const RHS: ChunkNames = chunk_names!("rhs");
const LHS_SCALES: ChunkNames = chunk_names!("lhs_scales");
const RHS_SCALES: ChunkNames = chunk_names!("rhs_scales");

/// The name of an operand of chunk `c` of `count`.
fn chunk_name(names: &'static ChunkNames, count: usize) -> impl Fn(usize) -> &'static str {
    move |c| if count == 1 { names[0] } else { names[c + 1] }
}

/// group_sizes `[C, G]` (`[G]` for one chunk) at argument `first`, then
/// group_offset; returns them and `G`.
fn decode_chunk_groups<'a>(call: &Call<'a>, first: usize, count: usize) -> Result<(Arg<'a>, Arg<'a>, usize)> {
    let (group_sizes, group_offset) = decode_groups(call, first)?;
    let groups = match (group_sizes.dims(), count) {
        (&[groups], 1) => groups as usize,
        (&[c, groups], _) if c as usize == count => groups as usize,
        (dims, _) => invalid!("group_sizes has shape {dims:?}, expected [{count}, groups] for {count} chunks"),
    };
    Ok((group_sizes, group_offset, groups))
}

/// The local groups of a transposed product's `out [Gl, K, N]`.
fn out_groups(out: &Ret, k: usize, n: usize) -> Result<usize> {
    match out.dims() {
        &[groups, _, _] => Ok(groups as usize),
        dims => invalid!("out has shape {dims:?}, expected [groups, {k}, {n}]"),
    }
}

// -- FP8 -------------------------------------------------------------------------------

/// The rows and columns of a block of FP8 values that share one scale, along
/// each blocked dimension (`oxmoe.fp8`'s 1 x 128, 128 x 128 and 128 x 1 blocks).
pub const FP8_BLOCK: usize = 128;

/// The FP8 results' types.
const FP8_OUT_TYPES: [DataType; 3] = [DataType::F32, DataType::BF16, DataType::F16];

/// `size`, dimension `dim` of `operand`, as whole FP8 blocks, or an error naming them.
fn fp8_blocks(size: usize, operand: &str, dim: &str) -> Result<usize> {
    if !size.is_multiple_of(FP8_BLOCK) {
        invalid!("{operand} has {dim} = {size}; FP8 operands have one scale per {FP8_BLOCK} along it, so {dim} must be a multiple of {FP8_BLOCK}")
    }
    Ok(size / FP8_BLOCK)
}

/// `oxmoe_fp8_ragged_dot`: lhs [M, K] float8_e4m3fn with its scales [M, K/128]
/// (1 x 128 blocks), rhs [Gl, K, N] (attribute `rhs_transposed`: [Gl, N, K])
/// with its scales [Gl, K/128, N/128] ([Gl, N/128, K/128]; 128 x 128 blocks),
/// group_sizes, group_offset -> out [M, N] float32, bfloat16 or float16: each
/// row of local group `i` times `rhs[i]` (`rhs[i]ᵀ`), the float32 partial of
/// each 128 of K scaled by both blocks' scales and added in block order.
pub struct Fp8RaggedDot<'a> {
    pub shape: GroupedShape,
    pub rhs_transposed: bool,
    pub lhs: Arg<'a>,
    pub lhs_scales: Arg<'a>,
    pub rhs: Arg<'a>,
    pub rhs_scales: Arg<'a>,
    pub group_sizes: Arg<'a>,
    pub group_offset: Arg<'a>,
    pub out: Ret<'a>,
    pub workspace: Ret<'a>,
}

impl<'a> Fp8RaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(6, 6)?;
        let lhs = call.arg(0, "lhs")?;
        lhs.expect_dtype(&[DataType::F8E4M3FN])?;
        let (m, k) = lhs.matrix()?;
        let k_blocks = fp8_blocks(k, "lhs", "K")?;
        let lhs_scales = call.arg(1, "lhs_scales")?;
        lhs_scales.expect(&[DataType::F32], &[m, k_blocks])?;
        let (rhs, rhs_transposed, local_groups, n) = decode_weights(call, 2, k, DataType::F8E4M3FN)?;
        let n_blocks = fp8_blocks(n, "rhs", "N")?;
        let rhs_scales = call.arg(3, "rhs_scales")?;
        let scales_shape = if rhs_transposed { [local_groups, n_blocks, k_blocks] } else { [local_groups, k_blocks, n_blocks] };
        rhs_scales.expect(&[DataType::F32], &scales_shape)?;
        let (group_sizes, group_offset, groups) = decode_ragged_groups(call, 4, local_groups)?;
        let out = call.ret(0, "out")?;
        out.expect(&FP8_OUT_TYPES, &[m, n])?;
        let workspace = call.workspace(1, workspace_bytes(1, local_groups))?;
        let shape = GroupedShape { m, k, n, groups, local_groups };
        Ok(Self { shape, rhs_transposed, lhs, lhs_scales, rhs, rhs_scales, group_sizes, group_offset, out, workspace })
    }
}

/// One chunk of an FP8 transposed product's rows, token-contiguous (K-major, as
/// Hopper's 8-bit `wgmma` reads them): `lhsᵀ [K, M_c]` with the scales
/// `[M_c/128, K]` of its 128-token blocks, `rhsᵀ [N, M_c]` with `[M_c/128, N]`
/// (128 x 1 blocks), or `[M_c/128, N/128]` (128 x 128 blocks).
pub struct Fp8Chunk<'a> {
    pub lhs: Arg<'a>,
    pub lhs_scales: Arg<'a>,
    pub rhs: Arg<'a>,
    pub rhs_scales: Arg<'a>,
    /// `M_c`, a multiple of 128.
    pub rows: usize,
}

/// `oxmoe_fp8_transposed_ragged_dot`: `C` chunks of rows ([`Fp8Chunk`]), each
/// operand's chunks in turn (lhsᵀ_0 .. lhsᵀ_{C-1}, their scales, rhsᵀ_0 ..,
/// their scales), group_sizes [C, G] ([G] for one chunk), group_offset -> out
/// [Gl, K, N]: local group `i`'s rows of every chunk, and for each 128-row
/// block of a chunk, the float32 sum of its rows' products (those of the
/// group) scaled by both blocks' scales of each column, added in block order.
/// Every chunk's rhs has the same blocks, told by the shape of its scales.
pub struct Fp8TransposedRaggedDot<'a> {
    pub shape: GroupedShape,
    pub chunks: Vec<Fp8Chunk<'a>>,
    /// The columns of rhs that share a scale: 1, or [`FP8_BLOCK`] (128 x 128 blocks).
    pub rhs_block_columns: usize,
    pub group_sizes: Arg<'a>,
    pub group_offset: Arg<'a>,
    pub out: Ret<'a>,
    pub workspace: Ret<'a>,
}

impl<'a> Fp8TransposedRaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        let count = chunk_count(call, 4)?;
        let names = [chunk_name(&LHS, count), chunk_name(&LHS_SCALES, count), chunk_name(&RHS, count),
                     chunk_name(&RHS_SCALES, count)];
        let (k, _) = call.arg(0, names[0](0))?.matrix()?;
        let (n, _) = call.arg(2 * count, names[2](0))?.matrix()?;
        let mut chunks = Vec::with_capacity(count);
        let mut rhs_block_columns = 1;
        for c in 0..count {
            let lhs = call.arg(c, names[0](c))?;
            let (_, rows) = lhs.matrix()?;
            lhs.expect(&[DataType::F8E4M3FN], &[k, rows])?;
            let row_blocks = fp8_blocks(rows, names[0](c), "M")?;
            let lhs_scales = call.arg(count + c, names[1](c))?;
            lhs_scales.expect(&[DataType::F32], &[row_blocks, k])?;
            let rhs = call.arg(2 * count + c, names[2](c))?;
            rhs.expect(&[DataType::F8E4M3FN], &[n, rows])?;
            let rhs_scales = call.arg(3 * count + c, names[3](c))?;
            // The first chunk's scales say rhs's blocks: 128 x 1, or 128 x 128.
            if c == 0 && n > 0 && n.is_multiple_of(FP8_BLOCK) && rhs_scales.matrix()?.1 == n / FP8_BLOCK {
                rhs_block_columns = FP8_BLOCK;
            }
            rhs_scales.expect(&[DataType::F32], &[row_blocks, n / rhs_block_columns])?;
            chunks.push(Fp8Chunk { lhs, lhs_scales, rhs, rhs_scales, rows });
        }
        let (group_sizes, group_offset, groups) = decode_chunk_groups(call, 4 * count, count)?;
        let out = call.ret(0, "out")?;
        let local_groups = out_groups(&out, k, n)?;
        out.expect(&FP8_OUT_TYPES, &[local_groups, k, n])?;
        check_window(local_groups, groups)?;
        let workspace = call.workspace(1, workspace_bytes(count, local_groups))?;
        let m = chunks.iter().map(|c| c.rows).sum();
        let shape = GroupedShape { m, k, n, groups, local_groups };
        Ok(Self { shape, chunks, rhs_block_columns, group_sizes, group_offset, out, workspace })
    }
}
