//! XLA FFI handlers of the quantization. Each decodes its call into
//! [`Quantize`]; the CPU handler then runs `cpu` on its slices (an FP8 input
//! dequantized first), once per quantization the call writes, the CUDA handler (`oxmoe_fp8_quantize_cuda`,
//! registered for the CUDA platform under the same target name) hands it to
//! `cuda` with the call's [`Stream`](crate::cuda::Stream).

use super::{cpu, cuda, Input, Quantization, Quantize};
use crate::ffi::Result;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_fp8_quantize, Quantize, |_, op| quantize_cpu(op));

export_cuda_handler!(oxmoe_fp8_quantize_cuda, Quantize, |stream, op| cuda::quantize(stream, &op));

/// Bytes of the workspace, `uint8[bytes]`, that a group-aligned
/// `oxmoe_fp8_quantize` of `rows` rows in `groups` groups takes as its last
/// result (the Python package asks when it builds the call).
#[no_mangle]
pub extern "C" fn oxmoe_fp8_quantize_workspace_bytes(rows: u64, groups: u64) -> u64 {
    super::ops::aligned_workspace_bytes(rows as usize, groups as usize) as u64
}

fn quantize_cpu(op: Quantize) -> Result<()> {
    with_real_type!(op.x.dtype(), T => {
        let dequantized: Vec<T>;
        let x = match &op.x {
            Input::Float(x) => x.slice()?,
            Input::Fp8 { values, scales, .. } => {
                dequantized = cpu::dequantized(values.slice()?, scales.slice()?);
                &dequantized
            }
        };
        for out in op.as_is.into_iter().chain(op.transposed) {
            let q = out.shape;
            match (&op.group_aligned, q.transpose) {
                (Some(aligned), true) => {
                    let (_, aligned_rows) = q.result_matrix();
                    let aligned = cpu::group_aligned(x, q.rows, q.cols, aligned.group_sizes.slice()?, aligned_rows);
                    let q = Quantization { rows: aligned_rows, groups: None, ..q };
                    cpu::quantize::<T>(&q, &aligned, out.values.slice_mut()?, out.scales.slice_mut()?);
                }
                _ => cpu::quantize::<T>(&q, x, out.values.slice_mut()?, out.scales.slice_mut()?),
            }
        }
    });
    Ok(())
}
