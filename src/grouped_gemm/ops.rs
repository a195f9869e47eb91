//! The grouped products' calls, decoded (and checked) once into typed
//! structs that the CPU and CUDA backends both take.
//!
//! Both take `group_sizes [G]` and `group_offset [1]` (int32, on the device).

use super::GroupedShape;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::FLOAT_TYPES;

/// The group sizes `[G]` and the window's first group `[1]`, both int32.
fn decode_groups<'a>(call: &Call<'a>, first: usize) -> Result<(Arg<'a>, Arg<'a>)> {
    let group_sizes = call.arg(first, "group_sizes")?;
    group_sizes.expect(&[DataType::S32], &[group_sizes.len()])?;
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
        check_window(local_groups, group_sizes.len())?;
        let out = call.ret(0, "out")?;
        check_out(&out, dtype, &[m, n])?;
        let shape = GroupedShape { m, k, n, groups: group_sizes.len(), local_groups };
        Ok(Self { shape, rhs_transposed, lhs, rhs, group_sizes, group_offset, out })
    }
}

/// `oxmoe_transposed_ragged_dot`: lhs [M, K], rhs [M, N], group_sizes, group_offset
/// -> out [Gl, K, N], each local group's `lhs_gᵀ · rhs_g`.
pub struct TransposedRaggedDot<'a> {
    pub shape: GroupedShape,
    pub lhs: Arg<'a>,
    pub rhs: Arg<'a>,
    pub group_sizes: Arg<'a>,
    pub group_offset: Arg<'a>,
    pub out: Ret<'a>,
}

impl<'a> TransposedRaggedDot<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(4, 4)?;
        let lhs = call.arg(0, "lhs")?;
        let dtype = lhs.expect_dtype(&FLOAT_TYPES)?;
        let (m, k) = lhs.matrix()?;
        let rhs = call.arg(1, "rhs")?;
        let (_, n) = rhs.matrix()?;
        rhs.expect(&[dtype], &[m, n])?;
        let (group_sizes, group_offset) = decode_groups(call, 2)?;
        let out = call.ret(0, "out")?;
        let local_groups = match out.dims() {
            &[groups, _, _] => groups as usize,
            dims => invalid!("out has shape {dims:?}, expected [groups, {k}, {n}]"),
        };
        check_out(&out, dtype, &[local_groups, k, n])?;
        check_window(local_groups, group_sizes.len())?;
        let shape = GroupedShape { m, k, n, groups: group_sizes.len(), local_groups };
        Ok(Self { shape, lhs, rhs, group_sizes, group_offset, out })
    }
}
