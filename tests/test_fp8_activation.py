"""oxmoe.fp8.activation_bwd and oxmoe.fp8.activation (the oxmoe_fp8_activation_bwd and
oxmoe_fp8_activation primitives: Rust on the CPU, one CUDA kernel each on a GPU): the
activation's backward with its results quantized as the FP8 layer's backward takes them, and
the forward's hidden activation quantized as its down projection takes it. Bit for bit the
quantizations (oxmoe.fp8.quantize_with_transpose and oxmoe.fp8.quantize) of
oxmoe.activation.activation_bwd's results; the row weights' gradient, and the forward's
dequantized values, against test_activation's float64 reference; on the expert widths of real
models, every activation, in float32, bfloat16 and float16, with plain and power-of-two scales,
on fresh random data (tails, padding rows of weight 0, NaNs and infinities included); and their
errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import activation as act
from oxmoe import fp8, model_shapes
from test_activation import EPS32, assert_close, draw, hidden_reference, reference

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The expert widths F of the benchmark's models, and one tile; rows: two blocks of 128.
WIDTHS = sorted({layer.ffn for layer in model_shapes.LAYER_SHAPES} | {128})
ROWS = 256


def quantized_composition(grad, pre, probs, activation: str, power_of_two: bool, block=fp8.ACTIVATION_BLOCK):
    """What oxmoe.fp8.activation_bwd specifies: the 16-bit results, then their quantizations
    (the gradient's transpose in ``block`` blocks)."""
    g = act.activation_bwd(grad, pre, probs, activation)
    rows = fp8.quantize(g.grad_pre_activation, power_of_two_scales=power_of_two)
    rows_transposed = fp8.quantize(g.grad_pre_activation, block, transpose=True, power_of_two_scales=power_of_two)
    weighted = fp8.quantize(g.weighted_hidden, transpose=True, power_of_two_scales=power_of_two)
    return fp8.QuantizedActivationGrads(rows, rows_transposed, weighted, g.grad_row_probs)


def assert_same_quantization(got: fp8.BlockQuantized, want: fp8.BlockQuantized, what: str) -> None:
    assert got.block == want.block, what
    assert got.shape == want.shape and got.scales.shape == want.scales.shape, what
    # As float32, so that NaN values (0x7f / 0xff) compare equal to NaN values.
    np.testing.assert_array_equal(np.asarray(got.values.astype(jnp.float32)),
                                  np.asarray(want.values.astype(jnp.float32)), err_msg=f"values, {what}")
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales), err_msg=f"scales, {what}")


