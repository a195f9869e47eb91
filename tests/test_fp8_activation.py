"""oxmoe.fp8.activation_bwd (the oxmoe_fp8_activation_bwd primitive: Rust on the CPU, one CUDA
kernel on a GPU): the activation's backward with its results quantized as the FP8 layer's
backward takes them. Bit for bit the quantizations (oxmoe.fp8.quantize_with_transpose and
oxmoe.fp8.quantize) of oxmoe.activation.activation_bwd's results, and its row weights' gradient
against test_activation's float64 reference, on the expert widths of real models, every
activation, in float32, bfloat16 and float16, with plain and power-of-two scales, on fresh
random data (tails, padding rows of weight 0, NaNs and infinities included); and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import activation as act
from oxmoe import fp8, model_shapes
from test_activation import assert_close, draw, reference

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# The expert widths F of the benchmark's models, and one tile; rows: two blocks of 128.
WIDTHS = sorted({layer.ffn for layer in model_shapes.LAYER_SHAPES} | {128})
ROWS = 256


def quantized_composition(grad, pre, probs, activation: str, power_of_two: bool):
    """What oxmoe.fp8.activation_bwd specifies: the 16-bit results, then their quantizations."""
    g = act.activation_bwd(grad, pre, probs, activation)
    rows, rows_transposed = fp8.quantize_with_transpose(g.grad_pre_activation, power_of_two_scales=power_of_two)
    weighted = fp8.quantize(g.weighted_hidden, transpose=True, power_of_two_scales=power_of_two)
    return fp8.QuantizedActivationGrads(rows, rows_transposed, weighted, g.grad_row_probs)


def assert_same_quantization(got: fp8.BlockQuantized, want: fp8.BlockQuantized, what: str) -> None:
    assert got.block == want.block == fp8.ACTIVATION_BLOCK, what
    assert got.shape == want.shape and got.scales.shape == want.scales.shape, what
    # As float32, so that NaN values (0x7f / 0xff) compare equal to NaN values.
    np.testing.assert_array_equal(np.asarray(got.values.astype(jnp.float32)),
                                  np.asarray(want.values.astype(jnp.float32)), err_msg=f"values, {what}")
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales), err_msg=f"scales, {what}")


def assert_is_the_composition(grad, pre, probs, activation: str, power_of_two: bool, what: str) -> None:
    got = jax.jit(fp8.activation_bwd, static_argnums=3, static_argnames="power_of_two_scales")(
        grad, pre, probs, activation, power_of_two_scales=power_of_two)
    want = quantized_composition(grad, pre, probs, activation, power_of_two)
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
def test_nans_and_infinities_make_their_blocks_nan_as_quantize_does(activation, rng, seed):
    grad, pre, probs = draw(rng, ROWS, 256, activation, jnp.bfloat16)
    grad = grad.at[3, 10].set(jnp.nan).at[200, 130].set(jnp.inf)
    pre = pre.at[140, 7].set(-jnp.inf).at[50, pre.shape[1] - 1].set(jnp.nan)
    got = assert_is_the_composition(grad, pre, probs, activation, False, f"{activation}, seed={seed}")
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
], ids=["rows", "features", "pre_activation_width", "power_of_two_not_a_bool", "activation"])
def test_bad_input_is_named(shapes, kwargs, error, message):
    grad, pre, probs = (jnp.zeros(shape, F32) for shape in shapes)
    with pytest.raises(error, match=message):
        fp8.activation_bwd(grad, pre, probs, **kwargs)
