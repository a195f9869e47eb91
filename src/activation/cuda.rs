//! The CUDA activation: `kernels/activation.cu`'s `activation_bwd` and
//! `activation_fwd`, one warp per row, and `kernels/quantize.cu`'s
//! `activation_bwd_quantized`, one block per 128 rows, and
//! `activation_quantized`, a few rows a warp (see the kernels for their
//! layout and why).

use super::{Activation, ActivationBwd, ActivationBwdFp8, ActivationFp8};
use crate::cuda::{arg, grid, int, launch, Instance, Kernel, LaunchConfig, Stream, ACTIVATION, QUANTIZE};
use crate::ffi::{DataType, Result};
use crate::quantize::{self, cuda::TILE, WEIGHT_BLOCK};

/// Threads of a block, a row a warp (the kernel's `ACTIVATION_THREADS`).
const THREADS: u32 = 256;
const ROWS_PER_BLOCK: usize = THREADS as usize / 32;

/// The kernel `name` for rows of `features` columns of `dtype`: 16-byte
/// loads and stores when a row's bytes are a multiple of 16 (every row then
/// starts aligned), else one element at a time.
fn instance(name: &str, dtype: DataType, activation: Activation, features: usize) -> Result<String> {
    let element_bytes = dtype.size().unwrap_or(1);
    let vector_bytes = if (features * element_bytes).is_multiple_of(16) { 16 } else { 0 };
    Instance::new(name).dtype(dtype).int(activation.code()).int(vector_bytes).int(THREADS).build()
}

pub fn activation_bwd_instance(dtype: DataType, activation: Activation, features: usize) -> Result<String> {
    instance("activation_bwd", dtype, activation, features)
}

pub fn activation_fwd_instance(dtype: DataType, activation: Activation, features: usize) -> Result<String> {
    instance("activation_fwd", dtype, activation, features)
}

/// The hidden activation `[rows, features]` of `dtype` at `hidden` of the
/// pre-activation at `pre_activation` (`[rows, activation.input_columns(features)]`).
pub fn activation_fwd(stream: Stream, dtype: DataType, activation: Activation, rows: usize, features: usize,
                      pre_activation: u64, hidden: u64) -> Result<()> {
    if rows == 0 || features == 0 {
        return Ok(());
    }
    let kernel = Kernel::get(stream, &ACTIVATION, &activation_fwd_instance(dtype, activation, features)?)?;
    let (grid_rows, rows, features) = (rows.div_ceil(ROWS_PER_BLOCK), int(rows)?, int(features)?);
    launch(stream, kernel, LaunchConfig { grid: grid(grid_rows)?, block: THREADS, shared_bytes: 0 }, &mut [
        arg(&pre_activation), arg(&rows), arg(&features), arg(&hidden),
    ])
}

pub fn activation_bwd(stream: Stream, op: &ActivationBwd) -> Result<()> {
    let x = &op.operands;
    if x.rows == 0 {
        return Ok(());
    }
    let instance = activation_bwd_instance(x.grad_hidden.dtype(), x.activation, x.features)?;
    let kernel = Kernel::get(stream, &ACTIVATION, &instance)?;
    let (rows, features) = (int(x.rows)?, int(x.features)?);
    // Without group sizes the kernel takes a null pointer: every row. With them the grid still
    // spans every row (only the device knows where the groups end); warps past them return.
    let (group_sizes, groups) = match &op.group_sizes {
        Some(sizes) => (sizes.device_ptr(), int(sizes.len())?),
        None => (0, 0),
    };
    launch(stream, kernel, LaunchConfig { grid: grid(x.rows.div_ceil(ROWS_PER_BLOCK))?, block: THREADS, shared_bytes: 0 }, &mut [
        arg(&x.grad_hidden.device_ptr()), arg(&x.pre_activation.device_ptr()), arg(&x.row_probs.device_ptr()),
        arg(&group_sizes), arg(&groups), arg(&rows), arg(&features), arg(&op.grad_pre_activation.device_ptr()),
        arg(&op.weighted_hidden.device_ptr()), arg(&op.grad_row_probs.device_ptr()),
    ])
}

/// The tiles of `QUANTIZE_TILE` x `QUANTIZE_TILE` elements a block of
/// `activation_bwd_quantized` holds in dynamic shared memory (the kernel's
/// `ACTIVATION_BWD_TILES`; gated activations use all three).
const QUANTIZED_TILES: usize = 3;

/// `square_grad_transposed`: the transposed gradient in 128 x 128 blocks (else 128 x 1).
pub fn activation_bwd_fp8_instance(dtype: DataType, activation: Activation, power_of_two_scales: bool,
                                   square_grad_transposed: bool) -> Result<String> {
    let instance = Instance::new("activation_bwd_quantized").dtype(dtype).int(activation.code());
    instance.flag(power_of_two_scales).flag(square_grad_transposed).int(quantize::cuda::THREADS).build()
}

/// The dynamic shared memory of a block of `activation_bwd_quantized`: its tiles.
fn quantized_shared_bytes(dtype: DataType, activation: Activation) -> u32 {
    let tiles = if activation.gated() { QUANTIZED_TILES } else { QUANTIZED_TILES - 1 };
    (tiles * TILE * TILE * dtype.size().unwrap_or(4)) as u32
}

