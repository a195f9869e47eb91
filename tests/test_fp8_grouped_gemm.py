"""oxmoe.fp8.ragged_dot (forward, and d lhs with the weights read transposed) and
oxmoe.fp8.transposed_ragged_dot (the weight gradient, over chunks of rows) against a float64
NumPy reference of the semantics (each 128-block's products summed, scaled by both blocks'
scales, the blocks added), and against oxmoe.reference.fp8, on fresh random data:

- the expert widths of real models (Qwen3-30B-A3B's up and down projections, DeepSeek-V3's
  down projection with a window of its groups), each shape's forward and d lhs, one with a
  float32 and one with a bfloat16 output;
- windows of groups (inside, at the end of and past G), empty groups, rows past the groups
  (exactly zero), groups that straddle 128-row blocks, chunks of rows (one without rows);
- under jit with traced group sizes, without retracing;
- each bad argument, raising the error that names it; differentiating, refused.

On a GPU (marked `gpu`, skipped without one), the same products against the same float64
reference.

The error bound is ragged_dot_checks.assert_gemm_close's with K terms per element (float32
sums, two roundings to scale each block's partial, one to add it) plus FP8_BLOCK_SUM of the
products' magnitudes: the freedom the semantics leave a block's sum, which Hopper's FP8
tensor cores take (oxmoe.fp8's docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ragged_dot_checks as checks
from oxmoe import fp8, model_shapes
from oxmoe.reference import fp8 as fp8_reference
from ragged_dot_reference import Expected, local_group_rows

F32, BF16 = jnp.float32, jnp.bfloat16
QWEN3, DEEPSEEK = model_shapes.QWEN3_30B_A3B_LAYER, model_shapes.DEEPSEEK_V3_LAYER


# Hopper's FP8 tensor cores sum a block's 128 products in four 32-deep steps into an
# accumulator of about 14 bits (the DeepSeek-V3 technical report): at most 2^-13 of the
# magnitudes lost a step, 2^-11 a block (measured on an H200: 2.3e-5 at worst, of 1.5 M
# elements). One block's partial wrongly scaled is ~sqrt(128) / K of them: 3x this at
# DeepSeek-V3's K = 7168, more at smaller K.
FP8_BLOCK_SUM = 2.0**-11
# The weight gradient's contraction runs over tokens, whose magnitudes differ (these tests
# draw rows 2^-4 .. 2^4 apart), and the accumulator aligns a step's products to its largest,
# so the small ones lose more: 2.47 x 2^-11 of the magnitudes at worst on an H200 (of 25 M
# elements). A wrongly scaled block is ~sqrt(128) / rows of them, >= 0.02 for a group of
# 500 rows.
FP8_WEIGHT_GRADIENT_BLOCK_SUM = 2.0**-8


def assert_fp8_close(got, expected, out, *, what: str, context: str) -> None:
    checks.assert_gemm_close(got, expected, out, what=what, context=context, block_sum_error=FP8_BLOCK_SUM)


def assert_fp8_weight_gradient_close(got, expected, out, *, what: str, context: str) -> None:
    checks.assert_gemm_close(got, expected, out, what=what, context=context,
                             block_sum_error=FP8_WEIGHT_GRADIENT_BLOCK_SUM)


def as64(q: fp8.BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(q.values.astype(F32), np.float64), np.asarray(q.scales, np.float64)


def expected_ragged_dot(lhs, rhs, sizes, *, group_offset=None, rhs_transposed=False) -> Expected:
    """float64: each row of local group i, per 128 of K, the block's products summed, times
    lhs's row scale and rhs[i]'s block scale of each column, summed over the blocks."""
    a, a_scales = as64(lhs)
    w, w_scales = as64(rhs)
    if rhs_transposed:
        w, w_scales = w.transpose(0, 2, 1), w_scales.transpose(0, 2, 1)
    m, k = a.shape
    local, n = w.shape[0], w.shape[2]
    value, scale = np.zeros((m, n)), np.zeros((m, n))
    for i, (start, end) in enumerate(local_group_rows(m, sizes, local, group_offset)):
        for b in range(k // 128):
            ks = slice(128 * b, 128 * (b + 1))
            factor = a_scales[start:end, b, None] * np.repeat(w_scales[i, b], 128)[None]
            value[start:end] += (a[start:end, ks] @ w[i, ks]) * factor
            scale[start:end] += (np.abs(a[start:end, ks]) @ np.abs(w[i, ks])) * np.abs(factor)
    zero = np.ones((m, 1), bool)
    for start, end in local_group_rows(m, sizes, local, group_offset):
        zero[start:end] = False
    return Expected(value, scale, k, zero)


def expected_transposed(lhs_chunks, rhs_chunks, sizes, *, num_groups=None, group_offset=None) -> Expected:
    """float64: per local group, per 128-row block of each chunk, its rows' products
    summed, times both blocks' scales of each column, summed over the blocks."""
    sizes = np.asarray(sizes).reshape(len(lhs_chunks), -1)
    groups = sizes.shape[1] if num_groups is None else num_groups
    k, n = lhs_chunks[0].shape[0], rhs_chunks[0].shape[0]
    value, scale = np.zeros((groups, k, n)), np.zeros((groups, k, n))
    acc_len = np.zeros((groups, 1, 1), np.int64)
    for lhs, rhs, chunk_sizes in zip(lhs_chunks, rhs_chunks, sizes):
        # The rows [M, K] and their 128 x 1 blocks' scales [M / 128, K] of each transposed
        # operand (rhs's 128 x 128 blocks' [M / 128, N / 128] over each block's columns).
        (a, a_scales), (c, c_scales) = (tuple(x.T for x in as64(q)) for q in (lhs, rhs))
        c_scales = np.repeat(c_scales, rhs.block[0], axis=1)
        for i, (start, end) in enumerate(local_group_rows(len(a), chunk_sizes, groups, group_offset)):
            for b in range(start // 128, -(-end // 128)):
                rows = slice(max(start, 128 * b), min(end, 128 * (b + 1)))
                factor = a_scales[b][:, None] * c_scales[b][None, :]
                value[i] += (a[rows].T @ c[rows]) * factor
                scale[i] += (np.abs(a[rows]).T @ np.abs(c[rows])) * np.abs(factor)
            acc_len[i] += end - start
    return Expected(value, scale, np.maximum(acc_len, 1), acc_len == 0)


def draw(rng, shape, block, *, spread: int = 4, transpose: bool = False):
    """Normal values whose magnitude varies by 2**-spread .. 2**spread over the rows,
    quantized in ``block`` blocks (with ``transpose``, the rows' transpose: the weight
    gradient's operands are rows ``[M, C]`` as ``[C, M]`` in (1, 128) blocks)."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape[:-1] + (1,))
    return fp8.quantize(jnp.asarray(x, F32), block, transpose=transpose)


def draw_transposed(rng, shape, block=fp8.ACTIVATION_BLOCK):
    """Rows ``[M, C]`` quantized as the weight gradient takes them (its rhs may be in
    ``WEIGHT_BLOCK`` blocks too)."""
    return draw(rng, shape, block, transpose=True)


def per_column(q: fp8.BlockQuantized) -> fp8.BlockQuantized:
    """A weight gradient's rhsᵀ in 128 x 128 blocks as the same tensor in 128 x 1 blocks:
    the same values, each block's scale repeated for each of its columns."""
    return fp8.BlockQuantized(q.values, jnp.repeat(q.scales, 128, axis=0), fp8.ACTIVATION_BLOCK)


def draw_sizes(rng, rows: int, groups: int) -> np.ndarray:
    """A split of all rows but a few among the groups, about a tenth of them empty."""
    return checks.sizes_with_empty_groups(rng, groups, rows - int(rng.integers(1, 4)), fraction=0.1)


# (name, rows, K, N, groups of the weights, groups of the window or None: all): each shape's
# forward with one output dtype and its d lhs with the other.
FORWARD_SHAPES = [
    ("qwen3_up", 384, QWEN3.hidden, 2 * QWEN3.ffn, 8, None),
    ("qwen3_down", 384, QWEN3.ffn, QWEN3.hidden, 8, None),
    ("deepseek_v3_down", 256, DEEPSEEK.ffn, DEEPSEEK.hidden, 4, 2),
]
FORWARD_CASES = [(shape, rhs_transposed, out) for i, shape in enumerate(FORWARD_SHAPES)
                 for rhs_transposed, out in ((False, (F32, BF16)[i % 2]), (True, (BF16, F32)[i % 2]))]


@pytest.mark.parametrize("case", FORWARD_CASES,
                         ids=[f"{shape[0]}-{'d_lhs' if transposed else 'forward'}-{jnp.dtype(out).name}"
                              for shape, transposed, out in FORWARD_CASES])
def test_ragged_dot_on_model_widths(case, seed, rng):
    (name, m, k, n, groups, window), rhs_transposed, out = case
    local = groups if window is None else window
    lhs = draw(rng, (m, k), fp8.ACTIVATION_BLOCK)
    rhs = draw(rng, (local, n, k) if rhs_transposed else (local, k, n), fp8.WEIGHT_BLOCK)
    sizes = draw_sizes(rng, m, groups)
    offset = None if window is None else np.int32(rng.integers(0, groups - window + 1))
    got = fp8.ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed,
                         preferred_element_type=out)
    context = f"{name}, rhs_transposed={rhs_transposed}, sizes={sizes.tolist()}, offset={offset}, seed={seed}"
    expected = expected_ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed)
    assert_fp8_close(got, expected, out, what="fp8.ragged_dot", context=context)
    if out == F32:  # the plain-JAX statement of the semantics, once a shape
        semantics = fp8_reference.ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed,
                                             preferred_element_type=out)
        assert_fp8_close(semantics, expected, out, what="oxmoe.reference.fp8.ragged_dot", context=context)


