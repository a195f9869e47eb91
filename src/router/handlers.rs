//! XLA FFI handlers of the router primitives. Each decodes its call into
//! the typed struct of `ops`; the CPU handler then runs `cpu` on its
//! slices, the CUDA handler (`<name>_cuda`, registered for the CUDA platform
//! under the same target name) hands it to `cuda` with the call's
//! [`Stream`](crate::cuda::Stream).

use super::{cpu, cuda, AuxLossBwd, AuxLossFwd, ScoresBwd, ScoresFwd, TopkBwd, TopkFwd};
use crate::ffi::{Arg, DataType, Result};
use crate::real::Real;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_topk_fwd, TopkFwd, |_, op| topk_fwd_cpu(op));
export_handler!(oxmoe_topk_bwd, TopkBwd, |_, op| topk_bwd_cpu(op));
export_handler!(oxmoe_aux_loss_scores_fwd, ScoresFwd, |_, op| scores_fwd_cpu(op));
export_handler!(oxmoe_aux_loss_scores_bwd, ScoresBwd, |_, op| scores_bwd_cpu(op));
export_handler!(oxmoe_aux_loss_fwd, AuxLossFwd, |_, op| aux_loss_fwd_cpu(op));
export_handler!(oxmoe_aux_loss_bwd, AuxLossBwd, |_, op| aux_loss_bwd_cpu(op));

export_cuda_handler!(oxmoe_topk_fwd_cuda, TopkFwd, |stream, op| cuda::topk_fwd(stream, &op));
export_cuda_handler!(oxmoe_topk_bwd_cuda, TopkBwd, |stream, op| cuda::topk_bwd(stream, &op));
export_cuda_handler!(oxmoe_aux_loss_scores_fwd_cuda, ScoresFwd, |stream, op| cuda::scores_fwd(stream, &op));
export_cuda_handler!(oxmoe_aux_loss_scores_bwd_cuda, ScoresBwd, |stream, op| cuda::scores_bwd(stream, &op));
export_cuda_handler!(oxmoe_aux_loss_fwd_cuda, AuxLossFwd, |stream, op| cuda::aux_loss_fwd(stream, &op));
export_cuda_handler!(oxmoe_aux_loss_bwd_cuda, AuxLossBwd, |stream, op| cuda::aux_loss_bwd(stream, &op));

/// Bytes of the workspace, `uint8[bytes]`, that `oxmoe_aux_loss_fwd` takes as
/// its last result (the Python package asks when it builds the call).
#[no_mangle]
pub extern "C" fn oxmoe_aux_loss_fwd_workspace_bytes() -> u64 {
    cuda::AUX_LOSS_WORKSPACE_BYTES as u64
}

fn topk_fwd_cpu(op: TopkFwd) -> Result<()> {
    let bias = op.bias.map(|b| b.slice::<f32>()).transpose()?;
    let routing_map = op.routing_map.mask_mut()?;
    with_real_type!(op.logits.dtype(), T => {
        cpu::topk_forward::<T>(&op.config, op.logits.slice()?, bias, op.probs.slice_mut()?, routing_map);
    });
    Ok(())
}

fn topk_bwd_cpu(op: TopkBwd) -> Result<()> {
    let routing_map = op.routing_map.mask()?;
    with_real_type!(op.logits.dtype(), T => {
        cpu::topk_backward::<T>(&op.config, op.grad_probs.slice()?, op.logits.slice()?, routing_map, op.grad_logits.slice_mut()?);
    });
    Ok(())
}

fn scores_fwd_cpu(op: ScoresFwd) -> Result<()> {
    let (map, scores) = (op.routing_map.mask_mut()?, op.scores.slice_mut()?);
    with_real_type!(op.logits.dtype(), T => {
        cpu::scores_forward::<T>(op.score_function, op.topk, op.experts, op.logits.slice()?, map, scores);
    });
    Ok(())
}

fn scores_bwd_cpu(op: ScoresBwd) -> Result<()> {
    with_real_type!(op.logits.dtype(), T => {
        cpu::scores_backward::<T>(op.score_function, op.experts, op.grad_scores.slice()?, op.logits.slice()?, op.grad_logits.slice_mut()?);
    });
    Ok(())
}

fn aux_loss_fwd_cpu(op: AuxLossFwd) -> Result<()> {
    let counts = counts_f32(&op.counts)?;
    let value = with_real_type!(op.probs.dtype(), T => cpu::aux_loss_forward::<T>(&op.config, op.probs.slice()?, &counts));
    op.loss.slice_mut::<f32>()?[0] = value;
    Ok(())
}

fn aux_loss_bwd_cpu(op: AuxLossBwd) -> Result<()> {
    let counts = counts_f32(&op.counts)?;
    let grad_loss = op.grad_loss.slice::<f32>()?[0];
    with_real_type!(op.grad_probs.dtype(), T => cpu::aux_loss_backward::<T>(&op.config, grad_loss, &counts, op.grad_probs.slice_mut()?));
    Ok(())
}

/// The counts as f32.
fn counts_f32(counts: &Arg) -> Result<Vec<f32>> {
    if counts.dtype() == DataType::S32 {
        return Ok(counts.slice::<i32>()?.iter().map(|&n| n as f32).collect());
    }
    with_real_type!(counts.dtype(), T => Ok(counts.slice::<T>()?.iter().map(|&n| n.to_f32()).collect()))
}
