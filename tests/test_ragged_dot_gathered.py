"""oxmoe.transposed_ragged_dot with its lhs rows gathered through ``lhs_rows`` (the MoE layer's
up-projection weight gradient reading the dispatched rows from their tokens): row r of the
product's lhs is ``lhs[lhs_rows[r]]``, zeros where lhs_rows is outside [0, T).

On fresh random data, with maps laid out as a dispatch lays them out (each group's rows
distinct tokens in increasing order, -1 on the padding rows that align each group, rows past
the groups), and a few rows naming tokens past T:

- the weight gradients of real models' up projections (Mixtral, Qwen3-30B-A3B, DeepSeek-V3)
  in 1 to 3 chunks, every dtype, output in the input dtype or float32: against the float64
  reference of the rows gathered in NumPy, and bit for bit against the product of the rows
  gathered first (the same kernel's sums);
- small odd shapes, windows of groups, a chunk whose token matrix is empty;
- the gradients of the tokens (each token the sum of its rows' gradients) and of rhs;
- every bad lhs_rows raising the error that names it;
- on a GPU (marked `gpu`, skipped without one): the same bit-for-bit comparison at full size
  (DeepSeek-V3 on one GPU: 8,192 tokens of 7,168, 65,536 rows, 32 groups) and at the shapes
  that take each Hopper variant (clusters of two where the column tiles pair up, one block
  where they do not, K past its last box, chunks), with rows of no token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm
from oxmoe.model_shapes import EXPERT_GEMMS

MIXTRAL_UP, QWEN3_UP, DEEPSEEK_UP, _ = EXPERT_GEMMS
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
GPUS = devices.gpu_devices()


def dispatch_map(rng, tokens: int, sizes, rows: int, *, align: int = 8, stray: int = 2) -> np.ndarray:
    """lhs_rows [rows] as a dispatch lays out its source_tokens: group g's rows are distinct
    tokens in increasing order, the last of them -1 up to a multiple of `align` (its padding,
    which `sizes` count), then -1 past the groups; `stray` rows name a token past `tokens`."""
    source = np.full(rows, -1, np.int32)
    start = 0
    for size in sizes:
        real = int(size) - int(rng.integers(0, min(align - 1, int(size)) + 1))
        source[start:start + real] = np.sort(rng.choice(tokens, min(real, tokens), replace=False))[:real] \
            if real <= tokens else rng.integers(0, tokens, real)
        start += int(size)
    if start:
        source[rng.integers(0, start, stray)] = tokens + int(rng.integers(0, 5))
    return source


def gathered(tokens, lhs_rows) -> np.ndarray:
    """The rows the product multiplies: tokens[lhs_rows[r]], zeros outside [0, T)."""
    tokens = np.asarray(tokens)
    inside = (lhs_rows >= 0) & (lhs_rows < len(tokens))
    rows = np.zeros((len(lhs_rows), tokens.shape[1]), tokens.dtype)
    rows[inside] = tokens[lhs_rows[inside]]
    return rows


def draw_case(rng, tokens, rows, k, n, groups, dtype):
    """Each chunk's tokens [T_c, K], rhs [M_c, N], sizes and lhs_rows."""
    token_chunks = [checks.draw(rng, (t, k), dtype) for t in tokens]
    rhs = [checks.draw(rng, (m, n), dtype) for m in rows]
    sizes = np.stack([checks.dirichlet_sizes(rng, groups, m - int(rng.integers(0, min(3, m) + 1))) for m in rows])
    maps = [dispatch_map(rng, t, s, m) for t, s, m in zip(tokens, sizes, rows)]
    return token_chunks, rhs, sizes.astype(np.int32), maps


def check_gathered(token_chunks, rhs, sizes, maps, *, dtype, pref=None, context, **window):
    got = grouped_gemm.transposed_ragged_dot(token_chunks, rhs, sizes, lhs_rows=maps, preferred_element_type=pref,
                                             **window)
    rows = [gathered(t, m) for t, m in zip(token_chunks, maps)]
    expected = ref.chunked_transposed_ragged_dot(rows, rhs, sizes, **window)
    checks.assert_gemm_close(got, expected, pref or dtype, what="gathered transposed_ragged_dot", context=context)
    first = grouped_gemm.transposed_ragged_dot(rows, rhs, sizes, preferred_element_type=pref, **window)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(first),
                                  err_msg=f"gathered against the rows gathered first, {context}")


