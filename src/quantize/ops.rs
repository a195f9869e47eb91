//! The quantization's call, decoded (and checked) once into the typed struct
//! that the CPU and CUDA backends both take.

use super::{Block, Orientation, Quantization, RECIPE_BLOCKS};
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::FLOAT_TYPES;

/// `oxmoe_fp8_quantize`: x [B, R, C] float32, bfloat16 or float16
/// (attributes `block_rows`, `block_cols`, `power_of_two_scales`,
/// `orientation`) -> with `orientation` `"as_is"`, values float8_e4m3fn
/// [B, R, C] and scales float32 [B, R / block_rows, C / block_cols]; with
/// `"transposed"`, those of each batch element's transpose, values [B, C, R]
/// and scales [B, C / block_rows, R / block_cols]; with `"both"`, the two
/// pairs in that order, from one read of x.
pub struct Quantize<'a> {
    pub x: Arg<'a>,
    /// x's quantization as it is, if the call writes it.
    pub as_is: Option<Output<'a>>,
    /// The quantization of x's transpose, if the call writes it.
    pub transposed: Option<Output<'a>>,
}

/// One quantization of a call and the results it writes.
pub struct Output<'a> {
    pub shape: Quantization,
    pub values: Ret<'a>,
    pub scales: Ret<'a>,
}

impl<'a> Quantize<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(1, 1)?;
        let x = call.arg(0, "x")?;
        x.expect_dtype(&FLOAT_TYPES)?;
        let &[batch, rows, cols] = x.dims() else {
            invalid!("x has shape {:?}, expected [batch, rows, columns]", x.dims())
        };
        let (batch, rows, cols) = (batch.max(0) as usize, rows.max(0) as usize, cols.max(0) as usize);
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

impl<'a> Output<'a> {
    /// The quantization `shape`, whose values and scales are results `first` and `first + 1`.
    fn decode(call: &Call<'a>, shape: Quantization, first: usize, names: [&'static str; 2]) -> Result<Self> {
        check_tiled(&shape)?;
        let values = call.ret(first, names[0])?;
        let (result_rows, result_cols) = shape.result_matrix();
        values.expect(&[DataType::F8E4M3FN], &[shape.batch, result_rows, result_cols])?;
        let scales = call.ret(first + 1, names[1])?;
        let (scale_rows, scale_cols) = shape.scales_matrix();
        scales.expect(&[DataType::F32], &[shape.batch, scale_rows, scale_cols])?;
        Ok(Self { shape, values, scales })
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
