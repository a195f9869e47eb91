//! XLA FFI handlers of the quantization. Each decodes its call into
//! [`Quantize`]; the CPU handler then runs `cpu` on its slices (an FP8 input
//! dequantized first), once per quantization the call writes, the CUDA handler (`oxmoe_fp8_quantize_cuda`,
//! registered for the CUDA platform under the same target name) hands it to
//! `cuda` with the call's [`Stream`](crate::cuda::Stream).

use super::{cpu, cuda, Input, Quantize};
use crate::ffi::Result;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_fp8_quantize, Quantize, |_, op| quantize_cpu(op));

export_cuda_handler!(oxmoe_fp8_quantize_cuda, Quantize, |stream, op| cuda::quantize(stream, &op));

fn quantize_cpu(op: Quantize) -> Result<()> {
    with_real_type!(op.x.dtype(), T => {
        let dequantized: Vec<T>;
        let x = match &op.x {
            Input::Float(x) => x.slice()?,
            Input::Fp8 { values, scales, source_rows: None, .. } => {
                dequantized = cpu::dequantized(values.slice()?, scales.slice()?);
                &dequantized
            }
            Input::Fp8 { values, scales, source_rows: Some(source_rows), .. } => {
                let cols = values.dims()[2].max(0) as usize;
                dequantized = cpu::dequantized_rows(values.slice()?, scales.slice()?, cols, source_rows.slice()?);
                &dequantized
            }
        };
        for out in op.as_is.into_iter().chain(op.transposed) {
            cpu::quantize::<T>(&out.shape, x, out.values.slice_mut()?, out.scales.slice_mut()?);
        }
    });
    Ok(())
}
