//! XLA FFI handlers of the activation backward and of the FP8 forward. Each
//! decodes its call into [`ActivationBwd`] (or [`ActivationBwdFp8`],
//! [`ActivationFp8`]); the CPU handler then runs `cpu` on its slices (and, for
//! the FP8 forms, the quantization's `cpu` on its results: that composition is
//! the FP8 forms' specification), the CUDA handler
//! (`<target>_cuda`, registered for the CUDA platform under the same target
//! name) hands it to `cuda` with the call's [`Stream`](crate::cuda::Stream).

use super::{cpu, cuda, ActivationBwd, ActivationBwdFp8, ActivationFp8, ActivationOperands};
use crate::ffi::Result;
use crate::quantize::cpu::quantize;
use crate::real::Real;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_activation_bwd, ActivationBwd, |_, op| activation_bwd_cpu(op));

export_cuda_handler!(oxmoe_activation_bwd_cuda, ActivationBwd, |stream, op| cuda::activation_bwd(stream, &op));

fn activation_bwd_cpu(op: ActivationBwd) -> Result<()> {
    let group_sizes = op.group_sizes.as_ref().map(|sizes| sizes.slice::<i32>()).transpose()?;
    with_real_type!(op.operands.grad_hidden.dtype(), T => {
        run_cpu::<T>(&op.operands, group_sizes, op.grad_pre_activation.slice_mut()?, op.weighted_hidden.slice_mut()?,
                     op.grad_row_probs.slice_mut()?)?;
    });
    Ok(())
}

/// `cpu::activation_bwd` of the call's operands (of the rows `group_sizes`
/// cover, when given) into the results given.
fn run_cpu<T: Real>(x: &ActivationOperands, group_sizes: Option<&[i32]>, grad_pre_activation: &mut [T],
                    weighted_hidden: &mut [T], grad_row_probs: &mut [f32]) -> Result<()> {
    cpu::activation_bwd::<T>(x.activation, x.features, x.grad_hidden.slice()?, x.pre_activation.slice()?,
                             x.row_probs.slice()?, group_sizes, grad_pre_activation, weighted_hidden, grad_row_probs);
    Ok(())
}

export_handler!(oxmoe_fp8_activation_bwd, ActivationBwdFp8, |_, op| activation_bwd_fp8_cpu(op));

export_cuda_handler!(oxmoe_fp8_activation_bwd_cuda, ActivationBwdFp8, |stream, op| cuda::activation_bwd_fp8(stream, &op));

fn activation_bwd_fp8_cpu(op: ActivationBwdFp8) -> Result<()> {
    let x = &op.operands;
    with_real_type!(x.grad_hidden.dtype(), T => {
        let mut grad_pre_activation = vec![T::default(); x.rows * x.width()];
        let mut weighted_hidden = vec![T::default(); x.rows * x.features];
        run_cpu::<T>(x, None, &mut grad_pre_activation, &mut weighted_hidden, op.grad_row_probs.slice_mut()?)?;
        for (out, x) in [(op.grad_pre_activation, &grad_pre_activation),
                         (op.grad_pre_activation_transposed, &grad_pre_activation),
                         (op.weighted_hidden_transposed, &weighted_hidden)] {
            quantize::<T>(&out.shape, x, out.values.slice_mut()?, out.scales.slice_mut()?);
        }
    });
    Ok(())
}

export_handler!(oxmoe_fp8_activation, ActivationFp8, |_, op| activation_fp8_cpu(op));

export_cuda_handler!(oxmoe_fp8_activation_cuda, ActivationFp8, |stream, op| cuda::activation_fp8(stream, &op));

fn activation_fp8_cpu(op: ActivationFp8) -> Result<()> {
    let q = &op.hidden.shape;
    with_real_type!(op.pre_activation.dtype(), T => {
        let mut hidden = vec![T::default(); q.batch * q.cols];
        cpu::activation_fwd::<T>(op.activation, q.cols, op.pre_activation.slice()?, &mut hidden);
        quantize::<T>(q, &hidden, op.hidden.values.slice_mut()?, op.hidden.scales.slice_mut()?);
    });
    Ok(())
}
