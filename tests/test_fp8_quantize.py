"""oxmoe.fp8's block quantization against a NumPy reference that decodes every float8_e4m3fn
bit pattern itself and rounds to the nearest (ties to the even pattern), on the activation,
weight and transposed-activation blocks at real models' widths, on fresh random data; its
special cases (zero, NaN and infinite blocks, power-of-two scales); and its errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import fp8, model_shapes


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


def reference(x: np.ndarray, block: tuple[int, int], power_of_two: bool = False):
    """(values as float64, scales as float32) of x (any float dtype, as float32)."""
    x32 = np.asarray(x, np.float32)
    *lead, rows, cols = x32.shape
    blocks = x32.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])
    amax = np.abs(blocks).max(axis=(-3, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (amax * np.float32(1 / 448)).astype(np.float32)
        if power_of_two:
            ratio = np.where(amax > 0, 2.0 ** np.ceil(np.log2(ratio.astype(np.float64))), 1).astype(np.float32)
        scales = np.where(np.isfinite(amax), np.where(amax > 0, ratio, np.float32(1)), np.nan).astype(np.float32)
        inverse = (np.float32(1) / scales).astype(np.float32)
        scaled = blocks * inverse[..., :, None, :, None]  # float32 products, as specified
    values = round_to_e4m3(np.clip(scaled.astype(np.float64), -448, 448))
    return values.reshape(x32.shape), scales


def as_float64(q: fp8.BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(q.values.astype(jnp.float32), np.float64), np.asarray(q.scales)


def assert_matches_reference(x, block, context, power_of_two=False):
    q = jax.jit(fp8.quantize, static_argnums=1, static_argnames="power_of_two_scales")(
        x, block, power_of_two_scales=power_of_two)
    values, scales = as_float64(q)
    want_values, want_scales = reference(np.asarray(x.astype(jnp.float32)), block, power_of_two)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scales.dtype == jnp.float32, context
    assert q.block == block and q.shape == x.shape, context
    np.testing.assert_array_equal(scales, want_scales, err_msg=f"{context}: scales")
    mismatch = values != want_values
    assert not mismatch.any(), (f"{context}: {mismatch.sum()} of {mismatch.size} values differ, first at "
                                f"{np.argwhere(mismatch)[0]}: {values[mismatch][0]} != {want_values[mismatch][0]}")
    return q


H_DEEPSEEK, H_QWEN3, F_DEEPSEEK = (model_shapes.DEEPSEEK_V3_LAYER.hidden, model_shapes.QWEN3_30B_A3B_LAYER.hidden,
                                   model_shapes.DEEPSEEK_V3_LAYER.ffn)

# (shape, dtype, block): tokens of DeepSeek-V3's and Qwen3's width per 128 channels, a
# DeepSeek-V3 expert's down weight [F, H] (two experts) per 128 x 128, and tokens per 128
# tokens per channel (the weight gradient's operand).
CASES = {
    "activations_deepseek_v3_bf16": ((256, H_DEEPSEEK), jnp.bfloat16, fp8.ACTIVATION_BLOCK),
    "activations_qwen3_f32": ((512, H_QWEN3), jnp.float32, fp8.ACTIVATION_BLOCK),
    "weights_deepseek_v3_down_bf16": ((2, F_DEEPSEEK, H_DEEPSEEK), jnp.bfloat16, fp8.WEIGHT_BLOCK),
    "transposed_activations_qwen3_bf16": ((512, H_QWEN3), jnp.bfloat16, fp8.TRANSPOSED_ACTIVATION_BLOCK),
    "activations_f16": ((64, 1024), jnp.float16, fp8.ACTIVATION_BLOCK),
}


def draw(rng, shape, dtype):
    """Normal values whose rows span 2**-12 .. 2**12 in scale, so that blocks reach e4m3's
    subnormals and every exponent."""
    scale = 2.0 ** rng.integers(-12, 13, size=(*shape[:-1], 1))
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("power_of_two", [False, True], ids=["float32_scales", "power_of_two_scales"])
def test_quantize_matches_the_float64_reference(case, power_of_two, rng, seed):
    shape, dtype, block = CASES[case]
    x = draw(rng, shape, dtype)
    context = f"{case}, power_of_two={power_of_two}, seed={seed}"
    q = assert_matches_reference(x, block, context, power_of_two)
    # Every block reaches the format's range: its largest value rounds to 448 (or, with
    # power-of-two scales, lands in (224, 448] and rounds into [224, 448]).
    values, scales = as_float64(q)
    blocks = values.reshape(*shape[:-2], shape[-2] // block[0], block[0], shape[-1] // block[1], block[1])
    top = np.abs(blocks).max(axis=(-3, -1))
    if power_of_two:
        assert (top >= 224).all() and (top <= 448).all(), context
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(scales))), scales, err_msg=context)
    else:
        np.testing.assert_array_equal(top, 448.0, err_msg=context)


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
    # or half the subnormal step 2**-9 (absolute), times the block's scale.
    bound = np.maximum(np.abs(values) * 2.0 ** -4, 2.0 ** -10) * step
    assert (np.abs(got - np.asarray(x, np.float64)) <= bound).all(), f"seed={seed}"
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


@pytest.mark.parametrize("x, block, error, message", [
    (jnp.zeros((4, 100)), (1, 128), ValueError, r"x's last two dimensions \(4, 100\) must be multiples of the block \(1, 128\)"),
    (jnp.zeros((100, 128)), (128, 128), ValueError, r"\(100, 128\) must be multiples of the block \(128, 128\)"),
    (jnp.zeros((256,)), (1, 128), ValueError, r"x must have at least two dimensions .* got shape \(256,\)"),
    (jnp.zeros((4, 128), jnp.int32), (1, 128), TypeError, r"x must be float32, bfloat16 or float16, got int32"),
    (jnp.zeros((4, 128)), (0, 128), ValueError, r"block must be a pair of positive ints \(rows, columns\), got \(0, 128\)"),
    (jnp.zeros((4, 128)), [1, 128], ValueError, r"block must be a pair of positive ints .* got \[1, 128\]"),
    ([[1.0] * 128], (1, 128), TypeError, r"x must be a JAX or NumPy array, got list"),
], ids=["columns", "rows", "rank", "dtype", "zero_block", "list_block", "not_an_array"])
def test_bad_input_is_named(x, block, error, message):
    with pytest.raises(error, match=message):
        fp8.quantize(x, block)


def test_bad_options_are_named():
    with pytest.raises(TypeError, match=r"power_of_two_scales must be a bool, got 1"):
        fp8.quantize(jnp.zeros((1, 128)), power_of_two_scales=1)
    with pytest.raises(TypeError, match=r"q must be an oxmoe.fp8.BlockQuantized, got ArrayImpl"):
        fp8.dequantize(jnp.zeros((1, 128)))


def test_the_reciprocal_is_the_nearest_float32_from_any_guess_within_two_ulp(rng):
    # XLA:GPU's float32 division is up to an ulp or two off (about one quotient in seven on an H200):
    # quantize corrects it. Here every guess 2 ulp either side of NumPy's correctly rounded
    # quotient, for scales over the corrected range and scales of real blocks (amax / 448).
    scales = np.concatenate([np.exp2(rng.uniform(-100, 100, 20000)),
                             np.abs(rng.standard_normal(20000)) * np.float32(1 / 448)]).astype(np.float32)
    scales = np.concatenate([scales, np.float32([2.0 ** -100, 2.0 ** 100, 1.0, 0.75])])
    exact = np.float32(1) / scales
    bits = exact.view(np.int32)
    for step in (-2, -1, 0, 1, 2):
        guess = (bits + step).view(np.float32)
        got = np.asarray(jax.jit(fp8._reciprocal)(jnp.asarray(scales), jnp.asarray(guess)))
        np.testing.assert_array_equal(got, exact, err_msg=f"guess {step} ulp from the quotient")
    # Outside the corrected range the guess stands.
    outside = np.float32([2.0 ** -120, 2.0 ** 110])
    guess = ((np.float32(1) / outside).view(np.int32) + 1).view(np.float32)
    np.testing.assert_array_equal(np.asarray(fp8._reciprocal(jnp.asarray(outside), jnp.asarray(guess))), guess)
