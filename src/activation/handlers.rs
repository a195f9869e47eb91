//! XLA FFI handlers of the activation backward. Each decodes its call into
//! [`ActivationBwd`]; the CPU handler then runs `cpu` on its slices, the CUDA
//! handler (`oxmoe_activation_bwd_cuda`, registered for the CUDA platform
//! under the same target name) hands it to `cuda` with the call's [`Stream`](crate::cuda::Stream).

use super::{cpu, cuda, ActivationBwd};
use crate::ffi::Result;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_activation_bwd, ActivationBwd, |_, op| activation_bwd_cpu(op));

export_cuda_handler!(oxmoe_activation_bwd_cuda, ActivationBwd, |stream, op| cuda::activation_bwd(stream, &op));

fn activation_bwd_cpu(op: ActivationBwd) -> Result<()> {
    with_real_type!(op.grad_hidden.dtype(), T => {
        cpu::activation_bwd::<T>(op.activation, op.features, op.grad_hidden.slice()?, op.pre_activation.slice()?,
                                 op.row_probs.slice()?, op.grad_pre_activation.slice_mut()?,
                                 op.weighted_hidden.slice_mut()?, op.grad_row_probs.slice_mut()?);
    });
    Ok(())
}
