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

``quantize(x, block, transpose=True)`` quantizes ``x``'s transpose instead, read from ``x`` as
it is: ``quantize(rows, ACTIVATION_BLOCK, transpose=True)`` is the ``(128, 1)`` quantization
of ``rows`` with its values written token-contiguous (``[channels, tokens]``), as Hopper's FP8
``wgmma`` reads the weight gradient's operands. ``quantize_with_transpose(x, block)`` returns
both quantizations, ``x``'s and its transpose's, from one read of ``x``, and
``requantize(q, block, dtype=...)`` quantizes ``dequantize(q, dtype)`` again (in other blocks,
or transposed) from ``q``'s FP8 values and scales.

The result is a :class:`BlockQuantized` pytree: the values (the input's shape, or with
``transpose`` its transpose's), the scales and the block shape. ``values * scales`` (each
scale over its block) is the tensor it stands for: :func:`dequantize`.

Semantics, the same bit for bit on every backend (float32 arithmetic; the CPU implementation,
in Rust, is the specification, CUDA kernels compute the same, and
:func:`oxmoe.reference.fp8.quantize` states it in plain JAX):

- float32 subnormals (magnitudes below 2^-126, which float32 and bfloat16 inputs may hold)
  count as zeros of their sign (XLA:CPU flushes them anyway; stated so that every backend
  agrees);
- ``amax`` is the largest ``|x|`` of a block; ``scale = amax * (1 / 448)`` (448 is the
  largest finite ``float8_e4m3fn``; ``1 / 448`` rounded to float32), or with
  ``power_of_two_scales`` the smallest power of two at least that (DeepSeek-V3 used such
  scales for some tensors: multiplying by them is exact);
- ``values = float8_e4m3fn(clip(x * (1 / scale), -448, 448))``: the block's reciprocal
  correctly rounded to float32, one float32 product per element, then round to nearest, ties
  to even (the clip only absorbs the roundings of the scale and its reciprocal; it never
  changes a value otherwise);
- a block of zeros has scale 1 and zero values, and so has a block whose largest magnitude
  is below ``448 * 2**-126`` (about 5e-36), whose scale would fall out of float32's normal
  range;
- a block holding a NaN or an infinity becomes NaN: its scale and every value (a
  non-finite ``amax`` says nothing about the block's other elements; nothing is silently
  clipped to a finite number).

