//! XLA FFI handlers of the permutation primitives. Each decodes its call
//! into the typed struct of `ops`; the CPU handler then runs `cpu` on
//! its slices, the CUDA handler (`<name>_cuda`, registered for the CUDA
//! platform under the same target name) hands it to `cuda` with the call's
//! [`Stream`](crate::cuda::Stream).

use super::cpu::{self, CombineGrads, ExpertCounts};
use super::{cuda, CombineBwd, CombineFwd, DispatchFwd, SortChunks};
use crate::ffi::Result;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_dispatch_fwd, DispatchFwd, |_, op| dispatch_fwd_cpu(op));
export_handler!(oxmoe_combine_fwd, CombineFwd, |_, op| combine_fwd_cpu(op));
export_handler!(oxmoe_combine_bwd, CombineBwd, |_, op| combine_bwd_cpu(op));
export_handler!(oxmoe_sort_chunks, SortChunks, |_, op| sort_chunks_cpu(op));

export_cuda_handler!(oxmoe_dispatch_fwd_cuda, DispatchFwd, |stream, op| cuda::dispatch_fwd(stream, &op));
export_cuda_handler!(oxmoe_combine_fwd_cuda, CombineFwd, |stream, op| cuda::combine_fwd(stream, &op));
export_cuda_handler!(oxmoe_combine_bwd_cuda, CombineBwd, |stream, op| cuda::combine_bwd(stream, &op));
export_cuda_handler!(oxmoe_sort_chunks_cuda, SortChunks, |stream, op| cuda::sort_chunks(stream, &op));

/// Bytes of the workspace, `uint8[bytes]`, that `oxmoe_dispatch_fwd` takes as
/// its last result for `tokens` tokens and `experts` experts (the Python
/// package asks when it builds the call).
#[no_mangle]
pub extern "C" fn oxmoe_dispatch_fwd_workspace_bytes(tokens: u64, experts: u64) -> u64 {
    cuda::dispatch_workspace_bytes(tokens as usize, experts as usize) as u64
}

fn dispatch_fwd_cpu(op: DispatchFwd) -> Result<()> {
    let source_tokens = op.source_tokens.slice_mut::<i32>()?;
    let probs = match (op.probs, op.out_probs) {
        (Some(probs), Some(out)) => Some((probs.slice::<f32>()?, out.slice_mut::<f32>()?)),
        _ => None,
    };
    let counts = ExpertCounts {
        tokens_per_expert: op.tokens_per_expert.slice_mut()?,
        real_tokens_per_expert: op.real_tokens_per_expert.slice_mut()?,
        pad_offsets: op.pad_offsets.slice_mut()?,
    };
    let routing_map = op.routing_map.mask()?;
    cpu::dispatch_map(&op.layout, routing_map, probs, op.dest_rows.slice_mut()?, source_tokens, counts);
    with_real_type!(op.tokens.dtype(), T => {
        let (tokens, out) = (op.tokens.slice()?, op.out_tokens.slice_mut()?);
        cpu::dispatch_rows::<T>(tokens, op.hidden, source_tokens, op.zero_unused_rows, out);
    });
    Ok(())
}

fn combine_fwd_cpu(op: CombineFwd) -> Result<()> {
    let weights = op.merging_probs.map(|w| w.slice::<f32>()).transpose()?;
    let addend = op.addend.map(|x| x.slice::<f32>()).transpose()?;
    with_real_type!(op.expert_tokens.dtype(), T => {
        let (expert_tokens, dest_rows) = (op.expert_tokens.slice()?, op.dest_rows.slice()?);
        cpu::combine::<T>(expert_tokens, op.hidden, dest_rows, op.experts, weights, addend, op.out.slice_mut()?);
    });
    Ok(())
}

fn combine_bwd_cpu(op: CombineBwd) -> Result<()> {
    let dest_rows = op.dest_rows.slice()?;
    let source_tokens = op.source_tokens.slice()?;
    with_real_type!(op.grad_out.dtype(), T => {
        let weighted = match op.weighted {
            Some((w, x, g)) => Some((w.slice::<f32>()?, x.slice::<T>()?, g.slice_mut::<f32>()?)),
            None => None,
        };
        let grads = CombineGrads { grad_expert_tokens: op.grad_expert_tokens.slice_mut()?, weighted };
        let grad_out = op.grad_out.slice()?;
        cpu::combine_backward::<T>(grad_out, op.hidden, dest_rows, source_tokens, op.experts, op.zero_unused_rows, grads);
    });
    Ok(())
}

fn sort_chunks_cpu(op: SortChunks) -> Result<()> {
    let (sizes, order) = (op.split_sizes.slice()?, op.sorted_indices.slice()?);
    with_real_type!(op.tokens.dtype(), T => {
        cpu::sort_chunks::<T>(op.tokens.slice()?, op.hidden, sizes, order, op.inverse, op.out.slice_mut()?);
    });
    Ok(())
}