@pytest.mark.parametrize("g0", [0, 3, 5, 6], ids=lambda g: f"g0_{g}")
def test_ragged_dot_window_of_groups(g0, seed, rng):
    # Three local groups of six: inside, reaching past the last group, at it, past it.
    lhs = draw(rng, (300, 256), fp8.ACTIVATION_BLOCK)
    rhs = draw(rng, (3, 256, 128), fp8.WEIGHT_BLOCK)
    sizes = draw_sizes(rng, 300, 6)
    got = fp8.ragged_dot(lhs, rhs, sizes, group_offset=np.array([g0], np.int32), preferred_element_type=F32)
    assert_fp8_close(got, expected_ragged_dot(lhs, rhs, sizes, group_offset=[g0]), F32,
                             what="fp8.ragged_dot", context=f"g0={g0}, sizes={sizes.tolist()}, seed={seed}")


# (rows of each chunk, K, N, groups, window or None, output dtype)
TRANSPOSED_CASES = [
    ((384,), QWEN3.hidden, 2 * QWEN3.ffn, 8, None, BF16),
    ((256, 128), QWEN3.ffn, QWEN3.hidden, 8, None, F32),
    ((128, 0, 256), 256, 384, 5, 3, F32),
]


@pytest.mark.parametrize("case", TRANSPOSED_CASES,
                         ids=[f"chunks{'_'.join(map(str, c[0]))}_K{c[1]}_N{c[2]}_{jnp.dtype(c[5]).name}"
                              for c in TRANSPOSED_CASES])
