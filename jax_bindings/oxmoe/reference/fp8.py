"""Block-scaled FP8 in plain JAX: the semantics of :func:`oxmoe.fp8.quantize` (and
:func:`oxmoe.fp8.quantize_with_transpose`, :func:`oxmoe.fp8.requantize`) and of the grouped
products
:func:`oxmoe.fp8.ragged_dot` and :func:`oxmoe.fp8.transposed_ragged_dot` (DeepSeek-V3's
recipe), written without oxmoe's kernels.

:func:`quantize` states :mod:`oxmoe.fp8`'s quantization semantics step by step in float32
(for any block shape, not only the recipe's three): float32 subnormals flushed to zeros of
their sign, each block's ``amax``, its scale (``amax * (1 / 448)``, or the next power of
two; 1 below ``448 * 2**-126``; NaN for a block with a NaN or an infinity), then ``x`` times
the scale's reciprocal, clipped and rounded to ``float8_e4m3fn``. XLA:GPU's float32 division
is not correctly rounded (about one quotient in seven was an ulp off on an H200, and one
value in 10^4 to 10^5 then rounded to a neighbouring float8), so the reciprocal is corrected
to the nearest float32: that of the scale's significand (in ``[1, 2)``), times the power of
two of its exponent, exactly. Every scale is a normal float32 (or NaN), so every backend
then rounds alike.

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
import numpy as np

from oxmoe._checks import check_array, check_bool
from oxmoe.fp8 import (ACTIVATION_BLOCK, E4M3_MAX, WEIGHT_BLOCK, BlockQuantized, _check_float_blocks, _check_quantized,
                       _weight_gradient_rhs_block)

__all__ = ["quantize", "quantize_with_transpose", "requantize", "ragged_dot", "transposed_ragged_dot"]

_BLOCK = 128
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
#: The smallest normal float32.
_TINY = float(np.finfo(np.float32).tiny)
#: The smallest ``amax`` whose scale ``amax * (1 / 448)`` is a normal float32.
_SMALLEST_SCALED_AMAX = E4M3_MAX * _TINY


def _check_block(x, block) -> None:
    if (not isinstance(block, tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be a pair of positive ints (rows, columns), got {block!r}")
    _check_float_blocks(x)
    rows, cols = x.shape[-2:]
    if rows % block[0] or cols % block[1]:
        raise ValueError(f"x's last two dimensions ({rows}, {cols}) must be multiples of the block {block}")


def _power_of_two_at_least(r):
    """The smallest power of two ``>= r`` for positive finite float32 ``r``, exactly (anything
    else gives a value the caller replaces)."""
    mantissa, exponent = jnp.frexp(r)  # r = mantissa * 2**exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(r), jnp.where(mantissa == 0.5, exponent - 1, exponent))


#: A float32's sign, exponent and top 11 stored mantissa bits: a value of 12 significant bits.
_HIGH_HALF = 0xFFFFF000


def _halves(a):
    """``(high, low)``, ``a = high + low`` exactly, each of at most 12 significant bits (split
    by masking the bits, which no compiler reassociates)."""
    high = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(_HIGH_HALF), jnp.float32)
    return high, a - high


def _one_minus_product(s, r):
    """``1 - s * r`` within one rounding, for ``s * r`` near 1: the product as ``p + e``
    exactly (Dekker's two-product on 12-bit halves, whose partial products are exact, so
    that contracting any of its steps into a fused multiply-add changes nothing)."""
    p = s * r
    (sh, sl), (rh, rl) = _halves(s), _halves(r)
    e = sl * rl - (((p - sh * rh) - sl * rh) - sh * rl)
    return (1 - p) - e  # 1 - p is exact for p in [0.5, 2]


def _nearest_reciprocal(m, guess):
    """``1 / m`` rounded to the nearest float32 for ``m`` in ``[1, 2)``, from a ``guess``
    within 2 ulp of it: of the guess and its four nearest neighbours, the one whose product
    with ``m`` is nearest 1 (every half and product above stays a normal number)."""
    bits = jax.lax.bitcast_convert_type(guess, jnp.int32)
    best, best_error = guess, jnp.full_like(guess, jnp.inf)
    for step in (-2, -1, 0, 1, 2):
        candidate = jax.lax.bitcast_convert_type(bits + step, jnp.float32)
        error = jnp.abs(_one_minus_product(m, candidate))
        closer = error < best_error
        best, best_error = jnp.where(closer, candidate, best), jnp.where(closer, error, best_error)
    return best


def _reciprocal(s):
    """``1 / s`` correctly rounded for positive normal float32 ``s`` below ``2**126`` (NaN
    for NaN), whatever the backend's division: ``s = m * 2**e`` with ``m`` in ``[1, 2)``,
    ``1 / m`` corrected to the nearest float32, times ``2**-e`` (exact: a normal result)."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    exponent = bits & jnp.uint32(0x7F800000)
    m = jax.lax.bitcast_convert_type((bits & jnp.uint32(0x007FFFFF)) | jnp.uint32(0x3F800000), jnp.float32)
    power = jax.lax.bitcast_convert_type(jnp.uint32(0x7F000000) - exponent, jnp.float32)  # 2**(127 - E) = 2**-e
    return jnp.where(jnp.isnan(s), s, _nearest_reciprocal(m, 1 / m) * power)


