"""The experts' activation primitive (oxmoe.moe.activation), which the layer applies between
its grouped GEMMs, against float64 NumPy: SiLU, GELU (tanh approximation), SwiGLU and GeGLU
at Qwen3's and DeepSeek-V3's expert widths and at a width of no whole vector, in bfloat16 and
float32, on fresh random rows and group sizes. Rows past the groups' total are zero and not
read (NaN there changes nothing); the gradient against the float64 derivative; the gated
form's odd width is refused before anything runs. (The layer's values with it: the layer
tests against the dense reference.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe.moe import activation as expert_activation

GELU_SCALE, GELU_CUBIC = np.sqrt(2 / np.pi), 0.044715
# (gated, GELU) of each activation.
KINDS = {"silu": (False, False), "gelu": (False, True), "swiglu": (True, False), "geglu": (True, True)}
# The activation's width F: Qwen3-30B-A3B's, DeepSeek-V3's, and one no vector of 16 bytes divides.
WIDTHS = {"qwen3": 768, "deepseek_v3": 2048, "odd": 13}
# One rounding to the result's dtype, and float32 arithmetic (exp, tanh) before it; near
# GELU's tails 1 + tanh cancels in float32 (at x = -5 its slope, -5.5e-7, came out 1.1e-6).
RTOL = {jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float32): 2e-6}
ATOL = 2e-5


def reference(up: np.ndarray, gelu: bool, glu: bool):
    """(hidden, d hidden / d gate, linear half or 1, activation) in float64 of float64 rows."""
    width = up.shape[1] // 2 if glu else up.shape[1]
    x = up[:, :width]
    linear = up[:, width:] if glu else np.ones_like(x)
    if gelu:
        t = np.tanh(GELU_SCALE * (x + GELU_CUBIC * x ** 3))
        act = 0.5 * x * (1 + t)
        slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_SCALE * (1 + 3 * GELU_CUBIC * x * x)
    else:
        s = 1 / (1 + np.exp(-x))
        act, slope = x * s, s * (1 + x * (1 - s))
    return act * linear, slope, linear, act


def draw(rng, kind, width, dtype, rows=384):
    glu, _ = KINDS[kind]
    up = (rng.standard_normal((rows, 2 * width if glu else width)) * 2).astype(np.float32)
    # Random groups covering part of the rows, one negative size (counted as zero).
    sizes = rng.multinomial(rows - 100, np.ones(6) / 6).astype(np.int32)
    sizes[2] = -5
    covered = int(np.maximum(sizes, 0).sum())
    up[covered:] = np.nan  # never read
    x = jnp.asarray(up, dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64), jnp.asarray(sizes), covered


def assert_close(got, want, dtype, context):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=RTOL[jnp.dtype(dtype)], atol=ATOL, err_msg=context)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_backward_match_float64(kind, width, dtype, rng, seed):
    glu, gelu = KINDS[kind]
    x, up, sizes, covered = draw(rng, kind, WIDTHS[width], dtype)
    f = WIDTHS[width]
    context = f"{kind}, F={f}, {jnp.dtype(dtype).name}, seed={seed}"
    hidden, slope, linear, act = reference(up[:covered], gelu, glu)

    got = jax.jit(expert_activation.forward, static_argnums=2)(x, sizes, kind)
    assert got.shape == (x.shape[0], f) and got.dtype == x.dtype, context
    assert_close(got[:covered], hidden, dtype, f"{context}: hidden")
    assert not np.asarray(got[covered:].astype(jnp.float32)).any(), f"{context}: rows past the groups not zero"

    grad_hidden = jnp.asarray(rng.standard_normal((x.shape[0], f)), dtype)
    dh = np.asarray(grad_hidden.astype(jnp.float32), np.float64)[:covered]
    grad_up, again = jax.jit(expert_activation.backward, static_argnums=3)(x, grad_hidden, sizes, kind)
    assert grad_up.shape == x.shape and again.shape == got.shape, context
    want = np.concatenate([dh * linear * slope, dh * act], axis=1) if glu else dh * slope
    assert_close(grad_up[:covered], want, dtype, f"{context}: grad up")
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got), err_msg=f"{context}: hidden again")
    assert not np.asarray(grad_up[covered:].astype(jnp.float32)).any(), f"{context}: grad past the groups not zero"

    # jax.grad through `activate` is the same backward.
    _, vjp = jax.vjp(lambda u: expert_activation.activate(u, sizes, kind), x)
    np.testing.assert_array_equal(np.asarray(vjp(grad_hidden)[0]), np.asarray(grad_up), err_msg=context)


def test_groups_past_the_rows_cover_every_row(rng):
    x = jnp.asarray(rng.standard_normal((64, 2 * 32)), jnp.float32)
    got = expert_activation.forward(x, jnp.asarray([40, 50], jnp.int32), "swiglu")
    hidden, *_ = reference(np.asarray(x, np.float64), gelu=False, glu=True)
    np.testing.assert_allclose(np.asarray(got), hidden, rtol=2e-6, atol=ATOL)


def test_a_gated_activation_of_an_odd_width_is_refused():
    with pytest.raises(ValueError, match=r"up has 7 columns: the gated activation 'geglu' takes an even number"):
        expert_activation.forward(jnp.zeros((4, 7), jnp.bfloat16), jnp.asarray([4], jnp.int32), "geglu")
