"""Grouped matrix products over row groups whose sizes stay on the device.

:func:`ragged_dot` is a drop-in for :func:`jax.lax.ragged_dot`: the rows of
``lhs`` come in consecutive groups, and group ``g``'s rows multiply
``rhs[g]``. It is the expert FFN's product after a dispatch, with the
dispatch's ``group_sizes``. :func:`ragged_dot_activation` is the expert
MLP's up projection: the same product and its activation (SwiGLU, ...) from
one kernel on Hopper. :func:`transposed_ragged_dot` is the product of
the weight gradient: per group, the rows' outer products summed,
``lhs_gᵀ · rhs_g``; it also takes its rows in chunks (up to
:data:`MAX_CHUNKS` buffers, each with its own group sizes), summing each
group's rows of every chunk into one result: the weight gradient of rows
that the MoE layer keeps per token chunk, without concatenating them.

Group sizes (and the first group of a window) are device arrays that the
kernels read themselves: nothing copies them to the host, so both work under
``jit`` and ``shard_map`` with sizes computed on the device. On the device,
out-of-range values are clamped so that nothing is read or written out of
bounds: negative sizes count as zero, groups end at row ``M`` at the latest,
and the window's first group is clamped to ``[0, G]``: under ``jit`` and
every other transformation, whether the sizes are traced or constants.
Called eagerly, outside every transformation, out-of-range values raise
instead.

Accumulation is float32. On a Hopper GPU, bfloat16 and float16 products whose
``K`` and ``N`` are multiples of 8 run on the tensor cores (``wgmma`` fed by
the tensor memory accelerator); other dtypes, shapes and GPUs take a simpler
kernel with the same results up to summation order.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import _library
from oxmoe.activation import _check_activation, _hidden_columns, activation_bwd, gated
from oxmoe._checks import FLOAT_DTYPES, called_eagerly, check_array, check_bool, check_count, check_float_dtype
from oxmoe._primitive import FfiPrimitive, Layout, vary_alike

__all__ = ["ActivatedRows", "ragged_dot", "ragged_dot_activation", "transposed_ragged_dot", "MAX_CHUNKS"]

DISPATCHED, WHOLE = Layout.DISPATCHED, Layout.WHOLE

MAX_CHUNKS = 8
"""The most chunks of rows :func:`transposed_ragged_dot` takes (the CUDA kernels
take each chunk's operands as launch arguments)."""


def _workspace_bytes(chunks: int, local_groups: int) -> int:
    """The workspace of a grouped product (FP8 or not) of ``chunks`` chunks of rows
    and ``local_groups`` groups (see :class:`oxmoe._primitive.FfiPrimitive`)."""
    return _library.workspace_bytes("oxmoe_grouped_gemm", chunks, local_groups)


_ragged_dot_p = FfiPrimitive(
    "oxmoe_ragged_dot", operands=(DISPATCHED, WHOLE, WHOLE, WHOLE), results=(DISPATCHED,),
    result_specs=lambda lhs, rhs, *_, n, out_dtype, **__: [jax.ShapeDtypeStruct((lhs.shape[0], n), out_dtype)],
    shape_params=("n", "out_dtype"), workspace=lambda lhs, rhs, *_, **__: _workspace_bytes(1, rhs.shape[0]))


_ragged_dot_activation_p = FfiPrimitive(
    "oxmoe_ragged_dot_activation", operands=(DISPATCHED, WHOLE, WHOLE, WHOLE), results=(DISPATCHED, DISPATCHED),
    result_specs=lambda lhs, rhs, *_, activation, **__: [
        jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), lhs.dtype),
        jax.ShapeDtypeStruct((lhs.shape[0], _hidden_columns(activation, rhs.shape[2])), lhs.dtype)],
    workspace=lambda lhs, rhs, *_, **__: _workspace_bytes(1, rhs.shape[0]))


@functools.cache
def _transposed_ragged_dot_p(chunks: int) -> FfiPrimitive:
    """The transposed product of ``chunks`` chunks: the lhs of each, the rhs of
    each, group_sizes ``[chunks, G]``, group_offset."""
    return FfiPrimitive(
        "oxmoe_transposed_ragged_dot", operands=(DISPATCHED,) * (2 * chunks) + (WHOLE, WHOLE), results=(WHOLE,),
        result_specs=lambda *operands, groups, out_dtype, **_: [
            jax.ShapeDtypeStruct((groups, operands[0].shape[1], operands[chunks].shape[1]), out_dtype)],
        shape_params=("groups", "out_dtype"), workspace=lambda *_, groups, **__: _workspace_bytes(chunks, groups))