On a GPU, a CUDA kernel reads ``x`` once and writes the values and scales once (``x``'s,
its transpose's, or both) from the same pass. :func:`activation` is the FP8 layer's
activation with its result quantized in the same pass, and :func:`activation_bwd` its
backward with its results quantized so, neither written in 16 bits. The quantization is not differentiated: the FP8 GEMMs that
consume it define their own gradients.

The grouped products on quantized operands (the expert GEMMs of an FP8 training step, as
DeepSeek-V3 runs them):

- :func:`ragged_dot`: rows ``[M, K]`` in ``(1, 128)`` blocks times their group's weights
  ``[G, K, N]`` in ``(128, 128)`` blocks (the forward), or, with ``rhs_transposed``, times
  ``rhs[g]ᵀ`` for weights ``[G, N, K]`` (d lhs: the forward's quantized weights, read the
  other way round; square blocks serve both);
- :func:`transposed_ragged_dot`: per group, ``lhsᵀ · rhs`` over its rows, both in
  ``(128, 1)`` blocks, or ``rhs`` in ``(128, 128)`` ones (the weight gradient), over up to
  8 chunks of rows as
  :func:`oxmoe.transposed_ragged_dot`; its operands come transposed (``lhsᵀ [K, M]``
  in ``(1, 128)`` blocks: the same blocks, each column's rows contiguous).

For each block of 128 of the contraction, the products of the FP8 values (exact in float32)
are summed, in any order and at float32 precision or at the tensor cores' (the one freedom
a kernel has: Hopper's FP8 ``wgmma`` sums into an accumulator of about 14 bits, aligned to a
step's largest product, which lost up to 2^-11 of a block's magnitudes where they were alike
and 2.5 x 2^-11 over tokens 2^8 apart, on an H200), and the block's partial is multiplied by
the product of the two blocks' scales and added to the float32 result in block order
(DeepSeek-V3's promotion out of the tensor core's accumulator every 128 of K, which keeps
the low-precision sums 128 products long); the result is rounded once to
``preferred_element_type``. Their CPU implementations are the specification;
:mod:`oxmoe.reference.fp8` writes the same in plain JAX. On Hopper (sm_90a) they run on the
tensor cores (FP8 ``wgmma``, whose 8-bit operands must both be K-major): :func:`ragged_dot`
with ``rhs_transposed`` (keep weights ``[G, N, K]`` for the forward), and
:func:`transposed_ragged_dot`; the
``[G, K, N]`` form of :func:`ragged_dot`, and every other GPU, run on kernels that
dequantize on load. They are not differentiable.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe._checks import FLOAT_DTYPES, check_array, check_bool, check_float_dtype
from oxmoe._primitive import FfiPrimitive, Layout, vary_alike
from oxmoe._pytree import pytree_dataclass
from oxmoe.activation import _check_activation, _hidden_columns, gated
from oxmoe.activation import _check_inputs as _check_activation_inputs
from oxmoe.grouped_gemm import _check_groups, _check_num_groups, _chunks_of, _workspace_bytes

__all__ = ["E4M3_MAX", "ACTIVATION_BLOCK", "WEIGHT_BLOCK", "TRANSPOSED_ACTIVATION_BLOCK", "BlockQuantized",
           "BlockScaling", "QuantizedActivationGrads", "quantize", "quantize_with_transpose", "requantize",
           "dequantize", "activation", "activation_bwd", "ragged_dot", "transposed_ragged_dot"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn``."""
ACTIVATION_BLOCK = (1, 128)
"""One scale per row (token) per 128 columns."""
WEIGHT_BLOCK = (128, 128)
"""One scale per 128 x 128 block."""
TRANSPOSED_ACTIVATION_BLOCK = (128, 1)
"""One scale per 128 rows (tokens) per column: the weight gradient's blocks, which its
product takes stored transposed (``quantize(x, ACTIVATION_BLOCK, transpose=True)``: the
same blocks, each column's tokens contiguous)."""


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


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """The FP8 recipe of the MoE layer (``MoEConfig(fp8=BlockScaling())``), DeepSeek-V3's
    and TransformerEngine's ``Float8BlockScaling``: the experts' three GEMMs of the
    forward and four of the backward on ``float8_e4m3fn`` operands, activations quantized
    in :data:`ACTIVATION_BLOCK` blocks, weights in :data:`WEIGHT_BLOCK` blocks, the weight
    gradients' operands in :data:`TRANSPOSED_ACTIVATION_BLOCK` blocks (stored transposed),
    every scale float32;
    the master weights, the router, the activation, the combine and the shared experts
    keep their own dtypes. The weights are quantized from their master copy in every call of
    the layer, or once for several calls (:func:`oxmoe.moe.quantize_expert_weights`).

    ``power_of_two_scales``: every scale rounded up to a power of two (exact scaling).

    ``square_gradient_blocks``: the weight gradients take the output gradients they
    multiply (the up projection's, and the layer's per expert row) in 128 x 128 blocks, one
    scale per 128 rows by 128 columns, instead of 128 x 1 (as TransformerEngine's
    ``grad_block_scaling_dim=2`` does for gradients); the data gradients still take them
    in 1 x 128 blocks. Each weight-gradient block's promotion then costs one factor a row
    of the result instead of one an element: the weight gradients 24-27% faster on an H200
    at DeepSeek-V3's shapes, 23% at Qwen3's (``bench/NOTES.md``). A row more than 2^15
    below the largest of its block loses precision (e4m3's normal range) that it would
    keep in its own 128 x 1 block."""

    power_of_two_scales: bool = False
    square_gradient_blocks: bool = False

    def __post_init__(self):
        check_bool("power_of_two_scales", self.power_of_two_scales)
        check_bool("square_gradient_blocks", self.square_gradient_blocks)

    @property
    def gradient_block(self) -> tuple[int, int]:
        """The blocks of the weight gradients' output-gradient operand, transposed as they
        take it: :data:`WEIGHT_BLOCK` with ``square_gradient_blocks``, else
        :data:`ACTIVATION_BLOCK` (the rows' 128 x 1 blocks)."""
        return WEIGHT_BLOCK if self.square_gradient_blocks else ACTIVATION_BLOCK


#: Each recipe block by its name, for messages.
_RECIPE_BLOCKS = {ACTIVATION_BLOCK: "ACTIVATION_BLOCK", WEIGHT_BLOCK: "WEIGHT_BLOCK",
                  TRANSPOSED_ACTIVATION_BLOCK: "TRANSPOSED_ACTIVATION_BLOCK"}


def _check_quantize_input(x, block, transpose: bool, name: str = "x") -> None:
    ints = isinstance(block, tuple) and all(isinstance(b, int) and not isinstance(b, bool) for b in block)
    if not ints or block not in _RECIPE_BLOCKS:
        names = ", ".join(f"{name} {b}" for b, name in _RECIPE_BLOCKS.items())
        raise ValueError(f"block must be one of the FP8 recipe's blocks ({names}), got {block!r}")
    _check_float_blocks(x)
    rows, cols = x.shape[-2:]
    blocked = (cols, rows) if transpose else (rows, cols)
    if blocked[0] % block[0] or blocked[1] % block[1]:
        transposed = f", transposed {blocked}," if transpose else ""
        raise ValueError(f"{name}'s last two dimensions ({rows}, {cols}){transposed} must be multiples of the block "
                         f"{block}")


def _check_float_blocks(x) -> None:
    """``x`` is a float32, bfloat16 or float16 array of at least two dimensions (the
    blocks'), for :func:`quantize` and :func:`oxmoe.reference.fp8.quantize`."""
    check_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x must have at least two dimensions (the block's rows and columns), got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")


def _quantization_results(batch: int, rows: int, cols: int, block: tuple[int, int]) -> list:
    """The values and scales of ``batch`` matrices ``[rows, cols]`` quantized in ``block`` blocks."""
    return [jax.ShapeDtypeStruct((batch, rows, cols), E4M3),
            jax.ShapeDtypeStruct((batch, rows // block[0], cols // block[1]), jnp.float32)]


def _quantize_results(x, *_, block_rows, block_cols, orientation, **__):
    batch, rows, cols = x.shape
    block = (block_rows, block_cols)
    as_is, transposed = _quantization_results(batch, rows, cols, block), _quantization_results(batch, cols, rows, block)
    return {"as_is": as_is, "transposed": transposed, "both": as_is + transposed}[orientation]


# x [B, R, C] -> values, scales (x's quantization as it is, or its transpose's, by the
# attribute `orientation`), each [B, ...]: the batch elements are quantized apart, so
# dimension 0 is independent rows whichever way the last two are laid out (transposed
# too), and batching folds into it and sharding splits it as the router's tokens.
_quantize_p = FfiPrimitive("oxmoe_fp8_quantize", operands=(Layout.ROWS,), results=(Layout.ROWS,) * 2,
                           result_specs=_quantize_results)
# The same target with orientation "both": x's values and scales, then its transpose's.
_quantize_with_transpose_p = FfiPrimitive("oxmoe_fp8_quantize", operands=(Layout.ROWS,),
                                          results=(Layout.ROWS,) * 4, result_specs=_quantize_results)
# The same target on x's FP8 values [B, R, C] and their 1 x 128 blocks' scales [B, R, C / 128],
# dequantized to the attribute `dequantized_dtype` as they are read.
_requantize_p = FfiPrimitive("oxmoe_fp8_quantize", operands=(Layout.ROWS,) * 2, results=(Layout.ROWS,) * 2,
                             result_specs=_quantize_results)
# The same with a third operand, source_rows [R'] int32: x [1, R', C] is the rows of the FP8
# values [1, R, C] it names, so no result row is the operands' row of the same index.
_requantize_rows_p = FfiPrimitive(
    "oxmoe_fp8_quantize", operands=(Layout.DISPATCHED,) * 3, results=(Layout.DISPATCHED,) * 2,
    result_specs=lambda values, scales, source_rows, **params: _quantize_results(
        jax.ShapeDtypeStruct((1, source_rows.shape[0], values.shape[2]), values.dtype), **params))


def _block_attrs(block: tuple[int, int], power_of_two_scales: bool) -> dict:
    return dict(block_rows=np.int64(block[0]), block_cols=np.int64(block[1]),
                power_of_two_scales=np.bool_(power_of_two_scales))


def _matrices(shape: tuple[int, ...], block: tuple[int, int], transpose: bool) -> tuple[int, int]:
    """``(batch, rows)``: the primitive's view of ``[..., R, C]`` as matrices of rows. Rows
    of 1 x 128 blocks are quantized apart, each its own batch element, so that a mesh
    splits them as it splits tokens; other blocks span rows, one matrix a batch element."""
    *lead, rows, _ = shape
    batch = math.prod(lead)
    return (batch * rows, 1) if block[0] == 1 and not transpose else (batch, rows)


def _quantized(values, scales, shape: tuple[int, ...], block: tuple[int, int]) -> BlockQuantized:
    """The primitive's values and scales as the quantization of a tensor of ``shape``."""
    *lead, rows, cols = shape
    return BlockQuantized(values.reshape(shape), scales.reshape(*lead, rows // block[0], cols // block[1]), block)


def quantize(x, block: tuple[int, int] = ACTIVATION_BLOCK, *, power_of_two_scales: bool = False,
             transpose: bool = False) -> BlockQuantized:
    """``x`` as ``float8_e4m3fn`` values with one float32 scale per block (the module's
    semantics).

    Args:
      x: ``[..., R, C]`` float32, bfloat16 or float16.
      block: ``(rows, columns)`` of a block of the result: :data:`ACTIVATION_BLOCK`,
        :data:`WEIGHT_BLOCK` or :data:`TRANSPOSED_ACTIVATION_BLOCK`; it must divide
        ``R`` and ``C`` (``C`` and ``R`` with ``transpose``).
      power_of_two_scales: round each scale up to a power of two.
      transpose: quantize ``swapaxes(x, -1, -2)`` instead, read from ``x`` as it is (no
        transposed copy): values ``[..., C, R]``, scales ``[..., C / block[0], R /
        block[1]]``, bit for bit ``quantize(jnp.swapaxes(x, -1, -2), block)``. The weight
        gradient's operands, token-contiguous as Hopper's FP8 ``wgmma`` reads them, are
        ``quantize(rows, ACTIVATION_BLOCK, transpose=True)``. For both quantizations of
        one ``x``, :func:`quantize_with_transpose` reads it once.
    """
    power_of_two_scales = check_bool("power_of_two_scales", power_of_two_scales)
    transpose = check_bool("transpose", transpose)
    _check_quantize_input(x, block, transpose)
    *lead, rows, cols = x.shape
    values, scales = _quantize_p(jax.lax.stop_gradient(x).reshape(*_matrices(x.shape, block, transpose), cols),
                                 **_block_attrs(block, power_of_two_scales),
                                 orientation="transposed" if transpose else "as_is")
    return _quantized(values, scales, (*lead, cols, rows) if transpose else x.shape, block)


def quantize_with_transpose(x, block: tuple[int, int] = ACTIVATION_BLOCK, *,
                            power_of_two_scales: bool = False) -> tuple[BlockQuantized, BlockQuantized]:
    """``(quantize(x, block), quantize(x, block, transpose=True))``, bit for bit, from one
    read of ``x``: for a tensor that two products take, one in each layout (the layer's
    expert weights, whose forward products read them ``[E, N, K]`` and whose backward
    ones ``[E, K, N]``; the rows of the up projection's gradient, the d lhs product's
    operand in 1 x 128 blocks and, transposed, the up weight gradient's).

    Args:
      x: ``[..., R, C]`` float32, bfloat16 or float16.
      block: :data:`ACTIVATION_BLOCK`, :data:`WEIGHT_BLOCK` or
        :data:`TRANSPOSED_ACTIVATION_BLOCK`, the block of each result; it must divide
        ``R`` and ``C`` both ways round (for the recipe's blocks: both multiples of 128).
      power_of_two_scales: round each scale up to a power of two.

    Returns:
      ``(q, qt)``: ``q`` the values ``[..., R, C]`` and their scales, ``qt`` those of
      ``swapaxes(x, -1, -2)``, values ``[..., C, R]``.
    """
    power_of_two_scales = check_bool("power_of_two_scales", power_of_two_scales)
    _check_quantize_input(x, block, False)
    _check_quantize_input(x, block, True)
    *lead, rows, cols = x.shape
    values, scales, transposed_values, transposed_scales = _quantize_with_transpose_p(
        jax.lax.stop_gradient(x).reshape(*_matrices(x.shape, block, transpose=True), cols),
        **_block_attrs(block, power_of_two_scales), orientation="both")
    return (_quantized(values, scales, x.shape, block),
            _quantized(transposed_values, transposed_scales, (*lead, cols, rows), block))


def requantize(q: BlockQuantized, block: tuple[int, int] = ACTIVATION_BLOCK, *, dtype=jnp.float32,
               power_of_two_scales: bool = False, transpose: bool = False,
               source_rows: jax.Array | None = None) -> BlockQuantized:
    """``quantize(dequantize(q, dtype), block, ...)``, bit for bit, read from ``q``'s FP8
    values and scales: the tensor ``q`` stands for, in ``dtype``, quantized in other blocks
    (or transposed) without a copy of it in ``dtype`` (the layer's output gradient, which
    travels per row in 1 x 128 blocks, for the down weight's gradient per 128 rows).
    With ``source_rows``, the same of the rows of ``q`` it names, gathered as they are
    read (the layer's tokens as the dispatch's rows, for the up weight's gradient, with
    no copy of those rows).

    Args:
      q: ``[..., R, C]`` in :data:`ACTIVATION_BLOCK` blocks (:func:`quantize`'s result, or
        values and scales of that form).
      block: as for :func:`quantize`.
      dtype: float32 (default, as :func:`dequantize`), bfloat16 or float16: each value
        times its scale is rounded to it before its quantization. The product is
        float32's with subnormal operands and results zeros of their sign, as XLA:CPU
        computes :func:`dequantize` (another backend's :func:`dequantize` may keep a
        subnormal product, which the quantization then counts as a zero unless it rounds
        up to ``2**-126`` in ``dtype``).
      power_of_two_scales: round each scale up to a power of two.
      transpose: quantize the transpose (values ``[..., C, R]``), as :func:`quantize`.
      source_rows: ``[R']`` int32, or None: requantize ``[R', C]`` rows instead, row ``r``
        being ``q``'s row ``source_rows[r]`` (``q`` ``[R, C]``, one matrix), zeros where
        the entry is -1 (a dispatch's ``row_id_map.source_tokens`` marks its padding rows
        so) and NaNs where it is any other value outside ``[0, R)`` (a map that does not
        belong to ``q``, as the permutation's gathers treat it).
    """
    _check_quantized("q", q, ACTIVATION_BLOCK, "[..., R, C]")
    dtype = jnp.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    power_of_two_scales = check_bool("power_of_two_scales", power_of_two_scales)
    transpose = check_bool("transpose", transpose)
    attrs = dict(_block_attrs(block, power_of_two_scales), orientation="transposed" if transpose else "as_is",
                 dequantized_dtype=dtype.name)
    values, scales = jax.lax.stop_gradient(q.values), jax.lax.stop_gradient(q.scales)
    if source_rows is None:
        _check_quantize_input(jax.ShapeDtypeStruct(q.shape, dtype), block, transpose, name="q")
        *lead, rows, cols = q.shape
        view = _matrices(q.shape, block, transpose)
        values, scales = _requantize_p(values.reshape(*view, cols), scales.reshape(*view, cols // 128), **attrs)
        return _quantized(values, scales, (*lead, cols, rows) if transpose else q.shape, block)
    if len(q.shape) != 2:
        raise ValueError(f"q must be one matrix [R, C] with source_rows, got shape {q.shape}")
    source_rows = jnp.asarray(source_rows)
    if source_rows.ndim != 1 or source_rows.dtype != jnp.int32:
        raise TypeError(f"source_rows must be int32 [rows], got {source_rows.dtype}{list(source_rows.shape)}")
    gathered = (len(source_rows), q.shape[1])
    _check_quantize_input(jax.ShapeDtypeStruct(gathered, dtype), block, transpose, name="q[source_rows]")
    values, scales = _requantize_rows_p(values[None], scales[None], source_rows, **attrs)
    return _quantized(values, scales, gathered[::-1] if transpose else gathered, block)


# pre_activation [R, 1, W] -> the hidden activation's values [R, 1, F] and scales [R, 1, F / 128]:
# each row its own batch element, as _quantize_p takes rows of 1 x 128 blocks (split as tokens).
_activation_p = FfiPrimitive(
    "oxmoe_fp8_activation", operands=(Layout.ROWS,), results=(Layout.ROWS,) * 2,
    result_specs=lambda pre_activation, *, activation, **_: _quantization_results(
        pre_activation.shape[0], 1, _hidden_columns(activation, pre_activation.shape[2]), ACTIVATION_BLOCK))


def activation(pre_activation, activation: str = "swiglu", *, power_of_two_scales: bool = False) -> BlockQuantized:
    """The expert MLP's hidden activation quantized in :data:`ACTIVATION_BLOCK` blocks,
    as the FP8 layer's down projection takes it, from one pass over the pre-activation
    (on a GPU the hidden activation is never written in 16 bits).

    Bit for bit ``quantize(h, ACTIVATION_BLOCK)`` (``power_of_two_scales`` as given) of
    the hidden activation ``h`` ``[R, F]`` that the layer's forward computes, in float32
    and rounded to the pre-activation's dtype: ``act(gate) * up`` for the gated
    activations (the pre-activation ``[gate, up]``, ``2F`` columns), ``act(x)`` otherwise
    (:mod:`oxmoe.activation`'s functions; it is the ``weighted_hidden`` that
    :func:`oxmoe.activation.activation_bwd` gives for rows of weight 1). Not
    differentiable.

    Args:
      pre_activation: ``[R, W]`` float32, bfloat16 or float16, the up projection's
        output: ``W = 2F`` for ``"swiglu"`` and ``"geglu"``, ``F`` for ``"gelu"`` and
        ``"silu"``, ``F`` a multiple of 128.
      activation: ``"swiglu"``, ``"geglu"``, ``"gelu"`` or ``"silu"``.
      power_of_two_scales: round each scale up to a power of two.

    Returns:
      :class:`BlockQuantized`: values ``[R, F]``, scales ``[R, F / 128]``.
    """
    _check_activation(activation)
    power_of_two_scales = check_bool("power_of_two_scales", power_of_two_scales)
    check_array("pre_activation", pre_activation)
    check_float_dtype("pre_activation", pre_activation)
    columns = 256 if gated(activation) else 128
    if pre_activation.ndim != 2 or pre_activation.shape[1] % columns:
        raise ValueError(f"pre_activation must be [R, W] with W a multiple of {columns} for {activation!r} (the "
                         f"hidden activation's F columns a multiple of 128, the blocks 1 x 128), got shape "
                         f"{tuple(pre_activation.shape)}")
    rows, width = pre_activation.shape
    values, scales = _activation_p(jax.lax.stop_gradient(pre_activation).reshape(rows, 1, width),
                                   activation=activation, power_of_two_scales=np.bool_(power_of_two_scales))
    return _quantized(values, scales, (rows, _hidden_columns(activation, width)), ACTIVATION_BLOCK)


class QuantizedActivationGrads(typing.NamedTuple):
    """The result of :func:`activation_bwd`: :class:`oxmoe.activation.ActivationGrads`
    quantized as the FP8 layer's backward products take them.

    Attributes:
      grad_pre_activation: the up projection's gradient ``[R, W]`` in
        :data:`ACTIVATION_BLOCK` blocks (the d lhs product's operand).
      grad_pre_activation_transposed: its transpose's quantization, ``[W, R]`` in
        :data:`ACTIVATION_BLOCK` blocks or as asked in :data:`WEIGHT_BLOCK` blocks (the up
        weight gradient's operand).
      weighted_hidden_transposed: the weighted hidden activation's transpose's,
        ``[F, R]`` in :data:`ACTIVATION_BLOCK` blocks (the down weight gradient's).
      grad_row_probs: ``[R]`` float32, each row weight's gradient.
    """

    grad_pre_activation: BlockQuantized
    grad_pre_activation_transposed: BlockQuantized
    weighted_hidden_transposed: BlockQuantized
    grad_row_probs: jax.Array


def _activation_bwd_results(grad_hidden, pre_activation, row_probs, *, square_grad_transposed, **_):
    (rows, features), width = grad_hidden.shape, pre_activation.shape[1]
    # Each quantization as oxmoe_fp8_quantize's, of one batch element.
    return [*_quantization_results(1, rows, width, ACTIVATION_BLOCK),
            *_quantization_results(1, width, rows, WEIGHT_BLOCK if square_grad_transposed else ACTIVATION_BLOCK),
            *_quantization_results(1, features, rows, ACTIVATION_BLOCK), jax.ShapeDtypeStruct((rows,), jnp.float32)]


# Dispatched rows: the 128 x 1 blocks of the transposed results span rows, so every shard sees all of them.
_activation_bwd_p = FfiPrimitive("oxmoe_fp8_activation_bwd", operands=(Layout.DISPATCHED,) * 3,
                                 results=(Layout.DISPATCHED,) * 7, result_specs=_activation_bwd_results)


def activation_bwd(grad_hidden, pre_activation, row_probs, activation: str = "swiglu", *,
                   power_of_two_scales: bool = False,
                   grad_transposed_block: tuple[int, int] = ACTIVATION_BLOCK) -> QuantizedActivationGrads:
    """:func:`oxmoe.activation.activation_bwd` with its two 16-bit results quantized
    as the FP8 layer's backward takes them, from the same pass (on a GPU they are
    never written in 16 bits).

    With ``g = oxmoe.activation.activation_bwd(grad_hidden, pre_activation, row_probs,
    activation)``, bit for bit: ``grad_pre_activation = quantize(g.grad_pre_activation)``,
    ``grad_pre_activation_transposed = quantize(g.grad_pre_activation,
    grad_transposed_block, transpose=True)``, ``weighted_hidden_transposed =
    quantize(g.weighted_hidden, transpose=True)`` (:data:`ACTIVATION_BLOCK` blocks,
    ``power_of_two_scales`` as given); ``grad_row_probs`` is ``g.grad_row_probs``
    (a sum in float32, whose order may differ by backend, as there). Not differentiable.

    Args:
      grad_hidden: ``[R, F]`` float32, bfloat16 or float16, ``R`` and ``F`` multiples
        of 128.
      pre_activation, row_probs, activation: as for :func:`oxmoe.activation.activation_bwd`.
      power_of_two_scales: round each scale up to a power of two.
      grad_transposed_block: :data:`ACTIVATION_BLOCK` (default: the transpose's 1 x 128
        blocks, 128 x 1 in the gradient) or :data:`WEIGHT_BLOCK` (128 x 128), the blocks of
        ``grad_pre_activation_transposed``.

    Returns:
      :class:`QuantizedActivationGrads`.
    """
    _check_activation_inputs(grad_hidden, pre_activation, row_probs, activation)
    power_of_two_scales = check_bool("power_of_two_scales", power_of_two_scales)
    if grad_transposed_block not in (ACTIVATION_BLOCK, WEIGHT_BLOCK):
        raise ValueError(f"grad_transposed_block must be ACTIVATION_BLOCK {ACTIVATION_BLOCK} or WEIGHT_BLOCK "
                         f"{WEIGHT_BLOCK}, got {grad_transposed_block!r}")
    rows, features = grad_hidden.shape
    if rows % 128 or features % 128:
        raise ValueError(f"grad_hidden must be [R, F] with R and F multiples of 128 (the blocks 1 x 128 along F "
                         f"and 128 x 1 along R), got {list(grad_hidden.shape)}")
    width = pre_activation.shape[1]
    operands = [jax.lax.stop_gradient(x) for x in (grad_hidden, pre_activation, row_probs)]
    (values, scales, transposed_values, transposed_scales, weighted_values, weighted_scales,
     grad_row_probs) = _activation_bwd_p(*operands, activation=activation,
                                         power_of_two_scales=np.bool_(power_of_two_scales),
                                         square_grad_transposed=np.bool_(grad_transposed_block == WEIGHT_BLOCK))
    return QuantizedActivationGrads(
        _quantized(values, scales, (rows, width), ACTIVATION_BLOCK),
        _quantized(transposed_values, transposed_scales, (width, rows), grad_transposed_block),
        _quantized(weighted_values, weighted_scales, (features, rows), ACTIVATION_BLOCK), grad_row_probs)


def _blocks(x, block: tuple[int, int]):
    """``[..., R, C]`` → ``[..., R / br, br, C / bc, bc]``."""
    *lead, rows, cols = x.shape
    return x.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])


def dequantize(q: BlockQuantized, dtype=jnp.float32) -> jax.Array:
    """The tensor ``q`` stands for: each value times its block's scale, in float32, then
    cast to ``dtype``."""
    if not isinstance(q, BlockQuantized):
        raise TypeError(f"q must be an oxmoe.fp8.BlockQuantized, got {type(q).__name__}")
    blocks = _blocks(q.values.astype(jnp.float32), q.block)
    return (blocks * q.scales[..., :, None, :, None]).reshape(q.values.shape).astype(dtype)


# -- the grouped products ------------------------------------------------------------

DISPATCHED, WHOLE = Layout.DISPATCHED, Layout.WHOLE
_BLOCK = 128
_OUT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

_ragged_dot_p = FfiPrimitive(
    "oxmoe_fp8_ragged_dot", operands=(DISPATCHED, DISPATCHED, WHOLE, WHOLE, WHOLE, WHOLE), results=(DISPATCHED,),
    result_specs=lambda lhs, *_, n, out_dtype, **__: [jax.ShapeDtypeStruct((lhs.shape[0], n), out_dtype)],
    shape_params=("n", "out_dtype"), workspace=lambda lhs, lhs_scales, rhs, *_, **__: _workspace_bytes(1, rhs.shape[0]))


@functools.cache
def _transposed_ragged_dot_p(chunks: int) -> FfiPrimitive:
    """The FP8 transposed product of ``chunks`` chunks: each operand's chunks in turn (lhsᵀ
    values ``[K, M_c]``, their scales ``[M_c / 128, K]``, rhsᵀ values ``[N, M_c]``, their
    scales ``[M_c / 128, N]``), group_sizes ``[chunks, G]``, group_offset."""
    return FfiPrimitive(
        "oxmoe_fp8_transposed_ragged_dot", operands=(DISPATCHED,) * (4 * chunks) + (WHOLE, WHOLE), results=(WHOLE,),
        result_specs=lambda *operands, groups, out_dtype, **_: [
            jax.ShapeDtypeStruct((groups, operands[0].shape[0], operands[2 * chunks].shape[0]), out_dtype)],
        shape_params=("groups", "out_dtype"), workspace=lambda *_, groups, **__: _workspace_bytes(chunks, groups))


_transposed_ragged_dot_p(1)  # registers the target at import, as every other primitive's is


def _check_quantized(name: str, q, block: tuple[int, int], layout: str) -> None:
    """``q`` is a :class:`BlockQuantized` of ``len(layout)`` dimensions (at least two for a
    layout ``[..., R, C]``) in ``block`` blocks, its values float8_e4m3fn and its scales
    float32 of the blocks' shape."""
    if not isinstance(q, BlockQuantized):
        raise TypeError(f"{name} must be an oxmoe.fp8.BlockQuantized (oxmoe.fp8.quantize's result), "
                        f"got {type(q).__name__}")
    rank = len(layout.split(","))
    ranked = len(q.shape) >= 2 if layout.startswith("[...") else len(q.shape) == rank
    if q.block != block or not ranked:
        raise ValueError(f"{name} must be {layout} quantized in {block} blocks, got shape {list(q.shape)} in "
                         f"{q.block} blocks")
    check_array(f"{name}.values", q.values)
    check_array(f"{name}.scales", q.scales)
    if q.values.dtype != E4M3:
        raise TypeError(f"{name}.values must be float8_e4m3fn, got {q.values.dtype}")
    *lead, rows, cols = q.shape
    expected = (*lead, rows // block[0], cols // block[1])
    if rows % block[0] or cols % block[1] or q.scales.shape != expected or q.scales.dtype != jnp.float32:
        raise ValueError(f"{name}.scales must be float32 {list(expected)} (one per {block} block of its values "
                         f"{list(q.shape)}), got {q.scales.dtype}{list(q.scales.shape)}")


def _weight_gradient_rhs_block(rhs) -> tuple[int, int]:
    """The blocks :func:`transposed_ragged_dot` takes ``rhs`` (its first chunk) in: ``rhs``'s
    own where they are :data:`WEIGHT_BLOCK`, else :data:`ACTIVATION_BLOCK`, which the checks
    then ask for."""
    return WEIGHT_BLOCK if isinstance(rhs, BlockQuantized) and rhs.block == WEIGHT_BLOCK else ACTIVATION_BLOCK


def _out_dtype(preferred_element_type):
    out = jnp.dtype(preferred_element_type)
    if out not in _OUT_DTYPES:
        raise TypeError(f"preferred_element_type must be float32, bfloat16 or float16, got {out}")
    return out


def ragged_dot(lhs: BlockQuantized, rhs: BlockQuantized, group_sizes, *, group_offset=None,
               rhs_transposed: bool = False, preferred_element_type=jnp.bfloat16) -> jax.Array:
    """The block-scaled FP8 grouped product: the rows of group ``g`` of ``lhs`` times
    ``rhs[g]`` (the module's semantics), as :func:`oxmoe.ragged_dot` groups them.

    Args:
      lhs: ``[M, K]`` in :data:`ACTIVATION_BLOCK` blocks (``K`` a multiple of 128).
      rhs: ``[G_local, K, N]`` in :data:`WEIGHT_BLOCK` blocks, or ``[G_local, N, K]``
        with ``rhs_transposed`` (``rhs[g]ᵀ`` multiplies: the forward's weights give
        the product of its d lhs).
      group_sizes: ``[G]`` integer row counts, on the device (cast to int32).
      group_offset: optional integer scalar or ``[1]`` array: local group ``i``
        multiplies the rows of group ``group_offset + i``.
      rhs_transposed: ``rhs`` is ``[G_local, N, K]`` (the form Hopper's tensor cores
        take: both operands K-major).
      preferred_element_type: float32, bfloat16 (default) or float16.

    Returns:
      ``[M, N]``; rows outside the window's groups are zero. Not differentiable.
    """
    _check_quantized("lhs", lhs, ACTIVATION_BLOCK, "[M, K]")
    rhs_transposed = check_bool("rhs_transposed", rhs_transposed)
    _check_quantized("rhs", rhs, WEIGHT_BLOCK, "[groups, N, K]" if rhs_transposed else "[groups, K, N]")
    m, k = lhs.shape
    local_groups, d1, d2 = rhs.shape
    rhs_k, n = (d2, d1) if rhs_transposed else (d1, d2)
    if rhs_k != k:
        layout = "[groups, N, K]" if rhs_transposed else "[groups, K, N]"
        raise ValueError(f"rhs must be {layout} with K = {k} (lhs's second dimension), got {list(rhs.shape)}")
    out_dtype = _out_dtype(preferred_element_type)
    _, sizes, offset = _check_groups(group_sizes, group_offset, local_groups, "rhs.shape[0] (its groups)", (m,))
    operands = vary_alike(lhs.values, lhs.scales, rhs.values, rhs.scales, sizes, offset)
    return _not_differentiable("oxmoe.fp8.ragged_dot", functools.partial(
        _ragged_dot_p, rhs_transposed=np.bool_(rhs_transposed), n=n, out_dtype=out_dtype))(*operands)


def transposed_ragged_dot(lhs, rhs, group_sizes, *, num_groups=None, group_offset=None,
                          preferred_element_type=jnp.float32) -> jax.Array:
    """The block-scaled FP8 weight gradient: per group, ``lhs_gᵀ · rhs_g`` over its rows
    (the module's semantics; each 128-row block of the operands scaled apart).

    Its operands come transposed, each column's rows (tokens) contiguous, as the tensor
    cores read them: rows ``x [M, K]`` quantized in 128 x 1 blocks (one scale per 128
    rows of a column) are ``xᵀ [K, M]`` in :data:`ACTIVATION_BLOCK` blocks, which
    ``quantize(x, transpose=True)`` writes from ``x`` itself. ``rhs`` may instead be in
    128 x 128 blocks (``quantize(y, WEIGHT_BLOCK, transpose=True)``: one scale per 128
    rows of 128 columns), which makes each block's promotion one factor a row of the
    result instead of one an element, as the forward's: the faster product on Hopper.

    Args:
      lhs: ``lhsᵀ [K, M]`` in :data:`ACTIVATION_BLOCK` blocks (``M`` a multiple of
        128), or a sequence of up to :data:`oxmoe.grouped_gemm.MAX_CHUNKS` such chunks
        ``[K, M_c]`` whose rows, chunk after chunk, the groups take, as
        :func:`oxmoe.transposed_ragged_dot` does.
      rhs: ``rhsᵀ [N, M]`` in the same blocks or, every chunk alike, in
        :data:`WEIGHT_BLOCK` blocks; or a sequence of chunks as ``lhs``'s.
      group_sizes: ``[G]`` integer row counts (``[C, G]`` for chunks), on the device.
      num_groups: the groups of the result; ``G`` by default, required with ``group_offset``.
      group_offset: optional integer scalar or ``[1]`` array, the window's first group.
      preferred_element_type: float32 (default), bfloat16 or float16.

    Returns:
      ``[num_groups, K, N]``; a group with no rows gives zeros. Not differentiable.
    """
    lhs_chunks, rhs_chunks, chunked = _chunks_of(lhs, rhs, "BlockQuantized")
    rhs_block = _weight_gradient_rhs_block(rhs_chunks[0])
    for c, (a, b) in enumerate(zip(lhs_chunks, rhs_chunks)):
        index = f"[{c}]" if chunked else ""
        _check_quantized(f"lhs{index}", a, ACTIVATION_BLOCK, "[K, M]")
        _check_quantized(f"rhs{index}", b, rhs_block, "[N, M]")
        if a.shape[0] != lhs_chunks[0].shape[0]:
            raise ValueError(f"lhs{index} must have lhs[0]'s K = {lhs_chunks[0].shape[0]}, got {list(a.shape)}")
        if b.shape[1] != a.shape[1] or b.shape[0] != rhs_chunks[0].shape[0]:
            raise ValueError(f"rhs{index} must have shape [N, M] with M = {a.shape[1]} (lhs{index}'s rows) and "
                             f"N = {rhs_chunks[0].shape[0]}, got {list(b.shape)}")
    num_groups = _check_num_groups(num_groups, group_offset)
    rows = tuple(a.shape[1] for a in lhs_chunks)
    groups, sizes, offset = _check_groups(group_sizes, group_offset, num_groups, "num_groups", rows, chunked)
    out_dtype = _out_dtype(preferred_element_type)
    # The kernels read a 128-row block's scales of every column together: [M_c / 128, K].
    operands = vary_alike(*(a.values for a in lhs_chunks), *(a.scales.T for a in lhs_chunks),
                          *(b.values for b in rhs_chunks), *(b.scales.T for b in rhs_chunks),
                          sizes.reshape(len(rows), groups), offset)
    return _not_differentiable("oxmoe.fp8.transposed_ragged_dot", functools.partial(
        _transposed_ragged_dot_p(len(rows)), groups=groups if num_groups is None else num_groups,
        out_dtype=out_dtype))(*operands)


def _not_differentiable(name: str, bind):
    """``bind(*operands)``'s single result, whose differentiation raises an error that
    says what to differentiate instead."""
    @jax.custom_vjp
    def product(*operands):
        (out,) = bind(*operands)
        return out

    def refuse(*_):
        raise TypeError(f"{name} is not differentiable (its operands are quantized); differentiate the layer "
                        "that uses it (oxmoe.moe.moe with MoEConfig.fp8), which defines the FP8 backward")

    product.defvjp(lambda *operands: (product(*operands), None), refuse)
    return product
