//! The activation's calls, decoded (and checked) once into typed structs that
//! the CPU and CUDA backends both take.

use super::Activation;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::float_matrix;

/// `(activation, rows, width)` of `up [rows, up_width]` (attributes `glu`,
/// `gelu`), `width` the activation's output columns, and `group_sizes [G]` s32.
fn decode_input<'a>(call: &Call<'a>, up: &Arg<'a>, sizes_index: usize) -> Result<(Activation, usize, usize, Arg<'a>)> {
    let activation = Activation { glu: call.attr("glu")?, gelu: call.attr("gelu")? };
    let (rows, up_width) = float_matrix(up)?;
    if activation.glu && up_width % 2 != 0 {
        invalid!("up has {up_width} columns: a gated activation takes an even number (the gate, then the linear half)")
    }
    let width = if activation.glu { up_width / 2 } else { up_width };
    let group_sizes = call.arg(sizes_index, "group_sizes")?;
    group_sizes.expect(&[DataType::S32], &[group_sizes.len()])?;
    Ok((activation, rows, width, group_sizes))
}

/// `oxmoe_activation_fwd`: up [R, W] (W = 2F with `glu`, else F), group_sizes
/// [G] s32 -> hidden [R, F].
pub struct ActivationFwd<'a> {
    pub activation: Activation,
    pub rows: usize,
    pub width: usize,
    pub up: Arg<'a>,
    pub group_sizes: Arg<'a>,
    pub hidden: Ret<'a>,
}

impl<'a> ActivationFwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(2, 2)?;
        let up = call.arg(0, "up")?;
        let (activation, rows, width, group_sizes) = decode_input(call, &up, 1)?;
        let hidden = call.ret(0, "hidden")?;
        hidden.expect(&[up.dtype()], &[rows, width])?;
        Ok(Self { activation, rows, width, up, group_sizes, hidden })
    }
}

/// `oxmoe_activation_bwd`: up [R, W], grad_hidden [R, F], group_sizes [G] s32
/// -> grad_up [R, W], hidden [R, F] (the forward's, recomputed for the down
/// projection's weight gradient).
pub struct ActivationBwd<'a> {
    pub activation: Activation,
    pub rows: usize,
    pub width: usize,
    pub up: Arg<'a>,
    pub grad_hidden: Arg<'a>,
    pub group_sizes: Arg<'a>,
    pub grad_up: Ret<'a>,
    pub hidden: Ret<'a>,
}

impl<'a> ActivationBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 3)?;
        let up = call.arg(0, "up")?;
        let (activation, rows, width, group_sizes) = decode_input(call, &up, 2)?;
        let grad_hidden = call.arg(1, "grad_hidden")?;
        grad_hidden.expect(&[up.dtype()], &[rows, width])?;
        let grad_up = call.ret(0, "grad_up")?;
        let up_width = if activation.glu { 2 * width } else { width };
        grad_up.expect(&[up.dtype()], &[rows, up_width])?;
        let hidden = call.ret(1, "hidden")?;
        hidden.expect(&[up.dtype()], &[rows, width])?;
        Ok(Self { activation, rows, width, up, grad_hidden, group_sizes, grad_up, hidden })
    }
}
