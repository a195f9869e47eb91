"""The block-scaled FP8 grouped products in plain JAX: the semantics of
:func:`oxmoe.fp8.ragged_dot` and :func:`oxmoe.fp8.transposed_ragged_dot` (DeepSeek-V3's
recipe), written without oxmoe's kernels.

The operands are :class:`oxmoe.fp8.BlockQuantized`. For :func:`ragged_dot`, the rows
``lhs [M, K]`` in ``(1, 128)`` blocks (one scale per row per 128 of K) and the experts'
weights ``rhs [G, K, N]`` in ``(128, 128)`` blocks (``[G, N, K]``, read transposed, with
``rhs_transposed``). Group ``g`` owns rows ``[start_g, start_g + group_sizes[g])`` of
``lhs``, ``start_g`` the sum of the sizes before it; local group ``i`` of ``rhs`` is group
``group_offset + i``; rows outside the window give zeros.

For each 128-wide block ``b`` of the contraction, the FP8 products (exact in float32) are
summed in float32 (in any order: that sum is the one freedom a kernel has), then the block's
partial is scaled and added to the float32 result in block order::

    out[m, n] += partial_b[m, n] * (lhs.scales[m, b] * rhs.scales[i(m), b, n // 128])

which keeps a long contraction as precise as float32 accumulation, however few bits the
tensor core's accumulator keeps over one block (DeepSeek-V3's promotion every 128 of K). The
result is rounded once to ``preferred_element_type``.

:func:`transposed_ragged_dot` (the weight gradient) contracts over the rows: both operands
``[M, K]`` and ``[M, N]`` in ``(128, 1)`` blocks; for each block of 128 rows, the products
of its rows that belong to group ``g`` are summed in float32 and scaled by the two blocks'
scales of each column, ``out[i, k, n] += partial_b[k, n] * (lhs.scales[b, k] *
rhs.scales[b, n])``, blocks in order (and chunk after chunk, for operands in chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe.fp8 import ACTIVATION_BLOCK, TRANSPOSED_ACTIVATION_BLOCK, WEIGHT_BLOCK, BlockQuantized

__all__ = ["ragged_dot", "transposed_ragged_dot"]

_BLOCK = 128


def _check(name: str, q, block: tuple[int, int], layout: str) -> None:
    if not isinstance(q, BlockQuantized):
        raise TypeError(f"{name} must be an oxmoe.fp8.BlockQuantized, got {type(q).__name__}")
    if q.block != block or len(q.shape) != len(layout.split(",")):
        raise ValueError(f"{name} must be {layout} quantized in {block} blocks, got shape {q.shape} in {q.block} "
                         "blocks")


def _window(group_sizes, group_offset, local_groups: int, rows: int):
    """``(local, sizes)``: each row's local group (``-1`` outside the window) and the
    ``[1 + local_groups]`` sizes of the rows before the window, then of each local group,
    from the global group sizes, clamped as the kernels clamp them."""
    sizes = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
    bounds = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.minimum(jnp.cumsum(sizes), rows)])
    g0 = 0 if group_offset is None else jnp.clip(jnp.asarray(group_offset, jnp.int32).reshape(()), 0, len(sizes))
    starts = bounds[jnp.minimum(g0 + jnp.arange(local_groups + 1), len(sizes))]
    row = jnp.arange(rows)
    local = jnp.searchsorted(starts, row, side="right") - 1
    local = jnp.where((row >= starts[0]) & (local < local_groups), local, -1)
    return local, jnp.concatenate([starts[:1], jnp.diff(starts)])


def ragged_dot(lhs: BlockQuantized, rhs: BlockQuantized, group_sizes, *, group_offset=None,
               rhs_transposed: bool = False, preferred_element_type=jnp.bfloat16) -> jax.Array:
    """``[M, N]``: each row of ``lhs`` times its local group's ``rhs``, by the module's
    semantics.

    Args:
      lhs: ``[M, K]`` in :data:`oxmoe.fp8.ACTIVATION_BLOCK` blocks.
      rhs: ``[G_local, K, N]`` in :data:`oxmoe.fp8.WEIGHT_BLOCK` blocks (``[G_local, N,
        K]`` with ``rhs_transposed``).
      group_sizes: ``[G]`` integers.
      group_offset: the window's first group (None: 0).
      rhs_transposed: ``rhs[g]ᵀ`` multiplies.
      preferred_element_type: the result's dtype (the sums are float32 either way).
    """
    _check("lhs", lhs, ACTIVATION_BLOCK, "[M, K]")
    _check("rhs", rhs, WEIGHT_BLOCK, "[G, N, K]" if rhs_transposed else "[G, K, N]")
    values, scales = rhs.values, rhs.scales
    if rhs_transposed:
        values, scales = jnp.swapaxes(values, 1, 2), jnp.swapaxes(scales, 1, 2)
    m, k = lhs.shape
    g, rhs_k, n = values.shape
    if rhs_k != k:
        raise ValueError(f"lhs's K ({k}) and rhs's K ({rhs_k}) differ")
    group_sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be integers [G], got {group_sizes.dtype}{list(group_sizes.shape)}")
    local, sizes = _window(group_sizes, group_offset, g, m)
    row_group = jnp.maximum(local, 0)
    a = lhs.values.astype(jnp.float32).reshape(m, k // _BLOCK, _BLOCK)
    # A group of zero weights for the rows before the window.
    b = jnp.concatenate([jnp.zeros((1, k, n), jnp.float32), values.astype(jnp.float32)])
    b = b.reshape(g + 1, k // _BLOCK, _BLOCK, n)

    def add_block(out, block):
        partial = jax.lax.ragged_dot(a[:, block], b[:, block], sizes, preferred_element_type=jnp.float32,
                                     precision=jax.lax.Precision.HIGHEST)
        column_scales = jnp.repeat(scales[row_group, block], _BLOCK, axis=-1)  # [M, N]
        return out + partial * (lhs.scales[:, block, None] * column_scales), None

    out, _ = jax.lax.scan(add_block, jnp.zeros((m, n), jnp.float32), jnp.arange(k // _BLOCK))
    return jnp.where((local >= 0)[:, None], out, 0).astype(preferred_element_type)


def transposed_ragged_dot(lhs, rhs, group_sizes, *, num_groups=None, group_offset=None,
                          preferred_element_type=jnp.float32) -> jax.Array:
    """``[num_groups, K, N]``: per local group, ``lhsᵀ · rhs`` over its rows, by the
    module's semantics.

    Args:
      lhs: ``lhsᵀ [K, M]`` in :data:`oxmoe.fp8.ACTIVATION_BLOCK` blocks (the rows'
        128 x 1 blocks, transposed), or a sequence of chunks ``[K, M_c]``.
      rhs: ``rhsᵀ [N, M]`` in the same blocks, or a sequence of chunks.
      group_sizes: ``[G]`` integers (``[C, G]`` for chunks).
      num_groups: the result's groups (default ``G``).
      group_offset: the window's first group (None: 0).
      preferred_element_type: the result's dtype.
    """
    chunked = isinstance(lhs, (list, tuple))
    lhs_chunks, rhs_chunks = (tuple(lhs), tuple(rhs)) if chunked else ((lhs,), (rhs,))
    sizes = jnp.asarray(group_sizes).reshape(len(lhs_chunks), -1)
    groups = sizes.shape[1] if num_groups is None else num_groups
    k, n = lhs_chunks[0].shape[0], rhs_chunks[0].shape[0]
    out = jnp.zeros((groups, k, n), jnp.float32)
    for a, c, chunk_sizes in zip(lhs_chunks, rhs_chunks, sizes):
        _check("lhs", a, ACTIVATION_BLOCK, "[K, M]")
        _check("rhs", c, ACTIVATION_BLOCK, "[N, M]")
        rows = a.shape[1]
        if rows == 0:
            continue
        local = _window(chunk_sizes, group_offset, groups, rows)[0].reshape(rows // _BLOCK, _BLOCK)
        av = a.values.astype(jnp.float32).T.reshape(rows // _BLOCK, _BLOCK, k)
        cv = c.values.astype(jnp.float32).T.reshape(rows // _BLOCK, _BLOCK, n)
        a_scales, c_scales = a.scales.T, c.scales.T  # [blocks, K], [blocks, N]

        def add_block(out, block):
            members = (local[block][:, None] == jnp.arange(groups)).astype(jnp.float32)  # [128, groups]
            partial = jnp.einsum("rg,rk,rn->gkn", members, av[block], cv[block],
                                 precision=jax.lax.Precision.HIGHEST)
            return out + partial * (a_scales[block][None, :, None] * c_scales[block][None, None, :]), None

        out, _ = jax.lax.scan(add_block, out, jnp.arange(rows // _BLOCK))
    return out.astype(preferred_element_type)
