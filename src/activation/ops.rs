//! The activation's calls, decoded (and checked) once into the typed structs
//! that the CPU and CUDA backends both take.

use super::Activation;
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::quantize::{Output, Quantization, ACTIVATION_BLOCK, WEIGHT_BLOCK};
use crate::real::{float_matrix, FLOAT_TYPES};

/// The operands of both activation backward calls, and their attribute
/// `activation`: grad_hidden [R, F], pre_activation [R, 2F] (gated
/// activations) or [R, F] of the same float type, row_probs [R] float32
/// (arguments 0 to 2; each call checks its count of arguments).
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

/// `oxmoe_activation_bwd`: [`ActivationOperands`], then optionally
/// group_sizes [G] int32 (G >= 1, on the device) -> grad_pre_activation
/// shaped and typed as pre_activation, weighted_hidden [R, F] of that type,
/// grad_row_probs [R] float32. With group_sizes only the rows the groups cover
/// (`cpu::covered_rows`) are computed; the results' other rows are left
/// unwritten.
pub struct ActivationBwd<'a> {
    pub operands: ActivationOperands<'a>,
    pub group_sizes: Option<Arg<'a>>,
    pub grad_pre_activation: Ret<'a>,
    pub weighted_hidden: Ret<'a>,
    pub grad_row_probs: Ret<'a>,
}

impl<'a> ActivationBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 4)?;
        let operands = ActivationOperands::decode(call)?;
        let group_sizes = call.optional_arg(3, "group_sizes")?;
        if let Some(group_sizes) = &group_sizes {
            group_sizes.expect_dtype(&[DataType::S32])?;
            if !matches!(group_sizes.dims(), &[groups] if groups >= 1) {
                invalid!("group_sizes has shape {:?}, expected [groups] with at least one group", group_sizes.dims())
            }
        }
        let (dtype, rows) = ([operands.grad_hidden.dtype()], operands.rows);
        let grad_pre_activation = call.ret(0, "grad_pre_activation")?;
        grad_pre_activation.expect(&dtype, &[rows, operands.width()])?;
        let weighted_hidden = call.ret(1, "weighted_hidden")?;
        weighted_hidden.expect(&dtype, &[rows, operands.features])?;
        let grad_row_probs = call.ret(2, "grad_row_probs")?;
        grad_row_probs.expect(&[DataType::F32], &[rows])?;
        Ok(Self { operands, group_sizes, grad_pre_activation, weighted_hidden, grad_row_probs })
    }
}

/// `oxmoe_fp8_activation_bwd`: [`ActivationOperands`], with rows and `F`
/// multiples of 128, and attributes `power_of_two_scales` and
/// `square_grad_transposed` -> the results of
/// `oxmoe_activation_bwd` as the FP8 layer's backward products take them,
/// each the quantization (`oxmoe_fp8_quantize`'s semantics and results, one
/// batch element) of what `oxmoe_activation_bwd` gives, never materialised:
/// the pre-activation's gradient `[R, W]` in 1 x 128 blocks (values
/// float8_e4m3fn `[1, R, W]`, scales float32 `[1, R, W / 128]`) and its
/// transpose's (`[1, W, R]`, `[1, W, R / 128]`; with attribute
/// `square_grad_transposed`, in 128 x 128 blocks: `[1, W / 128, R / 128]`), the weighted hidden
/// activation's transpose's (`[1, F, R]`, `[1, F, R / 128]`), then
/// grad_row_probs `[R]` float32.
pub struct ActivationBwdFp8<'a> {
    pub operands: ActivationOperands<'a>,
    pub grad_pre_activation: Output<'a>,
    pub grad_pre_activation_transposed: Output<'a>,
    pub weighted_hidden_transposed: Output<'a>,
    pub grad_row_probs: Ret<'a>,
}

impl<'a> ActivationBwdFp8<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 3)?;
        let operands = ActivationOperands::decode(call)?;
        let (rows, features, width) = (operands.rows, operands.features, operands.width());
        if !rows.is_multiple_of(128) || !features.is_multiple_of(128) {
            invalid!("grad_hidden is [{rows}, {features}], expected rows and features multiples of 128 (the FP8 recipe's \
                      blocks: 1 x 128 along the features, 128 x 1 along the rows)")
        }
        let power_of_two_scales = call.attr("power_of_two_scales")?;
        // Each quantization's results: values [1, result rows, result columns] and their scales.
        let quantized = |first, names, rows, cols, block, transpose| {
            Output::decode(call, Quantization { batch: 1, rows, cols, block, power_of_two_scales, transpose }, first, names)
        };
        let grad_pre_activation = quantized(0, ["grad_values", "grad_scales"], rows, width, ACTIVATION_BLOCK, false)?;
        let square: bool = call.attr("square_grad_transposed")?;
        let grad_pre_activation_transposed = quantized(2, ["grad_transposed_values", "grad_transposed_scales"], rows,
                                                       width, if square { WEIGHT_BLOCK } else { ACTIVATION_BLOCK }, true)?;
        let weighted_hidden_transposed = quantized(4, ["weighted_transposed_values", "weighted_transposed_scales"],
                                                   rows, features, ACTIVATION_BLOCK, true)?;
        let grad_row_probs = call.ret(6, "grad_row_probs")?;
        grad_row_probs.expect(&[DataType::F32], &[rows])?;
        Ok(Self { operands, grad_pre_activation, grad_pre_activation_transposed,
                  weighted_hidden_transposed, grad_row_probs })
    }
}

/// `oxmoe_fp8_activation`: pre_activation `[R, 1, W]` float32, bfloat16 or
/// float16 (each row its own batch element, as `oxmoe_fp8_quantize` takes
/// rows of 1 x 128 blocks), attributes `activation` and `power_of_two_scales`
/// -> the hidden activation `[R, 1, F]` (F = W / 2 gated, else W; a multiple of
/// 128) quantized in 1 x 128 blocks: `oxmoe_fp8_quantize`'s semantics and
/// results (values float8_e4m3fn `[R, 1, F]`, scales float32 `[R, 1, F / 128]`)
/// of what `cpu::activation_fwd` gives, never materialised.
pub struct ActivationFp8<'a> {
    pub activation: Activation,
    pub pre_activation: Arg<'a>,
    pub hidden: Output<'a>,
}

impl<'a> ActivationFp8<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(1, 1)?;
        let activation = Activation::parse(call.attr("activation")?)?;
        let pre_activation = call.arg(0, "pre_activation")?;
        pre_activation.expect_dtype(&FLOAT_TYPES)?;
        let &[rows, 1, width] = pre_activation.dims() else {
            invalid!("pre_activation has shape {:?}, expected [rows, 1, columns]", pre_activation.dims())
        };
        let (rows, width) = (rows.max(0) as usize, width.max(0) as usize);
        let blocks_width = activation.input_columns(128);
        if !width.is_multiple_of(blocks_width) {
            invalid!("pre_activation has {width} columns, expected a multiple of {blocks_width} for {:?} (the hidden \
                      activation's columns a multiple of 128: the FP8 recipe's 1 x 128 blocks)", activation.name())
        }
        let features = activation.hidden_columns(width);
        let power_of_two_scales = call.attr("power_of_two_scales")?;
        let shape = Quantization { batch: rows, rows: 1, cols: features, block: ACTIVATION_BLOCK, power_of_two_scales,
                                   transpose: false };
        let hidden = Output::decode(call, shape, 0, ["values", "scales"])?;
        Ok(Self { activation, pre_activation, hidden })
    }
}