def test_transposed_ragged_dot_in_chunks(case, seed, rng):
    rows, k, n, groups, window, out = case
    lhs = [draw_transposed(rng, (m, k)) for m in rows]
    rhs = [draw_transposed(rng, (m, n)) for m in rows]
    sizes = np.stack([draw_sizes(rng, m, groups) if m else np.zeros(groups, np.int32) for m in rows])
    kwargs = {} if window is None else dict(num_groups=window, group_offset=np.int32(rng.integers(0, 3)))
    chunked = len(rows) > 1
    got = fp8.transposed_ragged_dot(lhs if chunked else lhs[0], rhs if chunked else rhs[0],
                                    sizes if chunked else sizes[0], preferred_element_type=out, **kwargs)
    window_kwargs = {k: ([int(v)] if k == "group_offset" else v) for k, v in kwargs.items()}
    expected = expected_transposed(lhs, rhs, sizes, **window_kwargs)
    context = f"rows {rows}, sizes={sizes.tolist()}, {kwargs}, seed={seed}"
    assert_fp8_weight_gradient_close(got, expected, out, what="fp8.transposed_ragged_dot", context=context)
    if out == F32:  # the plain-JAX statement of the semantics, once a shape
        semantics = fp8_reference.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=F32, **kwargs)
        assert_fp8_weight_gradient_close(semantics, expected, F32,
                                         what="oxmoe.reference.fp8.transposed_ragged_dot",
                                 context=context)


