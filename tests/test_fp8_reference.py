"""oxmoe.reference.fp8.ragged_dot (the block-scaled FP8 grouped GEMM's semantics) against
float64 NumPy on Qwen3's expert widths, fresh random data and group sizes with empty groups
and rows past the groups; and its errors. (oxmoe.fp8's kernels are checked against float64
NumPy and this reference in test_fp8_grouped_gemm.py.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import fp8, model_shapes
from oxmoe.reference import fp8 as fp8_reference

H, F = model_shapes.QWEN3_30B_A3B_LAYER.hidden, model_shapes.QWEN3_30B_A3B_LAYER.ffn
# (rows, K, N, experts): Qwen3's up projection [H, 2F] and down projection [F, H].
CASES = {"qwen3_up": (512, H, 2 * F, 8), "qwen3_down": (512, F, H, 8)}


def expected(lhs: fp8.BlockQuantized, rhs: fp8.BlockQuantized, sizes: np.ndarray) -> np.ndarray:
    """float64: per row of group g and per 128 of K, the block's products summed, times both
    scales, summed over the blocks; zero past the groups."""
    a = np.asarray(lhs.values.astype(jnp.float32), np.float64)
    b = np.asarray(rhs.values.astype(jnp.float32), np.float64)
    a_scales, b_scales = np.asarray(lhs.scales, np.float64), np.asarray(rhs.scales, np.float64)
    m, k = a.shape
    out = np.zeros((m, b.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        for block in range(k // 128):
            ks = slice(128 * block, 128 * (block + 1))
            partial = a[rows, ks] @ b[g, ks]
            out[rows] += partial * a_scales[rows, block, None] * np.repeat(b_scales[g, block], 128)[None]
        start += size
    return out


def draw_sizes(rng, rows: int, experts: int) -> np.ndarray:
    """Group sizes summing to 7/8 of the rows, one group empty."""
    cuts = np.sort(rng.integers(0, rows * 7 // 8 + 1, experts - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [rows * 7 // 8]]))
    sizes[rng.integers(experts)] = 0
    return sizes.astype(np.int32)


@pytest.mark.parametrize("case", CASES)
def test_fp8_ragged_dot_matches_float64(case, rng, seed):
    m, k, n, experts = CASES[case]
    # Rows and weights whose scales vary over blocks by 2**-6 .. 2**6.
    x = rng.standard_normal((m, k)) * 2.0 ** rng.integers(-6, 7, (m, 1))
    w = rng.standard_normal((experts, k, n)) * 2.0 ** rng.integers(-6, 7, (experts, 1, n)) / np.sqrt(k)
    lhs = fp8.quantize(jnp.asarray(x, jnp.bfloat16), fp8.ACTIVATION_BLOCK)
    rhs = fp8.quantize(jnp.asarray(w, jnp.bfloat16), fp8.WEIGHT_BLOCK)
    sizes = draw_sizes(rng, m, experts)
    want = expected(lhs, rhs, sizes)
    got = np.asarray(fp8_reference.ragged_dot(lhs, rhs, jnp.asarray(sizes), preferred_element_type=jnp.float32),
                     np.float64)
    context = f"{case}, sizes={sizes.tolist()}, seed={seed}"
    # float32 sums of exact products within a block, float32 accumulation over the blocks.
    scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=2e-6, err_msg=context)
    assert (got[sizes.sum():] == 0).all(), context
    bf16 = fp8_reference.ragged_dot(lhs, rhs, jnp.asarray(sizes))
    assert bf16.dtype == jnp.bfloat16, context
    np.testing.assert_array_equal(np.asarray(bf16, np.float32), np.asarray(jnp.asarray(got, jnp.float32)
                                                                           .astype(jnp.bfloat16), np.float32))


def test_fp8_ragged_dot_errors_name_the_operand():
    lhs = fp8.quantize(jnp.ones((4, 256)))
    rhs = fp8.quantize(jnp.ones((2, 256, 128)), fp8.WEIGHT_BLOCK)
    sizes = jnp.array([2, 2], jnp.int32)
    with pytest.raises(TypeError,
                       match=r"lhs must be an oxmoe.fp8.BlockQuantized \(oxmoe.fp8.quantize's result\), got ArrayImpl"):
        fp8_reference.ragged_dot(jnp.ones((4, 256)), rhs, sizes)
    with pytest.raises(ValueError, match=r"lhs must be \[M, K\] quantized in \(1, 128\) blocks, got shape "
                                         r"\[128, 256\] in \(128, 128\) blocks"):
        fp8_reference.ragged_dot(fp8.quantize(jnp.ones((128, 256)), fp8.WEIGHT_BLOCK), rhs, sizes)
    with pytest.raises(ValueError, match=r"rhs must be \[G, K, N\] quantized in \(128, 128\) blocks"):
        fp8_reference.ragged_dot(lhs, fp8.quantize(jnp.ones((2, 256, 128))), sizes)
    with pytest.raises(ValueError, match=r"lhs's K \(256\) and rhs's K \(128\) differ"):
        fp8_reference.ragged_dot(lhs, fp8.quantize(jnp.ones((2, 128, 128)), fp8.WEIGHT_BLOCK), sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be integers \[G\], got float32\[2\]"):
        fp8_reference.ragged_dot(lhs, rhs, jnp.array([2.0, 2.0]))
