//! The activation backward's call, decoded (and checked) once into the typed
//! struct that the CPU and CUDA backends both take.

use super::Activation;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::real::float_matrix;

/// `oxmoe_activation_bwd`: grad_hidden [R, F], pre_activation [R, 2F] (gated
/// activations) or [R, F] of the same float type, row_probs [R] float32
/// (attribute `activation`) -> grad_pre_activation shaped and typed as
/// pre_activation, weighted_hidden [R, F] of that type, grad_row_probs [R]
/// float32.
pub struct ActivationBwd<'a> {
    pub activation: Activation,
    pub rows: usize,
    /// `F`: the hidden activation's columns.
    pub features: usize,
    pub grad_hidden: Arg<'a>,
    pub pre_activation: Arg<'a>,
    pub row_probs: Arg<'a>,
    pub grad_pre_activation: Ret<'a>,
    pub weighted_hidden: Ret<'a>,
    pub grad_row_probs: Ret<'a>,
}

impl<'a> ActivationBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 3)?;
        let activation = Activation::parse(call.attr("activation")?)?;
        let grad_hidden = call.arg(0, "grad_hidden")?;
        let (rows, features) = float_matrix(&grad_hidden)?;
        let dtype = [grad_hidden.dtype()];
        let pre_shape = [rows, activation.input_columns(features)];
        let pre_activation = call.arg(1, "pre_activation")?;
        pre_activation.expect(&dtype, &pre_shape)?;
        let row_probs = call.arg(2, "row_probs")?;
        row_probs.expect(&[DataType::F32], &[rows])?;
        let grad_pre_activation = call.ret(0, "grad_pre_activation")?;
        grad_pre_activation.expect(&dtype, &pre_shape)?;
        let weighted_hidden = call.ret(1, "weighted_hidden")?;
        weighted_hidden.expect(&dtype, &[rows, features])?;
        let grad_row_probs = call.ret(2, "grad_row_probs")?;
        grad_row_probs.expect(&[DataType::F32], &[rows])?;
        Ok(Self { activation, rows, features, grad_hidden, pre_activation, row_probs, grad_pre_activation,
                  weighted_hidden, grad_row_probs })
    }
}