def _flushed(x):
    """``x`` with float32 subnormals replaced by zeros of their sign."""
    return jnp.where(jnp.abs(x) < _TINY, jnp.copysign(jnp.float32(0), x), x)


def quantize(x, block: tuple[int, int] = ACTIVATION_BLOCK, *, power_of_two_scales: bool = False,
             transpose: bool = False) -> BlockQuantized:
    """``x`` (or with ``transpose`` ``swapaxes(x, -1, -2)``) as ``float8_e4m3fn`` values with
    one float32 scale per ``block``, by :mod:`oxmoe.fp8`'s semantics.

    Args:
      x: ``[..., R, C]`` float32, bfloat16 or float16.
      block: ``(rows, columns)`` of a block, any positive pair that divides the (transposed)
        last two dimensions.
      power_of_two_scales: round each scale up to a power of two.
      transpose: quantize ``swapaxes(x, -1, -2)``.
    """
    power_of_two_scales = check_bool("power_of_two_scales", power_of_two_scales)
    transpose = check_bool("transpose", transpose)
    check_array("x", x)
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if transpose and x.ndim >= 2:
        x = jnp.swapaxes(x, -1, -2)
    _check_block(x, block)
    x = _flushed(x.astype(jnp.float32))
    *lead, rows, cols = x.shape
    blocks = x.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    # Asked apart: XLA:CPU's vectorised max drops NaNs (jax 0.10, from 16 rows on).
    finite = jnp.all(jnp.isfinite(blocks), axis=(-3, -1))
    scales = jnp.where(amax >= _SMALLEST_SCALED_AMAX, amax * jnp.float32(1 / E4M3_MAX), 1.0)
    if power_of_two_scales:
        scales = _power_of_two_at_least(scales)
    scales = jnp.where(finite, scales, jnp.nan)
    inverse = _reciprocal(scales)
    scaled = jnp.clip(blocks * inverse[..., :, None, :, None], -E4M3_MAX, E4M3_MAX)
    return BlockQuantized(scaled.astype(_E4M3).reshape(x.shape), scales, block)


def quantize_with_transpose(x, block: tuple[int, int] = ACTIVATION_BLOCK, *,
                            power_of_two_scales: bool = False) -> tuple[BlockQuantized, BlockQuantized]:
    """``(quantize(x, block), quantize(x, block, transpose=True))``: the two results of
    :func:`oxmoe.fp8.quantize_with_transpose`, by the module's semantics (any block that
    divides the last two dimensions both ways round)."""
    return (quantize(x, block, power_of_two_scales=power_of_two_scales),
            quantize(x, block, power_of_two_scales=power_of_two_scales, transpose=True))