@pytest.mark.parametrize("case", TRANSPOSED_CASES[:2],
                         ids=[f"chunks{'_'.join(map(str, c[0]))}_K{c[1]}_N{c[2]}" for c in TRANSPOSED_CASES[:2]])
def test_transposed_ragged_dot_with_rhs_in_square_blocks(case, seed, rng):
    """rhs in 128 x 128 blocks: against float64, against the plain-JAX semantics, and bit
    for bit the product of the same tensor in 128 x 1 blocks (each scale repeated)."""
    rows, k, n, groups, _, out = case
    lhs = [draw_transposed(rng, (m, k)) for m in rows]
    rhs = [draw_transposed(rng, (m, n), fp8.WEIGHT_BLOCK) for m in rows]
    sizes = np.stack([draw_sizes(rng, m, groups) for m in rows])
    got = fp8.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=out)
    context = f"rows {rows}, sizes={sizes.tolist()}, seed={seed}"
    assert_fp8_weight_gradient_close(got, expected_transposed(lhs, rhs, sizes), out,
                                     what="fp8.transposed_ragged_dot (rhs in 128 x 128 blocks)", context=context)
    semantics = fp8_reference.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=out)
    assert_fp8_weight_gradient_close(semantics, expected_transposed(lhs, rhs, sizes), out,
                                     what="oxmoe.reference.fp8.transposed_ragged_dot (128 x 128)", context=context)
    columns = fp8.transposed_ragged_dot(lhs, [per_column(q) for q in rhs], sizes, preferred_element_type=out)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(columns), err_msg=context)


def test_under_jit_new_group_sizes_without_retracing(seed, rng):
    lhs, rhs = draw(rng, (256, 256), fp8.ACTIVATION_BLOCK), draw(rng, (4, 256, 128), fp8.WEIGHT_BLOCK)
    traces = []

    @jax.jit
    def fn(lhs, rhs, sizes):
        traces.append(1)
        return fp8.ragged_dot(lhs, rhs, sizes, preferred_element_type=F32)

    for _ in range(2):
        sizes = draw_sizes(rng, 256, 4)
        assert_fp8_close(fn(lhs, rhs, sizes), expected_ragged_dot(lhs, rhs, sizes), F32,
                                 what="jit fp8.ragged_dot", context=f"sizes={sizes.tolist()}, seed={seed}")
    assert len(traces) == 1


