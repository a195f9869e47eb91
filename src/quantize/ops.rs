//! The quantization's call, decoded (and checked) once into the typed struct
//! that the CPU and CUDA backends both take.

use super::{Block, Quantization, RECIPE_BLOCKS};
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::FLOAT_TYPES;

/// `oxmoe_fp8_quantize`: x [B, R, C] float32, bfloat16 or float16
/// (attributes `block_rows`, `block_cols`, `power_of_two_scales`,
/// `transpose`) -> values float8_e4m3fn [B, R, C] and scales float32
/// [B, R / block_rows, C / block_cols]; with `transpose`, values [B, C, R]
/// and scales [B, C / block_rows, R / block_cols].
pub struct Quantize<'a> {
    pub shape: Quantization,
    pub x: Arg<'a>,
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
        let shape = Quantization {
            batch,
            rows,
            cols,
            block,
            power_of_two_scales: call.attr("power_of_two_scales")?,
            transpose: call.attr("transpose")?,
        };
        check_tiled(&shape)?;
        let values = call.ret(0, "values")?;
        let (result_rows, result_cols) = shape.result_matrix();
        values.expect(&[DataType::F8E4M3FN], &[batch, result_rows, result_cols])?;
        let scales = call.ret(1, "scales")?;
        let (scale_rows, scale_cols) = shape.scales_matrix();
        scales.expect(&[DataType::F32], &[batch, scale_rows, scale_cols])?;
        Ok(Self { shape, x, values, scales })
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
