"""oxmoe.grouped_gemm.ragged_dot_activation_bwd (the down projection's gradient product and
the activation's backward of it from one primitive: Rust on the CPU; on a Hopper GPU one
tensor-core kernel whose epilogue applies the activation's backward to each tile of the
product, which never leaves the kernel; elsewhere the product, then the activation's pass)
against float64 references: the semantics are oxmoe.activation.activation_bwd of
ragged_dot(grad_out, rhs, rhs_transposed=True), so each result is checked against
test_activation.py's float64 reference of the activation's backward of that product as
ragged_dot returns it (checked itself against float64 by test_ragged_dot_values.py), with
its bounds. On the expert widths of real models and odd ones (F not a multiple of the
kernel's 128-column tiles, F not a multiple of 8, K not a multiple of 8), every activation,
three dtypes, groups across tiles, windows of groups and rows past every group (a product
of zero there, whose backward the kernel still writes); its errors.

With a GPU as the default device (scripts/gpu-check) the same tests check the CUDA paths;
test_full_size_down_projections_on_gpu adds the benchmark's down projections at full size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ragged_dot_checks as checks
from oxmoe import grouped_gemm, model_shapes
from oxmoe.activation import ACTIVATIONS, gated
from test_activation import assert_close, reference

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

# (M, K, F, G): Qwen3-30B-A3B's and DeepSeek-V3's expert widths at fewer rows; F = 200
# (two of the kernel's 128-column tiles, the second clipped: a cluster pair), F = 96 (one
# clipped tile), F = 100 (not a multiple of 8: the unfused path on a GPU); K = 72 (a stage
# past its end), K = 100 (not a multiple of 8: the unfused path).
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
    """grad_out [M, K]; rhs [G, F, K] scaled so that the products are about 1; the
    pre-activation spread over the activation's tails (a tenth of it past +-6); row weights,
    a tenth of them zero; Dirichlet group sizes that leave a tail of rows in no group."""
    width = 2 * features if gated(activation) else features
    grad_out = checks.draw(rng, (m, k), dtype)
    rhs = np.asarray(checks.draw(rng, (groups, features, k), np.float32) / np.sqrt(k)).astype(checks.np_dtype(dtype))
    pre = rng.standard_normal((m, width)) * 2.0
    pre[rng.random(pre.shape) < 0.1] *= 5.0
    probs = rng.random(m).astype(np.float32)
    probs[rng.random(m) < 0.1] = 0.0
    sizes = checks.dirichlet_sizes(rng, groups, m - m // 10)
    return grad_out, rhs, jnp.asarray(pre, dtype), jnp.asarray(probs), sizes


def check(got, grad_out, rhs, sizes, pre, probs, activation: str, what: str, group_offset=None):
    """Each result against the float64 activation's backward of the product ragged_dot
    returns (zero in the rows outside the window)."""
    product = grouped_gemm.ragged_dot(grad_out, rhs, sizes, group_offset=group_offset, rhs_transposed=True)
    assert got.grad_pre_activation.dtype == pre.dtype and got.weighted_hidden.dtype == pre.dtype
    assert got.weighted_hidden.shape == product.shape and got.grad_row_probs.dtype == jnp.float32
    for name, result, want in zip(got._fields, got, reference(product, pre, probs, activation)):
        assert_close(result, want, f"{name}, {what}")


@pytest.mark.parametrize("m, k, features, groups", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_the_float64_references(activation, dtype, m, k, features, groups, rng, seed):
    dtype = DTYPES[dtype]
    grad_out, rhs, pre, probs, sizes = draw(rng, m, k, features, groups, activation, dtype)
    got = jax.jit(grouped_gemm.ragged_dot_activation_bwd, static_argnums=5)(grad_out, rhs, sizes, pre, probs,
                                                                          activation)
    what = f"{activation} {np.dtype(dtype).name} M{m} K{k} F{features} sizes {sizes.tolist()}, seed={seed}"
    check(got, grad_out, rhs, sizes, pre, probs, activation, what)


@pytest.mark.parametrize("g0", [0, 2, 5], ids=lambda g: f"g0_{g}")
def test_a_window_of_groups(g0, rng, seed):
    """Local group i multiplies global group g0 + i; every other row's product is zero."""
    m, k, features, groups, local = 640, 128, 200, 8, 3
    grad_out, rhs, pre, probs, sizes = draw(rng, m, k, features, groups, "swiglu", jnp.bfloat16)
    rhs = rhs[:local]
    offset = np.array([g0], np.int32)
    got = grouped_gemm.ragged_dot_activation_bwd(grad_out, rhs, sizes, pre, probs, "swiglu", group_offset=offset)
    check(got, grad_out, rhs, sizes, pre, probs, "swiglu", f"window g0={g0} of sizes {sizes.tolist()}, seed={seed}",
          group_offset=offset)