def _dequantized(q: BlockQuantized, dtype):
    """``q``'s values times their 1 x 128 blocks' scales rounded to ``dtype``, as
    flush-to-zero float32 arithmetic (XLA:CPU's) computes :func:`oxmoe.fp8.dequantize`, on
    any backend: a subnormal scale counts as zero, and so does a product below ``2**-126``,
    decided on the product times ``2**64`` (a normal float32, rounded alike). Materialised
    in ``dtype`` behind an optimization barrier: XLA:GPU's excess precision (on by default)
    otherwise skipped the rounding to bf16 inside its fusion with the quantization that
    follows (on an H200, at 16384 x 2048: up to 0.9% of the values and 35% of the scales off
    the CPU's)."""
    values = q.values.astype(jnp.float32)
    scales = jnp.repeat(_flushed(q.scales), _BLOCK, axis=-1)
    product = values * scales
    tiny = jnp.abs((values * jnp.float32(2.0 ** 64)) * scales) < jnp.float32(_TINY * 2.0 ** 64)
    return jax.lax.optimization_barrier(jnp.where(tiny, jnp.copysign(jnp.float32(0), product), product).astype(dtype))


def requantize(q: BlockQuantized, block: tuple[int, int] = ACTIVATION_BLOCK, *, dtype=jnp.float32,
               power_of_two_scales: bool = False, transpose: bool = False) -> BlockQuantized:
    """:func:`oxmoe.fp8.requantize`: :func:`quantize` of ``q`` (``[..., R, C]`` in 1 x 128
    blocks) dequantized to ``dtype`` by flush-to-zero float32 products."""
    _check_quantized("q", q, ACTIVATION_BLOCK, "[..., R, C]")
    return quantize(_dequantized(q, dtype), block, power_of_two_scales=power_of_two_scales, transpose=transpose)


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
    _check_quantized("lhs", lhs, ACTIVATION_BLOCK, "[M, K]")
    _check_quantized("rhs", rhs, WEIGHT_BLOCK, "[G, N, K]" if rhs_transposed else "[G, K, N]")
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
      rhs: ``rhsᵀ [N, M]`` in the same blocks or in :data:`oxmoe.fp8.WEIGHT_BLOCK`
        blocks (the rows' 128 x 128 blocks), or a sequence of chunks, all in the same blocks.
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
    rhs_block = _weight_gradient_rhs_block(rhs_chunks[0])
    out = jnp.zeros((groups, k, n), jnp.float32)
    for a, c, chunk_sizes in zip(lhs_chunks, rhs_chunks, sizes):
        _check_quantized("lhs", a, ACTIVATION_BLOCK, "[K, M]")
        _check_quantized("rhs", c, rhs_block, "[N, M]")
        rows = a.shape[1]
        if rows == 0:
            continue
        local = _window(chunk_sizes, group_offset, groups, rows)[0].reshape(rows // _BLOCK, _BLOCK)
        av = a.values.astype(jnp.float32).T.reshape(rows // _BLOCK, _BLOCK, k)
        cv = c.values.astype(jnp.float32).T.reshape(rows // _BLOCK, _BLOCK, n)
        # [blocks, K], [blocks, N]: each scale over the c.block[0] columns of rhs it serves.
        a_scales, c_scales = a.scales.T, jnp.repeat(c.scales.T, c.block[0], axis=1)

        def add_block(out, block):
            members = (local[block][:, None] == jnp.arange(groups)).astype(jnp.float32)  # [128, groups]
            partial = jnp.einsum("rg,rk,rn->gkn", members, av[block], cv[block],
                                 precision=jax.lax.Precision.HIGHEST)
            return out + partial * (a_scales[block][None, :, None] * c_scales[block][None, None, :]), None

        out, _ = jax.lax.scan(add_block, out, jnp.arange(rows // _BLOCK))
    return out.astype(preferred_element_type)
