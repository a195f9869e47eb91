//! CUDA implementation of the activation: which specialisation of
//! `kernels/activation.cu` a call needs and its launch.

use super::{Activation, ActivationBwd, ActivationFwd};
use crate::cuda::{arg, grid, int, launch, Instance, Kernel, LaunchConfig, LaunchContext, ACTIVATION};
use crate::ffi::{DataType, Result};

/// Threads of a block, and blocks at most (each loops over its share of the rows).
const BLOCK: u32 = 256;
const MAX_BLOCKS: usize = 4096;

/// `(V, W)`: the elements a thread moves at once (16 bytes' worth where the width
/// allows it, so that every access is one aligned vector) and their bytes (0: one
/// element at a time).
fn vector(dtype: DataType, width: usize) -> (usize, usize) {
    let per_vector = 16 / dtype.size().expect("a float type");
    if width % per_vector == 0 {
        (per_vector, 16)
    } else {
        (1, 0)
    }
}

/// The kernel (`activation_fwd` or `activation_bwd`) for rows of `width` outputs.
pub fn instance(kernel: &str, dtype: DataType, activation: Activation, width: usize) -> Result<String> {
    let (v, w) = vector(dtype, width);
    Instance::new(kernel).dtype(dtype).flag(activation.glu).flag(activation.gelu).int(v).int(w).int(BLOCK).build()
}

fn config(rows: usize, width: usize, v: usize) -> Result<LaunchConfig> {
    let chunks = rows * (width / v);
    Ok(LaunchConfig { grid: grid(chunks.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS))?, block: BLOCK, shared_bytes: 0 })
}

pub fn forward(ctx: &LaunchContext, a: &ActivationFwd) -> Result<()> {
    let dtype = a.up.dtype();
    let kernel = Kernel::get(ctx.stream, &ACTIVATION, &instance("activation_fwd", dtype, a.activation, a.width)?)?;
    let (up, sizes, hidden) = (a.up.device_ptr(), a.group_sizes.device_ptr(), a.hidden.device_ptr());
    let (groups, rows, width) = (int(a.group_sizes.len())?, int(a.rows)?, int(a.width)?);
    launch(ctx.stream, kernel, config(a.rows, a.width, vector(dtype, a.width).0)?, &mut [
        arg(&up), arg(&sizes), arg(&groups), arg(&hidden), arg(&rows), arg(&width),
    ])
}

pub fn backward(ctx: &LaunchContext, a: &ActivationBwd) -> Result<()> {
    let dtype = a.up.dtype();
    let kernel = Kernel::get(ctx.stream, &ACTIVATION, &instance("activation_bwd", dtype, a.activation, a.width)?)?;
    let (up, grad_hidden, sizes) = (a.up.device_ptr(), a.grad_hidden.device_ptr(), a.group_sizes.device_ptr());
    let (grad_up, hidden) = (a.grad_up.device_ptr(), a.hidden.device_ptr());
    let (groups, rows, width) = (int(a.group_sizes.len())?, int(a.rows)?, int(a.width)?);
    launch(ctx.stream, kernel, config(a.rows, a.width, vector(dtype, a.width).0)?, &mut [
        arg(&up), arg(&grad_hidden), arg(&sizes), arg(&groups), arg(&grad_up), arg(&hidden), arg(&rows), arg(&width),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{compile_check, Architecture};

    /// Every activation and element type at the real models' widths (Mixtral's
    /// and Qwen3's F, DeepSeek-V3's), and at a width of no whole vector.
    #[test]
    fn activation_kernels_compile_for_ampere_hopper_and_blackwell() {
        let mut instances = Vec::new();
        for dtype in [DataType::F32, DataType::BF16, DataType::F16] {
            for (glu, gelu) in [(true, false), (true, true), (false, false), (false, true)] {
                for width in [4096, 768, 2048, 13] {
                    for kernel in ["activation_fwd", "activation_bwd"] {
                        instances.push(instance(kernel, dtype, Activation { glu, gelu }, width).unwrap());
                    }
                }
            }
        }
        let instances: Vec<&str> = instances.iter().map(String::as_str).collect();
        for arch in ["sm_80", "sm_90a", "sm_100"] {
            compile_check(&ACTIVATION, &instances, &Architecture(arch.into())).unwrap();
        }
    }
}
