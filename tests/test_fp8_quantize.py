"""oxmoe.fp8's block quantization (the oxmoe_fp8_quantize primitive: Rust on the CPU, the CUDA
kernel on a GPU) against a NumPy reference that decodes every float8_e4m3fn bit pattern itself
and rounds to the nearest (ties to the even pattern), and against the plain-JAX statement of the
semantics (oxmoe.reference.fp8.quantize), bit for bit: on the activation, weight and
transposed-activation blocks at real models' widths, transposed or not, from float32, bfloat16
and float16, on fresh random data; its special cases (zero, NaN, infinite, subnormal and tiny
blocks, power-of-two scales); vmap, jit and sharding; and its errors. The same for
oxmoe.fp8.quantize_with_transpose, both quantizations from one read of x: each bit for bit the
reference's and the separate quantize call's; and for oxmoe.fp8.requantize, the quantization of
FP8 values and scales dequantized as they are read: bit for bit quantize(dequantize(q, dtype)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import devices
from oxmoe import fp8, model_shapes
from oxmoe.reference import fp8 as fp8_reference


def e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """The non-negative finite float8_e4m3fn values in float64, ascending, and their bit
    patterns (sign 0, exponent 4 bits biased by 7, mantissa 3 bits; exponent 0 is
    subnormal; 0x7F is NaN and there is no infinity)."""
    bits = np.arange(0x7F)
    exponent, mantissa = bits >> 3, bits & 7
    values = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values, bits


GRID, GRID_BITS = e4m3_grid()


def round_to_e4m3(v: np.ndarray) -> np.ndarray:
    """|v| <= 448 (float64) to the nearest float8_e4m3fn value, ties to the even bit pattern;
    NaN stays NaN."""
    magnitude = np.abs(np.nan_to_num(v))
    upper = np.clip(np.searchsorted(GRID, magnitude), 0, len(GRID) - 1)
    lower = np.maximum(upper - 1, 0)
    below, above = magnitude - GRID[lower], GRID[upper] - magnitude
    take_upper = (above < below) | ((above == below) & (GRID_BITS[upper] % 2 == 0))
    rounded = np.where(take_upper, GRID[upper], GRID[lower])
    return np.where(np.isnan(v), np.nan, np.copysign(rounded, v))


TINY = np.finfo(np.float32).tiny  # 2^-126, the smallest normal float32
SMALLEST_SCALED_AMAX = np.float32(448 * 2.0 ** -126)


def reference(x: np.ndarray, block: tuple[int, int], power_of_two: bool = False, transpose: bool = False):
    """(values as float64, scales as float32) of x (any float dtype, as float32), or with
    `transpose` of x.swapaxes(-1, -2): float32 subnormals count as zeros; amax below
    448 * 2^-126 gives scale 1; NaN and infinite blocks are NaN."""
    x32 = np.asarray(x, np.float32)
    if transpose:
        x32 = np.swapaxes(x32, -1, -2)
    x32 = np.where(np.abs(x32) < TINY, np.copysign(np.float32(0), x32), x32)
    *lead, rows, cols = x32.shape
    blocks = x32.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])
    amax = np.abs(blocks).max(axis=(-3, -1))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ratio = (amax * np.float32(1 / 448)).astype(np.float32)
        if power_of_two:
            ratio = (2.0 ** np.ceil(np.log2(ratio.astype(np.float64)))).astype(np.float32)
        scales = np.where(np.isfinite(amax), np.where(amax >= SMALLEST_SCALED_AMAX, ratio, np.float32(1)),
                          np.nan).astype(np.float32)
        inverse = (np.float32(1) / scales).astype(np.float32)
        scaled = blocks * inverse[..., :, None, :, None]  # float32 products, as specified
    values = round_to_e4m3(np.clip(scaled.astype(np.float64), -448, 448))
    return values.reshape(x32.shape), scales


def as_float64(q: fp8.BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(q.values.astype(jnp.float32), np.float64), np.asarray(q.scales)


def assert_same(got, want, context: str) -> None:
    """Equal values (NaN where NaN) and scales, saying where the first difference is."""
    (values, scales), (want_values, want_scales) = got, want
    assert values.shape == want_values.shape and scales.shape == want_scales.shape, context
    np.testing.assert_array_equal(scales, want_scales, err_msg=f"{context}: scales")
    mismatch = ~((values == want_values) | (np.isnan(values) & np.isnan(want_values)))
    assert not mismatch.any(), (f"{context}: {mismatch.sum()} of {mismatch.size} values differ, first at "
                                f"{np.argwhere(mismatch)[0]}: {values[mismatch][0]} != {want_values[mismatch][0]}")


_quantize = jax.jit(fp8.quantize, static_argnums=1, static_argnames=("power_of_two_scales", "transpose"))


def assert_matches_reference(x, block, context, power_of_two=False, transpose=False):
    q = _quantize(x, block, power_of_two_scales=power_of_two, transpose=transpose)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scales.dtype == jnp.float32, context
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transpose else x.shape
    assert q.block == block and q.shape == shape, context
    assert_same(as_float64(q), reference(np.asarray(x.astype(jnp.float32)), block, power_of_two, transpose),
                context)
    return q


DEEPSEEK_V3, QWEN3 = model_shapes.DEEPSEEK_V3_LAYER, model_shapes.QWEN3_30B_A3B_LAYER
H_DEEPSEEK, F_DEEPSEEK, H_QWEN3, F_QWEN3 = DEEPSEEK_V3.hidden, DEEPSEEK_V3.ffn, QWEN3.hidden, QWEN3.ffn
ACT, WEIGHT, TACT = fp8.ACTIVATION_BLOCK, fp8.WEIGHT_BLOCK, fp8.TRANSPOSED_ACTIVATION_BLOCK

# (x's shape, dtype, block, transpose) at DeepSeek-V3's and Qwen3's widths: tokens per 128
# channels (rows that are no multiple of 128 too), experts' weights per 128 x 128, tokens per
# 128 tokens per channel, and transposed, the weight gradient's token-contiguous operands
# (tokens [T, H] or [T, F] in (1, 128) blocks of the transpose) and transposed weights.
CASES = {
    "activations_deepseek_v3_bf16": ((200, H_DEEPSEEK), jnp.bfloat16, ACT, False),
    "activations_qwen3_f32": ((512, H_QWEN3), jnp.float32, ACT, False),
    "activations_qwen3_ffn_f16_batched": ((3, 40, F_QWEN3), jnp.float16, ACT, False),
    "weights_deepseek_v3_down_bf16": ((2, F_DEEPSEEK, H_DEEPSEEK), jnp.bfloat16, WEIGHT, False),
    "weights_qwen3_up_f32": ((2, H_QWEN3, 2 * F_QWEN3), jnp.float32, WEIGHT, False),
    "transposed_activations_qwen3_bf16": ((512, H_QWEN3), jnp.bfloat16, TACT, False),
    "transposed_activations_of_100_columns_f16": ((256, 100), jnp.float16, TACT, False),
    "weight_gradient_rows_qwen3_bf16": ((512, H_QWEN3), jnp.bfloat16, ACT, True),
    "weight_gradient_rows_deepseek_v3_ffn_bf16": ((256, F_DEEPSEEK), jnp.bfloat16, ACT, True),
    "weight_gradient_rows_qwen3_ffn_f32": ((384, F_QWEN3), jnp.float32, ACT, True),
    "weight_gradient_rows_of_200_channels_f16": ((2, 128, 200), jnp.float16, ACT, True),
    "weights_deepseek_v3_down_transposed_bf16": ((1, F_DEEPSEEK, H_DEEPSEEK), jnp.bfloat16, WEIGHT, True),
    "weights_qwen3_up_transposed_f32": ((2, H_QWEN3, 2 * F_QWEN3), jnp.float32, WEIGHT, True),
    "rows_of_200_tokens_transposed_per_128_channels_bf16": ((200, F_QWEN3), jnp.bfloat16, TACT, True),
}


def draw(rng, shape, dtype):
    """Normal values whose rows span 2**-12 .. 2**12 in scale, so that blocks reach e4m3's
    subnormals and every exponent."""
    scale = 2.0 ** rng.integers(-12, 13, size=(*shape[:-1], 1))
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["float32_scales", "power_of_two_scales"])
def test_quantize_matches_the_float64_reference(case, power_of_two, rng, seed):
    shape, dtype, block, transpose = CASES[case]
    x = draw(rng, shape, dtype)
    context = f"{case}, power_of_two={power_of_two}, seed={seed}"
    q = assert_matches_reference(x, block, context, power_of_two, transpose)
    # Every block reaches the format's range: its largest value rounds to 448 (or, with
    # power-of-two scales, lands in (224, 448] and rounds into [224, 448]).
    values, scales = as_float64(q)
    *lead, rows, cols = q.shape
    top = np.abs(values.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])).max(axis=(-3, -1))
    if power_of_two:
        assert (top >= 224).all() and (top <= 448).all(), context
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(scales))), scales, err_msg=context)
    else:
        np.testing.assert_array_equal(top, 448.0, err_msg=context)


@pytest.mark.parametrize("case", ["activations_qwen3_ffn_f16_batched", "weights_qwen3_up_f32",
                                  "transposed_activations_of_100_columns_f16", "weight_gradient_rows_qwen3_bf16",
                                  "rows_of_200_tokens_transposed_per_128_channels_bf16"])
def test_quantize_equals_the_plain_jax_reference(case, rng, seed):
    shape, dtype, block, transpose = CASES[case]
    x = draw(rng, shape, dtype)
    for power_of_two in (False, True):
        q = _quantize(x, block, power_of_two_scales=power_of_two, transpose=transpose)
        want = jax.jit(fp8_reference.quantize, static_argnums=1, static_argnames=("power_of_two_scales", "transpose"))(
            x, block, power_of_two_scales=power_of_two, transpose=transpose)
        assert q.block == want.block
        assert_same(as_float64(q), as_float64(want), f"{case}, power_of_two={power_of_two}, seed={seed}")


@pytest.mark.parametrize("block", [ACT, WEIGHT, TACT], ids=["activation", "weight", "transposed_activation"])
def test_the_transposed_quantization_is_that_of_the_transpose(block, rng, seed):
    x = draw(rng, (2, 256, 384), jnp.bfloat16)
    transposed = _quantize(x, block, transpose=True)
    of_transpose = _quantize(jnp.swapaxes(x, -1, -2), block)
    assert_same(as_float64(transposed), as_float64(of_transpose), f"{block}, seed={seed}")
    # And (1, 128) blocks of the transpose are (128, 1) blocks of x, written transposed.
    if block == ACT:
        column_blocks = _quantize(x, TACT)
        values, scales = as_float64(column_blocks)
        assert_same(as_float64(transposed), (np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)), "(128, 1)")


# (x's shape, dtype, block) of tensors the layer quantizes both ways: the up projection's
# gradient rows [R, 2F] and the dispatched rows [R, H] in 1 x 128 blocks, the experts' weights
# [E, K, N] in 128 x 128 blocks, and rows per 128 tokens per channel.
BOTH_CASES = {
    "grad_up_rows_qwen3_bf16": ((256, 2 * F_QWEN3), jnp.bfloat16, ACT),
    "grad_up_rows_deepseek_v3_bf16": ((128, 2 * F_DEEPSEEK), jnp.bfloat16, ACT),
    "dispatched_rows_qwen3_f32": ((384, H_QWEN3), jnp.float32, ACT),
    "dispatched_rows_deepseek_v3_f16": ((128, H_DEEPSEEK), jnp.float16, ACT),
    "rows_batched_f16": ((3, 128, 256), jnp.float16, ACT),
    "weights_qwen3_up_bf16": ((2, H_QWEN3, 2 * F_QWEN3), jnp.bfloat16, WEIGHT),
    "weights_qwen3_down_f32": ((2, F_QWEN3, H_QWEN3), jnp.float32, WEIGHT),
    "weights_deepseek_v3_down_bf16": ((1, F_DEEPSEEK, H_DEEPSEEK), jnp.bfloat16, WEIGHT),
    "transposed_activations_qwen3_bf16": ((256, H_QWEN3), jnp.bfloat16, TACT),
}

_quantize_with_transpose = jax.jit(fp8.quantize_with_transpose, static_argnums=1,
                                   static_argnames="power_of_two_scales")


def assert_both_match(x, block, context, power_of_two=False):
    """quantize_with_transpose's two results: each the NumPy reference's, and bit for bit
    quantize's of x and of x transposed."""
    q, qt = _quantize_with_transpose(x, block, power_of_two_scales=power_of_two)
    x64 = np.asarray(x.astype(jnp.float32))
    for got, transpose in ((q, False), (qt, True)):
        where = f"{context}, {'transposed' if transpose else 'as is'}"
        shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transpose else x.shape
        assert got.block == block and got.shape == shape and got.values.dtype == jnp.float8_e4m3fn, where
        assert_same(as_float64(got), reference(x64, block, power_of_two, transpose), where)
        alone = _quantize(x, block, power_of_two_scales=power_of_two, transpose=transpose)
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(alone.values).view(np.uint8),
                                      err_msg=f"{where}: the values' bits against quantize's")
        np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint32),
                                      np.asarray(alone.scales).view(np.uint32),
                                      err_msg=f"{where}: the scales' bits against quantize's")