LHS = fp8.quantize(jnp.ones((128, 256)))
RHS = fp8.quantize(jnp.ones((2, 256, 128)), fp8.WEIGHT_BLOCK)
ROWS = fp8.quantize(jnp.ones((256, 128)))  # 128 rows of K = 256, transposed
SQUARE_ROWS = fp8.quantize(jnp.ones((128, 256)), fp8.WEIGHT_BLOCK, transpose=True)  # the same in 128 x 128 blocks
SIZES = np.array([64, 64], np.int32)
RAGGED_DOT_ERRORS = {
    "lhs_an_array": ((jnp.ones((128, 256)), RHS, SIZES), {}, TypeError,
                     r"lhs must be an oxmoe.fp8.BlockQuantized \(oxmoe.fp8.quantize's result\), got ArrayImpl"),
    "lhs_in_weight_blocks": ((fp8.quantize(jnp.ones((128, 256)), fp8.WEIGHT_BLOCK), RHS, SIZES), {}, ValueError,
                             r"lhs must be \[M, K\] quantized in \(1, 128\) blocks, got shape \[128, 256\] in "
                             r"\(128, 128\) blocks"),
    "rhs_in_row_blocks": ((LHS, fp8.quantize(jnp.ones((2, 256, 128))), SIZES), {}, ValueError,
                          r"rhs must be \[groups, K, N\] quantized in \(128, 128\) blocks"),
    "k_differs": ((LHS, fp8.quantize(jnp.ones((2, 128, 128)), fp8.WEIGHT_BLOCK), SIZES), {}, ValueError,
                  r"rhs must be \[groups, K, N\] with K = 256 \(lhs's second dimension\), got \[2, 128, 128\]"),
    "k_differs_transposed": ((LHS, RHS, SIZES), dict(rhs_transposed=True), ValueError,
                             r"rhs must be \[groups, N, K\] with K = 256"),
    "values_not_fp8": ((fp8.BlockQuantized(LHS.values.astype(F32), LHS.scales, LHS.block), RHS, SIZES), {},
                       TypeError, r"lhs.values must be float8_e4m3fn, got float32"),
    "scales_of_other_blocks": ((fp8.BlockQuantized(LHS.values, LHS.scales[:, :1], LHS.block), RHS, SIZES), {},
                               ValueError, r"lhs.scales must be float32 \[128, 2\] \(one per \(1, 128\) block"),
    "out_float8": ((LHS, RHS, SIZES), dict(preferred_element_type=jnp.float8_e4m3fn), TypeError,
                   r"preferred_element_type must be float32, bfloat16 or float16, got float8_e4m3fn"),
    "groups_of_other_weights": ((LHS, RHS, np.array([1, 1, 1], np.int32)), {}, ValueError,
                                r"rhs.shape\[0\] \(its groups\) is 2 but group_sizes has 3 groups"),
    "rows_overrun": ((LHS, RHS, np.array([100, 100], np.int32)), {}, ValueError,
                     r"group_sizes sum to 200, more than the 128 rows of lhs"),
    "rhs_transposed_an_int": ((LHS, RHS, SIZES), dict(rhs_transposed=1), ValueError,
                              r"rhs_transposed must be a bool, got 1"),
}


@pytest.mark.parametrize("case", RAGGED_DOT_ERRORS)
def test_ragged_dot_bad_argument_raises_naming_it(case):
    args, kwargs, error, match = RAGGED_DOT_ERRORS[case]
    with pytest.raises(error, match=match):
        fp8.ragged_dot(*args, **kwargs)


