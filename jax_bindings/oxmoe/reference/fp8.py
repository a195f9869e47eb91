"""The block-scaled FP8 grouped GEMM in plain JAX: the semantics oxmoe's FP8 kernels are to
match (DeepSeek-V3's recipe; the kernels are not in oxmoe yet).

The operands are :class:`oxmoe.fp8.BlockQuantized`: the rows ``lhs [M, K]`` in
``(1, 128)`` blocks (one scale per row per 128 of K), the experts' weights ``rhs [G, K,
N]`` in ``(128, 128)`` blocks. Group ``g`` owns rows ``[start_g, start_g +
group_sizes[g])`` of ``lhs``, ``start_g`` the sum of the sizes before it; rows past the
groups give zeros.

For each 128-wide block ``b`` of the contraction, the FP8 products (exact in float32) are
summed in float32 (in any order: that sum is the one freedom a kernel has), then the block's
partial is scaled and added to the float32 result in block order::

    out[m, n] += partial_b[m, n] * (lhs.scales[m, b] * rhs.scales[g(m), b, n // 128])

which keeps a long contraction as precise as float32 accumulation, however few bits the
tensor core's accumulator keeps over one block (DeepSeek-V3's promotion every 128 of K). The
result is rounded once to ``preferred_element_type``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe.fp8 import ACTIVATION_BLOCK, WEIGHT_BLOCK, BlockQuantized

__all__ = ["ragged_dot"]

_K_BLOCK = 128


def _check(lhs, rhs, group_sizes) -> None:
    if not isinstance(lhs, BlockQuantized) or not isinstance(rhs, BlockQuantized):
        raise TypeError(f"lhs and rhs must be oxmoe.fp8.BlockQuantized, got {type(lhs).__name__} and "
                        f"{type(rhs).__name__}")
    if lhs.block != ACTIVATION_BLOCK or len(lhs.shape) != 2:
        raise ValueError(f"lhs must be [M, K] quantized in {ACTIVATION_BLOCK} blocks, got shape {lhs.shape} in "
                         f"{lhs.block} blocks")
    if rhs.block != WEIGHT_BLOCK or len(rhs.shape) != 3:
        raise ValueError(f"rhs must be [G, K, N] quantized in {WEIGHT_BLOCK} blocks, got shape {rhs.shape} in "
                         f"{rhs.block} blocks")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"lhs's K ({lhs.shape[1]}) and rhs's K ({rhs.shape[1]}) differ")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers [G] = [{rhs.shape[0]}], got {group_sizes.dtype}"
                         f"{list(group_sizes.shape)}")


def ragged_dot(lhs: BlockQuantized, rhs: BlockQuantized, group_sizes, *,
               preferred_element_type=jnp.bfloat16) -> jax.Array:
    """``[M, N]``: each row of ``lhs`` times its group's ``rhs``, by the module's semantics.

    Args:
      lhs: ``[M, K]`` in :data:`oxmoe.fp8.ACTIVATION_BLOCK` blocks.
      rhs: ``[G, K, N]`` in :data:`oxmoe.fp8.WEIGHT_BLOCK` blocks.
      group_sizes: ``[G]`` integers summing to at most M.
      preferred_element_type: the result's dtype (the sums are float32 either way).
    """
    _check(lhs, rhs, group_sizes)
    m, k = lhs.shape
    g, _, n = rhs.shape
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(m)
    group_of_row = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), g - 1)
    in_a_group = rows < ends[-1]
    a = lhs.values.astype(jnp.float32).reshape(m, k // _K_BLOCK, _K_BLOCK)
    b = rhs.values.astype(jnp.float32).reshape(g, k // _K_BLOCK, _K_BLOCK, n)
    # Each row's weight scales, one per 128 of N, widened to N.
    row_scales = jnp.repeat(rhs.scales[group_of_row], _K_BLOCK, axis=-1)  # [M, K / 128, N]

    def add_block(out, block):
        partial = jax.lax.ragged_dot(a[:, block], b[:, block], group_sizes, preferred_element_type=jnp.float32)
        return out + partial * (lhs.scales[:, block, None] * row_scales[:, block]), None

    out, _ = jax.lax.scan(add_block, jnp.zeros((m, n), jnp.float32), jnp.arange(k // _K_BLOCK))
    return jnp.where(in_a_group[:, None], out, 0).astype(preferred_element_type)
