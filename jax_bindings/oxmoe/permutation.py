"""Token permutation: moving token rows to their experts and back.

:func:`dispatch` copies each token's row once per expert it is routed to, in
**expert-major** order: all rows of expert 0 (in increasing token order), then
expert 1, and so on, each expert's block optionally padded with zero rows to a
multiple of ``align_size`` (what a grouped GEMM with aligned tiles wants).
:func:`combine` brings the expert outputs back to token order, weighting each
copy by its merging probability and summing. :func:`sort_chunks` and
:func:`unsort_chunks` reorder contiguous chunks of rows, the local step after
an expert-parallel all-to-all.

Everything is differentiable (hand-written backwards from saved residuals),
works under ``jit`` and ``vmap``, and runs on CPU and GPU with the same
results. With inputs split along the tokens under ``jit``, these functions see
all tokens (XLA gathers them): per-shard permutation belongs inside
``shard_map``, where each shard dispatches its own tokens.

Under ``jit`` nothing here synchronises with the host, so the output's row
count is static: :func:`dispatched_rows` gives it. Routed copies that do not
fit (only possible with a routing map holding more than ``num_out_tokens``
entries) are dropped under ``jit`` and every other transformation (``vmap``,
``grad``, ``eval_shape``, ...), whether the map is traced or a constant.
Called eagerly, outside every transformation, :func:`dispatch` counts the
routing map on the host (a device-to-host copy) and raises instead.

Below the public functions, a primitive level for composing layers (the MoE
layer's forward and backward use it): each operation's forward and backward as
plain functions of arrays, a :class:`RowIdMap` and static sizes, with no
argument checks and no custom VJP. The public functions check their arguments
and define their gradients with them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import _library
from oxmoe._checks import MAX_ROWS, called_eagerly, check_array, check_bool, check_count, check_float_dtype
from oxmoe._primitive import FfiPrimitive, Layout

__all__ = ["Dispatched", "RowIdMap", "dispatch", "combine", "sort_chunks", "unsort_chunks", "dispatched_rows",
           "padded_rows", "dispatch_fwd", "dispatch_bwd", "dispatch_probs_bwd", "combine_fwd", "combine_bwd",
           "permute_chunks"]

ROWS, WHOLE, DISPATCHED = Layout.ROWS, Layout.WHOLE, Layout.DISPATCHED
_I32 = jnp.int32


def _dispatch_specs(tokens, routing_map, *probs, num_rows, **_):
    (t, h), e = tokens.shape, routing_map.shape[1]
    per_expert = jax.ShapeDtypeStruct((e,), _I32)
    specs = [jax.ShapeDtypeStruct((num_rows, h), tokens.dtype), jax.ShapeDtypeStruct((t, e), _I32),
             jax.ShapeDtypeStruct((num_rows,), _I32), per_expert, per_expert, per_expert]
    return specs + [jax.ShapeDtypeStruct((num_rows,), jnp.float32)] * len(probs)


def _combine_bwd_specs(grad_out, dest_rows, source_tokens, *weighted, **_):
    rows, h = source_tokens.shape[0], grad_out.shape[1]
    specs = [jax.ShapeDtypeStruct((rows, h), grad_out.dtype)]
    return specs + [jax.ShapeDtypeStruct(dest_rows.shape, jnp.float32)] * bool(weighted)


_dispatch_fwd_p = FfiPrimitive(
    "oxmoe_dispatch_fwd", operands=(ROWS, ROWS, ROWS),
    results=(DISPATCHED, ROWS, DISPATCHED, WHOLE, WHOLE, WHOLE, DISPATCHED),
    result_specs=_dispatch_specs, shape_params=("num_rows",),
    workspace=lambda tokens, routing_map, *_, **__: _library.workspace_bytes("oxmoe_dispatch_fwd", *routing_map.shape))
_combine_fwd_p = FfiPrimitive(
    "oxmoe_combine_fwd", operands=(DISPATCHED, ROWS, ROWS, ROWS), results=(ROWS,),
    result_specs=lambda x, dest_rows, *w, **_: [jax.ShapeDtypeStruct((dest_rows.shape[0], x.shape[1]), x.dtype)])
_combine_bwd_p = FfiPrimitive(
    "oxmoe_combine_bwd", operands=(ROWS, ROWS, DISPATCHED, ROWS, DISPATCHED), results=(DISPATCHED, ROWS),
    result_specs=_combine_bwd_specs)
_sort_chunks_p = FfiPrimitive(
    "oxmoe_sort_chunks", operands=(DISPATCHED, WHOLE, WHOLE), results=(DISPATCHED,),
    result_specs=lambda x, *_, **__: [jax.ShapeDtypeStruct(x.shape, x.dtype)])


@functools.partial(jax.tree_util.register_dataclass, data_fields=("dest_rows", "source_tokens"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class RowIdMap:
    """How a :func:`dispatch` moved the rows: what :func:`combine` needs to undo it.

    Made by :func:`dispatch` only; treat it as opaque.
    """

    dest_rows: jax.Array
    """``[T, E]`` int32: the output row of token t's copy for expert e; -1 if none."""
    source_tokens: jax.Array
    """``[R]`` int32: the token each output row holds; -1 for padding and unused rows."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("tokens", "probs", "row_id_map", "group_sizes", "tokens_per_expert",
                                "pad_offsets"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """The result of :func:`dispatch`: token rows in expert-major order.

    ``tokens_per_expert`` counts routed rows, as everywhere in oxmoe; the
    padded block sizes are ``group_sizes`` (before, these two fields were
    ``real_tokens_per_expert`` and ``tokens_per_expert``).
    """

    tokens: jax.Array
    """``[R, H]``, the tokens' dtype: expert 0's rows, then expert 1's, ...; zero
    rows pad each expert's block (with ``align_size``) and fill the end."""
    probs: jax.Array | None
    """``[R]``, the probs' dtype: the routing weight of each row (zero on padding);
    None when :func:`dispatch` got no probs."""
    row_id_map: RowIdMap
    """What :func:`combine` needs to bring the rows back."""
    group_sizes: jax.Array
    """``[E]`` int32: the rows of each expert's block (padded counts with
    ``align_size``); the group sizes of a grouped GEMM over ``tokens``."""
    tokens_per_expert: jax.Array
    """``[E]`` int32: the routed (unpadded) rows of each expert."""
    pad_offsets: jax.Array | None
    """``[E]`` int32: the padding rows before each expert's block; None without ``align_size``."""


