//! XLA FFI handlers of the activation: the CPU ones run `cpu` on the call's
//! slices, the CUDA ones (`<name>_cuda`) hand the call to `cuda`.

use super::{cpu, covered_rows, cuda, ActivationBwd, ActivationFwd};
use crate::cuda::LaunchContext;
use crate::ffi::Result;
use crate::{export_handler, with_real_type};

export_handler!(oxmoe_activation_fwd, ActivationFwd, |_, op| forward_cpu(op));
export_handler!(oxmoe_activation_bwd, ActivationBwd, |_, op| backward_cpu(op));

export_handler!(oxmoe_activation_fwd_cuda, ActivationFwd, |call, op| cuda::forward(&LaunchContext::begin(call)?, &op));
export_handler!(oxmoe_activation_bwd_cuda, ActivationBwd, |call, op| cuda::backward(&LaunchContext::begin(call)?, &op));

fn forward_cpu(op: ActivationFwd) -> Result<()> {
    let covered = covered_rows(op.group_sizes.slice()?, op.rows);
    with_real_type!(op.up.dtype(), T => {
        cpu::forward::<T>(op.activation, op.up.slice()?, op.width, covered, op.hidden.slice_mut()?);
    });
    Ok(())
}

fn backward_cpu(op: ActivationBwd) -> Result<()> {
    let covered = covered_rows(op.group_sizes.slice()?, op.rows);
    with_real_type!(op.up.dtype(), T => {
        cpu::backward::<T>(op.activation, op.up.slice()?, op.grad_hidden.slice()?, op.width, covered,
                           op.grad_up.slice_mut()?, op.hidden.slice_mut()?);
    });
    Ok(())
}