@pytest.mark.parametrize("case", BOTH_CASES)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["float32_scales", "power_of_two_scales"])
def test_quantize_with_transpose_is_both_quantizations(case, power_of_two, rng, seed):
    shape, dtype, block = BOTH_CASES[case]
    assert_both_match(draw(rng, shape, dtype), block, f"{case}, power_of_two={power_of_two}, seed={seed}",
                      power_of_two)


def test_quantize_with_transpose_equals_the_plain_jax_reference(rng, seed):
    for block in (ACT, WEIGHT, TACT):
        x = draw(rng, (2, 256, 384), jnp.bfloat16)
        got = _quantize_with_transpose(x, block, power_of_two_scales=True)
        want = fp8_reference.quantize_with_transpose(x, block, power_of_two_scales=True)
        for g, w, what in zip(got, want, ("as is", "transposed")):
            assert g.block == w.block
            assert_same(as_float64(g), as_float64(w), f"{block}, {what}, seed={seed}")


def dequantized_reference(q: fp8.BlockQuantized, dtype) -> np.ndarray:
    """q's values times their 1 x 128 blocks' scales (float32 subnormal scales and products
    below 2^-126 zeros of their sign; the product exact in float64, rounded once to float32),
    rounded to dtype, as float32."""
    values = np.asarray(q.values.astype(jnp.float32), np.float64)
    scales = np.asarray(q.scales, np.float64)
    scales = np.where(np.abs(scales) < TINY, np.copysign(0.0, scales), scales)
    exact = values * np.repeat(scales, 128, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows to infinity, as specified
        product = np.where(np.abs(exact) < TINY, np.copysign(0.0, exact), exact).astype(np.float32)
        return product.astype(dtype).astype(np.float32)


_requantize = jax.jit(fp8.requantize, static_argnums=1, static_argnames=("dtype", "power_of_two_scales", "transpose"))


def assert_requantize_matches(q, block, dtype, context, power_of_two=False, transpose=False, dequantize_on=None):
    """requantize's result: the NumPy reference's and bit for bit quantize(dequantize(q, dtype))'s
    (computed on `dequantize_on`, a device whose dequantize flushes subnormal products alike)."""
    got = _requantize(q, block, dtype=dtype, power_of_two_scales=power_of_two, transpose=transpose)
    shape = (*q.shape[:-2], q.shape[-1], q.shape[-2]) if transpose else q.shape
    assert got.block == block and got.shape == shape and got.values.dtype == jnp.float8_e4m3fn, context
    assert_same(as_float64(got), reference(dequantized_reference(q, dtype), block, power_of_two, transpose), context)
    if dequantize_on is not None:
        q = jax.device_put(q, dequantize_on)
    want = _quantize(fp8.dequantize(q, dtype), block, power_of_two_scales=power_of_two, transpose=transpose)
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8),
                                  err_msg=f"{context}: the values' bits against quantize(dequantize(q))'s")
    np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint32), np.asarray(want.scales).view(np.uint32),
                                  err_msg=f"{context}: the scales' bits against quantize(dequantize(q))'s")


