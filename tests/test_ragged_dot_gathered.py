"""oxmoe.ragged_dot and oxmoe.grouped_gemm.ragged_dot_activation with ``lhs_rows``: the
product's rows read from ``lhs`` through a row map, as a dispatch's rows from its tokens.

Against the float64 reference of the product of the gathered rows, and bit for bit against
the same call on the rows gathered first (on Hopper the producer warp copies the rows where
TMA loads the tiles: the same products in the same order). The maps are dispatches' (each
token's copies in its experts' blocks, -1 padding rows between them) and arbitrary ones
(repeated rows, indices past lhs or negative: zero rows there), on the expert widths of real
models and odd ones (K not a multiple of 8: the SIMT kernel on a GPU; N past a tile). The
gradients against float64 formulas; errors for a bad ``lhs_rows``.

With a GPU as the default device (scripts/gpu-check) the same tests check the CUDA paths;
test_full_size_gathered_up_projections_on_gpu adds the benchmark's up projections at full
size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm, model_shapes
from test_ragged_dot_values import check_ragged_dot

# (tokens, K, N, experts, top-k, alignment): Qwen3-30B-A3B's up projection and DeepSeek-V3's
# down projection at few tokens; Mixtral's up with 128-row alignment; odd widths (K = 72: a
# stage past its end; K = 100: not a multiple of 8; N = 200: a clipped second tile).
SHAPES = [
    (64, model_shapes.QWEN3_30B_A3B_LAYER.hidden, 2 * model_shapes.QWEN3_30B_A3B_LAYER.ffn, 16, 8, None),
    (48, model_shapes.DEEPSEEK_V3_LAYER.ffn, 512, 8, 8, None),
    (96, model_shapes.MIXTRAL_LAYER.hidden, 256, 8, 2, 128),
    (100, 72, 200, 5, 2, 16),
    (60, 100, 64, 4, 2, None),
]
SHAPE_IDS = [f"T{t}_K{k}_N{n}_E{e}_k{top}_align{a}" for t, k, n, e, top, a in SHAPES]


def dispatch_map(rng, tokens: int, experts: int, top_k: int, align: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A dispatch's ``(source_tokens [R], group_sizes [E])``: each token's ``top_k`` experts at
    random, each expert's tokens in token order, its block padded with -1 rows to a multiple
    of ``align``, and 16 unused rows (-1) after the last block."""
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    rows, sizes = [], []
    for e in range(experts):
        block = np.flatnonzero((chosen == e).any(axis=1))
        padded = block.size if align is None else -(-block.size // align) * align
        rows.append(np.concatenate([block, np.full(padded - block.size, -1)]))
        sizes.append(padded)
    rows.append(np.full(16, -1))
    return np.concatenate(rows).astype(np.int32), np.array(sizes, np.int32)


def gathered(lhs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``lhs[rows]``, zero rows where the index is outside lhs."""
    inside = (rows >= 0) & (rows < len(lhs))
    return np.where(inside[:, None], lhs[np.where(inside, rows, 0)], np.zeros((), lhs.dtype))


@pytest.mark.parametrize("tokens, k, n, experts, top_k, align", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype, preferred", [(jnp.bfloat16, None), (jnp.bfloat16, jnp.float32),
                                              (jnp.float32, None)], ids=["bf16", "bf16_to_f32", "f32"])
@pytest.mark.parametrize("rhs_transposed", [False, True], ids=["rhs_KN", "rhs_NK"])
def test_gathered_product_matches_the_reference_and_the_product_of_gathered_rows(
        tokens, k, n, experts, top_k, align, dtype, preferred, rhs_transposed, rng, seed):
    rows, sizes = dispatch_map(rng, tokens, experts, top_k, align)
    lhs = checks.draw(rng, (tokens, k), dtype)
    rhs = checks.draw(rng, (experts, n, k) if rhs_transposed else (experts, k, n), dtype)
    product = jax.jit(grouped_gemm.ragged_dot, static_argnames=("preferred_element_type", "rhs_transposed"))
    got = product(lhs, rhs, sizes, preferred_element_type=preferred, rhs_transposed=rhs_transposed, lhs_rows=rows)
    context = f"tokens={tokens} K={k} N={n} sizes={sizes.tolist()} seed={seed}"
    expected_rows = gathered(lhs, rows)
    check_ragged_dot(got, expected_rows, rhs, sizes, rhs_transposed=rhs_transposed, out_dtype=preferred,
                     context=context)
    plain = product(expected_rows, rhs, sizes, preferred_element_type=preferred, rhs_transposed=rhs_transposed)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain), err_msg=context)


@pytest.mark.parametrize("tokens, k, n, experts, top_k, align", SHAPES[:4], ids=SHAPE_IDS[:4])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gathered_activation_is_the_activation_of_gathered_rows(tokens, k, n, experts, top_k, align, activation,
                                                                rng, seed):
    """Both results bit for bit those of the rows gathered first, whose own tests check them
    against float64 (test_ragged_dot_activation.py); the pre-activation against float64 too."""
    rows, sizes = dispatch_map(rng, tokens, experts, top_k, align)
    lhs = checks.draw(rng, (tokens, k), jnp.bfloat16)
    rhs = (checks.draw(rng, (experts, k, n), np.float32) * (3.0 / np.sqrt(k))).astype(jnp.bfloat16)
    call = jax.jit(grouped_gemm.ragged_dot_activation, static_argnums=3)
    pre, hidden = call(lhs, rhs, sizes, activation, lhs_rows=rows)
    expected_rows = gathered(lhs, rows)
    plain_pre, plain_hidden = call(expected_rows, rhs, sizes, activation)
    context = f"tokens={tokens} K={k} N={n} sizes={sizes.tolist()} seed={seed}"
    check_ragged_dot(pre, expected_rows, rhs, sizes, context=context)
    np.testing.assert_array_equal(np.asarray(pre), np.asarray(plain_pre), err_msg=context)
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(plain_hidden), err_msg=context)


def test_row_indices_outside_lhs_read_zeros(rng, seed):
    """Repeated rows, -1, indices at and past lhs's end and below -1: zero rows where the index
    is outside lhs, within and across groups."""
    tokens, k, n = 40, 64, 128
    rows = np.array([3, 3, 0, -1, 39, 40, 1 << 30, -7, 12, 5, -2**31, 7] * 3, np.int32)
    sizes = np.array([10, 0, 20, 6], np.int32)
    lhs = checks.draw(rng, (tokens, k), jnp.bfloat16)
    rhs = checks.draw(rng, (4, k, n), jnp.bfloat16)
    got = jax.jit(grouped_gemm.ragged_dot)(lhs, rhs, sizes, lhs_rows=rows)
    check_ragged_dot(got, gathered(lhs, rows), rhs, sizes, context=f"seed={seed}")
    outside = (rows < 0) | (rows >= tokens)
    assert not np.asarray(got)[outside].any(), "rows of indices outside lhs are not zero"


@pytest.mark.parametrize("rhs_transposed", [False, True], ids=["rhs_KN", "rhs_NK"])
def test_gathered_gradients_match_float64(rhs_transposed, rng, seed):
    """d lhs: each token's copies' gradients summed (rows of -1 give nothing); d rhs: the
    transposed product of the gathered rows. Float32, against float64 formulas."""
    tokens, k, n, experts = 80, 128, 192, 8
    rows, sizes = dispatch_map(rng, tokens, experts, 2, 16)
    lhs = checks.draw(rng, (tokens, k), jnp.float32)
    rhs = checks.draw(rng, (experts, n, k) if rhs_transposed else (experts, k, n), jnp.float32)
    grad_out = checks.draw(rng, (len(rows), n), jnp.float32)

    def product(lhs, rhs):
        return grouped_gemm.ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed, lhs_rows=rows)

    _, vjp = jax.vjp(product, lhs, rhs)
    grad_lhs, grad_rhs = jax.jit(vjp)(grad_out)
    d_rows, d_rhs = ref.ragged_dot_backward(gathered(lhs, rows), rhs, sizes, grad_out, rhs_transposed=rhs_transposed)
    context = f"sizes={sizes.tolist()} seed={seed}"
    checks.assert_gemm_close(grad_rhs, d_rhs, jnp.float32, what="d rhs", context=context)
    # Each token's rows summed, value and error scale alike.
    inside = (rows >= 0) & (rows < tokens)
    value, scale = np.zeros((tokens, k)), np.zeros((tokens, k))
    np.add.at(value, rows[inside], d_rows.value[inside])
    np.add.at(scale, rows[inside], d_rows.scale[inside])
    unused = np.bincount(rows[inside], minlength=tokens) == 0
    expected = ref.Expected(value, scale, n * 2, unused[:, None])
    checks.assert_gemm_close(grad_lhs, expected, jnp.float32, what="d lhs", context=context)


@pytest.mark.parametrize("lhs_rows, error, message", [
    (np.zeros(8, np.float32), TypeError, "lhs_rows must be a one-dimensional integer array"),
    (np.zeros((8, 1), np.int32), TypeError, "lhs_rows must be a one-dimensional integer array"),
    (np.zeros(4, np.int32), ValueError, "group_sizes sum to 8, more than the 4 rows"),
    (np.array([0, 1, 2, 3, 4, 5, 6, 1 << 40]), ValueError, "lhs_rows must fit in int32"),
], ids=["float", "rank_2", "fewer_than_the_sizes", "past_int32"])
def test_bad_lhs_rows_are_named(lhs_rows, error, message):
    lhs, rhs = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 32), jnp.bfloat16)
    with pytest.raises(error, match=message):
        grouped_gemm.ragged_dot(lhs, rhs, np.array([4, 4], np.int32), lhs_rows=lhs_rows)
    with pytest.raises(error, match=message):
        grouped_gemm.ragged_dot_activation(lhs, rhs, np.array([4, 4], np.int32), lhs_rows=lhs_rows)


GPUS = devices.gpu_devices()
# The benchmark's layers on one GPU: (name, tokens, H, F, experts, top-k).
FULL_SIZE = [("mixtral", 32768, 1024, 4096, 8, 2), ("qwen3_30b_a3b", 16384, 2048, 768, 128, 8),
             ("deepseek_v3_E32", 8192, 7168, 2048, 32, 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("name, tokens, k, features, experts, top_k", FULL_SIZE, ids=[c[0] for c in FULL_SIZE])
def test_full_size_gathered_up_projections_on_gpu(name, tokens, k, features, experts, top_k, rng, seed):
    """The benchmark's layers' up projections with SwiGLU at full size, bfloat16, rows read
    through a dispatch's map of the layer's tokens: both results bit for bit those of the
    rows gathered first, every row past the groups exactly zero."""
    gpu = GPUS[0]
    if gpu.platform == "cpu":  # the stand-in: a fraction of the size
        tokens, k, features = tokens // 64, k // 16, features // 16
    rows, sizes = dispatch_map(rng, tokens, experts, top_k, None)
    lhs = jax.device_put(jax.random.normal(jax.random.key(seed), (tokens, k), jnp.bfloat16), gpu)
    rhs = jax.device_put((jax.random.normal(jax.random.key(seed + 1), (experts, k, 2 * features), jnp.float32)
                          * (3.0 / np.sqrt(k))).astype(jnp.bfloat16), gpu)
    rows_on_gpu, sizes_on_gpu = (jax.device_put(jnp.asarray(x), gpu) for x in (rows, sizes))
    call = jax.jit(grouped_gemm.ragged_dot_activation, static_argnums=3)
    pre, hidden = call(lhs, rhs, sizes_on_gpu, "swiglu", lhs_rows=rows_on_gpu)
    plain_rows = jax.jit(lambda x, r: x.at[r].get(mode="fill", fill_value=0))(lhs, rows_on_gpu)
    plain_pre, plain_hidden = call(plain_rows, rhs, sizes_on_gpu, "swiglu")
    what = f"{name} T{tokens} K{k} F{features}, seed={seed}"
    for result, got, want in (("pre_activation", pre, plain_pre), ("hidden", hidden, plain_hidden)):
        differ = int(jnp.sum(got != want))
        assert differ == 0, f"{result}, {what}: {differ} elements differ from the gathered rows' product"
    tail = int(sizes.sum())
    assert not bool(jnp.any(pre[tail:] != 0)) and not bool(jnp.any(hidden[tail:] != 0)), f"{what}: tail rows"
