//! XLA FFI handlers of the grouped products. Each decodes its call into the
//! typed struct of `ops`; the CPU handler then runs `cpu` on its
//! slices, the CUDA handler (`<name>_cuda`, registered for the CUDA platform
//! under the same target name) hands it to `cuda` with the call's
//! [`Stream`](crate::cuda::Stream).

use super::ops::{Fp8RaggedDot, Fp8TransposedRaggedDot, RaggedDotActivation};
use super::{cpu, cuda, RaggedDot, TransposedRaggedDot};
use crate::ffi::{DataType, Result};
use crate::real::E4m3;
use crate::{export_cuda_handler, export_handler, with_real_type};

export_handler!(oxmoe_ragged_dot, RaggedDot, |_, op| ragged_dot_cpu(op));
export_handler!(oxmoe_ragged_dot_activation, RaggedDotActivation, |_, op| ragged_dot_activation_cpu(op));
export_handler!(oxmoe_transposed_ragged_dot, TransposedRaggedDot, |_, op| transposed_ragged_dot_cpu(op));
export_handler!(oxmoe_fp8_ragged_dot, Fp8RaggedDot, |_, op| fp8_ragged_dot_cpu(op));
export_handler!(oxmoe_fp8_transposed_ragged_dot, Fp8TransposedRaggedDot, |_, op| fp8_transposed_ragged_dot_cpu(op));

export_cuda_handler!(oxmoe_ragged_dot_cuda, RaggedDot, |stream, op| cuda::ragged_dot(stream, &op));
export_cuda_handler!(oxmoe_ragged_dot_activation_cuda, RaggedDotActivation, |stream, op| cuda::ragged_dot_activation(stream, &op));
export_cuda_handler!(oxmoe_transposed_ragged_dot_cuda, TransposedRaggedDot, |stream, op| cuda::transposed_ragged_dot(stream, &op));
export_cuda_handler!(oxmoe_fp8_ragged_dot_cuda, Fp8RaggedDot, |stream, op| cuda::fp8_ragged_dot(stream, &op));
export_cuda_handler!(oxmoe_fp8_transposed_ragged_dot_cuda, Fp8TransposedRaggedDot, |stream, op| cuda::fp8_transposed_ragged_dot(stream, &op));

/// Bytes of the workspace, `uint8[bytes]`, that the grouped products take as
/// their last result, for `chunks` chunks of rows (1 for the `ragged_dot`
/// targets) and `local_groups` groups (the Python package asks when it builds
/// the call).
#[no_mangle]
pub extern "C" fn oxmoe_grouped_gemm_workspace_bytes(chunks: u64, local_groups: u64) -> u64 {
    super::ops::workspace_bytes(chunks as usize, local_groups as usize) as u64
}

fn ragged_dot_cpu(op: RaggedDot) -> Result<()> {
    let (sizes, offset) = (op.group_sizes.slice::<i32>()?, op.group_offset.slice::<i32>()?[0]);
    with_real_type!(op.lhs.dtype(), T => {
        let (lhs, rhs) = (op.lhs.slice::<T>()?, op.rhs.slice::<T>()?);
        let (rhs_transposed, zero_unused_rows) = (op.rhs_transposed, op.zero_unused_rows);
        if op.out.dtype() == DataType::F32 {
            cpu::ragged_dot::<T, f32>(&op.shape, lhs, rhs, rhs_transposed, sizes, offset, zero_unused_rows,
                                      op.out.slice_mut()?);
        } else {
            cpu::ragged_dot::<T, T>(&op.shape, lhs, rhs, rhs_transposed, sizes, offset, zero_unused_rows,
                                    op.out.slice_mut()?);
        }
    });
    Ok(())
}

fn ragged_dot_activation_cpu(op: RaggedDotActivation) -> Result<()> {
    let RaggedDotActivation { product, activation, hidden } = op;
    let (sizes, offset) = (product.group_sizes.slice::<i32>()?, product.group_offset.slice::<i32>()?[0]);
    with_real_type!(product.lhs.dtype(), T => {
        cpu::ragged_dot_activation::<T>(&product.shape, product.lhs.slice()?, product.rhs.slice()?, activation, sizes,
                                        offset, product.zero_unused_rows, product.out.slice_mut()?,
                                        hidden.slice_mut()?);
    });
    Ok(())
}

fn transposed_ragged_dot_cpu(op: TransposedRaggedDot) -> Result<()> {
    let (sizes, offset) = (op.group_sizes.slice::<i32>()?, op.group_offset.slice::<i32>()?[0]);
    with_real_type!(op.chunks[0].lhs.dtype(), T => {
        let chunks = op.chunks.iter()
            .map(|c| Ok(cpu::ChunkRows { lhs: c.lhs.slice::<T>()?, rhs: c.rhs.slice::<T>()?, rows: c.rows }))
            .collect::<Result<Vec<_>>>()?;
        if op.out.dtype() == DataType::F32 {
            cpu::transposed_ragged_dot::<T, f32>(&op.shape, &chunks, sizes, offset, op.out.slice_mut()?);
        } else {
            cpu::transposed_ragged_dot::<T, T>(&op.shape, &chunks, sizes, offset, op.out.slice_mut()?);
        }
    });
    Ok(())
}

fn fp8_ragged_dot_cpu(op: Fp8RaggedDot) -> Result<()> {
    let (sizes, offset) = (op.group_sizes.slice::<i32>()?, op.group_offset.slice::<i32>()?[0]);
    let (lhs, lhs_scales) = (op.lhs.slice::<E4m3>()?, op.lhs_scales.slice::<f32>()?);
    let (rhs, rhs_scales) = (op.rhs.slice::<E4m3>()?, op.rhs_scales.slice::<f32>()?);
    with_real_type!(op.out.dtype(), O => {
        cpu::fp8_ragged_dot::<O>(&op.shape, lhs, lhs_scales, rhs, rhs_scales, op.rhs_transposed, sizes, offset,
                                 op.out.slice_mut()?);
    });
    Ok(())
}

fn fp8_transposed_ragged_dot_cpu(op: Fp8TransposedRaggedDot) -> Result<()> {
    let (sizes, offset) = (op.group_sizes.slice::<i32>()?, op.group_offset.slice::<i32>()?[0]);
    let chunks = op.chunks.iter()
        .map(|c| Ok(cpu::Fp8ChunkRows { lhs: c.lhs.slice()?, lhs_scales: c.lhs_scales.slice()?, rhs: c.rhs.slice()?,
                                        rhs_scales: c.rhs_scales.slice()?, rows: c.rows }))
        .collect::<Result<Vec<_>>>()?;
    with_real_type!(op.out.dtype(), O => {
        cpu::fp8_transposed_ragged_dot::<O>(&op.shape, &chunks, op.rhs_block_columns, sizes, offset,
                                             op.out.slice_mut()?);
    });
    Ok(())
}