# (shape, tokens of each chunk, rows of each chunk, dtype, preferred_element_type, groups)
MODEL_CASES = [
    (MIXTRAL_UP, (96,), (192,), BF16, F32, 8),
    (QWEN3_UP, (40, 0, 64), (120, 0, 150), F16, None, 12),
    (DEEPSEEK_UP, (30, 20), (100, 70), F32, None, 3),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[f"{c[0].name}-chunks{len(c[1])}-{jnp.dtype(c[3]).name}"
                                                   for c in MODEL_CASES])
def test_gathered_weight_gradient_of_model_shapes(case, seed, rng):
    shape, tokens, rows, dtype, pref, groups = case
    chunks = draw_case(rng, tokens, rows, shape.k, shape.n, groups, dtype)
    check_gathered(*chunks, dtype=dtype, pref=pref, context=f"{shape.name}, seed={seed}")


@pytest.mark.parametrize("k, n, g", [(1, 1, 1), (13, 7, 3), (72, 136, 5)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_small_odd_shapes_gathered(k, n, g, dtype, seed, rng):
    chunks = draw_case(rng, (9, 1), (33, 17), k, n, g, dtype)
    check_gathered(*chunks, dtype=dtype, context=f"K={k}, N={n}, G={g}, seed={seed}")


@pytest.mark.parametrize("g0", [0, 2, 5], ids=lambda g: f"g0_{g}")
def test_a_window_of_groups_gathered(g0, seed, rng):
    chunks = draw_case(rng, (25, 31), (80, 64), 24, 16, 6, BF16)
    window = dict(num_groups=3, group_offset=jnp.asarray(g0, jnp.int32))
    check_gathered(*chunks, dtype=BF16, context=f"g0={g0}, seed={seed}", **window)


def test_rows_of_an_empty_token_matrix_are_zeros(seed, rng):
    rhs = checks.draw(rng, (20, 16), BF16)
    out = grouped_gemm.transposed_ragged_dot(np.zeros((0, 24), BF16), rhs, np.array([8, 12], np.int32),
                                             lhs_rows=np.arange(20, dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.zeros((2, 24, 16), np.float32))


def test_gradients_of_the_tokens_and_rhs(seed, rng):
    (tokens,), (rhs,), (sizes,), (lhs_rows,) = draw_case(rng, (30,), (90,), 12, 10, 4, F32)
    grad_out = checks.draw(rng, (4, 12, 10), F32)
    _, vjp = jax.vjp(lambda a, b: grouped_gemm.transposed_ragged_dot(a, b, sizes, lhs_rows=lhs_rows), tokens, rhs)
    grad_tokens, grad_rhs = vjp(grad_out)
    rows = gathered(tokens, lhs_rows)
    expected_rows, expected_rhs = ref.transposed_ragged_dot_backward(rows, rhs, sizes, grad_out)
    context = f"sizes {sizes.tolist()}, seed={seed}"
    checks.assert_gemm_close(grad_rhs, expected_rhs, F32, what="d rhs", context=context)
    # Each token's gradient: the sum of its rows' (a token's rows are in different groups).
    inside = (lhs_rows >= 0) & (lhs_rows < len(tokens))
    expected = np.zeros(tokens.shape)
    np.add.at(expected, lhs_rows[inside], expected_rows.value[inside])
    np.testing.assert_allclose(np.asarray(grad_tokens), expected, rtol=1e-5, atol=1e-5,
                               err_msg=f"d tokens, {context}")


TOKENS, RHS = np.ones((5, 4), np.float32), np.ones((6, 3), np.float32)
SIZES, ROWS = np.array([2, 4], np.int32), np.arange(6, dtype=np.int32)
ERROR_CASES = {
    "rows_of_floats": ((TOKENS, RHS, SIZES), dict(lhs_rows=ROWS.astype(np.float32)), TypeError,
                       r"lhs_rows must be a one-dimensional integer array \[M\].*got float32\[6\]"),
    "rows_of_two_dimensions": ((TOKENS, RHS, SIZES), dict(lhs_rows=ROWS.reshape(2, 3)), TypeError,
                               r"lhs_rows must be a one-dimensional integer array \[M\].*got int32\[2, 3\]"),
    "rows_of_another_length": ((TOKENS, RHS, SIZES), dict(lhs_rows=ROWS[:5]), ValueError,
                               r"rhs must have shape \[M, N\] with M = 5 \(lhs_rows's\), got \(6, 3\)"),
    "one_map_for_chunks": (([TOKENS, TOKENS], [RHS, RHS], np.stack([SIZES, SIZES])), dict(lhs_rows=ROWS),
                           TypeError, r"lhs_rows must be a sequence of one array per chunk, as lhs is, got ndarray"),
    "maps_short_of_a_chunk": (([TOKENS, TOKENS], [RHS, RHS], np.stack([SIZES, SIZES])), dict(lhs_rows=[ROWS]),
                              ValueError, r"lhs_rows must have lhs's 2 chunks, got 1"),
    "sizes_past_the_rows": ((TOKENS, RHS[:4], SIZES), dict(lhs_rows=ROWS[:4]), ValueError,
                            r"group_sizes sum to 6, more than the 4 rows of rhs"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_a_bad_lhs_rows_raises_naming_it(case):
    args, kwargs, error, match = ERROR_CASES[case]
    with pytest.raises(error, match=match):
        grouped_gemm.transposed_ragged_dot(*args, **kwargs)


# -- on the GPU ------------------------------------------------------------------------------

@jax.jit
def _both_ways(token_chunks, rhs, sizes, maps):
    """The gathered product and the product of the rows gathered first (jnp.take)."""
    got = grouped_gemm.transposed_ragged_dot(token_chunks, rhs, sizes, lhs_rows=maps)
    rows = [jnp.take(t, jnp.where((m >= 0) & (m < len(t)), m, len(t)), axis=0, mode="fill", fill_value=0)
            if len(t) else jnp.zeros((len(m), t.shape[1]), t.dtype) for t, m in zip(token_chunks, maps)]
    return got, grouped_gemm.transposed_ragged_dot(rows, rhs, sizes)


# (tokens of each chunk, rows of each chunk, K, N, groups, dtype): clusters of two (N 1536: six
# 256-column tiles), one block (N 384: three 128-column tiles), four (N 1024), K past its last
# 64-column box (200), chunks with one of no rows and one of a single token, DeepSeek-V3 on one
# GPU (clusters of four).
GPU_CASES = [
    ((4096,), (32768,), 2048, 1536, 16, BF16),
    ((1000,), (8000,), 1024, 384, 8, F16),
    ((500,), (4000,), 512, 1024, 6, F16),
    ((300, 0, 1), (2000, 0, 700), 200, 512, 5, BF16),
    ((8192,), (65536,), 7168, 4096, 32, BF16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"T{'_'.join(map(str, c[0]))}-K{c[2]}-N{c[3]}" for c in GPU_CASES])
def test_gathered_equals_the_rows_gathered_first_on_gpu(case, gpu, seed, rng):
    tokens, rows, k, n, groups, dtype = case
    token_chunks, rhs, sizes, maps = draw_case(rng, tokens, rows, k, n, groups, dtype)
    args = jax.device_put((token_chunks, rhs, sizes, maps), gpu)
    got, first = _both_ways(*args)
    equal = jnp.all(jax.lax.bitcast_convert_type(got, jnp.uint16) == jax.lax.bitcast_convert_type(first, jnp.uint16))
    assert bool(equal), f"gathered differs from the rows gathered first, T={tokens}, K={k}, N={n}, seed={seed}"
    # And a group against float64: the rows the kernel multiplied are the map's.
    g = int(np.argmax(sizes[0]))
    start = int(sizes[0][:g].sum())
    rows_g = gathered(token_chunks[0], maps[0][start:start + sizes[0][g]]).astype(np.float64)
    expected = rows_g[:, :64].T @ np.asarray(rhs[0][start:start + sizes[0][g], :64], np.float64)
    if len(tokens) == 1:
        np.testing.assert_allclose(np.asarray(got[g, :64, :64], np.float64), expected,
                                   rtol=2e-2, atol=2e-2 * np.sqrt(sizes[0][g]),
                                   err_msg=f"group {g} against float64, seed={seed}")
