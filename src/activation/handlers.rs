//! XLA FFI handlers of the activation backward. Each decodes its call into
//! [`ActivationBwd`] (or [`ActivationBwdFp8`]); the CPU handler then runs `cpu`
//! on its slices (and, for the FP8 form, the quantization's `cpu` on its
//! results: that composition is the FP8 form's specification), the CUDA handler
//! (`<target>_cuda`, registered for the CUDA platform under the same target
//! name) hands it to `cuda` with the call's [`Stream`](crate::cuda::Stream).

use super::{cpu, cuda, ActivationBwd, ActivationBwdFp8};
use crate::ffi::Result;
use crate::quantize::cpu::quantize;
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

export_handler!(oxmoe_fp8_activation_bwd, ActivationBwdFp8, |_, op| activation_bwd_fp8_cpu(op));

export_cuda_handler!(oxmoe_fp8_activation_bwd_cuda, ActivationBwdFp8, |stream, op| cuda::activation_bwd_fp8(stream, &op));

fn activation_bwd_fp8_cpu(op: ActivationBwdFp8) -> Result<()> {
    with_real_type!(op.grad_hidden.dtype(), T => {
        let width = op.activation.input_columns(op.features);
        let mut grad_pre_activation = vec![T::default(); op.rows * width];
        let mut weighted_hidden = vec![T::default(); op.rows * op.features];
        cpu::activation_bwd::<T>(op.activation, op.features, op.grad_hidden.slice()?, op.pre_activation.slice()?,
                                 op.row_probs.slice()?, &mut grad_pre_activation, &mut weighted_hidden,
                                 op.grad_row_probs.slice_mut()?);
        for (out, x) in [(op.grad_pre_activation, &grad_pre_activation),
                         (op.grad_pre_activation_transposed, &grad_pre_activation),
                         (op.weighted_hidden_transposed, &weighted_hidden)] {
            quantize::<T>(&out.shape, x, out.values.slice_mut()?, out.scales.slice_mut()?);
        }
    });
    Ok(())
}
