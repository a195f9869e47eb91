"""Block-scaled FP8 quantization: the operands of FP8 GEMMs, as DeepSeek-V3 trained with.

A tensor is cut into blocks over its last two dimensions; each block gets one float32
scale, its largest magnitude over the format's largest finite value, and its elements are
divided by that scale and rounded to ``float8_e4m3fn``. The three block shapes of
DeepSeek-V3's recipe are the three uses:

- ``(1, 128)``: activations, one scale per token per 128 channels (the forward's and the
  data gradients' left operands);
- ``(128, 128)``: weights, one scale per 128 x 128 block;
- ``(128, 1)``: activations for the weight gradient, whose contraction runs over the tokens:
  one scale per 128 tokens per channel, from the same ``[tokens, channels]`` array, with no
  transposed copy.

The result is a :class:`BlockQuantized` pytree: the values (the input's shape), the scales
and the block shape. ``values * scales`` (each scale over its block) is the tensor it stands
for: :func:`dequantize`.

Semantics (the same on every backend: it is JAX, computed in float32):

- ``amax`` is the largest ``|x|`` of a block; ``scale = amax * (1 / 448)`` (448 is the
  largest finite ``float8_e4m3fn``; ``1 / 448`` rounded to float32, a product because
  compilers turn a division by a constant into one, differently per backend), or with
  ``power_of_two_scales`` the smallest power of two at least that (DeepSeek-V3 used such
  scales for some tensors: multiplying by them is exact);
- ``values = float8_e4m3fn(clip(x * (1 / scale), -448, 448))``: the block's reciprocal
  rounded to the nearest float32, one float32 product per element (what XLA makes of
  ``x / scale`` anyway, stated so that every backend rounds alike), then round to nearest,
  ties to even (the clip only absorbs the roundings of the scale and its reciprocal; it
  never changes a value otherwise). XLA:GPU's float32 division is not correctly rounded
  (about one quotient in seven was an ulp off on an H200, and one value in 10^4 to 10^5 then
  rounded to a neighbouring float8), so the quotient is corrected to the nearest
  reciprocal for scales in ``[2**-100, 2**100]``; outside that range (blocks whose largest
  magnitude is below about 10^-28 or above 10^32) it is the backend's division;
- a block of zeros has scale 1 and zero values;
- a block holding a NaN or an infinity becomes NaN: its scale and every value (a
  non-finite ``amax`` says nothing about the block's other elements; nothing is silently
  clipped to a finite number).

The quantization is not differentiated: the FP8 GEMMs that consume it define their own
gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe._checks import FLOAT_DTYPES, check_array
from oxmoe.moe.config import pytree_dataclass

__all__ = ["E4M3_MAX", "ACTIVATION_BLOCK", "WEIGHT_BLOCK", "TRANSPOSED_ACTIVATION_BLOCK", "BlockQuantized",
           "quantize", "dequantize"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn``."""
ACTIVATION_BLOCK = (1, 128)
"""One scale per row (token) per 128 columns."""
WEIGHT_BLOCK = (128, 128)
"""One scale per 128 x 128 block."""
TRANSPOSED_ACTIVATION_BLOCK = (128, 1)
"""One scale per 128 rows (tokens) per column: the weight gradient's operand."""


