//! The activation backward's calls, decoded (and checked) once into the typed
//! struct that the CPU and CUDA backends both take.

use super::Activation;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::quantize::{Block, Output, Quantization};
use crate::real::float_matrix;

/// The operands of both activation backward calls, and their attribute
/// `activation`: grad_hidden [R, F], pre_activation [R, 2F] (gated
/// activations) or [R, F] of the same float type, row_probs [R] float32.
pub struct ActivationOperands<'a> {
    pub activation: Activation,
    pub rows: usize,
    /// `F`: the hidden activation's columns.
    pub features: usize,
    pub grad_hidden: Arg<'a>,
    pub pre_activation: Arg<'a>,
    pub row_probs: Arg<'a>,
}

impl<'a> ActivationOperands<'a> {
    fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 3)?;
        let activation = Activation::parse(call.attr("activation")?)?;
        let grad_hidden = call.arg(0, "grad_hidden")?;
        let (rows, features) = float_matrix(&grad_hidden)?;
        let pre_activation = call.arg(1, "pre_activation")?;
        pre_activation.expect(&[grad_hidden.dtype()], &[rows, activation.input_columns(features)])?;
        let row_probs = call.arg(2, "row_probs")?;
        row_probs.expect(&[DataType::F32], &[rows])?;
        Ok(Self { activation, rows, features, grad_hidden, pre_activation, row_probs })
    }

    /// The pre-activation's columns: `2F` gated, else `F`.
    pub fn width(&self) -> usize {
        self.activation.input_columns(self.features)
    }
}

/// `oxmoe_activation_bwd`: [`ActivationOperands`] -> grad_pre_activation
/// shaped and typed as pre_activation, weighted_hidden [R, F] of that type,
/// grad_row_probs [R] float32.
pub struct ActivationBwd<'a> {
    pub operands: ActivationOperands<'a>,
    pub grad_pre_activation: Ret<'a>,
    pub weighted_hidden: Ret<'a>,
    pub grad_row_probs: Ret<'a>,
}

impl<'a> ActivationBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        let operands = ActivationOperands::decode(call)?;
        let (dtype, rows) = ([operands.grad_hidden.dtype()], operands.rows);
        let grad_pre_activation = call.ret(0, "grad_pre_activation")?;
        grad_pre_activation.expect(&dtype, &[rows, operands.width()])?;
        let weighted_hidden = call.ret(1, "weighted_hidden")?;
        weighted_hidden.expect(&dtype, &[rows, operands.features])?;
        let grad_row_probs = call.ret(2, "grad_row_probs")?;
        grad_row_probs.expect(&[DataType::F32], &[rows])?;
        Ok(Self { operands, grad_pre_activation, weighted_hidden, grad_row_probs })
    }
}

/// `oxmoe_fp8_activation_bwd`: [`ActivationOperands`], with rows and `F`
/// multiples of 128, and attribute `power_of_two_scales` -> the results of
/// `oxmoe_activation_bwd` as the FP8 layer's backward products take them,
/// each the quantization (`oxmoe_fp8_quantize`'s semantics and results, one
/// batch element) of what `oxmoe_activation_bwd` gives, never materialised:
/// the pre-activation's gradient `[R, W]` in 1 x 128 blocks (values
/// float8_e4m3fn `[1, R, W]`, scales float32 `[1, R, W / 128]`) and its
/// transpose's (`[1, W, R]`, `[1, W, R / 128]`), the weighted hidden
/// activation's transpose's (`[1, F, R]`, `[1, F, R / 128]`), then
/// grad_row_probs `[R]` float32.
pub struct ActivationBwdFp8<'a> {
    pub operands: ActivationOperands<'a>,
    pub power_of_two_scales: bool,
    pub grad_pre_activation: Output<'a>,
    pub grad_pre_activation_transposed: Output<'a>,
    pub weighted_hidden_transposed: Output<'a>,
    pub grad_row_probs: Ret<'a>,
}

impl<'a> ActivationBwdFp8<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        let operands = ActivationOperands::decode(call)?;
        let (rows, features, width) = (operands.rows, operands.features, operands.width());
        if !rows.is_multiple_of(128) || !features.is_multiple_of(128) {
            invalid!("grad_hidden is [{rows}, {features}], expected rows and features multiples of 128 (the FP8 recipe's \
                      blocks: 1 x 128 along the features, 128 x 1 along the rows)")
        }
        let power_of_two_scales = call.attr("power_of_two_scales")?;
        // Each quantization's results: values [1, result rows, result columns] and their scales.
        let quantized = |first, names, rows, cols, transpose| {
            let block = Block { rows: 1, cols: 128 };
            Output::decode(call, Quantization { batch: 1, rows, cols, block, power_of_two_scales, transpose }, first, names)
        };
        let grad_pre_activation = quantized(0, ["grad_values", "grad_scales"], rows, width, false)?;
        let grad_pre_activation_transposed =
            quantized(2, ["grad_transposed_values", "grad_transposed_scales"], rows, width, true)?;
        let weighted_hidden_transposed =
            quantized(4, ["weighted_transposed_values", "weighted_transposed_scales"], rows, features, true)?;
        let grad_row_probs = call.ret(6, "grad_row_probs")?;
        grad_row_probs.expect(&[DataType::F32], &[rows])?;
        Ok(Self { operands, power_of_two_scales, grad_pre_activation, grad_pre_activation_transposed,
                  weighted_hidden_transposed, grad_row_probs })
    }
}