TRANSPOSED_ERRORS = {
    "weight_blocks": ((fp8.quantize(jnp.ones((256, 128)), fp8.WEIGHT_BLOCK), ROWS, SIZES), {}, ValueError,
                      r"lhs must be \[K, M\] quantized in \(1, 128\) blocks, got shape \[256, 128\] in \(128, 128\)"),
    "rows_differ": ((ROWS, fp8.quantize(jnp.ones((128, 256))), SIZES), {}, ValueError,
                    r"rhs must have shape \[N, M\] with M = 128 \(lhs's rows\) and N = 128, got \[128, 256\]"),
    "chunks_and_one": (([ROWS, ROWS], ROWS, np.ones((2, 2), np.int32)), {}, TypeError,
                       r"lhs and rhs must both be BlockQuantized or both sequences of chunks"),
    "chunk_of_other_k": (([ROWS, fp8.quantize(jnp.ones((128, 128)))], [ROWS, ROWS],
                          np.ones((2, 2), np.int32)), {}, ValueError, r"lhs\[1\] must have lhs\[0\]'s K = 256"),
    "sizes_of_one_chunk": (([ROWS, ROWS], [ROWS, ROWS], SIZES), {}, ValueError,
                           r"group_sizes must have shape \[chunks, num_groups\] = \[2, G\] for 2 chunks"),
    "offset_without_num_groups": ((ROWS, ROWS, SIZES), dict(group_offset=np.int32(1)), ValueError,
                                  r"num_groups \(the groups of the result\) is required with group_offset"),
    "rhs_chunks_in_two_blocks": (([ROWS, ROWS], [SQUARE_ROWS, ROWS], np.ones((2, 2), np.int32)), {}, ValueError,
                                 r"rhs\[1\] must be \[N, M\] quantized in \(128, 128\) blocks, got shape "
                                 r"\[256, 128\] in \(1, 128\) blocks"),
    "rhs_in_transposed_blocks": ((ROWS, fp8.quantize(jnp.ones((128, 256)), fp8.TRANSPOSED_ACTIVATION_BLOCK), SIZES),
                                 {}, ValueError, r"rhs must be \[N, M\] quantized in \(1, 128\) blocks"),
}


@pytest.mark.parametrize("case", TRANSPOSED_ERRORS)
def test_transposed_ragged_dot_bad_argument_raises_naming_it(case):
    args, kwargs, error, match = TRANSPOSED_ERRORS[case]
    with pytest.raises(error, match=match):
        fp8.transposed_ragged_dot(*args, **kwargs)


def test_differentiating_the_fp8_products_is_refused():
    with pytest.raises(TypeError, match=r"oxmoe.fp8.ragged_dot is not differentiable .* MoEConfig.fp8"):
        jax.grad(lambda s: fp8.ragged_dot(fp8.BlockQuantized(LHS.values, s, LHS.block), RHS, SIZES,
                                          preferred_element_type=F32).sum())(LHS.scales)
    with pytest.raises(TypeError, match=r"oxmoe.fp8.transposed_ragged_dot is not differentiable"):
        jax.grad(lambda s: fp8.transposed_ragged_dot(fp8.BlockQuantized(ROWS.values, s, ROWS.block), ROWS,
                                                     SIZES).sum())(ROWS.scales)


GPUS = devices.gpu_devices()


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("rhs_transposed", [False, True], ids=["forward", "d_lhs"])
def test_fp8_products_on_gpu_match_float64(rhs_transposed, seed, rng):
    gpu = GPUS[0]
    m, k, n, groups = 1000, QWEN3.hidden, 2 * QWEN3.ffn, 8
    lhs = draw(rng, (m, k), fp8.ACTIVATION_BLOCK)
    rhs = draw(rng, (groups, n, k) if rhs_transposed else (groups, k, n), fp8.WEIGHT_BLOCK)
    sizes = draw_sizes(rng, m, groups)
    rows = [draw_transposed(rng, (r, k)) for r in (512, 384)]
    grads = [draw_transposed(rng, (r, n)) for r in (512, 384)]
    chunk_sizes = np.stack([draw_sizes(rng, r, groups) for r in (512, 384)])

    @jax.jit
    def run(lhs, rhs, sizes, rows, grads, chunk_sizes):
        return (fp8.ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed, preferred_element_type=BF16),
                fp8.transposed_ragged_dot(rows, grads, chunk_sizes))

    out, weights = run(*jax.device_put((lhs, rhs, sizes, rows, grads, chunk_sizes), gpu))
    assert out.devices() == weights.devices() == {gpu}
    context = f"rhs_transposed={rhs_transposed}, sizes={sizes.tolist()}, seed={seed}"
    assert_fp8_close(out, expected_ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed), BF16,
                             what="GPU fp8.ragged_dot", context=context)
    assert_fp8_weight_gradient_close(weights, expected_transposed(rows, grads, chunk_sizes), F32,
                             what="GPU fp8.transposed_ragged_dot", context=context)


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("shape", [("deepseek_v3_up", DEEPSEEK.hidden, 2 * DEEPSEEK.ffn),
                                   ("qwen3_down", QWEN3.ffn, QWEN3.hidden)], ids=lambda s: s[0])
