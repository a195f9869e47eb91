//! XLA FFI handlers of the quantization. Each decodes its call into
//! [`Quantize`]; the CPU handler then runs `cpu` on its slices, once per
//! quantization the call writes, the CUDA handler (`oxmoe_fp8_quantize_cuda`,
//! registered for the CUDA platform under the same target name) hands it to
//! `cuda` with the call's [`LaunchContext`].

use super::{cpu, cuda, Quantize};
use crate::cuda::LaunchContext;
use crate::ffi::Result;
use crate::{export_handler, with_real_type};

export_handler!(oxmoe_fp8_quantize, Quantize, |_, op| quantize_cpu(op));

export_handler!(oxmoe_fp8_quantize_cuda, Quantize, |call, op| cuda::quantize(&LaunchContext::begin(call)?, &op));

fn quantize_cpu(op: Quantize) -> Result<()> {
    for out in op.as_is.into_iter().chain(op.transposed) {
        with_real_type!(op.x.dtype(), T => {
            cpu::quantize::<T>(&out.shape, op.x.slice()?, out.values.slice_mut()?, out.scales.slice_mut()?);
        });
    }
    Ok(())
}
