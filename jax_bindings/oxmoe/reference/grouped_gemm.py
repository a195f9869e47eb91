"""The grouped GEMM in plain JAX: the semantics :mod:`oxmoe.grouped_gemm` matches,
as ``jax.lax.ragged_dot`` computes it.

Group ``g`` owns rows ``[start_g, start_g + group_sizes[g])`` of the ragged
operand, ``start_g`` the sum of the sizes before it. oxmoe's ``group_offset``,
``num_groups`` (a window of the groups) and ``preferred_element_type`` have no
counterpart here.
"""

from __future__ import annotations

import jax

__all__ = ["ragged_dot", "transposed_ragged_dot"]

#: ``jax.lax.ragged_dot`` with ``rhs [G, N, K]``: contract lhs's K with rhs's last dimension.
_NK_DIMENSIONS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def ragged_dot(lhs, rhs, group_sizes, *, rhs_transposed: bool = False):
    """:func:`oxmoe.ragged_dot` in plain JAX: each row of ``lhs`` times its group's weight.

    Args:
      lhs: ``[M, K]``.
      rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``rhs_transposed``.
      group_sizes: ``[G]`` int32, summing to at most M.
      rhs_transposed: whether ``rhs`` is stored ``[G, N, K]``.

    Returns:
      ``[M, N]``: ``jax.lax.ragged_dot`` (``ragged_dot_general`` for ``[G, N, K]``).
    """
    if rhs_transposed:
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, _NK_DIMENSIONS)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def transposed_ragged_dot(lhs, rhs, group_sizes):
    """:func:`oxmoe.transposed_ragged_dot` in plain JAX: per group, ``lhs_gᵀ rhs_g``, the
    gradient of :func:`ragged_dot` in its weight (what ``jax.vjp`` of
    ``jax.lax.ragged_dot`` applies, built with ``jax.linear_transpose``).

    Args:
      lhs: ``[M, K]``.
      rhs: ``[M, N]``.
      group_sizes: ``[G]`` int32, summing to at most M.

    Returns:
      ``[G, K, N]``, zero for an empty group.
    """
    weight = jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), lhs.dtype)
    (grad,) = jax.linear_transpose(lambda w: jax.lax.ragged_dot(lhs, w, group_sizes), weight)(rhs)
    return grad