# (the quantized tensor's shape, the dequantized dtype, the new block, transpose): the layer's
# output gradient rows [R, H] (quantized per row, requantized transposed for the down weight's
# gradient), and the other blocks.
REQUANTIZE_CASES = {
    "grad_out_rows_qwen3_bf16": ((256, H_QWEN3), jnp.bfloat16, ACT, True),
    "grad_out_rows_deepseek_v3_bf16": ((128, H_DEEPSEEK), jnp.bfloat16, ACT, True),
    "grad_out_rows_qwen3_f32": ((384, H_QWEN3), jnp.float32, ACT, True),
    "rows_f16_batched": ((3, 128, 256), jnp.float16, ACT, True),
    "rows_per_row_again_bf16": ((200, F_QWEN3), jnp.bfloat16, ACT, False),
    "rows_per_128_rows_f32": ((256, 384), jnp.float32, TACT, False),
    "rows_per_128_x_128_transposed_bf16": ((2, 256, 384), jnp.bfloat16, WEIGHT, True),
}


@pytest.mark.parametrize("case", REQUANTIZE_CASES)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["float32_scales", "power_of_two_scales"])
def test_requantize_is_the_quantization_of_the_dequantized_tensor(case, power_of_two, rng, seed):
    shape, dtype, block, transpose = REQUANTIZE_CASES[case]
    q = fp8.quantize(draw(rng, shape, jnp.float32), ACT, power_of_two_scales=power_of_two)
    assert_requantize_matches(q, block, dtype, f"{case}, power_of_two={power_of_two}, seed={seed}", power_of_two,
                              transpose)


