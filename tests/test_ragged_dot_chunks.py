"""oxmoe.transposed_ragged_dot over chunks of rows (the MoE layer's weight gradient when its
tokens travel in chunks): lhs and rhs given as C arrays each, group_sizes [C, G]; group g's
rows are its rows in chunk 0, then chunk 1, ..., summed into one out[g].

Against the float64 reference (ragged_dot_reference.chunked_transposed_ragged_dot, which
stacks each group's rows of every chunk), on fresh random data:

- the weight gradients of real models' expert GEMMs (Mixtral up, Qwen3-30B-A3B up,
  DeepSeek-V3 down) in 2 to 4 chunks, every dtype, output in the input dtype or float32;
- small odd shapes in the most chunks (MAX_CHUNKS), chunks without rows, chunks whose
  groups are all empty, rows past a chunk's groups, windows of groups (group_offset);
- under jit with traced sizes (no retrace for new ones), and the gradients of every chunk's
  lhs and rhs through jax.vjp;
- every bad argument raising the error that names it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm
from oxmoe.model_shapes import EXPERT_GEMMS

MIXTRAL_UP, QWEN3_UP, DEEPSEEK_UP, DEEPSEEK_DOWN = EXPERT_GEMMS
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def draw_chunks(rng, rows, k, n, groups, dtype, *, tail=True):
    """Each chunk's lhs [M_c, K], rhs [M_c, N] and sizes over `groups` groups (a few rows of a
    chunk past its groups when `tail`)."""
    lhs = [checks.draw(rng, (m, k), dtype) for m in rows]
    rhs = [checks.draw(rng, (m, n), dtype) for m in rows]
    sizes = np.stack([checks.group_size_draw(rng, ["dirichlet", "empty10"][int(rng.integers(2))], groups,
                                             m - (int(rng.integers(0, min(3, m) + 1)) if tail else 0))
                      for m in rows]) if rows else np.zeros((0, groups), np.int32)
    return lhs, rhs, sizes.astype(np.int32)


def check_chunked(out, lhs, rhs, sizes, *, dtype, context, **window):
    expected = ref.chunked_transposed_ragged_dot(lhs, rhs, sizes, **window)
    checks.assert_gemm_close(out, expected, dtype, what="chunked transposed_ragged_dot", context=context)


# (shape, rows of each chunk, dtype, preferred_element_type, groups of the window or None: all)
MODEL_CASES = [
    (MIXTRAL_UP, (192, 160), BF16, F32, None),
    (QWEN3_UP, (96, 0, 130, 64), F16, None, None),
    (DEEPSEEK_UP, (70, 90, 50), F32, None, 3),
    (DEEPSEEK_DOWN, (128, 100), BF16, None, 2),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[f"{c[0].name}-chunks{len(c[1])}-{jnp.dtype(c[2]).name}"
                                                   f"-out_{'same' if c[3] is None else 'f32'}" for c in MODEL_CASES])
def test_weight_gradient_of_model_shapes_in_chunks(case, seed, rng):
    shape, rows, dtype, pref, window = case
    groups = shape.groups if window is None else window + 4
    lhs, rhs, sizes = draw_chunks(rng, rows, shape.k, shape.n, groups, dtype)
    kwargs = {} if window is None else dict(num_groups=window, group_offset=np.int32(rng.integers(0, 5)))
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=pref, **kwargs)
    check_chunked(out, lhs, rhs, sizes, dtype=pref or dtype, context=f"{shape.name}, rows {rows}, sizes "
                  f"{sizes.tolist() if groups <= 8 else sizes.shape}, {kwargs}, seed={seed}", **kwargs)


# (rows of each chunk, K, N, G): the most chunks; empty chunks; one row; odd K and N.
SMALL_CASES = [((5, 0, 9, 1, 3, 8, 2, 4), 7, 5, 3), ((1, 1), 1, 1, 1), ((0, 0, 0), 6, 3, 2), ((33, 17), 13, 1, 4),
               ((40,), 9, 11, 5)]


@pytest.mark.parametrize("rows, k, n, g", SMALL_CASES, ids=[f"rows{'_'.join(map(str, c[0]))}_K{c[1]}_N{c[2]}_G{c[3]}"
                                                            for c in SMALL_CASES])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_small_odd_shapes_in_chunks(rows, k, n, g, dtype, seed, rng):
    lhs, rhs, sizes = draw_chunks(rng, list(rows), k, n, g, dtype)
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes)
    check_chunked(out, lhs, rhs, sizes, dtype=dtype, context=f"sizes {sizes.tolist()}, seed={seed}")


def test_a_group_empty_in_every_chunk_gives_zeros_and_one_chunk_is_the_unchunked_product(seed, rng):
    lhs, rhs, sizes = draw_chunks(rng, [30, 20], 8, 6, 4, F32)
    sizes[:, 2] = 0  # group 2: rows in no chunk
    out = np.asarray(grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes))
    assert (out[2] == 0).all()
    check_chunked(out, lhs, rhs, sizes, dtype=F32, context=f"sizes {sizes.tolist()}, seed={seed}")
    # One chunk given as a sequence is the plain product, to the bit.
    single = grouped_gemm.transposed_ragged_dot([lhs[0]], [rhs[0]], sizes[:1])
    np.testing.assert_array_equal(single, grouped_gemm.transposed_ragged_dot(lhs[0], rhs[0], sizes[0]))


@pytest.mark.parametrize("g0", [0, 2, 5, 6], ids=lambda g: f"g0_{g}")
def test_a_window_of_groups_in_chunks(g0, seed, rng):
    # Windows inside, at the end of and past the 6 groups.
    lhs, rhs, sizes = draw_chunks(rng, [50, 31, 44], 16, 24, 6, BF16)
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, num_groups=3, group_offset=np.array([g0], np.int32))
    check_chunked(out, lhs, rhs, sizes, dtype=BF16, context=f"g0={g0}, sizes {sizes.tolist()}, seed={seed}",
                  num_groups=3, group_offset=[g0])


def test_under_jit_new_sizes_without_retracing(seed, rng):
    lhs, rhs, _ = draw_chunks(rng, [64, 48], 24, 16, 5, F32)
    traces = []

    @jax.jit
    def fn(lhs, rhs, sizes):
        traces.append(1)
        return grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes)

    for _ in range(2):
        sizes = np.stack([checks.dirichlet_sizes(rng, 5, 60), checks.sizes_with_empty_groups(rng, 5, 48)])
        check_chunked(fn(lhs, rhs, sizes), lhs, rhs, sizes, dtype=F32, context=f"sizes {sizes.tolist()}, seed={seed}")
    assert len(traces) == 1


def test_gradients_of_every_chunk(seed, rng):
    # out = Σ_c (chunk c's product): each chunk's gradient is the one-chunk product's gradient.
    lhs, rhs, sizes = draw_chunks(rng, [40, 0, 27], 12, 10, 4, F32)
    grad_out = checks.draw(rng, (4, 12, 10), F32)
    _, vjp = jax.vjp(lambda a, b: grouped_gemm.transposed_ragged_dot(a, b, sizes), lhs, rhs)
    grad_lhs, grad_rhs = vjp(grad_out)
    for c, (a, b, s) in enumerate(zip(lhs, rhs, sizes)):
        expected_lhs, expected_rhs = ref.transposed_ragged_dot_backward(a, b, s, grad_out)
        context = f"chunk {c}, sizes {sizes.tolist()}, seed={seed}"
        checks.assert_gemm_close(grad_lhs[c], expected_lhs, F32, what="d lhs", context=context)
        checks.assert_gemm_close(grad_rhs[c], expected_rhs, F32, what="d rhs", context=context)


LHS, RHS = np.ones((6, 4), np.float32), np.ones((6, 3), np.float32)
SIZES = np.array([[2, 4], [1, 1]], np.int32)
ERROR_CASES = {
    "lhs_chunks_rhs_array": (([LHS, LHS], RHS, SIZES), {}, TypeError, "lhs and rhs must both be arrays or both"),
    "no_chunks": (([], [], np.zeros((0, 2), np.int32)), {}, ValueError, r"lhs must have 1 to 8 chunks, got 0"),
    "nine_chunks": (([LHS] * 9, [RHS] * 9, np.ones((9, 2), np.int32)), {}, ValueError, r"1 to 8 chunks, got 9"),
    "rhs_short_of_a_chunk": (([LHS, LHS], [RHS], SIZES), {}, ValueError, r"rhs must have lhs's 2 chunks, got 1"),
    "sizes_of_one_chunk": (([LHS, LHS], [RHS, RHS], SIZES[0]), {}, ValueError,
                           r"group_sizes must have shape \[chunks, num_groups\] = \[2, G\] for 2 chunks"),
    "sizes_of_three_chunks": (([LHS, LHS], [RHS, RHS], np.ones((3, 2), np.int32)), {}, ValueError,
                              r"\[2, G\] for 2 chunks of lhs and rhs, got \(3, 2\)"),
    "chunk_of_other_k": (([LHS, LHS[:, :3]], [RHS, RHS], SIZES), {}, ValueError,
                         r"lhs\[1\] must have shape \[M, K\] with K = 4 \(lhs\[0\]'s\), got \(6, 3\)"),
    "chunk_of_other_n": (([LHS, LHS], [RHS, RHS[:, :2]], SIZES), {}, ValueError,
                         r"rhs\[1\] must have shape \[M, N\] with M = 6 \(lhs\[1\]'s rows\) and N = 3"),
    "chunk_rows_disagree": (([LHS, LHS], [RHS, RHS[:5]], SIZES), {}, ValueError, r"rhs\[1\] must have shape \[M, N\]"),
    "chunk_of_other_dtype": (([LHS, LHS.astype(np.float16)], [RHS, RHS.astype(np.float16)], SIZES), {}, TypeError,
                             r"lhs\[1\] must have lhs\[0\]'s dtype float32, got float16"),
    "chunk_sizes_overrun": (([LHS, LHS[:1]], [RHS, RHS[:1]], SIZES), {}, ValueError,
                            r"chunk 1's sizes sum to 2, more than the 1 rows of lhs\[1\]"),
    "negative_size_in_a_chunk": (([LHS, LHS], [RHS, RHS], np.array([[2, 4], [1, -1]], np.int32)), {}, ValueError,
                                 r"group_sizes must be >= 0, got -1 at chunk 1, group 1"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_a_bad_argument_raises_naming_it(case):
    args, kwargs, error, match = ERROR_CASES[case]
    with pytest.raises(error, match=match):
        grouped_gemm.transposed_ragged_dot(*args, **kwargs)
