//! The quantization's call, decoded (and checked) once into the typed struct
//! that the CPU and CUDA backends both take.

use super::{Block, Orientation, Quantization, RECIPE_BLOCKS};
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::FLOAT_TYPES;

/// `oxmoe_fp8_quantize`: x [B, R, C] float32, bfloat16 or float16, or x's
/// FP8 values and their scales ([`Input`]; attributes `block_rows`,
/// `block_cols`, `power_of_two_scales`, `orientation`) -> with `orientation`
/// `"as_is"`, values float8_e4m3fn [B, R, C] and scales float32 [B, R /
/// block_rows, C / block_cols]; with `"transposed"`, those of each batch
/// element's transpose, values [B, C, R] and scales [B, C / block_rows, R /
/// block_cols]; with `"both"`, the two pairs in that order, from one read of x.
pub struct Quantize<'a> {
    pub x: Input<'a>,
    /// x's quantization as it is, if the call writes it.
    pub as_is: Option<Output<'a>>,
    /// The quantization of x's transpose, if the call writes it.
    pub transposed: Option<Output<'a>>,
}

/// What a call quantizes: x [B, R, C].
pub enum Input<'a> {
    /// x itself, float32, bfloat16 or float16 (one argument).
    Float(Arg<'a>),
    /// x as FP8 values [B, R, C] and their 1 x 128 blocks' float32 scales
    /// [B, R, C / 128] (two arguments; `requantize`): each element their
    /// product rounded to `dtype` (attribute `dequantized_dtype`: float32,
    /// bfloat16 or float16), as `oxmoe.fp8.dequantize(q, dtype)` gives it.
    /// With a third argument, `source_rows` int32 [R'] (and B = 1), x is
    /// [1, R', C], row r the FP8 row `source_rows[r]` of the R, gathered as
    /// the permutation's gathers do ([`Entry`](crate::permutation::Entry)).
    Fp8 { values: Arg<'a>, scales: Arg<'a>, dtype: DataType, source_rows: Option<Arg<'a>> },
}

impl Input<'_> {
    /// The type of x's elements: the FP8 values' dequantized type.
    pub fn dtype(&self) -> DataType {
        match self {
            Self::Float(x) => x.dtype(),
            Self::Fp8 { dtype, .. } => *dtype,
        }
    }
}

/// One quantization of a call and the results it writes.
pub struct Output<'a> {
    pub shape: Quantization,
    pub values: Ret<'a>,
    pub scales: Ret<'a>,
}

impl<'a> Quantize<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(1, 3)?;
        let (x, [batch, rows, cols]) = Input::decode(call)?;
        let block = Block { rows: call.count("block_rows")?, cols: call.count("block_cols")? };
        if !RECIPE_BLOCKS.contains(&block) {
            invalid!("the block is ({}, {}) (attributes `block_rows`, `block_cols`), expected one of the FP8 recipe's: (1, 128), (128, 128) or (128, 1)",
                     block.rows, block.cols)
        }
        let power_of_two_scales = call.attr("power_of_two_scales")?;
        let orientation = Orientation::parse(call.attr("orientation")?)?;
        let shape = |transpose| Quantization { batch, rows, cols, block, power_of_two_scales, transpose };
        // Results 0 and 1 are the first quantization the call writes, 2 and 3 the second.
        let as_is = if orientation.as_is() { Some(Output::decode(call, shape(false), 0, ["values", "scales"])?) } else { None };
        let transposed = if orientation.transposed() {
            let (first, names) = if as_is.is_some() { (2, ["transposed_values", "transposed_scales"]) } else { (0, ["values", "scales"]) };
            Some(Output::decode(call, shape(true), first, names)?)
        } else {
            None
        };
        Ok(Self { x, as_is, transposed })
    }
}