@pytree_dataclass(("values", "scales"), ("block",))
class BlockQuantized:
    """A tensor as FP8 values and one float32 scale per block of its last two dimensions."""

    values: jax.Array
    """``float8_e4m3fn``, the tensor's shape ``[..., R, C]``."""
    scales: jax.Array
    """float32 ``[..., R / block[0], C / block[1]]``: each block's dequantization factor."""
    block: tuple[int, int]
    """The block's rows and columns."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self.values.shape)


def _check_block(x, block) -> None:
    if (not isinstance(block, tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"block must be a pair of positive ints (rows, columns), got {block!r}")
    check_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x must have at least two dimensions (the block's rows and columns), got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    rows, cols = x.shape[-2:]
    if rows % block[0] or cols % block[1]:
        raise ValueError(f"x's last two dimensions ({rows}, {cols}) must be multiples of the block {block}")


def _blocks(x, block: tuple[int, int]):
    """``[..., R, C]`` → ``[..., R / br, br, C / bc, bc]``."""
    *lead, rows, cols = x.shape
    return x.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])


def _power_of_two_at_least(r):
    """The smallest power of two ``>= r`` for positive finite float32 ``r``, exactly (anything
    else gives a value the caller replaces)."""
    mantissa, exponent = jnp.frexp(r)  # r = mantissa * 2**exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(r), jnp.where(mantissa == 0.5, exponent - 1, exponent))


#: A float32's sign, exponent and top 11 stored mantissa bits: a value of 12 significant bits.
_HIGH_HALF = 0xFFFFF000
#: The scales whose reciprocal is corrected: every half and product below stays a normal number.
_CORRECTED_SCALES = (2.0 ** -100, 2.0 ** 100)


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


def _reciprocal(s, guess):
    """``1 / s`` rounded to the nearest float32, from a ``guess`` within 2 ulp of it: of the
    guess and its four nearest neighbours, the one whose product with ``s`` is nearest 1
    (for ``s`` in :data:`_CORRECTED_SCALES`; elsewhere the guess)."""
    bits = jax.lax.bitcast_convert_type(guess, jnp.int32)
    best, best_error = guess, jnp.full_like(guess, jnp.inf)
    for step in (-2, -1, 0, 1, 2):
        candidate = jax.lax.bitcast_convert_type(bits + step, jnp.float32)
        error = jnp.abs(_one_minus_product(s, candidate))
        closer = error < best_error
        best, best_error = jnp.where(closer, candidate, best), jnp.where(closer, error, best_error)
    low, high = _CORRECTED_SCALES
    return jnp.where((s >= low) & (s <= high), best, guess)


def quantize(x, block: tuple[int, int] = ACTIVATION_BLOCK, *, power_of_two_scales: bool = False) -> BlockQuantized:
    """``x`` as ``float8_e4m3fn`` values with one float32 scale per block (the module's
    semantics).

    Args:
      x: ``[..., R, C]`` float32, bfloat16 or float16; ``block`` must divide ``R`` and ``C``.
      block: ``(rows, columns)`` of a block: :data:`ACTIVATION_BLOCK`,
        :data:`WEIGHT_BLOCK`, :data:`TRANSPOSED_ACTIVATION_BLOCK` or any other.
      power_of_two_scales: round each scale up to a power of two.
    """
    _check_block(x, block)
    if not isinstance(power_of_two_scales, bool):
        raise TypeError(f"power_of_two_scales must be a bool, got {power_of_two_scales!r}")
    blocks = _blocks(jax.lax.stop_gradient(x).astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scales = jnp.where(amax > 0, amax * jnp.float32(1 / E4M3_MAX), 1.0)
    if power_of_two_scales:
        scales = _power_of_two_at_least(scales)
    scales = jnp.where(jnp.isfinite(amax), scales, jnp.nan)
    inverse = _reciprocal(scales, 1 / scales)
    scaled = jnp.clip(blocks * inverse[..., :, None, :, None], -E4M3_MAX, E4M3_MAX)
    return BlockQuantized(scaled.astype(E4M3).reshape(x.shape), scales, block)


def dequantize(q: BlockQuantized, dtype=jnp.float32) -> jax.Array:
    """The tensor ``q`` stands for: each value times its block's scale, in float32, then
    cast to ``dtype``."""
    if not isinstance(q, BlockQuantized):
        raise TypeError(f"q must be an oxmoe.fp8.BlockQuantized, got {type(q).__name__}")
    blocks = _blocks(q.values.astype(jnp.float32), q.block)
    return (blocks * q.scales[..., :, None, :, None]).reshape(q.values.shape).astype(dtype)
