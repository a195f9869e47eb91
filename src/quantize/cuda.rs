//! The CUDA quantization: `kernels/quantize.cu`'s `quantize`, one block of
//! threads per 128 x 128 tile of `x` (see the kernel for its layout and why),
//! which writes a call's quantizations (as it is, transposed, or both) from one
//! read of the tile (of x, or of FP8 values dequantized as they are read).

use super::{Block, Input, Orientation, Output, Quantize};
use crate::cuda::{arg, grid, int, launch, Instance, Kernel, LaunchConfig, Stream, QUANTIZE};
use crate::ffi::{DataType, Result};

/// Threads of a block, and the edge of the tile it quantizes (the kernels'
/// `QUANTIZE_THREADS`, `QUANTIZE_TILE`; also `activation_bwd_quantized`'s).
pub(crate) const THREADS: u32 = 256;
pub(crate) const TILE: usize = 128;

/// The kernel for x of `dtype` (with `fp8_input`: FP8 values dequantized to it).
pub fn quantize_instance(dtype: DataType, block: Block, orientation: Orientation, power_of_two_scales: bool, fp8_input: bool) -> Result<String> {
    let instance = Instance::new("quantize").dtype(dtype).int(block.rows).int(block.cols);
    let instance = instance.flag(orientation.as_is()).flag(orientation.transposed()).flag(power_of_two_scales);
    instance.flag(fp8_input).int(THREADS).build()
}

pub fn quantize(stream: Stream, op: &Quantize) -> Result<()> {
    // Both quantizations of a call share x's shape, the block and the options.
    let (orientation, first) = match (&op.as_is, &op.transposed) {
        (Some(out), None) => (Orientation::AsIs, out),
        (None, Some(out)) => (Orientation::Transposed, out),
        (Some(out), Some(_)) => (Orientation::Both, out),
        (None, None) => return Ok(()),
    };
    if first.values.is_empty() {
        return Ok(());
    }
    let q = &first.shape;
    // Without a transpose, no block straddles two batch elements (their rows
    // are a multiple of the block's): the kernel sees one matrix of all rows.
    let (batch, rows) = if orientation.transposed() { (q.batch, q.rows) } else { (1, q.batch * q.rows) };
    let tiles = batch * rows.div_ceil(TILE) * q.cols.div_ceil(TILE);
    // An FP8 input's own rows, and the pointer to the rows of x it gives (null: x's row r is its row r).
    let (x, x_scales, fp8_input, source_rows, input_rows) = match &op.x {
        Input::Float(x) => (x.device_ptr(), 0, false, 0, 0),
        Input::Fp8 { values, scales, source_rows, .. } => {
            let source = source_rows.as_ref().map_or(0, |s| s.device_ptr());
            (values.device_ptr(), scales.device_ptr(), true, source, values.dims()[1].max(0) as usize)
        }
    };
    let instance = quantize_instance(op.x.dtype(), q.block, orientation, q.power_of_two_scales, fp8_input)?;
    let kernel = Kernel::get(stream, &QUANTIZE, &instance)?;
    let (batch, rows, cols, input_rows) = (int(batch)?, int(rows)?, int(q.cols)?, int(input_rows)?);
    // A result the call does not write is a null pointer the kernel never follows.
    let pointers = |out: &Option<Output>| out.as_ref().map_or((0, 0), Output::device_ptrs);
    let ((values, scales), (transposed_values, transposed_scales)) = (pointers(&op.as_is), pointers(&op.transposed));
    launch(stream, kernel, LaunchConfig { grid: grid(tiles)?, block: THREADS, shared_bytes: 0 }, &mut [
        arg(&x), arg(&x_scales), arg(&source_rows), arg(&input_rows), arg(&batch), arg(&rows), arg(&cols), arg(&values),
        arg(&scales), arg(&transposed_values), arg(&transposed_scales),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{assert_family_compiles, compile_check, Architecture};
    use crate::quantize::RECIPE_BLOCKS;

    fn instances(dtypes: &[DataType]) -> Vec<String> {
        let mut instances = Vec::new();
        for &dtype in dtypes {
            for block in RECIPE_BLOCKS {
                for orientation in [Orientation::AsIs, Orientation::Transposed, Orientation::Both] {
                    for power_of_two in [false, true] {
                        for fp8_input in [false, true] {
                            instances.push(quantize_instance(dtype, block, orientation, power_of_two, fp8_input).unwrap());
                        }
                    }
                }
            }
        }
        instances
    }

    /// CI has no GPU but has NVRTC: every instance a call can ask for
    /// compiles for Ampere (its own float-to-e4m3 rounding), Hopper and
    /// Blackwell (the conversion instruction): `assert_family_compiles`.
    #[test]
    fn quantize_kernels_compile_for_ampere_hopper_and_blackwell() {
        assert_family_compiles(&QUANTIZE, instances);
    }

    /// The kernel checks the launch's threads against its layout.
    #[test]
    fn a_launch_of_other_threads_does_not_compile() {
        let instance = Instance::new("quantize").dtype(DataType::BF16).int(1).int(128).flag(true).flag(false).flag(false).flag(false).int(128);
        let error = compile_check(&QUANTIZE, &[&instance.build().unwrap()], &Architecture("sm_90a".into())).unwrap_err();
        assert!(error.message().contains("the launch's threads"), "{}", error.message());
    }
}