def test_requantize_equals_the_plain_jax_reference(rng, seed):
    q = fp8.quantize(draw(rng, (2, 256, 384), jnp.bfloat16))
    for dtype, block, transpose in ((jnp.bfloat16, ACT, True), (jnp.float16, TACT, False), (jnp.float32, WEIGHT, True)):
        got = _requantize(q, block, dtype=dtype, power_of_two_scales=True, transpose=transpose)
        want = fp8_reference.requantize(q, block, dtype=dtype, power_of_two_scales=True, transpose=transpose)
        assert got.block == want.block
        assert_same(as_float64(got), as_float64(want), f"{jnp.dtype(dtype).name}, {block}, seed={seed}")


def dispatch_like_rows(rng, tokens: int, rows: int) -> np.ndarray:
    """A dispatch's source_tokens [rows]: each token on a few rows, in no order, and -1 on
    the padding rows."""
    source = np.full(rows, -1, np.int32)
    routed = rng.choice(rows, size=min(rows, 3 * tokens) * 7 // 8, replace=False)
    source[routed] = rng.integers(0, tokens, len(routed))
    return source


def gathered(q: fp8.BlockQuantized, source_rows: np.ndarray) -> fp8.BlockQuantized:
    """q's rows that source_rows names, bytes and scales copied, zeros where it is -1."""
    values, scales = np.asarray(q.values).view(np.uint8), np.asarray(q.scales)
    routed, at = source_rows >= 0, np.maximum(source_rows, 0)
    return fp8.BlockQuantized(jnp.asarray(np.where(routed[:, None], values[at], 0).view(jnp.float8_e4m3fn)),
                              jnp.asarray(np.where(routed[:, None], scales[at], 0)), ACT)


# (tokens [T, C] quantized per row, the rows gathered, the dequantized dtype, the block,
# transpose): the layer's tokens read as the dispatch's rows for the up weight's gradient.
REQUANTIZE_ROWS_CASES = {
    "tokens_qwen3_bf16": ((200, H_QWEN3), 384, jnp.bfloat16, ACT, True),
    "tokens_deepseek_v3_bf16": ((100, H_DEEPSEEK), 256, jnp.bfloat16, ACT, True),
    "tokens_per_row_f32": ((150, F_QWEN3), 300, jnp.float32, ACT, False),
    "tokens_per_128_x_128_f16": ((90, 256), 256, jnp.float16, WEIGHT, False),
}


@pytest.mark.parametrize("case", REQUANTIZE_ROWS_CASES)
def test_requantize_through_source_rows_is_that_of_the_gathered_rows(case, rng, seed):
    (tokens, cols), rows, dtype, block, transpose = REQUANTIZE_ROWS_CASES[case]
    q = fp8.quantize(draw(rng, (tokens, cols), jnp.float32), ACT)
    source_rows = dispatch_like_rows(rng, tokens, rows)
    got = jax.jit(fp8.requantize, static_argnums=1, static_argnames=("dtype", "transpose"))(
        q, block, dtype=dtype, transpose=transpose, source_rows=jnp.asarray(source_rows))
    context = f"{case}, seed={seed}"
    assert got.shape == ((cols, rows) if transpose else (rows, cols)) and got.block == block, context
    assert_requantize_matches(gathered(q, source_rows), block, dtype, context, transpose=transpose)
    want = _requantize(gathered(q, source_rows), block, dtype=dtype, transpose=transpose)
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8),
                                  err_msg=f"{context}: the values' bits against requantize of the gathered rows")
    np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint32), np.asarray(want.scales).view(np.uint32),
                                  err_msg=f"{context}: the scales' bits against requantize of the gathered rows")


def test_requantize_through_source_rows_out_of_range_gives_nan_rows(rng):
    tokens, cols = 64, 256
    q = fp8.quantize(draw(rng, (tokens, cols), jnp.bfloat16), ACT)
    source_rows = dispatch_like_rows(rng, tokens, 128)
    bad = [3, 50, 99]
    source_rows[bad] = [tokens, -2, np.iinfo(np.int32).max]
    got = fp8.requantize(q, ACT, dtype=jnp.bfloat16, source_rows=jnp.asarray(source_rows))
    good = np.setdiff1d(np.arange(128), bad)
    assert np.isnan(np.asarray(got.scales)[bad]).all() and np.isnan(np.asarray(got.values, np.float32)[bad]).all()
    want = _requantize(gathered(q, np.where(np.isin(np.arange(128), bad), -1, source_rows)), ACT, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8)[good], np.asarray(want.values).view(np.uint8)[good])
    np.testing.assert_array_equal(np.asarray(got.scales)[good], np.asarray(want.scales)[good])


def special_fp8_rows() -> fp8.BlockQuantized:
    """[256, 256] FP8 rows in 1 x 128 blocks whose products with their scales are special: a
    NaN value, a NaN scale, a subnormal scale, zeros, values near float16's largest (past it,
    rounded to float16: infinite), and 0.5 times (2 - 2^-23) * 2^-126, a product below 2^-126
    that IEEE rounding would make 2^-126 (flushed, it is zero: with 448 * 2^-118 in the same
    column and nothing else there, 2^-126 would quantize to the nonzero 2^-8)."""
    rng = np.random.default_rng(11)
    values = jnp.asarray(rng.standard_normal((256, 256)) * 100, jnp.float32).astype(jnp.float8_e4m3fn)
    scales = np.exp2(rng.integers(-20, 20, (256, 2))).astype(np.float32)
    values = values.at[3, 7].set(jnp.nan).at[5:9, :128].set(0)
    scales[10, 1] = np.nan
    scales[11, 0] = TINY / 4
    values = values.at[12, 128:].set(448)
    scales[12, 1] = 300.0  # 448 * 300 = 134400: past float16's 65504
    values = values.at[:128, 0].set(0).at[20, 0].set(0.5).at[21, 0].set(448)
    scales[20, 0], scales[21, 0] = np.uint32(0x00FFFFFF).view(np.float32), 2.0 ** -118
    return fp8.BlockQuantized(values, jnp.asarray(scales), ACT)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("block, transpose", [(ACT, True), (ACT, False), (WEIGHT, False), (TACT, True)],
                         ids=["transposed", "rows", "weight", "transposed_columns"])