def dispatched_rows(num_out_tokens: int, num_experts: int, align_size: int | None = None) -> int:
    """The static row count of :func:`dispatch`'s output.

    ``num_out_tokens`` without ``align_size``. With it, room for the worst-case
    padding: each of at most ``min(num_experts, num_out_tokens)`` non-empty
    experts adds fewer than ``align_size`` rows, and the total is a multiple of
    ``align_size``. At most ``2**31 - 1`` (row indices are int32): a larger
    count raises ``ValueError``.
    """
    n = check_count("num_out_tokens", num_out_tokens, 0)
    e = check_count("num_experts", num_experts, 1)
    a = None if align_size is None else check_count("align_size", align_size, 1, MAX_ROWS, " (row indices are int32)")
    rows = padded_rows(n, e, a)
    if rows > MAX_ROWS:
        raise ValueError(f"dispatch would have {rows} rows, more than 2**31 - 1 (row indices are int32): "
                         f"num_out_tokens={n}, num_experts={e}, align_size={a}")
    return rows


def _check_routed_count(routing_map, num_out_tokens: int, room: str) -> None:
    """Called eagerly, more entries than rows is an error, not a drop. ``room``
    names the argument the caller gave the room with, as the message shows it."""
    if not called_eagerly():
        return
    routed = int(np.count_nonzero(np.asarray(routing_map)))
    if routed > num_out_tokens:
        raise ValueError(f"{room} is too small: routing_map routes {routed} (token, expert) pairs; under jit "
                         "(or another transformation) the copies that do not fit would be dropped")