_transposed_ragged_dot_p(1)  # registers the target at import, as every other primitive's is


def _out_dtype(preferred_element_type, dtype):
    if preferred_element_type is None:
        return jnp.dtype(dtype)
    out = jnp.dtype(preferred_element_type)
    if out not in (jnp.dtype(jnp.float32), jnp.dtype(dtype)):
        raise TypeError(f"preferred_element_type must be None, float32 or the inputs' dtype {jnp.dtype(dtype)}, "
                        f"got {out}")
    return out


def _check_groups(group_sizes, group_offset, local_groups: int | None, local_groups_name: str,
                  rows: tuple[int, ...], chunked: bool = False):
    """Checks the group arguments; returns ``(G, group_sizes as int32, group_offset
    as int32 [1])``. ``local_groups`` is the window's group count, which the
    argument named ``local_groups_name`` gives (None: not given, the window is
    every group). ``rows``: the rows of each chunk; ``chunked``: group_sizes is
    ``[chunks, G]``, else ``[G]``."""
    check_array("group_sizes", group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array (int32, or another integer dtype that is cast "
                        f"to int32), got {group_sizes.dtype}")
    if chunked and (group_sizes.ndim != 2 or group_sizes.shape[0] != len(rows)):
        raise ValueError(f"group_sizes must have shape [chunks, num_groups] = [{len(rows)}, G] for {len(rows)} "
                         f"chunks of lhs and rhs, got {tuple(group_sizes.shape)}")
    if not chunked and group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must have shape [num_groups], got {tuple(group_sizes.shape)}")
    groups = group_sizes.shape[-1]
    if group_offset is None:
        if local_groups is not None and local_groups != groups:
            raise ValueError(f"{local_groups_name} is {local_groups} but group_sizes has {groups} groups; give "
                             "group_offset to use a window of the groups")
        offset = jnp.zeros((1,), jnp.int32)
    else:
        check_array("group_offset", group_offset)
        if not jnp.issubdtype(group_offset.dtype, jnp.integer) or group_offset.shape not in ((), (1,)):
            raise ValueError(f"group_offset must be an integer (int32) scalar or [1] array, got "
                             f"{group_offset.dtype}{list(group_offset.shape)}")
        if local_groups is not None and local_groups > groups:
            raise ValueError(f"{local_groups_name} is {local_groups}, more than the {groups} groups of group_sizes")
        offset = jnp.reshape(_as_int32("group_offset", group_offset), (1,))
    _check_concrete(group_sizes, group_offset, rows, chunked)
    return groups, _as_int32("group_sizes", group_sizes), offset


def _as_int32(name: str, values):
    """Integer ``values`` (int64, unsigned, NumPy, ...) as an int32 JAX array.
    Called eagerly, a value outside int32 raises; under a transformation it is
    clamped to int32's range (the kernels clamp sizes to the rows anyway)."""
    if values.dtype == jnp.int32:
        return jnp.asarray(values)
    info = np.iinfo(np.int32)
    if called_eagerly():
        concrete = np.asarray(values)
        outside = (concrete < info.min) | (concrete > info.max)
        if outside.any():
            raise ValueError(f"{name} must fit in int32 (it is cast to int32), got {concrete[outside].flat[0]} "
                             f"({values.dtype})")
        return jnp.asarray(concrete.astype(np.int32))
    values = jnp.asarray(values)
    own = jnp.iinfo(values.dtype)
    if own.min < info.min or own.max > info.max:  # wider than int32: clamp first (a narrower one would wrap)
        values = jnp.clip(values, max(own.min, info.min), min(own.max, info.max))
    return values.astype(jnp.int32)


def _check_concrete(group_sizes, group_offset, rows: tuple[int, ...], chunked: bool) -> None:
    """Called eagerly, out-of-range sizes are errors, not clamped."""
    if not called_eagerly():
        return
    sizes = np.asarray(group_sizes).reshape(len(rows), -1)
    if (sizes < 0).any():
        chunk, group = np.argwhere(sizes < 0)[0]
        at = f"chunk {chunk}, group {group}" if chunked else f"group {group}"
        raise ValueError(f"group_sizes must be >= 0, got {sizes[chunk, group]} at {at}")
    for chunk, (chunk_sizes, m) in enumerate(zip(sizes, rows)):
        total = int(chunk_sizes.sum(dtype=np.int64))
        if total > m:
            of = f"chunk {chunk}'s sizes" if chunked else "group_sizes"
            lhs = f"lhs[{chunk}]" if chunked else "lhs"
            raise ValueError(f"{of} sum to {total}, more than the {m} rows of {lhs}")
    if group_offset is not None:
        offset = int(np.asarray(group_offset).reshape(()))
        if not 0 <= offset <= sizes.shape[1]:
            raise ValueError(f"group_offset must be in [0, {sizes.shape[1]}] (the number of groups), got {offset}")




def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
               out_sharding=None, *, rhs_transposed=False, zero_unused_rows=True):
    """Grouped product: the rows of group ``g`` of ``lhs`` times ``rhs[g]``.

    Takes :func:`jax.lax.ragged_dot`'s arguments, in its order, with its
    meaning, plus ``rhs_transposed`` and ``zero_unused_rows``. Group ``g``
    holds rows ``[start_g, start_g + group_sizes[g])`` of ``lhs``,
    ``start_g = sum(group_sizes[:g])``. With ``group_offset = g0``, local group
    ``i`` of ``rhs`` multiplies global group ``g0 + i`` (the local experts of an
    expert-parallel shard).

    Args:
      lhs: ``[M, K]`` float32, bfloat16 or float16.
      rhs: ``[G_local, K, N]`` float32, bfloat16 or float16; ``[G_local, N, K]``
        with ``rhs_transposed`` (then ``rhs[g]ᵀ`` multiplies, with no transpose
        materialised). Operands of two dtypes are promoted as
        :func:`jax.lax.ragged_dot` promotes them.
      group_sizes: ``[G]`` integer row counts, on the device; int32, or any
        other integer dtype (int64, NumPy arrays), cast to int32 (called
        eagerly, a value outside int32 raises).
      precision: accepted as :func:`jax.lax.ragged_dot` accepts it (None, a
        :class:`jax.lax.Precision` or its name, or a pair of them) and changes
        nothing: the kernels multiply the inputs in their own dtype and
        accumulate in float32 always. A dot algorithm is refused.
      preferred_element_type: the output dtype: None (the dtype
        :func:`jax.lax.ragged_dot` gives, the promoted inputs' for one dtype),
        float32, bfloat16 or float16 (rounded from the float32 sums).
      group_offset: optional integer scalar or ``[1]`` array, the first group
        of the window; ``G_local`` must equal ``G`` without it.
      out_sharding: None only (an output sharding is refused).
      rhs_transposed: ``rhs`` is ``[G_local, N, K]``.
      zero_unused_rows: with False, the rows outside the groups of the window
        (those of the groups before and after it, and the rows past the
        groups' total) are left unwritten (their values are unspecified; NaN on the CPU)
        instead of zeroed: for callers that read only the window's rows. The
        gradients are the same either way.

    Returns:
      ``[M, N]``: each row of a group in the window is its product, summed in
      float32; every other row (other groups, rows past the groups' total) is
      zero (unspecified with ``zero_unused_rows=False``). Differentiable in
      ``lhs`` and ``rhs``.
    """
    _check_precision(precision)
    if out_sharding is not None:
        raise ValueError(f"out_sharding is not supported by oxmoe.ragged_dot (None only), got {out_sharding!r}; "
                         "shard the result with jax.lax.with_sharding_constraint or jax.sharding.reshard")
    rhs_transposed = check_bool("rhs_transposed", rhs_transposed)
    zero_unused_rows = check_bool("zero_unused_rows", zero_unused_rows)
    m, _ = _check_operands(lhs, rhs, rhs_transposed)
    _, sizes, offset = _check_groups(group_sizes, group_offset, rhs.shape[0], "rhs.shape[0] (its groups)", (m,))
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    out_dtype = _ragged_dot_out_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
    # The kernels write the inputs' dtype or float32; any other output is rounded from float32.
    kernel_dtype = out_dtype if out_dtype in (dtype, jnp.dtype(jnp.float32)) else jnp.dtype(jnp.float32)
    operands = vary_alike(jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), sizes, offset)
    return _ragged_dot(*operands, (rhs_transposed, kernel_dtype, zero_unused_rows)).astype(out_dtype)