def test_requantize_special_products_match_the_reference(block, transpose, dtype, cpu):
    q = special_fp8_rows()
    context = f"{jnp.dtype(dtype).name}, {block}, transpose={transpose}"
    for power_of_two in (False, True):
        # XLA:CPU's dequantize flushes subnormal products as requantize does.
        assert_requantize_matches(q, block, dtype, context, power_of_two, transpose, dequantize_on=cpu)
        want = fp8_reference.requantize(q, block, dtype=dtype, power_of_two_scales=power_of_two, transpose=transpose)
        got = _requantize(q, block, dtype=dtype, power_of_two_scales=power_of_two, transpose=transpose)
        assert_same(as_float64(got), as_float64(want), f"{context}: the plain-JAX reference")
    # The flushed product: zero, where 2^-126 would give 2^-8 (in float16, 448 * 2^-118 is zero too).
    if block == ACT and transpose and dtype != jnp.float16:
        values, _ = as_float64(_requantize(q, block, dtype=dtype, transpose=True))
        assert values[0, 20] == 0 and values[0, 21] == 448


def special_blocks(dtype) -> np.ndarray:
    """[256, 384] in 128 x 128 tiles, each a kind of block (whatever the block shape, every
    block of a tile is of the tile's kind, except the first row or column of a tile where
    one value is planted): normal values; zeros; a NaN, an infinity and a minus infinity
    among normal values; values below 448 * 2^-126 (their scale would be no normal float);
    the same with one at 448 * 2^-126; float32 subnormals beside normal values 2^-110."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 384))
    tiles = [x[r:r + 128, c:c + 128] for r in (0, 128) for c in (0, 128, 256)]
    tiles[1][:] = 0
    tiles[2][[0, 5, 9], [3, 0, 7]] = [np.nan, np.inf, -np.inf]
    tiles[3][:] *= 2.0 ** -120  # below 448 * 2^-126 ~ 2^-117.2
    tiles[4][:] = np.clip(tiles[4], -1, 1) * 2.0 ** -120
    tiles[4][0, :] = tiles[4][:, 0] = 448 * 2.0 ** -126
    tiles[5][:] = np.where(rng.random((128, 128)) < 0.5, 2.0 ** -110, -(2.0 ** -127) * rng.random((128, 128)))
    if dtype == jnp.bfloat16:
        x = np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    return x


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transpose", [False, True], ids=["", "transposed"])
@pytest.mark.parametrize("block", [ACT, WEIGHT, TACT], ids=["activation", "weight", "transposed_activation"])
def test_special_blocks_match_the_reference(block, transpose, dtype):
    x = jnp.asarray(special_blocks(dtype), dtype)
    context = f"{block}, transpose={transpose}, {jnp.dtype(dtype).name}"
    for power_of_two in (False, True):
        q = assert_matches_reference(x, block, context, power_of_two, transpose)
        want = fp8_reference.quantize(x, block, power_of_two_scales=power_of_two, transpose=transpose)
        assert_same(as_float64(q), as_float64(want), f"{context}: the plain-JAX reference")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block", [ACT, WEIGHT, TACT], ids=["activation", "weight", "transposed_activation"])
def test_special_blocks_quantized_both_ways_match_the_reference(block, dtype):
    x = jnp.asarray(special_blocks(dtype), dtype)
    for power_of_two in (False, True):
        assert_both_match(x, block, f"{block}, {jnp.dtype(dtype).name}, power_of_two={power_of_two}", power_of_two)


def test_tiny_blocks_and_subnormals():
    # Float32 subnormals count as zeros (of their sign) beside normal values: without that,
    # -2^-127 in a block of largest magnitude 2^-110 would be -2^-17 * 448 ~ -0.0034 in FP8.
    x = np.zeros((4, 128), np.float32)
    x[0, :3] = [2.0 ** -110, -(2.0 ** -127), 2.0 ** -149]
    # A block below 448 * 2^-126 has scale 1 and zero values; at it, a normal scale.
    x[1, 0] = np.nextafter(np.float32(448 * 2.0 ** -126), np.float32(0))
    x[2, 0] = 448 * 2.0 ** -126
    x[3, 0] = 2.0 ** -130  # a subnormal alone: a block of zeros
    values, scales = as_float64(fp8.quantize(jnp.asarray(x)))
    np.testing.assert_array_equal(scales[:, 0], [np.float32(2.0 ** -110) * np.float32(1 / 448), 1.0,
                                                 np.float32(448 * 2.0 ** -126) * np.float32(1 / 448), 1.0])
    assert values[0, 0] == 448 and values[0, 1] == 0 and np.signbit(values[0, 1]) and values[0, 2] == 0
    assert (values[1:3, 1:] == 0).all() and values[1, 0] == 0 and values[2, 0] == 448 and values[3, 0] == 0


@pytest.mark.parametrize("transpose", [False, True], ids=["", "transposed"])
@pytest.mark.parametrize("block", [ACT, WEIGHT, TACT], ids=["activation", "weight", "transposed_activation"])
def test_vmap_quantizes_each_element(block, transpose, rng, seed):
    x = draw(rng, (3, 2, 128, 256), jnp.bfloat16)
    quantize = lambda x: fp8.quantize(x, block, transpose=transpose)  # noqa: E731
    whole = quantize(x)
    for mapped in (jax.vmap(quantize)(x), jax.jit(jax.vmap(jax.vmap(quantize)))(x),
                   jax.vmap(quantize, in_axes=1, out_axes=1)(x)):
        assert_same(as_float64(mapped), as_float64(whole), f"{block}, transpose={transpose}, seed={seed}")


@pytest.mark.parametrize("block", [ACT, WEIGHT, TACT], ids=["activation", "weight", "transposed_activation"])
def test_vmap_quantizes_each_element_both_ways(block, rng, seed):
    x = draw(rng, (3, 2, 128, 256), jnp.bfloat16)
    quantize = lambda x: fp8.quantize_with_transpose(x, block)  # noqa: E731
    whole = quantize(x)
    for mapped in (jax.vmap(quantize)(x), jax.jit(jax.vmap(jax.vmap(quantize)))(x),
                   jax.vmap(quantize, in_axes=1, out_axes=1)(x)):
        for got, want in zip(mapped, whole):
            assert_same(as_float64(got), as_float64(want), f"{block}, seed={seed}")


@pytest.mark.parametrize("block, transpose", [(ACT, True), (WEIGHT, False)], ids=["transposed", "weight"])
def test_vmap_requantizes_each_element(block, transpose, rng, seed):
    q = fp8.quantize(draw(rng, (3, 2, 128, 256), jnp.bfloat16))
    requantize = lambda q: fp8.requantize(q, block, dtype=jnp.bfloat16, transpose=transpose)  # noqa: E731
    whole = requantize(q)
    for mapped in (jax.vmap(requantize)(q), jax.jit(jax.vmap(jax.vmap(requantize)))(q),
                   jax.vmap(requantize, in_axes=1, out_axes=1)(q)):
        assert_same(as_float64(mapped), as_float64(whole), f"{block}, transpose={transpose}, seed={seed}")


def test_sharded_inputs_give_the_unsharded_result(rng, seed):
    mesh = jax.make_mesh((4,), ("data",), devices=devices.mesh_devices(4))
    tokens = draw(rng, (512, H_QWEN3), jnp.bfloat16)
    weights = draw(rng, (4, 256, 384), jnp.float32)
    on_mesh = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    whole_device = mesh.devices.flat[0]
    for x, spec, block, transpose in [(tokens, P("data", None), ACT, False), (tokens, P("data", None), ACT, True),
                                      (tokens, P("data", None), TACT, False),
                                      (weights, P("data", None, None), WEIGHT, True)]:
        q = _quantize(on_mesh(x, spec), block, transpose=transpose)
        want = _quantize(jax.device_put(x, whole_device), block, transpose=transpose)
        assert_same(as_float64(q), as_float64(want), f"{spec}, {block}, transpose={transpose}, seed={seed}")
        if not transpose and block == ACT:  # rows quantized where they are
            assert q.values.sharding.spec[0] == "data" and q.scales.sharding.spec[0] == "data"
    # Both ways: the experts' weights split over the mesh, quantized where they are.
    both = _quantize_with_transpose(on_mesh(weights, P("data", None, None)), WEIGHT)
    for got, want in zip(both, _quantize_with_transpose(jax.device_put(weights, whole_device), WEIGHT)):
        assert_same(as_float64(got), as_float64(want), f"both ways, seed={seed}")
        assert got.values.sharding.spec[0] == "data" and got.scales.sharding.spec[0] == "data"


def test_halfway_values_round_to_the_even_pattern():
    # A block whose power-of-two scale is 1 (amax 400): the values are rounded as they are.
    # 8.5 lies between 8 (pattern 0x50) and 9 (0x51), 9.5 between 9 and 10 (0x52), 100
    # between 96 (0x6C) and 104 (0x6D), 1.5 * 2**-9 between the subnormals 2**-9 (0x01) and
    # 2**-8 (0x02), and 400 (the block's largest) between 384 (0x7C) and 416 (0x7D).
    halfway = [8.5, 9.5, 100.0, -8.5, 1.5 * 2.0 ** -9, 400.0]
    even = [8.0, 10.0, 96.0, -8.0, 2.0 ** -8, 384.0]
    x = jnp.zeros((1, 128), jnp.float32).at[0, :len(halfway)].set(jnp.asarray(halfway, jnp.float32))
    q = fp8.quantize(x, power_of_two_scales=True)
    values, scales = as_float64(q)
    assert scales[0, 0] == 1.0
    np.testing.assert_array_equal(values[0, :len(even)], even)
    np.testing.assert_array_equal(round_to_e4m3(np.asarray(halfway)), even)  # the reference agrees


def test_dequantize_is_within_half_a_step_of_the_input(rng, seed):
    x = draw(rng, (128, H_QWEN3), jnp.float32)
    q = fp8.quantize(x)
    got = np.asarray(fp8.dequantize(q), np.float64)
    values, scales = as_float64(q)
    step = np.repeat(scales, 128, axis=-1).astype(np.float64)
    # e4m3 has 3 mantissa bits: a rounding is at most 2**-4 of the value it lands on (relative),
    # or half the subnormal step 2**-9 (absolute), times the block's scale. The scaled value
    # x * (1 / scale) is itself rounded twice in float32 (2**-24 each), which can carry a value
    # just past a tie onto it (seed 2484871341: 136.0000134 scaled to 136.0, a tie, rounded to
    # 128: 8.0000134 steps off).
    x64 = np.asarray(x, np.float64)
    bound = (np.maximum(np.abs(values) * 2.0 ** -4, 2.0 ** -10) + np.abs(x64) / step * 2.0 ** -23) * step
    assert (np.abs(got - x64) <= bound).all(), f"seed={seed}"
    # The float32 product, as specified.
    np.testing.assert_array_equal(got, values.astype(np.float32) * step.astype(np.float32))
    assert fp8.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def test_a_block_of_zeros_has_scale_one():
    x = jnp.zeros((4, 256), jnp.bfloat16).at[1, 130].set(3.0)
    q = fp8.quantize(x)
    scales = np.array(q.scales)
    assert scales[1, 1] == np.float32(3.0) * np.float32(1 / 448)
    scales[1, 1] = 1.0
    np.testing.assert_array_equal(scales, 1.0)
    values, _ = as_float64(q)
    assert values[1, 130] == 448.0 and np.count_nonzero(values) == 1


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "minus_inf"])
def test_a_block_with_a_nan_or_an_infinity_becomes_nan(special, rng):
    x = np.asarray(rng.standard_normal((2, 256)), np.float32)
    x[0, 5] = special
    q = fp8.quantize(jnp.asarray(x))
    values, scales = as_float64(q)
    assert np.isnan(scales[0, 0]) and np.isnan(values[0, :128]).all(), "the poisoned block"
    assert np.isfinite(scales[0, 1]) and np.isfinite(scales[1]).all() and np.isfinite(values[0, 128:]).all()
    assert np.isnan(np.asarray(fp8.dequantize(q))[0, :128]).all()


def test_quantize_is_not_differentiated(rng):
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(fp8.dequantize(fp8.quantize(x))))(x)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


RECIPE = r"\(ACTIVATION_BLOCK \(1, 128\), WEIGHT_BLOCK \(128, 128\), TRANSPOSED_ACTIVATION_BLOCK \(128, 1\)\)"


@pytest.mark.parametrize("x, block, kwargs, error, message", [
    (jnp.zeros((4, 100)), ACT, {}, ValueError,
     r"x's last two dimensions \(4, 100\) must be multiples of the block \(1, 128\)"),
    (jnp.zeros((100, 128)), WEIGHT, {}, ValueError, r"\(100, 128\) must be multiples of the block \(128, 128\)"),
    (jnp.zeros((100, 256)), ACT, {"transpose": True}, ValueError,
     r"x's last two dimensions \(100, 256\), transposed \(256, 100\), must be multiples of the block \(1, 128\)"),
    (jnp.zeros((128, 100)), TACT, {"transpose": True}, ValueError,
     r"\(128, 100\), transposed \(100, 128\), must be multiples of the block \(128, 1\)"),
    (jnp.zeros((256,)), ACT, {}, ValueError, r"x must have at least two dimensions .* got shape \(256,\)"),
    (jnp.zeros((4, 128), jnp.int32), ACT, {}, TypeError, r"x must be float32, bfloat16 or float16, got int32"),
    (jnp.zeros((4, 128), jnp.float64) if jax.config.jax_enable_x64 else np.zeros((4, 128)), ACT, {}, TypeError,
     r"x must be float32, bfloat16 or float16, got float64"),
    (jnp.zeros((4, 128)), (0, 128), {}, ValueError, r"block must be one of the FP8 recipe's blocks " + RECIPE +
     r", got \(0, 128\)"),
    (jnp.zeros((128, 128)), (64, 128), {}, ValueError, r"block must be one of .* got \(64, 128\)"),
    (jnp.zeros((4, 128)), (1, 1), {}, ValueError, r"block must be one of .* got \(1, 1\)"),
    (jnp.zeros((4, 128)), [1, 128], {}, ValueError, r"block must be one of .* got \[1, 128\]"),
    (jnp.zeros((4, 128)), (True, 128), {}, ValueError, r"block must be one of .* got \(True, 128\)"),
    ([[1.0] * 128], ACT, {}, TypeError, r"x must be a JAX or NumPy array, got list"),
    (jnp.zeros((1, 128)), ACT, {"power_of_two_scales": 1}, ValueError, r"power_of_two_scales must be a bool, got 1"),
    (jnp.zeros((128, 128)), ACT, {"transpose": "yes"}, ValueError, r"transpose must be a bool, got 'yes'"),
], ids=["columns", "rows", "transposed_rows", "transposed_columns", "rank", "dtype", "float64", "zero_block",
        "block_of_64_rows", "block_of_one", "list_block", "bool_block", "not_an_array", "power_of_two_not_a_bool",
        "transpose_not_a_bool"])
def test_bad_input_is_named(x, block, kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8.quantize(x, block, **kwargs)


@pytest.mark.parametrize("x, block, kwargs, error, message", [
    (jnp.zeros((100, 256)), ACT, {}, ValueError,
     r"x's last two dimensions \(100, 256\), transposed \(256, 100\), must be multiples of the block \(1, 128\)"),
    (jnp.zeros((256, 100)), ACT, {}, ValueError, r"x's last two dimensions \(256, 100\) must be multiples of the "
                                                 r"block \(1, 128\)"),
    (jnp.zeros((128, 100)), TACT, {}, ValueError,
     r"\(128, 100\), transposed \(100, 128\), must be multiples of the block \(128, 1\)"),
    (jnp.zeros((2, 128, 192)), WEIGHT, {}, ValueError, r"\(128, 192\) must be multiples of the block \(128, 128\)"),
    (jnp.zeros((128,)), ACT, {}, ValueError, r"x must have at least two dimensions .* got shape \(128,\)"),
    (jnp.zeros((128, 128), jnp.int8), ACT, {}, TypeError, r"x must be float32, bfloat16 or float16, got int8"),
    (jnp.zeros((128, 128)), (1, 1), {}, ValueError, r"block must be one of .* got \(1, 1\)"),
    (jnp.zeros((128, 128)), ACT, {"power_of_two_scales": "no"}, ValueError,
     r"power_of_two_scales must be a bool, got 'no'"),
    (jnp.zeros((128, 128)), ACT, {"transpose": True}, TypeError, r"unexpected keyword argument 'transpose'"),
], ids=["rows", "columns", "transposed_columns", "weight_columns", "rank", "dtype", "block", "power_of_two_not_a_bool",
        "transpose"])
def test_bad_input_to_quantize_with_transpose_is_named(x, block, kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8.quantize_with_transpose(x, block, **kwargs)


_Q = fp8.BlockQuantized(jnp.zeros((100, 256), jnp.float8_e4m3fn), jnp.ones((100, 2)), ACT)


@pytest.mark.parametrize("q, block, kwargs, error, message", [
    (jnp.zeros((128, 256)), ACT, {}, TypeError, r"q must be an oxmoe.fp8.BlockQuantized .* got ArrayImpl"),
    (fp8.BlockQuantized(jnp.zeros((128, 256), jnp.float8_e4m3fn), jnp.ones((1, 2)), WEIGHT), ACT, {}, ValueError,
     r"q must be \[..., R, C\] quantized in \(1, 128\) blocks, got shape \[128, 256\] in \(128, 128\) blocks"),
    (fp8.BlockQuantized(jnp.zeros((256,), jnp.float8_e4m3fn), jnp.ones((2,)), ACT), ACT, {}, ValueError,
     r"q must be \[..., R, C\] quantized in \(1, 128\) blocks, got shape \[256\]"),
    (fp8.BlockQuantized(jnp.zeros((4, 256)), jnp.ones((4, 2)), ACT), ACT, {}, TypeError,
     r"q.values must be float8_e4m3fn, got float32"),
    (fp8.BlockQuantized(jnp.zeros((4, 256), jnp.float8_e4m3fn), jnp.ones((4, 3)), ACT), ACT, {}, ValueError,
     r"q.scales must be float32 \[4, 2\]"),
    (_Q, ACT, {"transpose": True}, ValueError,
     r"q's last two dimensions \(100, 256\), transposed \(256, 100\), must be multiples of the block \(1, 128\)"),
    (_Q, WEIGHT, {}, ValueError, r"q's last two dimensions \(100, 256\) must be multiples of the block \(128, 128\)"),
    (_Q, (2, 128), {}, ValueError, r"block must be one of .* got \(2, 128\)"),
    (_Q, ACT, {"dtype": jnp.int32}, TypeError, r"dtype must be float32, bfloat16 or float16, got int32"),
    (_Q, ACT, {"dtype": jnp.float8_e4m3fn}, TypeError, r"dtype must be float32, bfloat16 or float16, got float8_e4m3fn"),
    (_Q, ACT, {"power_of_two_scales": None}, ValueError, r"power_of_two_scales must be a bool, got None"),
    (_Q, ACT, {"transpose": 0}, ValueError, r"transpose must be a bool, got 0"),
], ids=["array", "weight_blocks", "rank", "values_dtype", "scales_shape", "transposed_rows", "weight_rows", "block",
        "int_dtype", "fp8_dtype", "power_of_two_not_a_bool", "transpose_not_a_bool"])
def test_bad_input_to_requantize_is_named(q, block, kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8.requantize(q, block, **kwargs)


@pytest.mark.parametrize("q, kwargs, error, message", [
    (_Q, {"source_rows": jnp.zeros((128,), jnp.float32)}, TypeError, r"source_rows must be int32 \[rows\], got float32\[128\]"),
    (_Q, {"source_rows": jnp.zeros((2, 64), jnp.int32)}, TypeError, r"source_rows must be int32 \[rows\], got int32\[2, 64\]"),
    (fp8.BlockQuantized(jnp.zeros((2, 100, 256), jnp.float8_e4m3fn), jnp.ones((2, 100, 2)), ACT),
     {"source_rows": jnp.zeros((128,), jnp.int32)}, ValueError,
     r"q must be one matrix \[R, C\] with source_rows, got shape \(2, 100, 256\)"),
    (_Q, {"source_rows": jnp.zeros((100,), jnp.int32), "transpose": True}, ValueError,
     r"q\[source_rows\]'s last two dimensions \(100, 256\), transposed \(256, 100\), must be multiples"),
], ids=["float_rows", "matrix_of_rows", "batched_q", "rows_not_a_multiple_of_the_block"])
def test_bad_source_rows_to_requantize_are_named(q, kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8.requantize(q, ACT, **kwargs)


def test_dequantize_takes_only_a_quantized_tensor():
    with pytest.raises(TypeError, match=r"q must be an oxmoe.fp8.BlockQuantized, got ArrayImpl"):
        fp8.dequantize(jnp.zeros((1, 128)))


def test_the_reference_takes_any_block_and_names_bad_ones(rng):
    x = draw(rng, (6, 10), jnp.float32)
    q = fp8_reference.quantize(x, (3, 5))
    assert_same(as_float64(q), reference(np.asarray(x), (3, 5)), "(3, 5)")
    q = fp8_reference.quantize(x, (2, 3), transpose=True)
    assert_same(as_float64(q), reference(np.asarray(x), (2, 3), transpose=True), "(2, 3), transposed")
    with pytest.raises(ValueError, match=r"block must be a pair of positive ints \(rows, columns\), got \(0, 128\)"):
        fp8_reference.quantize(x, (0, 128))
    with pytest.raises(ValueError, match=r"x's last two dimensions \(6, 10\) must be multiples of the block \(4, 5\)"):
        fp8_reference.quantize(x, (4, 5))


def test_the_reciprocal_is_the_nearest_float32_from_any_guess_within_two_ulp(rng):
    # XLA:GPU's float32 division is up to an ulp or two off (about one quotient in seven on an H200):
    # the plain-JAX reference corrects it. Here every guess 2 ulp either side of NumPy's correctly
    # rounded quotient, for significands in [1, 2).
    m = np.concatenate([1 + rng.random(40000), [1.0, 1.5, np.nextafter(2, 0)]]).astype(np.float32)
    exact = np.float32(1) / m
    bits = exact.view(np.int32)
    for step in (-2, -1, 0, 1, 2):
        guess = (bits + step).view(np.float32)
        got = np.asarray(jax.jit(fp8_reference._nearest_reciprocal)(jnp.asarray(m), jnp.asarray(guess)))
        np.testing.assert_array_equal(got, exact, err_msg=f"guess {step} ulp from the quotient")


def test_the_reference_reciprocal_is_correctly_rounded_over_every_scale(rng):
    # Any normal float32 a scale can be (448 * 2^-126 * (1 / 448) up to 2^120), the powers of
    # two among them, and NaN.
    scales = np.concatenate([np.exp2(rng.uniform(-126, 125, 40000)), np.exp2(np.arange(-126, 126.0)),
                             [np.finfo(np.float32).tiny, np.float32(2.0 ** 125) * np.float32(1.75)]])
    scales = scales.astype(np.float32)
    got = np.asarray(jax.jit(fp8_reference._reciprocal)(jnp.asarray(scales)))
    np.testing.assert_array_equal(got, np.float32(1) / scales)
    assert np.isnan(np.asarray(fp8_reference._reciprocal(jnp.float32(np.nan))))