impl<'a> Input<'a> {
    /// The call's x and its dimensions.
    fn decode(call: &Call<'a>) -> Result<(Self, [usize; 3])> {
        if call.num_args() == 1 {
            let x = call.arg(0, "x")?;
            x.expect_dtype(&FLOAT_TYPES)?;
            let dims = matrices("x", &x)?;
            return Ok((Self::Float(x), dims));
        }
        let values = call.arg(0, "values")?;
        values.expect_dtype(&[DataType::F8E4M3FN])?;
        let dims @ [batch, rows, cols] = matrices("values", &values)?;
        if !cols.is_multiple_of(128) {
            invalid!("values has {cols} columns, expected a multiple of 128 (the FP8 input's 1 x 128 blocks)")
        }
        let scales = call.arg(1, "scales")?;
        scales.expect(&[DataType::F32], &[batch, rows, cols / 128])?;
        let name: &str = call.attr("dequantized_dtype")?;
        let Some(&dtype) = FLOAT_TYPES.iter().find(|t| t.name() == name) else {
            invalid!("dequantized_dtype is {name:?}, expected \"float32\", \"bfloat16\" or \"float16\"")
        };
        if call.num_args() == 2 {
            return Ok((Self::Fp8 { values, scales, dtype, source_rows: None }, dims));
        }
        let source_rows = call.arg(2, "source_rows")?;
        let &[x_rows] = source_rows.dims() else {
            invalid!("source_rows has shape {:?}, expected [rows]", source_rows.dims())
        };
        let x_rows = x_rows.max(0) as usize;
        source_rows.expect(&[DataType::S32], &[x_rows])?;
        if batch != 1 {
            invalid!("values has shape [{batch}, {rows}, {cols}], expected one matrix [1, rows, columns] with source_rows")
        }
        Ok((Self::Fp8 { values, scales, dtype, source_rows: Some(source_rows) }, [1, x_rows, cols]))
    }
}

/// The dimensions of `arg`, `[batch, rows, columns]`.
fn matrices(name: &str, arg: &Arg) -> Result<[usize; 3]> {
    let &[batch, rows, cols] = arg.dims() else {
        invalid!("{name} has shape {:?}, expected [batch, rows, columns]", arg.dims())
    };
    Ok([batch, rows, cols].map(|d| d.max(0) as usize))
}

impl<'a> Output<'a> {
    /// The quantization `shape`, whose values and scales are results `first` and `first + 1`.
    pub(crate) fn decode(call: &Call<'a>, shape: Quantization, first: usize, names: [&'static str; 2]) -> Result<Self> {
        check_tiled(&shape)?;
        let values = call.ret(first, names[0])?;
        let (result_rows, result_cols) = shape.result_matrix();
        values.expect(&[DataType::F8E4M3FN], &[shape.batch, result_rows, result_cols])?;
        let scales = call.ret(first + 1, names[1])?;
        let (scale_rows, scale_cols) = shape.scales_matrix();
        scales.expect(&[DataType::F32], &[shape.batch, scale_rows, scale_cols])?;
        Ok(Self { shape, values, scales })
    }

    /// The device pointers of its values and scales, as the kernels take them.
    pub fn device_ptrs(&self) -> (u64, u64) {
        (self.values.device_ptr(), self.scales.device_ptr())
    }
}

/// The block tiles the result: its rows and columns are multiples of the block's.
fn check_tiled(q: &Quantization) -> Result<()> {
    let (result_rows, result_cols) = q.result_matrix();
    // x's dimension that becomes the result's rows, and the one that becomes its columns.
    let (rows_of, cols_of) = if q.transpose { ("columns", "rows") } else { ("rows", "columns") };
    let transposed = if q.transpose { ", the transposed result's rows," } else { "" };
    if !result_rows.is_multiple_of(q.block.rows) {
        invalid!("x's {rows_of} ({result_rows}){transposed} must be a multiple of the block's rows ({})", q.block.rows)
    }
    let transposed = if q.transpose { ", the transposed result's columns," } else { "" };
    if !result_cols.is_multiple_of(q.block.cols) {
        invalid!("x's {cols_of} ({result_cols}){transposed} must be a multiple of the block's columns ({})", q.block.cols)
    }
    Ok(())
}
