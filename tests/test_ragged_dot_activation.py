"""oxmoe.grouped_gemm.ragged_dot_activation (the up projection and its activation from one
primitive: Rust on the CPU; on a Hopper GPU one tensor-core kernel that applies the activation
to each tile before it leaves, elsewhere the product then a pass over the rows) against
float64 references: the product against ragged_dot_reference.py's, the hidden activation
against the activation in float64 of the product as returned, rounded where the semantics
round (test_activation.py's hidden_reference). On the expert widths of real models and odd
ones (F not a multiple of the kernel's 128-column tiles, F not a multiple of 8, K not a
multiple of 8), every activation, three dtypes, groups across tiles, windows of groups and
rows past every group; with the rows outside the window left unwritten (zero_unused_rows=False),
the window's rows and the gradients bit for bit the default call's; its VJP against plain JAX
in float32; its errors.

With a GPU as the default device (scripts/gpu-check) the same tests check the CUDA paths;
test_full_size_up_projections_on_gpu adds the benchmark's up projections at full size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm, model_shapes
from oxmoe.activation import ACTIVATIONS, gated
from test_activation import hidden_reference
from test_ragged_dot_values import check_ragged_dot

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
HIGHEST = jax.lax.Precision.HIGHEST

# (M, K, F, G): Qwen3-30B-A3B's and DeepSeek-V3's expert widths at fewer rows; F = 200
# (two of the kernel's 128-column tiles, the second clipped: a cluster pair), F = 96 (one
# clipped tile), F = 100 (not a multiple of 8: the unfused path on a GPU); K = 72 (a
# stage past its end), K = 100 (not a multiple of 8: the generic kernel).
SHAPES = [
    (512, 256, model_shapes.QWEN3_30B_A3B_LAYER.ffn, 8),
    (384, 128, model_shapes.DEEPSEEK_V3_LAYER.ffn, 4),
    (300, 72, 200, 5),
    (257, 64, 96, 3),
    (130, 64, 100, 2),
    (200, 100, 64, 4),
]
SHAPE_IDS = [f"M{m}_K{k}_F{f}_G{g}" for m, k, f, g in SHAPES]


def draw(rng, m: int, k: int, features: int, groups: int, activation: str, dtype):
    """lhs [M, K], rhs [G, K, N] scaled so that the products spread over the activation's
    tails, Dirichlet group sizes that leave a tail of rows in no group."""
    n = 2 * features if gated(activation) else features
    lhs = checks.draw(rng, (m, k), dtype)
    rhs = np.asarray(checks.draw(rng, (groups, k, n), np.float32) * (3.0 / np.sqrt(k))).astype(checks.np_dtype(dtype))
    sizes = checks.dirichlet_sizes(rng, groups, m - m // 10)
    return lhs, rhs, sizes


def check_hidden(hidden, pre_activation, activation: str, outside, what: str):
    """hidden against the float64 activation of the returned pre-activation, and exactly zero
    in the rows outside every group of the window (``outside``, a bool per row)."""
    want, bound, *_ = hidden_reference(jnp.asarray(pre_activation), activation)
    got = np.asarray(jnp.asarray(hidden).astype(jnp.float32), np.float64)
    bad = np.abs(got - want) > bound + 1e-30
    assert not bad.any(), f"hidden, {what}: {bad.sum()} of {bad.size} off, e.g. got {got[bad][:4]} want {want[bad][:4]}"
    assert not got[outside].any(), f"hidden, {what}: rows outside the window are not zero"


@pytest.mark.parametrize("m, k, features, groups", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_the_float64_references(activation, dtype, m, k, features, groups, rng, seed):
    dtype = DTYPES[dtype]
    lhs, rhs, sizes = draw(rng, m, k, features, groups, activation, dtype)
    pre, hidden = jax.jit(grouped_gemm.ragged_dot_activation, static_argnums=3)(lhs, rhs, sizes, activation)
    what = f"{activation} {np.dtype(dtype).name} M{m} K{k} F{features} sizes {sizes.tolist()}, seed={seed}"
    assert pre.dtype == dtype and hidden.dtype == dtype
    assert hidden.shape == (m, features)
    check_ragged_dot(pre, lhs, rhs, sizes, what="pre_activation", context=what)
    check_hidden(hidden, pre, activation, ~ref.rows_in_window(m, sizes, groups), what)


@pytest.mark.parametrize("g0", [0, 2, 5], ids=lambda g: f"g0_{g}")
def test_a_window_of_groups(g0, rng, seed):
    """Local group i multiplies global group g0 + i; the rows of every other group are zero."""
    m, k, features, groups, local = 640, 128, 200, 8, 3
    lhs, rhs, sizes = draw(rng, m, k, features, groups, "swiglu", jnp.bfloat16)
    rhs = rhs[:local]
    offset = np.array([g0], np.int32)
    pre, hidden = grouped_gemm.ragged_dot_activation(lhs, rhs, sizes, "swiglu", group_offset=offset)
    what = f"window g0={g0} of sizes {sizes.tolist()}, seed={seed}"
    check_ragged_dot(pre, lhs, rhs, sizes, group_offset=offset, what="pre_activation", context=what)
    check_hidden(hidden, pre, "swiglu", ~ref.rows_in_window(m, sizes, local, offset), what)


# (M, K, F, G, g0, local groups): a window of groups 3..5 of 8 at test_a_window_of_groups'
# size, with rows of other groups before and after it; every group at Qwen3-30B-A3B's expert
# width. Either way draw's sizes leave a tenth of the rows in no group.
UNUSED_ROWS_CASES = {"window": (640, 128, 200, 8, 3, 3),
                     "rows_past_the_total": (256, 256, model_shapes.QWEN3_30B_A3B_LAYER.ffn, 8, None, 8)}


@pytest.mark.parametrize("case", UNUSED_ROWS_CASES)
def test_rows_left_unwritten_change_neither_the_window_s_rows_nor_the_gradients(case, rng, seed):
    """With zero_unused_rows=False both results' window rows are the default call's bit for bit,
    and so are the gradients (for cotangents on every row of both results); the rows outside the
    window are unspecified, and not compared."""
    m, k, features, groups, g0, local = UNUSED_ROWS_CASES[case]
    lhs, rhs, sizes = draw(rng, m, k, features, groups, "swiglu", jnp.bfloat16)
    rhs, offset = rhs[:local], None if g0 is None else np.array([g0], np.int32)
    cotangents = (checks.draw(rng, (m, 2 * features), jnp.bfloat16), checks.draw(rng, (m, features), jnp.bfloat16))

    def results_and_gradients(zero_unused_rows):
        results, vjp = jax.vjp(lambda a, b: tuple(grouped_gemm.ragged_dot_activation(
            a, b, sizes, "swiglu", group_offset=offset, zero_unused_rows=zero_unused_rows)), lhs, rhs)
        return [np.asarray(x) for x in (*results, *vjp(cotangents))]

    default, unwritten = results_and_gradients(True), results_and_gradients(False)
    covered = ref.rows_in_window(m, sizes, local, offset)
    assert covered.any() and not covered[-1] and (g0 is None or not covered[0])
    what = f"{case}: g0={g0} of sizes {sizes.tolist()}, seed={seed}"
    check_ragged_dot(default[0], lhs, rhs, sizes, group_offset=offset, what="default pre_activation", context=what)
    check_hidden(default[1], default[0], "swiglu", ~covered, what)
    for name, got, want in zip(("pre_activation", "hidden"), unwritten, default):
        checks.assert_same_bits(got[covered], want[covered], what=f"{name}'s window rows (zero_unused_rows=False)",
                                context=what)
    for name, got, want in zip(("d lhs", "d rhs"), unwritten[2:], default[2:]):
        checks.assert_same_bits(got, want, what=f"{name} through zero_unused_rows=False", context=what)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_vjp_is_plain_jax_s_in_float32(activation, rng, seed):
    """Cotangents for both results, through the product and the activation, against plain
    JAX's VJP of the same function (jax.lax.ragged_dot at HIGHEST precision, jax.nn's
    activations), in float32."""
    m, k, features, groups = 256, 64, 96, 4
    lhs, rhs, sizes = draw(rng, m, k, features, groups, activation, jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    grad_pre = jnp.asarray(rng.standard_normal((m, rhs.shape[2])), jnp.float32)
    grad_hidden = jnp.asarray(rng.standard_normal((m, features)), jnp.float32)

    def plain(a, b):
        u = jax.lax.ragged_dot(a, b, sizes, precision=HIGHEST)
        if gated(activation):
            gate, up = jnp.split(u, 2, axis=1)
            return u, jax.nn.silu(gate) * up if activation == "swiglu" else jax.nn.gelu(gate, approximate=True) * up
        return u, jax.nn.silu(u) if activation == "silu" else jax.nn.gelu(u, approximate=True)

    def fused(a, b):
        return tuple(grouped_gemm.ragged_dot_activation(a, b, sizes, activation))

    _, fused_vjp = jax.vjp(fused, jnp.asarray(lhs), jnp.asarray(rhs))
    _, plain_vjp = jax.vjp(plain, jnp.asarray(lhs), jnp.asarray(rhs))
    for name, got, want in zip(("lhs", "rhs"), fused_vjp((grad_pre, grad_hidden)), plain_vjp((grad_pre, grad_hidden))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale, err_msg=f"d {name}, {activation}, seed={seed}")


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((jnp.zeros((4, 8)), jnp.zeros((2, 8, 6)), jnp.array([2, 2])), {"activation": "relu"}, ValueError,
     r"activation must be one of \('swiglu', 'geglu', 'gelu', 'silu'\), got 'relu'"),
    ((jnp.zeros((4, 8)), jnp.zeros((2, 8, 7)), jnp.array([2, 2])), {}, ValueError,
     r"rhs must have an even number of columns N = 2F \(\[gate, up\]\) for 'swiglu', got \(2, 8, 7\)"),
    ((jnp.zeros((4, 8)), jnp.zeros((2, 6, 8)), jnp.array([2, 2])), {}, ValueError,
     r"rhs must be \[groups, K, N\] with K = 8 \(lhs's second dimension\), got \(2, 6, 8\)"),
    ((jnp.zeros((4, 8)), jnp.zeros((2, 8, 8), jnp.bfloat16), jnp.array([2, 2])), {}, TypeError,
     r"rhs must have lhs's dtype float32, got bfloat16"),
    ((jnp.zeros((2, 4, 8)), jnp.zeros((2, 8, 8)), jnp.array([2, 2])), {}, ValueError,
     r"lhs must have shape \[M, K\], got \(2, 4, 8\)"),
    ((jnp.zeros((4, 8), jnp.int32), jnp.zeros((2, 8, 8)), jnp.array([2, 2])), {}, TypeError,
     r"lhs must be float32, bfloat16 or float16, got int32"),
    ((jnp.zeros((4, 8)), jnp.zeros((2, 8, 8)), jnp.array([2, 2, 0])), {}, ValueError,
     r"rhs.shape\[0\] \(its groups\) is 2 but group_sizes has 3 groups"),
    ((jnp.zeros((4, 8)), jnp.zeros((2, 8, 8)), jnp.array([3, 2])), {}, ValueError,
     r"group_sizes sum to 5, more than the 4 rows of lhs"),
], ids=["activation", "odd_gated_width", "k", "rhs_dtype", "lhs_rank", "int_lhs", "groups", "sizes_past_rows"])
def test_bad_input_is_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        grouped_gemm.ragged_dot_activation(*args, **kwargs)


GPUS = devices.gpu_devices()
# The benchmark's up projections (rows M = tokens x top-k, DeepSeek-V3 on one of eight
# expert-parallel ranks), with the layer's SwiGLU: rhs [G, K, 2F].
FULL_SIZE = [model_shapes.MIXTRAL_LAYER.up_gemm(), model_shapes.QWEN3_30B_A3B_LAYER.up_gemm(),
             model_shapes.DEEPSEEK_V3_LAYER.up_gemm(8)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("shape", FULL_SIZE, ids=lambda shape: shape.name.replace(" ", "_"))
def test_full_size_up_projections_on_gpu(shape, rng, seed):
    """On the GPU at full size, bfloat16: the pre-activation bit for bit ragged_dot's (the same
    products in the same order; on Hopper the fused kernel's tiles pair gate and up columns),
    every row past the groups exactly zero in both results, and the hidden activation of 512
    sampled rows against the float64 reference."""
    gpu = GPUS[0]
    m, k, features = shape.m, shape.k, shape.n
    if gpu.platform == "cpu":  # the stand-in: a fraction of the size
        m, k, features = m // 64, k // 16, features // 16
    lhs = jax.device_put(jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16), gpu)
    rhs = jax.device_put((jax.random.normal(jax.random.key(seed + 1), (shape.groups, k, 2 * features), jnp.float32)
                          * (3.0 / np.sqrt(k))).astype(jnp.bfloat16), gpu)
    sizes = checks.sizes_with_empty_groups(rng, shape.groups, m - m // 16)
    sizes_on_gpu = jax.device_put(jnp.asarray(sizes, jnp.int32), gpu)
    pre, hidden = jax.jit(grouped_gemm.ragged_dot_activation, static_argnums=3)(lhs, rhs, sizes_on_gpu, "swiglu")
    plain = jax.jit(grouped_gemm.ragged_dot)(lhs, rhs, sizes_on_gpu)
    what = f"{shape.name} M{m} K{k} F{features}, seed={seed}"
    differ = int(jnp.sum(pre != plain))
    assert differ == 0, f"pre_activation, {what}: {differ} elements differ from ragged_dot's"
    tail = int(sizes.sum())
    assert not bool(jnp.any(pre[tail:] != 0)) and not bool(jnp.any(hidden[tail:] != 0)), f"{what}: tail rows"
    rows = np.sort(rng.choice(tail, min(512, tail), replace=False))
    check_hidden(np.asarray(hidden[rows]), np.asarray(pre[rows]), "swiglu", np.zeros(rows.size, bool), what)