class ActivatedRows(typing.NamedTuple):
    """The result of :func:`ragged_dot_activation`.

    Attributes:
      pre_activation: ``[M, N]``: the product, as :func:`ragged_dot` gives it
        (what the activation's backward takes,
        :func:`oxmoe.activation.activation_bwd`).
      hidden: ``[M, F]``: its activation, ``F = N / 2`` for a gated one.
    """

    pre_activation: jax.Array
    hidden: jax.Array


def ragged_dot_activation(lhs, rhs, group_sizes, activation: str = "swiglu", *, group_offset=None,
                          zero_unused_rows: bool = True) -> ActivatedRows:
    """The expert MLP's up projection and its activation: :func:`ragged_dot`'s
    product ``u`` and, row by row, the hidden activation of it.

    For a gated activation (``"swiglu"``, ``"geglu"``) ``u``'s columns are
    ``[gate, up]``, ``F`` each, and ``hidden = round(act(gate) * up)``, else
    ``hidden = round(act(u))``, computed in float32 from ``u`` as rounded to
    the inputs' dtype (``round``: the rounding to it), the hidden activation
    :func:`oxmoe.activation.activation_bwd` recomputes from ``u``. On a Hopper
    GPU, when the product runs on the tensor cores and ``F`` is a multiple of
    8, the activation is applied to each output tile before it leaves the
    kernel, so ``u`` is not read back, with the GPU's approximate exponential
    and reciprocal (a few float32 ulps from the other paths: rarely, a value
    rounds to the neighbouring one of the dtype); elsewhere (and on the CPU)
    a second pass over the rows computes it.

    Args:
      lhs: ``[M, K]`` float32, bfloat16 or float16.
      rhs: ``[G_local, K, N]`` in ``lhs``'s dtype; ``N = 2F`` for a gated
        activation (gate columns, then up columns), ``F`` otherwise.
      group_sizes: ``[G]`` integer row counts, as :func:`ragged_dot` takes them.
      activation: one of :data:`oxmoe.activation.ACTIVATIONS`.
      group_offset: optional integer scalar or ``[1]`` array, the first group
        of the window, as :func:`ragged_dot` takes it.
      zero_unused_rows: with False, the rows outside the groups of the window
        (those of the groups before and after it, and the rows past the
        groups' total) are left unwritten in both results (their values are
        unspecified; NaN on the CPU) instead of zeroed: for callers that read only the
        window's rows. The gradients are the same either way.

    Returns:
      :class:`ActivatedRows`, both in ``lhs``'s dtype; rows outside every
      group in the window are zero in both (unspecified with
      ``zero_unused_rows=False``). Differentiable in ``lhs`` and ``rhs``, with
      cotangents for both results.
    """
    _check_activation(activation)
    zero_unused_rows = check_bool("zero_unused_rows", zero_unused_rows)
    m, _ = _check_operands(lhs, rhs, rhs_transposed=False)
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs must have lhs's dtype {lhs.dtype}, got {rhs.dtype}")
    if gated(activation) and rhs.shape[2] % 2:
        raise ValueError(f"rhs must have an even number of columns N = 2F ([gate, up]) for {activation!r}, "
                         f"got {tuple(rhs.shape)}")
    _, sizes, offset = _check_groups(group_sizes, group_offset, rhs.shape[0], "rhs.shape[0] (its groups)", (m,))
    operands = vary_alike(jnp.asarray(lhs), jnp.asarray(rhs), sizes, offset)
    return ActivatedRows(*_ragged_dot_activation(*operands, activation, zero_unused_rows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ragged_dot_activation(lhs, rhs, group_sizes, group_offset, activation_name, zero_unused_rows):
    return tuple(_ragged_dot_activation_p(lhs, rhs, group_sizes, group_offset, activation=activation_name,
                                          zero_unused_rows=zero_unused_rows))


def _ragged_dot_activation_vjp_fwd(lhs, rhs, group_sizes, group_offset, activation_name, zero_unused_rows):
    pre_activation, hidden = _ragged_dot_activation(lhs, rhs, group_sizes, group_offset, activation_name,
                                                    zero_unused_rows)
    return (pre_activation, hidden), (lhs, rhs, group_sizes, group_offset, pre_activation)


def _ragged_dot_activation_vjp_bwd(activation_name, zero_unused_rows, residuals, grads):
    # zero_unused_rows changes nothing here: the rows outside the window (of pre_activation, and
    # so of grad_product below) may hold anything, but the product's backward reads only the
    # window's rows of its cotangent.
    del zero_unused_rows
    lhs, rhs, group_sizes, group_offset, pre_activation = residuals
    grad_pre_activation, grad_hidden = grads
    # The activation's backward with every row's weight 1 (its rounding of the gradient
    # after the weight is then the identity), added to the product's own cotangent.
    ones = jnp.ones(pre_activation.shape[:1], jnp.float32)
    through_hidden = activation_bwd(grad_hidden.astype(lhs.dtype), pre_activation, ones, activation_name).grad_pre_activation
    grad_product = (grad_pre_activation.astype(jnp.float32) + through_hidden.astype(jnp.float32)).astype(lhs.dtype)
    return _ragged_dot_vjp_bwd((False, lhs.dtype, True), (lhs, rhs, group_sizes, group_offset), grad_product)


_ragged_dot_activation.defvjp(_ragged_dot_activation_vjp_fwd, _ragged_dot_activation_vjp_bwd)


def _check_operands(lhs, rhs, rhs_transposed: bool) -> tuple[int, int]:
    """A ragged product's float ``lhs [M, K]`` and ``rhs [G, K, N]`` (``[G, N, K]``
    with ``rhs_transposed``); returns ``(M, K)``."""
    check_array("lhs", lhs)
    check_array("rhs", rhs)
    check_float_dtype("lhs", lhs)
    check_float_dtype("rhs", rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs must have shape [M, K], got {tuple(lhs.shape)}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must have shape [groups, K, N] (or [groups, N, K] with rhs_transposed), "
                         f"got {tuple(rhs.shape)}")
    m, k = lhs.shape
    rhs_k = rhs.shape[2] if rhs_transposed else rhs.shape[1]
    if rhs_k != k:
        layout = "[groups, N, K]" if rhs_transposed else "[groups, K, N]"
        raise ValueError(f"rhs must be {layout} with K = {k} (lhs's second dimension), got {tuple(rhs.shape)}")
    return m, k


def _check_precision(precision) -> None:
    """``precision`` as :func:`jax.lax.dot` takes it, but only the kinds that
    name a precision (the kernels accumulate in float32 whatever it says)."""
    parts = precision if isinstance(precision, (tuple, list)) and len(precision) == 2 else (precision,)
    for part in parts:
        if part is None or isinstance(part, jax.lax.Precision):
            continue
        if isinstance(part, str):
            try:
                jax.lax.Precision(part)
                continue
            except ValueError:
                pass
        raise ValueError(f"precision must be None, a jax.lax.Precision, its name, or a pair of them (oxmoe's kernels "
                         f"accumulate in float32 always; a dot algorithm is not supported), got {precision!r}")


def _ragged_dot_out_dtype(preferred_element_type, lhs_dtype, rhs_dtype):
    """The output dtype :func:`jax.lax.ragged_dot` gives, of the float dtypes oxmoe writes."""
    if preferred_element_type is not None:
        out = jnp.dtype(preferred_element_type)
        if out not in FLOAT_DTYPES:
            raise TypeError(f"preferred_element_type must be None, float32, bfloat16 or float16, got {out}")
        return out
    if lhs_dtype == rhs_dtype:
        return jnp.dtype(lhs_dtype)
    # Two dtypes: lax's own rule (e.g. bfloat16 x float32 gives float32), read from its abstract evaluation.
    return jax.eval_shape(jax.lax.ragged_dot, jax.ShapeDtypeStruct((1, 1), lhs_dtype),
                          jax.ShapeDtypeStruct((1, 1, 1), rhs_dtype),
                          jax.ShapeDtypeStruct((1,), jnp.int32)).dtype


def transposed_ragged_dot(lhs, rhs, group_sizes, *, num_groups=None, group_offset=None,
                          preferred_element_type=None):
    """Per group, the rows' outer products summed: ``out[i] = lhs_gᵀ · rhs_g``.

    ``lhs_g`` and ``rhs_g`` are the rows of group ``g = g0 + i`` (``g0`` the
    window's first group, 0 without ``group_offset``), as in :func:`ragged_dot`.
    This is the gradient of :func:`ragged_dot`'s ``rhs``: with ``lhs`` the
    forward's input and ``rhs`` the output's cotangent.

    In chunks: ``lhs`` and ``rhs`` may each be a sequence of ``C`` arrays
    (``1 <= C <=`` :data:`MAX_CHUNKS`), chunk ``c`` ``[M_c, K]`` and ``[M_c, N]``
    with its own group sizes ``group_sizes[c]``: group ``g``'s rows are then
    its rows in chunk 0, then in chunk 1, and so on, summed into one
    ``out[i]``, as if the chunks were one matrix with the groups' rows
    gathered together (the weight gradient over rows kept in ``C`` buffers,
    with no copy).

    Args:
      lhs: ``[M, K]`` float32, bfloat16 or float16, or a sequence of chunks.
      rhs: ``[M, N]`` in lhs's dtype, or a sequence of chunks as ``lhs``'s.
      group_sizes: ``[G]`` int32 row counts, on the device; ``[C, G]`` for chunks.
      num_groups: the groups of the result; ``G`` by default, required with
        ``group_offset``.
      group_offset: optional int32 scalar or ``[1]`` array, the window's first group.
      preferred_element_type: the output dtype: None (lhs's dtype) or float32.

    Returns:
      ``[num_groups, K, N]``, summed in float32; a group with no rows (or past
      the last group) gives zeros. Differentiable in ``lhs`` and ``rhs``.
    """
    lhs_chunks, rhs_chunks, chunked = _chunks_of(lhs, rhs, "arrays")
    for c, (a, b) in enumerate(zip(lhs_chunks, rhs_chunks)):
        _check_chunk(a, b, lhs_chunks[0], rhs_chunks[0], f"[{c}]" if chunked else "")
    num_groups = _check_num_groups(num_groups, group_offset)
    rows = tuple(a.shape[0] for a in lhs_chunks)
    groups, sizes, offset = _check_groups(group_sizes, group_offset, num_groups, "num_groups", rows, chunked)
    out_dtype = _out_dtype(preferred_element_type, lhs_chunks[0].dtype)
    static = (groups if num_groups is None else num_groups, out_dtype)
    *operands, sizes, offset = vary_alike(*lhs_chunks, *rhs_chunks, sizes.reshape(len(rows), groups), offset)
    return _transposed(tuple(operands[:len(rows)]), tuple(operands[len(rows):]), sizes, offset, static)


def _chunks_of(lhs, rhs, single: str) -> tuple[tuple, tuple, bool]:
    """``(lhs's chunks, rhs's chunks, whether they came as sequences)`` of a transposed
    product's operands: both ``single`` operands (one chunk), or both sequences of
    the same 1 to :data:`MAX_CHUNKS` chunks."""
    chunked = isinstance(lhs, (list, tuple))
    if isinstance(rhs, (list, tuple)) != chunked:
        raise TypeError(f"lhs and rhs must both be {single} or both sequences of chunks, got {type(lhs).__name__} "
                        f"and {type(rhs).__name__}")
    lhs_chunks, rhs_chunks = (tuple(lhs), tuple(rhs)) if chunked else ((lhs,), (rhs,))
    if not 1 <= len(lhs_chunks) <= MAX_CHUNKS:
        raise ValueError(f"lhs must have 1 to {MAX_CHUNKS} chunks, got {len(lhs_chunks)}")
    if len(rhs_chunks) != len(lhs_chunks):
        raise ValueError(f"rhs must have lhs's {len(lhs_chunks)} chunks, got {len(rhs_chunks)}")
    return lhs_chunks, rhs_chunks, chunked


def _check_num_groups(num_groups, group_offset) -> int | None:
    """A transposed product's ``num_groups``, required with ``group_offset``."""
    if group_offset is not None and num_groups is None:
        raise ValueError("num_groups (the groups of the result) is required with group_offset")
    return None if num_groups is None else check_count("num_groups", num_groups, 0)


def _check_chunk(lhs, rhs, first_lhs, first_rhs, index: str) -> None:
    """Chunk ``index`` (``"[c]"``, or ``""`` without chunks) of the transposed
    product: ``lhs [M_c, K]`` and ``rhs [M_c, N]``, with the first chunk's
    dtype, ``K`` and ``N``."""
    check_array(f"lhs{index}", lhs)
    check_array(f"rhs{index}", rhs)
    check_float_dtype(f"lhs{index}", lhs)
    if lhs.dtype != first_lhs.dtype:
        raise TypeError(f"lhs{index} must have lhs[0]'s dtype {first_lhs.dtype}, got {lhs.dtype}")
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs{index} must have lhs's dtype {lhs.dtype}, got {rhs.dtype}")
    k_of = f" with K = {first_lhs.shape[-1]} (lhs[0]'s)" if index else ""
    if lhs.ndim != 2 or lhs.shape[1] != first_lhs.shape[-1]:
        raise ValueError(f"lhs{index} must have shape [M, K]{k_of}, got {tuple(lhs.shape)}")
    n_of = f" and N = {first_rhs.shape[-1]} (rhs[0]'s)" if index else ""
    if rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0] or rhs.shape[1] != first_rhs.shape[-1]:
        raise ValueError(f"rhs{index} must have shape [M, N] with M = {lhs.shape[0]} (lhs{index}'s rows){n_of}, "
                         f"got {tuple(rhs.shape)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ragged_dot(lhs, rhs, group_sizes, group_offset, static):
    """``static``: ``(rhs_transposed, out_dtype, zero_unused_rows)``."""
    rhs_transposed, out_dtype, zero_unused_rows = static
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    (out,) = _ragged_dot_p(lhs, rhs, group_sizes, group_offset, rhs_transposed=np.bool_(rhs_transposed),
                           zero_unused_rows=zero_unused_rows, n=n, out_dtype=out_dtype)
    return out


def _ragged_dot_vjp_fwd(lhs, rhs, group_sizes, group_offset, static):
    return _ragged_dot(lhs, rhs, group_sizes, group_offset, static), (lhs, rhs, group_sizes, group_offset)


def _ragged_dot_vjp_bwd(static, residuals, grad_out):
    rhs_transposed, _, _ = static
    lhs, rhs, group_sizes, group_offset = residuals
    grad_out = grad_out.astype(lhs.dtype)
    # d lhs = d out · rhs[g]ᵀ: the same product with rhs read the other way round; its rows
    # outside the window are zero whether or not the forward zeroed its own.
    grad_lhs = _ragged_dot(grad_out, rhs, group_sizes, group_offset, (not rhs_transposed, lhs.dtype, True))
    # d rhs[g] = lhs_gᵀ · d out_g, or its transpose d out_gᵀ · lhs_g for [G, N, K].
    operands = (grad_out, lhs) if rhs_transposed else (lhs, grad_out)
    grad_rhs = _transposed((operands[0],), (operands[1],), group_sizes[None], group_offset, (rhs.shape[0], rhs.dtype))
    return grad_lhs, grad_rhs, None, None


_ragged_dot.defvjp(_ragged_dot_vjp_fwd, _ragged_dot_vjp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _transposed(lhs: tuple, rhs: tuple, group_sizes, group_offset, static):
    """The chunks ``lhs`` and ``rhs`` (tuples of arrays), ``group_sizes [C, G]``."""
    groups, out_dtype = static
    (out,) = _transposed_ragged_dot_p(len(lhs))(*lhs, *rhs, group_sizes, group_offset, groups=groups,
                                                out_dtype=out_dtype)
    return out


def _transposed_vjp_fwd(lhs, rhs, group_sizes, group_offset, static):
    return _transposed(lhs, rhs, group_sizes, group_offset, static), (lhs, rhs, group_sizes, group_offset)


def _transposed_vjp_bwd(static, residuals, grad_out):
    lhs, rhs, group_sizes, group_offset = residuals
    grad_out = grad_out.astype(lhs[0].dtype)  # [G, K, N]
    # out[g] = Σ_c lhs_cgᵀ rhs_cg: d lhs_cg = rhs_cg · d out[g]ᵀ, d rhs_cg = lhs_cg · d out[g].
    grad_lhs = tuple(_ragged_dot(b, grad_out, sizes, group_offset, (True, a.dtype, True))
                     for a, b, sizes in zip(lhs, rhs, group_sizes))
    grad_rhs = tuple(_ragged_dot(a, grad_out, sizes, group_offset, (False, b.dtype, True))
                     for a, b, sizes in zip(lhs, rhs, group_sizes))
    return grad_lhs, grad_rhs, None, None


_transposed.defvjp(_transposed_vjp_fwd, _transposed_vjp_bwd)