def assert_is_the_composition(grad, pre, probs, activation: str, power_of_two: bool, what: str,
                              block=fp8.ACTIVATION_BLOCK) -> None:
    got = jax.jit(fp8.activation_bwd, static_argnums=3,
                  static_argnames=("power_of_two_scales", "grad_transposed_block"))(
        grad, pre, probs, activation, power_of_two_scales=power_of_two, grad_transposed_block=block)
    want = quantized_composition(grad, pre, probs, activation, power_of_two, block)
    assert got.grad_pre_activation_transposed.block == block, what
    for name in ("grad_pre_activation", "grad_pre_activation_transposed", "weighted_hidden_transposed"):
        assert_same_quantization(getattr(got, name), getattr(want, name), f"{name}, {what}")
    assert got.grad_row_probs.dtype == jnp.float32
    return got


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scales", "power_of_two"])
@pytest.mark.parametrize("features", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", act.ACTIVATIONS)
def test_the_quantized_results_are_those_of_activation_bwd(activation, dtype, features, power_of_two, rng, seed):
    dtype = DTYPES[dtype]
    grad, pre, probs = draw(rng, ROWS, features, activation, dtype)
    what = f"{activation} {np.dtype(dtype).name} [{ROWS}, {features}], seed={seed}"
    got = assert_is_the_composition(grad, pre, probs, activation, power_of_two, what)
    # The row weights' gradient is a float32 sum whose order the backends choose: against float64.
    *_, sums = reference(grad, pre, probs, activation)
    assert_close(got.grad_row_probs, sums, f"grad_row_probs, {what}")


@pytest.mark.parametrize("activation", act.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_gradient_transposed_in_square_blocks_is_its_quantization(activation, dtype, rng, seed):
    """grad_transposed_block=WEIGHT_BLOCK: the transposed gradient is quantize(g, WEIGHT_BLOCK,
    transpose=True) bit for bit (the other results as before), at each model width."""
    for i, features in enumerate(WIDTHS):
        grad, pre, probs = draw(rng, ROWS, features, activation, DTYPES[dtype])
        what = f"{activation} {dtype} [{ROWS}, {features}], 128 x 128, seed={seed}"
        assert_is_the_composition(grad, pre, probs, activation, i % 2 == 1, what, fp8.WEIGHT_BLOCK)


@pytest.mark.parametrize("block", [fp8.ACTIVATION_BLOCK, fp8.WEIGHT_BLOCK], ids=["128x1", "128x128"])
@pytest.mark.parametrize("activation", act.ACTIVATIONS)
def test_nans_and_infinities_make_their_blocks_nan_as_quantize_does(activation, block, rng, seed):
    grad, pre, probs = draw(rng, ROWS, 256, activation, jnp.bfloat16)
    grad = grad.at[3, 10].set(jnp.nan).at[200, 130].set(jnp.inf)
    pre = pre.at[140, 7].set(-jnp.inf).at[50, pre.shape[1] - 1].set(jnp.nan)
    got = assert_is_the_composition(grad, pre, probs, activation, False, f"{activation}, seed={seed}", block)
    assert np.isnan(np.asarray(got.grad_pre_activation.scales)).any()


def test_padding_rows_of_weight_zero_give_zero_blocks(rng):
    """A dispatch's padding rows (weight 0): every gradient of theirs is 0, scale 1."""
    grad, pre, probs = draw(rng, ROWS, 128, "swiglu", jnp.bfloat16)
    probs = probs.at[128:].set(0.0)
    got = fp8.activation_bwd(grad, pre, probs)
    np.testing.assert_array_equal(np.asarray(got.grad_pre_activation.values[128:].astype(jnp.float32)), 0.0)
    np.testing.assert_array_equal(np.asarray(got.grad_pre_activation.scales[128:]), 1.0)
    np.testing.assert_array_equal(np.asarray(got.weighted_hidden_transposed.scales[:, 1]), 1.0)


def test_is_not_differentiated(rng):
    grad, pre, probs = draw(rng, 128, 128, "swiglu", jnp.float32)

    def loss(grad, pre):
        q = fp8.activation_bwd(grad, pre, probs)
        return jnp.sum(fp8.dequantize(q.grad_pre_activation)) + jnp.sum(q.grad_row_probs)

    for g in jax.grad(loss, argnums=(0, 1))(grad, pre):
        np.testing.assert_array_equal(np.asarray(g), 0.0)


F32 = jnp.float32


@pytest.mark.parametrize("shapes, kwargs, error, message", [
    (((100, 128), (100, 256), (100,)), {}, ValueError,
     r"grad_hidden must be \[R, F\] with R and F multiples of 128 .* got \[100, 128\]"),
    (((128, 64), (128, 128), (128,)), {}, ValueError, r"multiples of 128 .* got \[128, 64\]"),
    (((128, 128), (128, 128), (128,)), {}, ValueError, r"pre_activation must be float32\[128, 256\] for 'swiglu'"),
    (((128, 128), (128, 256), (128,)), {"power_of_two_scales": 1}, ValueError,
     r"power_of_two_scales must be a bool, got 1"),
    (((128, 128), (128, 256), (128,)), {"activation": "relu"}, ValueError, r"activation must be one of"),
    (((128, 128), (128, 256), (128,)), {"grad_transposed_block": fp8.TRANSPOSED_ACTIVATION_BLOCK}, ValueError,
     r"grad_transposed_block must be ACTIVATION_BLOCK \(1, 128\) or WEIGHT_BLOCK \(128, 128\), got \(128, 1\)"),
], ids=["rows", "features", "pre_activation_width", "power_of_two_not_a_bool", "activation", "grad_block"])
def test_bad_input_is_named(shapes, kwargs, error, message):
    grad, pre, probs = (jnp.zeros(shape, F32) for shape in shapes)
    with pytest.raises(error, match=message):
        fp8.activation_bwd(grad, pre, probs, **kwargs)


# -- the forward: oxmoe.fp8.activation ------------------------------------------------------

#: Rows of the forward's draws: two tiles of 128 and a partial one.
FORWARD_ROWS = 300


def hidden_quantized(pre, activation: str, power_of_two: bool) -> fp8.BlockQuantized:
    """What oxmoe.fp8.activation specifies: the hidden activation (activation_bwd's weighted
    hidden activation of rows of weight 1), quantized in 1 x 128 blocks."""
    rows, width = pre.shape
    features = width // 2 if act.gated(activation) else width
    hidden = act.activation_bwd(jnp.zeros((rows, features), pre.dtype), pre, jnp.ones((rows,), jnp.float32),
                                activation).weighted_hidden
    return fp8.quantize(hidden, fp8.ACTIVATION_BLOCK, power_of_two_scales=power_of_two)


@pytest.mark.parametrize("power_of_two", [False, True], ids=["scales", "power_of_two"])
@pytest.mark.parametrize("features", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", act.ACTIVATIONS)
def test_the_forward_is_the_quantized_hidden_activation(activation, dtype, features, power_of_two, rng, seed):
    dtype = DTYPES[dtype]
    _, pre, _ = draw(rng, FORWARD_ROWS, features, activation, dtype)
    what = f"{activation} {np.dtype(dtype).name} [{FORWARD_ROWS}, {features}], seed={seed}"
    got = jax.jit(fp8.activation, static_argnums=1, static_argnames="power_of_two_scales")(
        pre, activation, power_of_two_scales=power_of_two)
    assert_same_quantization(got, hidden_quantized(pre, activation, power_of_two), what)
    # Against float64: each value within the FP8 rounding (half an ulp: 2^-4 of a normal value,
    # 2^-10 of the block's scale below e4m3's normal range) of the hidden activation, itself
    # within its float32 evaluation's bound.
    hidden, hidden_error, *_ = hidden_reference(pre, activation)
    scales = np.repeat(np.asarray(got.scales, np.float64), 128, axis=1)
    bound = 2.0**-4 * np.abs(hidden) + 2.0**-10 * scales + 1.07 * hidden_error
    assert_close(fp8.dequantize(got), (hidden, bound), f"values, {what}")
    # Each scale is its block's largest magnitude over 448 (rounded up to a power of two).
    amax = np.abs(hidden).reshape(FORWARD_ROWS, -1, 128).max(axis=2)
    amax_bound = hidden_error.reshape(FORWARD_ROWS, -1, 128).max(axis=2) + 2 * EPS32 * amax
    low, high = (amax - amax_bound) / fp8.E4M3_MAX, (amax + amax_bound) / fp8.E4M3_MAX
    if power_of_two:
        low, high = 2.0 ** np.ceil(np.log2(low)), 2.0 ** np.ceil(np.log2(high))
    got_scales = np.asarray(got.scales, np.float64)
    assert ((got_scales >= low * (1 - 2 * EPS32)) & (got_scales <= high * (1 + 2 * EPS32))).all(), what


@pytest.mark.parametrize("activation", act.ACTIVATIONS)
def test_the_forwards_nans_and_infinities_make_their_blocks_nan(activation, rng, seed):
    _, pre, _ = draw(rng, FORWARD_ROWS, 256, activation, jnp.bfloat16)
    # A NaN gate, an infinite up (or x), in different blocks of different rows.
    pre = pre.at[3, 10].set(jnp.nan).at[290, pre.shape[1] - 1].set(jnp.inf)
    got = fp8.activation(pre, activation)
    assert_same_quantization(got, hidden_quantized(pre, activation, False), f"{activation}, seed={seed}")
    scales = np.asarray(got.scales)
    assert np.isnan(scales[3, 0]) and np.isnan(scales[290, 1]), scales[[3, 290]]
    assert np.isfinite(np.delete(scales, [3, 290], axis=0)).all()


def test_the_forward_is_not_differentiated(rng):
    _, pre, _ = draw(rng, 128, 128, "swiglu", jnp.float32)
    grad = jax.grad(lambda pre: jnp.sum(fp8.dequantize(fp8.activation(pre))))(pre)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("shape, dtype, kwargs, error, message", [
    ((128, 128), F32, {}, ValueError,
     r"pre_activation must be \[R, W\] with W a multiple of 256 for 'swiglu' .* got shape \(128, 128\)"),
    ((128, 192), F32, {"activation": "gelu"}, ValueError, r"W a multiple of 128 for 'gelu' .* got shape \(128, 192\)"),
    ((2, 128, 256), F32, {}, ValueError, r"must be \[R, W\] .* got shape \(2, 128, 256\)"),
    ((128, 256), jnp.int32, {}, TypeError, r"pre_activation must be float32, bfloat16 or float16"),
    ((128, 256), F32, {"power_of_two_scales": 1}, ValueError, r"power_of_two_scales must be a bool, got 1"),
    ((128, 256), F32, {"activation": "relu"}, ValueError, r"activation must be one of"),
], ids=["width", "ungated_width", "rank", "dtype", "power_of_two_not_a_bool", "activation"])
def test_the_forwards_bad_input_is_named(shape, dtype, kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8.activation(jnp.zeros(shape, dtype), **kwargs)