def test_fp8_weight_gradient_with_square_rhs_blocks_on_gpu(shape, seed, rng):
    """The weight gradient with rhs in 128 x 128 blocks (one rhs scale a tile on Hopper)
    against float64, and bit for bit the GPU's product of the same tensor in 128 x 1 blocks."""
    name, k, n = shape
    chunk_rows, groups = (512, 384), 8
    lhs = [draw_transposed(rng, (r, k)) for r in chunk_rows]
    rhs = [draw_transposed(rng, (r, n), fp8.WEIGHT_BLOCK) for r in chunk_rows]
    sizes = np.stack([draw_sizes(rng, r, groups) for r in chunk_rows])
    run = jax.jit(lambda lhs, rhs, sizes: fp8.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=BF16))
    got = run(*jax.device_put((lhs, rhs, sizes), GPUS[0]))
    assert got.devices() == {GPUS[0]}
    context = f"{name}, sizes={sizes.tolist()}, seed={seed}"
    assert_fp8_weight_gradient_close(got, expected_transposed(lhs, rhs, sizes), BF16,
                                     what="GPU fp8.transposed_ragged_dot (rhs in 128 x 128 blocks)", context=context)
    columns = run(*jax.device_put((lhs, [per_column(q) for q in rhs], sizes), GPUS[0]))
    np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(columns.astype(F32)), err_msg=context)


# The Hopper tensor-core kernel's cases (rhs_transposed, on sm_90a; elsewhere the SIMT
# kernel's): each model width with its window, a long contraction (DeepSeek-V3's up
# projection, 56 blocks of K), windows at and past the last group; both output dtypes.
# (name, rows, K, N, groups, window or None: all, first group of the window)
HOPPER_CASES = [
    *[(name, 1000, k, n, groups, window, 1 if window else None) for name, _, k, n, groups, window in FORWARD_SHAPES],
    ("deepseek_v3_up", 700, DEEPSEEK.hidden, 2 * DEEPSEEK.ffn, 4, None, None),
    ("window_past_the_last_group", 300, 256, 384, 6, 3, 5),
    ("window_after_the_groups", 300, 256, 128, 6, 3, 6),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("out", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=[c[0] for c in HOPPER_CASES])
def test_fp8_k_major_product_on_gpu_matches_float64(case, out, seed, rng):
    name, m, k, n, groups, window, g0 = case
    local = groups if window is None else window
    lhs = draw(rng, (m, k), fp8.ACTIVATION_BLOCK)
    rhs = draw(rng, (local, n, k), fp8.WEIGHT_BLOCK)
    sizes = draw_sizes(rng, m, groups)
    offset = None if g0 is None else np.array([g0], np.int32)
    run = jax.jit(lambda lhs, rhs, sizes, offset: fp8.ragged_dot(lhs, rhs, sizes, group_offset=offset,
                                                                 rhs_transposed=True, preferred_element_type=out))
    got = run(*jax.device_put((lhs, rhs, sizes, offset), GPUS[0]))
    assert got.devices() == {GPUS[0]}
    expected = expected_ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=True)
    assert_fp8_close(got, expected, out, what="GPU fp8.ragged_dot (K-major)",
                             context=f"{name}, sizes={sizes.tolist()}, offset={offset}, seed={seed}")