def dispatch(tokens, routing_map, *, probs=None, topk=None, num_out_tokens=None, align_size=None) -> Dispatched:
    """Copies each token's row to every expert it is routed to, expert-major.

    Args:
      tokens: ``[T, H]`` float32, bfloat16 or float16 activations.
      routing_map: ``[T, E]`` bool, e.g. from :func:`oxmoe.router.topk`.
      probs: optional ``[T, E]`` float routing weights to dispatch with the rows.
      topk: the most experts a token is routed to: room for ``T * topk`` copies.
      num_out_tokens: or the room for copies directly (give exactly one of the
        two). A map with more entries raises when called eagerly; under a
        transformation the copies that do not fit are dropped.
      align_size: pad each expert's block with zero rows to a multiple of this.

    Returns:
      A :class:`Dispatched` with ``R = dispatched_rows(num_out_tokens, E,
      align_size)`` rows. Differentiable in ``tokens`` and ``probs``.
    """
    check_array("tokens", tokens)
    check_array("routing_map", routing_map)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [num_tokens, hidden], got {tuple(tokens.shape)}")
    check_float_dtype("tokens", tokens)
    if routing_map.dtype != jnp.bool_:
        raise TypeError(f"routing_map must be bool, got {routing_map.dtype}")
    if routing_map.ndim != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"routing_map must have shape [num_tokens, num_experts] with num_tokens = "
                         f"{tokens.shape[0]} (tokens' first dimension), got {tuple(routing_map.shape)}")
    t, e = routing_map.shape
    if probs is not None:
        check_array("probs", probs)
        if probs.shape != routing_map.shape:
            raise ValueError(f"probs must have routing_map's shape {(t, e)}, got {tuple(probs.shape)}")
        check_float_dtype("probs", probs)
    if (topk is None) == (num_out_tokens is None):
        raise ValueError("give exactly one of topk (room for num_tokens * topk copies) and num_out_tokens, "
                         f"got topk={topk!r}, num_out_tokens={num_out_tokens!r}")
    if topk is None:
        room = f"num_out_tokens ({num_out_tokens})"
    else:
        topk = check_count("topk", topk, 1, e, f" (the number of experts is {e})")
        num_out_tokens = t * topk
        room = f"topk={topk} (room for {t} tokens x {topk} = {num_out_tokens} copies)"
    rows = dispatched_rows(num_out_tokens, e, align_size)  # checks num_out_tokens and align_size
    _check_routed_count(routing_map, num_out_tokens, room)

    static = (rows, None if align_size is None else int(align_size), None if probs is None else jnp.dtype(probs.dtype))
    return _dispatch(tokens, routing_map, probs, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(tokens, routing_map, probs, static):
    num_rows, align_size, _ = static
    return dispatch_fwd(tokens, routing_map, probs, num_rows=num_rows, align_size=align_size)


def _dispatch_vjp_fwd(tokens, routing_map, probs, static):
    num_rows, align_size, _ = static
    out = dispatch_fwd(tokens, routing_map, probs, num_rows=num_rows, align_size=align_size)
    return out, out.row_id_map


def _dispatch_vjp_bwd(static, row_id_map, cotangents):
    probs_dtype = static[2]
    if probs_dtype is None:
        grad_tokens, _ = dispatch_bwd(cotangents.tokens, row_id_map)
        return grad_tokens, None, None
    grad_tokens, grad_probs = dispatch_bwd(cotangents.tokens, row_id_map, cotangents.probs)
    return grad_tokens, None, grad_probs.astype(probs_dtype)


_dispatch.defvjp(_dispatch_vjp_fwd, _dispatch_vjp_bwd)


def combine(expert_tokens, row_id_map: RowIdMap, merging_probs=None, *, pad_offsets=None, num_tokens=None):
    """Brings dispatched rows back to token order, weighted and summed.

    ``out[t] = sum_e merging_probs[t, e] * expert_tokens[row of (t, e)]`` over
    the experts token t was dispatched to (in increasing expert order, in
    float32); weight 1 without ``merging_probs``. Padding rows are never read.

    Args:
      expert_tokens: ``[R, H]`` float32, bfloat16 or float16 rows in the layout
        of the :func:`dispatch` that made ``row_id_map``.
      row_id_map: :attr:`Dispatched.row_id_map`.
      merging_probs: optional ``[T, E]`` float weights.
      pad_offsets: optional, :attr:`Dispatched.pad_offsets`. The rows in
        ``row_id_map`` already include the padding, so it is only checked
        (an int32 ``[E]`` array); it exists so that a call written for
        TransformerEngine's signature works unchanged.
      num_tokens: optional T, checked against ``row_id_map``, which carries it.

    Returns:
      ``[T, H]`` in ``expert_tokens``' dtype. Differentiable in
      ``expert_tokens`` and ``merging_probs``. A ``row_id_map`` that does not
      belong to ``expert_tokens`` (rows out of range) gives NaN rows.
    """
    check_array("expert_tokens", expert_tokens)
    if expert_tokens.ndim != 2:
        raise ValueError(f"expert_tokens must have shape [rows, hidden], got {tuple(expert_tokens.shape)}")
    check_float_dtype("expert_tokens", expert_tokens)
    if not isinstance(row_id_map, RowIdMap):
        raise TypeError(f"row_id_map must be the RowIdMap of a dispatch, got {type(row_id_map).__name__}")
    rows = row_id_map.source_tokens.shape[0]
    if expert_tokens.shape[0] != rows:
        raise ValueError(f"expert_tokens has {expert_tokens.shape[0]} rows, but row_id_map comes from a "
                         f"dispatch of {rows} rows")
    t, e = row_id_map.dest_rows.shape
    if num_tokens is not None and check_count("num_tokens", num_tokens, 0) != t:
        raise ValueError(f"num_tokens is {num_tokens}, but row_id_map comes from a dispatch of {t} tokens")
    if pad_offsets is not None:
        check_array("pad_offsets", pad_offsets)
        if pad_offsets.shape != (e,) or pad_offsets.dtype != jnp.int32:
            raise ValueError(f"pad_offsets must be the int32 [num_experts] = [{e}] array of the dispatch, "
                             f"got {pad_offsets.dtype}{list(pad_offsets.shape)}")
    if merging_probs is not None:
        check_array("merging_probs", merging_probs)
        if merging_probs.shape != row_id_map.dest_rows.shape:
            raise ValueError(f"merging_probs must have shape [num_tokens, num_experts] = "
                             f"{tuple(row_id_map.dest_rows.shape)}, got {tuple(merging_probs.shape)}")
        check_float_dtype("merging_probs", merging_probs)
    return _combine(expert_tokens, row_id_map, merging_probs)


@jax.custom_vjp
def _combine(expert_tokens, row_id_map, merging_probs):
    return combine_fwd(expert_tokens, row_id_map, merging_probs)


def _combine_vjp_fwd(expert_tokens, row_id_map, merging_probs):
    out = combine_fwd(expert_tokens, row_id_map, merging_probs)
    saved_rows = None if merging_probs is None else expert_tokens
    return out, (saved_rows, row_id_map, merging_probs)


def _combine_vjp_bwd(residuals, grad_out):
    expert_tokens, row_id_map, merging_probs = residuals
    grad_rows, grad_probs = combine_bwd(grad_out, expert_tokens, row_id_map, merging_probs)
    return grad_rows, None, None if merging_probs is None else grad_probs.astype(merging_probs.dtype)


_combine.defvjp(_combine_vjp_fwd, _combine_vjp_bwd)


def _check_chunks(tokens, split_sizes, sorted_indices) -> None:
    check_array("tokens", tokens)
    if tokens.ndim < 1:
        raise ValueError("tokens must have a leading row dimension, got a scalar")
    check_float_dtype("tokens", tokens)
    for name, x in (("split_sizes", split_sizes), ("sorted_indices", sorted_indices)):
        check_array(name, x)
        if x.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
        if x.ndim != 1 or x.shape[0] < 1:
            raise ValueError(f"{name} must have shape [num_chunks] with num_chunks >= 1, got {tuple(x.shape)}")
    if split_sizes.shape != sorted_indices.shape:
        raise ValueError(f"split_sizes and sorted_indices must have one length, got {split_sizes.shape[0]} "
                         f"and {sorted_indices.shape[0]}")
    if called_eagerly():
        _check_permutation(np.asarray(sorted_indices))


def _check_permutation(sorted_indices: np.ndarray) -> None:
    """Called eagerly, sorted_indices must be a permutation of range(C)."""
    num_chunks, seen = len(sorted_indices), set()
    for at, index in enumerate(sorted_indices.tolist()):
        if index in seen or not 0 <= index < num_chunks:
            again = " again" if index in seen else ""
            raise ValueError(f"sorted_indices must be a permutation of range({num_chunks}), got {index}{again} "
                             f"at position {at}")
        seen.add(index)


def sort_chunks(tokens, split_sizes, sorted_indices):
    """Reorders contiguous chunks of rows: chunk ``sorted_indices[p]`` goes to position ``p``.

    Chunk ``j`` is the ``split_sizes[j]`` rows after chunks ``0..j-1``. After an
    expert-parallel all-to-all, rows arrive grouped by source shard, then by
    local expert; sorting the chunks groups them by local expert.

    Args:
      tokens: ``[N, ...]`` float32, bfloat16 or float16 rows.
      split_sizes: ``[C]`` int32 chunk sizes; rows past their sum are not in a chunk.
      sorted_indices: ``[C]`` int32, a permutation of ``range(C)``: called
        eagerly, anything else raises ``ValueError``. Under ``jit`` (or another
        transformation) it is not checked: an index outside ``[0, C)``, or one
        already listed, lists nothing and takes no rows.

    Returns:
      ``tokens``' shape and dtype: the listed chunks one after another, then zero
      rows. On the device, sizes are clamped so that chunks stay inside the ``N``
      rows (negative sizes count as 0). Each row moves at most once, so the
      gradient in ``tokens`` is :func:`unsort_chunks` whatever the indices.
    """
    _check_chunks(tokens, split_sizes, sorted_indices)
    return _sort(tokens, split_sizes, sorted_indices, False)


def unsort_chunks(tokens, split_sizes, sorted_indices):
    """The inverse of :func:`sort_chunks` (same arguments): chunks back to their places.

    ``unsort_chunks(sort_chunks(x, s, i), s, i)`` equals ``x`` on the rows inside
    chunks; the other rows are zero.
    """
    _check_chunks(tokens, split_sizes, sorted_indices)
    return _sort(tokens, split_sizes, sorted_indices, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sort(tokens, split_sizes, sorted_indices, inverse):
    return permute_chunks(tokens, split_sizes, sorted_indices, inverse=inverse)


def _sort_vjp_fwd(tokens, split_sizes, sorted_indices, inverse):
    return permute_chunks(tokens, split_sizes, sorted_indices, inverse=inverse), (split_sizes, sorted_indices)


def _sort_vjp_bwd(inverse, residuals, grad_out):
    split_sizes, sorted_indices = residuals
    # Through _sort, not permute_chunks: the gradient is differentiable again.
    return _sort(grad_out, split_sizes, sorted_indices, not inverse), None, None


_sort.defvjp(_sort_vjp_fwd, _sort_vjp_bwd)


# -- primitive level: no checks, no custom VJP; for composing layers ------------

def padded_rows(num_out_tokens: int, num_experts: int, align_size: int | None) -> int:
    """:func:`dispatched_rows` without its checks: the result may pass
    ``2**31 - 1``, for a caller that says why itself."""
    n, a = num_out_tokens, align_size
    return n if a is None else (n + min(num_experts, n) * (a - 1)) // a * a


def dispatch_fwd(tokens, routing_map, probs, *, num_rows: int, align_size: int | None,
                 zero_unused_rows: bool = True) -> Dispatched:
    """:func:`dispatch` into ``num_rows`` rows (:func:`dispatched_rows`),
    unchecked (but for ``zero_unused_rows``) and not differentiable; ``probs``
    may be None.

    zero_unused_rows: with False, the rows of ``tokens`` outside the groups (the
    rows no copy holds: alignment padding and the rows past the last group,
    where ``source_tokens`` is -1) are left unwritten (their values are
    unspecified; NaN on the CPU) instead of zeroed: for callers that read only the groups'
    rows. The other results, ``probs`` included, are the same either way.
    """
    zero_unused_rows = check_bool("zero_unused_rows", zero_unused_rows)
    weights = () if probs is None else (probs.astype(jnp.float32),)
    rows, dest_rows, source_tokens, group_sizes, routed, pads, *row_probs = _dispatch_fwd_p(
        tokens, routing_map, *weights, num_rows=num_rows, align_size=np.int64(1 if align_size is None else align_size),
        zero_unused_rows=zero_unused_rows)
    return Dispatched(tokens=rows, probs=None if probs is None else row_probs[0].astype(probs.dtype),
                      row_id_map=RowIdMap(dest_rows, source_tokens), group_sizes=group_sizes,
                      tokens_per_expert=routed, pad_offsets=None if align_size is None else pads)


def dispatch_bwd(grad_rows, row_id_map: RowIdMap, grad_row_probs=None) -> tuple[jax.Array, jax.Array | None]:
    """The transpose of :func:`dispatch_fwd`: ``grad_rows [R, H]`` back to
    ``[T, H]``, each token's copies summed (a :func:`combine_fwd` without
    weights), and :func:`dispatch_probs_bwd` of ``grad_row_probs`` (None without it)."""
    grad_tokens = combine_fwd(grad_rows, row_id_map)
    if grad_row_probs is None:
        return grad_tokens, None
    return grad_tokens, dispatch_probs_bwd(grad_row_probs, row_id_map)


def dispatch_probs_bwd(grad_row_probs, row_id_map: RowIdMap) -> jax.Array:
    """The routing weights' half of :func:`dispatch_bwd`: ``grad_row_probs [R]``
    (or ``[R, X]``: a vector per row) back to ``[T, E]`` (``[T, E, X]``) in its
    dtype, zero where nothing was dispatched. Apart from the rows' half, so that
    what the weights' gradient feeds can start that half's sums
    (:func:`combine_fwd`'s ``addend``)."""
    # Entries that were not dispatched (-1) pick a zero appended past the rows
    # (which may be none). On an explicit-sharding mesh the gather's result
    # sharding must be named.
    dest_rows = row_id_map.dest_rows
    sharding = jax.typeof(dest_rows).sharding
    rows = grad_row_probs.shape[0]
    zero = jnp.zeros((1, *grad_row_probs.shape[1:]), grad_row_probs.dtype)
    return jnp.append(grad_row_probs, zero, axis=0).at[jnp.where(dest_rows >= 0, dest_rows, rows)].get(
        out_sharding=sharding if sharding.mesh.axis_names else None)


def combine_fwd(rows, row_id_map: RowIdMap, merging_probs=None, addend=None) -> jax.Array:
    """:func:`combine` of ``rows [R, H]``, unchecked and not differentiable:
    ``[T, H]`` in the rows' dtype (``merging_probs`` is cast to float32). With
    ``addend [T, H]`` (cast to float32) each token's float32 sum starts from its
    row, and is rounded to the rows' dtype once."""
    weights = () if merging_probs is None else (merging_probs.astype(jnp.float32),)
    start = () if addend is None else (addend.astype(jnp.float32),)
    (out,) = _combine_fwd_p(rows, row_id_map.dest_rows, *weights, *start, weighted=np.bool_(bool(weights)))
    return out


def combine_bwd(grad_out, rows, row_id_map: RowIdMap, merging_probs=None, *,
                zero_unused_rows: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """The gradient of :func:`combine_fwd` (same arguments after ``grad_out``):
    ``(grad_rows, grad_probs)``, ``[R, H]`` in ``grad_out``'s dtype and
    ``[T, E]`` float32 (None without ``merging_probs``). ``rows`` are read only
    with ``merging_probs``, for the weights' gradient. Without ``merging_probs``
    each row of a dispatch's map is its token's row of ``grad_out``, bit for bit.
    A row whose maps disagree (its token out of range, or not listing it) is NaN.

    zero_unused_rows: with False, the rows of ``grad_rows`` outside the groups
    (the rows whose ``source_tokens`` entry is -1: alignment padding and the
    rows past the last group) are left unwritten (their values are unspecified; NaN on the CPU)
    instead of zeroed: for callers that read only the groups' rows. Rows whose
    maps disagree are NaN either way, and ``grad_probs`` is the same.
    """
    zero_unused_rows = check_bool("zero_unused_rows", zero_unused_rows)
    dest_rows, source_tokens = row_id_map.dest_rows, row_id_map.source_tokens
    if merging_probs is None:
        (grad_rows,) = _combine_bwd_p(grad_out, dest_rows, source_tokens, zero_unused_rows=zero_unused_rows)
        return grad_rows, None
    grad_rows, grad_probs = _combine_bwd_p(grad_out, dest_rows, source_tokens, merging_probs.astype(jnp.float32),
                                           rows, zero_unused_rows=zero_unused_rows)
    return grad_rows, grad_probs


def permute_chunks(tokens, split_sizes, sorted_indices, *, inverse: bool) -> jax.Array:
    """:func:`sort_chunks` (``inverse=False``) or :func:`unsort_chunks`
    (``inverse=True``), unchecked and not differentiable. Each is the other's
    transpose: the backward of one is the other."""
    rows = tokens.reshape(tokens.shape[0], math.prod(tokens.shape[1:]))
    (out,) = _sort_chunks_p(rows, split_sizes, sorted_indices, inverse=np.bool_(inverse))
    return out.reshape(tokens.shape)
