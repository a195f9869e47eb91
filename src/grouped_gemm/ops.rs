//! The grouped products' calls, decoded (and checked) once into typed
//! structs that the CPU and CUDA backends both take.
//!
//! Both take `group_sizes` and `group_offset [1]` (int32, on the device).

use super::GroupedShape;
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

/// `oxmoe_ragged_dot`: lhs [M, K], rhs [Gl, K, N] (attribute
/// `rhs_transposed`: [Gl, N, K]), group_sizes, group_offset -> out [M, N].
pub struct RaggedDot<'a> {
    pub shape: GroupedShape,
    pub rhs_transposed: bool,
    pub lhs: Arg<'a>,
    pub rhs: Arg<'a>,
    pub group_sizes: Arg<'a>,
    pub group_offset: Arg<'a>,
    pub out: Ret<'a>,
}

impl<'a> RaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(4, 4)?;
        let lhs = call.arg(0, "lhs")?;
        let dtype = lhs.expect_dtype(&FLOAT_TYPES)?;
        let (m, k) = lhs.matrix()?;
        let rhs = call.arg(1, "rhs")?;
        let rhs_transposed: bool = call.attr("rhs_transposed")?;
        let &[local_groups, d1, d2] = rhs.dims() else {
            invalid!("rhs has shape {:?}, expected [groups, K, N] or [groups, N, K]", rhs.dims())
        };
        let (local_groups, d1, d2) = (local_groups as usize, d1 as usize, d2 as usize);
        let n = if rhs_transposed { d1 } else { d2 };
        let rhs_shape = if rhs_transposed { [local_groups, n, k] } else { [local_groups, k, n] };
        rhs.expect(&[dtype], &rhs_shape)?;
        let (group_sizes, group_offset) = decode_groups(call, 2)?;
        group_sizes.expect(&[DataType::S32], &[group_sizes.len()])?;
        check_window(local_groups, group_sizes.len())?;
        let out = call.ret(0, "out")?;
        check_out(&out, dtype, &[m, n])?;
        let shape = GroupedShape { m, k, n, groups: group_sizes.len(), local_groups };
        Ok(Self { shape, rhs_transposed, lhs, rhs, group_sizes, group_offset, out })
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
}

impl<'a> TransposedRaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(4, 2 * MAX_CHUNKS + 2)?;
        if call.num_args() % 2 != 0 {
            invalid!("got {} arguments, expected lhs and rhs of each chunk, group_sizes and group_offset", call.num_args())
        }
        let count = (call.num_args() - 2) / 2;
        // Each chunk's operands by name: "lhs" and "rhs" alone, "lhs[c]" and "rhs[c]" among chunks.
        const LHS: [&str; MAX_CHUNKS] = ["lhs[0]", "lhs[1]", "lhs[2]", "lhs[3]", "lhs[4]", "lhs[5]", "lhs[6]", "lhs[7]"];
        const RHS: [&str; MAX_CHUNKS] = ["rhs[0]", "rhs[1]", "rhs[2]", "rhs[3]", "rhs[4]", "rhs[5]", "rhs[6]", "rhs[7]"];
        let lhs_name = |c: usize| if count == 1 { "lhs" } else { LHS[c] };
        let rhs_name = |c: usize| if count == 1 { "rhs" } else { RHS[c] };
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
        let (group_sizes, group_offset) = decode_groups(call, 2 * count)?;
        let groups = match (group_sizes.dims(), count) {
            (&[groups], 1) => groups as usize,
            (&[c, groups], _) if c as usize == count => groups as usize,
            (dims, _) => invalid!("group_sizes has shape {dims:?}, expected [{count}, groups] for {count} chunks"),
        };
        let out = call.ret(0, "out")?;
        let local_groups = match out.dims() {
            &[groups, _, _] => groups as usize,
            dims => invalid!("out has shape {dims:?}, expected [groups, {k}, {n}]"),
        };
        check_out(&out, dtype, &[local_groups, k, n])?;
        check_window(local_groups, groups)?;
        let m = chunks.iter().map(|c| c.rows).sum();
        let shape = GroupedShape { m, k, n, groups, local_groups };
        Ok(Self { shape, chunks, group_sizes, group_offset, out })
    }
}