pub fn activation_bwd_fp8(stream: Stream, op: &ActivationBwdFp8) -> Result<()> {
    let x = &op.operands;
    if x.rows == 0 {
        return Ok(());
    }
    let dtype = x.grad_hidden.dtype();
    let shared_bytes = quantized_shared_bytes(dtype, x.activation);
    // Every result's quantization takes the call's power_of_two_scales.
    let power_of_two_scales = op.grad_pre_activation.shape.power_of_two_scales;
    let square = op.grad_pre_activation_transposed.shape.block == WEIGHT_BLOCK;
    let instance = activation_bwd_fp8_instance(dtype, x.activation, power_of_two_scales, square)?;
    let kernel = Kernel::get_with_shared_bytes(stream, &QUANTIZE, &instance, shared_bytes)?;
    let (rows, features) = (int(x.rows)?, int(x.features)?);
    let (grad_values, grad_scales) = op.grad_pre_activation.device_ptrs();
    let (grad_transposed_values, grad_transposed_scales) = op.grad_pre_activation_transposed.device_ptrs();
    let (weighted_values, weighted_scales) = op.weighted_hidden_transposed.device_ptrs();
    let config = LaunchConfig { grid: grid(x.rows / TILE)?, block: quantize::cuda::THREADS, shared_bytes };
    launch(stream, kernel, config, &mut [
        arg(&x.grad_hidden.device_ptr()), arg(&x.pre_activation.device_ptr()), arg(&x.row_probs.device_ptr()),
        arg(&rows), arg(&features), arg(&grad_values), arg(&grad_scales), arg(&grad_transposed_values),
        arg(&grad_transposed_scales), arg(&weighted_values), arg(&weighted_scales),
        arg(&op.grad_row_probs.device_ptr()),
    ])
}

/// Rows a warp of `activation_quantized` takes, its loads all in flight together.
const FP8_ROWS_PER_WARP: usize = 4;

pub fn activation_fp8_instance(dtype: DataType, activation: Activation, power_of_two_scales: bool) -> Result<String> {
    let instance = Instance::new("activation_quantized").dtype(dtype).int(activation.code());
    instance.flag(power_of_two_scales).int(FP8_ROWS_PER_WARP).int(quantize::cuda::THREADS).build()
}

pub fn activation_fp8(stream: Stream, op: &ActivationFp8) -> Result<()> {
    let q = &op.hidden.shape;
    if op.hidden.values.is_empty() {
        return Ok(());
    }
    let dtype = op.pre_activation.dtype();
    let instance = activation_fp8_instance(dtype, op.activation, q.power_of_two_scales)?;
    let kernel = Kernel::get(stream, &QUANTIZE, &instance)?;
    // Each row is a batch element of one row: the kernel sees one matrix of them. A block
    // takes FP8_ROWS_PER_WARP rows a warp of one span of columns, 16 bytes of each a lane.
    let block_rows = quantize::cuda::THREADS as usize / 32 * FP8_ROWS_PER_WARP;
    let span = 32 * 16 / dtype.size().unwrap_or(4);
    let blocks = q.batch.div_ceil(block_rows) * q.cols.div_ceil(span);
    let (rows, features) = (int(q.batch)?, int(q.cols)?);
    let (values, scales) = op.hidden.device_ptrs();
    launch(stream, kernel, LaunchConfig { grid: grid(blocks)?, block: quantize::cuda::THREADS, shared_bytes: 0 }, &mut [
        arg(&op.pre_activation.device_ptr()), arg(&rows), arg(&features), arg(&values), arg(&scales),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{assert_family_compiles, compile_check, Architecture};

    fn instances(dtypes: &[DataType]) -> Vec<String> {
        let mut instances = Vec::new();
        for &dtype in dtypes {
            for activation in Activation::ALL {
                for features in [768, 100] {
                    instances.push(activation_bwd_instance(dtype, activation, features).unwrap());
                    instances.push(activation_fwd_instance(dtype, activation, features).unwrap());
                }
            }
        }
        instances
    }

    fn fp8_instances(dtypes: &[DataType]) -> Vec<String> {
        let mut instances = Vec::new();
        for &dtype in dtypes {
            for activation in Activation::ALL {
                for power_of_two in [false, true] {
                    for square in [false, true] {
                        instances.push(activation_bwd_fp8_instance(dtype, activation, power_of_two, square).unwrap());
                    }
                    instances.push(activation_fp8_instance(dtype, activation, power_of_two).unwrap());
                }
            }
        }
        instances
    }

    /// CI has no GPU but has NVRTC: every instance a call can ask for
    /// compiles for Ampere, Hopper and Blackwell (`assert_family_compiles`).
    #[test]
    fn activation_kernels_compile_for_ampere_hopper_and_blackwell() {
        assert_family_compiles(&ACTIVATION, instances);
        assert_family_compiles(&QUANTIZE, fp8_instances);
    }

    /// The kernel checks the launch's threads against its layout.
    #[test]
    fn a_launch_of_other_threads_does_not_compile() {
        let instance = Instance::new("activation_bwd").dtype(DataType::BF16).int(Activation::Swiglu.code()).int(16).int(128);
        let error = compile_check(&ACTIVATION, &[&instance.build().unwrap()], &Architecture("sm_90a".into())).unwrap_err();
        assert!(error.message().contains("the launch's threads"), "{}", error.message());
    }
}