@pytest.mark.parametrize("m, k, features", [(0, 64, 32), (96, 0, 32), (96, 64, 0)], ids=["M0", "K0", "F0"])
def test_empty_dimensions(m, k, features, rng, seed):
    """No rows: empty results. No contraction: a product of zeros, whose backward is still
    written (the weighted hidden activation is not zero). No hidden columns: the weights'
    gradients are zero sums."""
    grad_out, rhs, pre, probs, sizes = draw(rng, m, k, features, 3, "swiglu", jnp.bfloat16)
    got = grouped_gemm.ragged_dot_activation_bwd(grad_out, rhs, sizes, pre, probs, "swiglu")
    check(got, grad_out, rhs, sizes, pre, probs, "swiglu", f"M{m} K{k} F{features}, seed={seed}")


def _operands(m=4, k=8, features=6, groups=2, width=None, dtype=jnp.float32, probs_dtype=jnp.float32):
    width = 2 * features if width is None else width
    return (jnp.zeros((m, k), dtype), jnp.zeros((groups, features, k), dtype), jnp.array([2, 2]),
            jnp.zeros((m, width), dtype), jnp.zeros((m,), probs_dtype))


@pytest.mark.parametrize("args, kwargs, error, message", [
    (_operands(), {"activation": "relu"}, ValueError,
     r"activation must be one of \('swiglu', 'geglu', 'gelu', 'silu'\), got 'relu'"),
    (_operands(width=6), {}, ValueError,
     r"pre_activation must be float32\[4, 12\] for 'swiglu' with rhs \[2, 6, 8\] \(\[groups, F, K\]\), got "
     r"float32\[4, 6\]"),
    (_operands()[:1] + (jnp.zeros((2, 6, 5)),) + _operands()[2:], {}, ValueError,
     r"rhs must be \[groups, N, K\] with K = 8 \(lhs's second dimension\), got \(2, 6, 5\)"),
    (_operands()[:1] + (jnp.zeros((2, 6, 8), jnp.bfloat16),) + _operands()[2:], {}, TypeError,
     r"rhs must have grad_out's dtype float32, got bfloat16"),
    (_operands(probs_dtype=jnp.bfloat16), {}, ValueError,
     r"row_probs must be float32\[4\] \(one weight a row of grad_out\), got bfloat16\[4\]"),
    (_operands()[:2] + (jnp.array([3, 2]),) + _operands()[3:], {}, ValueError,
     r"group_sizes sum to 5, more than the 4 rows of lhs"),
], ids=["activation", "pre_activation_width", "k", "rhs_dtype", "row_probs_dtype", "sizes_past_rows"])
def test_bad_input_is_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        grouped_gemm.ragged_dot_activation_bwd(*args, **kwargs)


GPUS = devices.gpu_devices()
# The benchmark's down projections (rows M = tokens x top-k, DeepSeek-V3 on one of eight
# expert-parallel ranks), with the layer's SwiGLU: grad_out [M, H], rhs [G, F, H].
FULL_SIZE = [model_shapes.MIXTRAL_LAYER.down_gemm(), model_shapes.QWEN3_30B_A3B_LAYER.down_gemm(),
             model_shapes.DEEPSEEK_V3_LAYER.down_gemm(8)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("shape", FULL_SIZE, ids=lambda shape: shape.name.replace(" ", "_"))
def test_full_size_down_projections_on_gpu(shape, rng, seed):
    """On the GPU at full size, bfloat16: the results of 512 sampled rows, and of the last
    rows (past every group), against the float64 reference of the activation's backward of
    the product ragged_dot returns."""
    gpu = GPUS[0]
    m, features, k = shape.m, shape.k, shape.n
    if gpu.platform == "cpu":  # the stand-in: a fraction of the size
        m, k, features = m // 64, k // 16, features // 16
    keys = jax.random.split(jax.random.key(seed), 4)
    put = lambda x: jax.device_put(x, gpu)  # noqa: E731
    grad_out = put(jax.random.normal(keys[0], (m, k), jnp.bfloat16))
    rhs = put((jax.random.normal(keys[1], (shape.groups, features, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16))
    pre = put((2.0 * jax.random.normal(keys[2], (m, 2 * features), jnp.float32)).astype(jnp.bfloat16))
    probs = put(jax.random.uniform(keys[3], (m,), jnp.float32))
    sizes = checks.sizes_with_empty_groups(rng, shape.groups, m - m // 16)
    sizes_on_gpu = put(jnp.asarray(sizes, jnp.int32))
    got = jax.jit(grouped_gemm.ragged_dot_activation_bwd, static_argnums=5)(grad_out, rhs, sizes_on_gpu, pre, probs,
                                                                          "swiglu")
    product = jax.jit(grouped_gemm.ragged_dot, static_argnames="rhs_transposed")(grad_out, rhs, sizes_on_gpu,
                                                                                   rhs_transposed=True)
    tail = int(sizes.sum())
    rows = np.concatenate([np.sort(rng.choice(tail, min(512, tail), replace=False)), np.arange(tail, m)[-64:]])
    wants = reference(product[rows], pre[rows], probs[rows], "swiglu")
    what = f"{shape.name} M{m} K{k} F{features}, seed={seed}"
    for name, result, want in zip(got._fields, got, wants):
        assert_close(np.asarray(result[rows]), want, f"{name}, {what}")
