"""Forward values of oxmoe.ragged_dot and oxmoe.transposed_ragged_dot (the grouped GEMM)
against the float64 reference (ragged_dot_reference.py), on fresh random data:

- the expert GEMMs of real models (Mixtral up, Qwen3-30B-A3B up, DeepSeek-V3 8-way expert
  parallel up and down) at a few hundred rows, in every dtype, both rhs layouts;
- small odd shapes (M, K, N not multiples of 8, K = 1, N = 1) in every dtype, both rhs
  layouts, output in the input dtype and in float32;
- the group structure: empty groups, one group holding every row, no rows at all, rows past
  the groups' total, windows of groups (group_offset) inside, at the end of and past G;
  empty dimensions (M, K, N or the local groups 0);
- zero_unused_rows=False (the rows outside the window left unwritten): the window's rows
  and the gradients bit for bit the default call's;
- under jit with group sizes and group offset traced (clamped there: negative sizes,
  totals past M, offsets outside [0, G]) and without recompiling for new sizes; under vmap;
  inside shard_map with the experts split over eight devices.

Every result must lie within the float32-accumulation error bound of the reference
(checks.assert_gemm_close: |got - ref| <= eps_out |ref| + 4 eps32 sqrt(n) (|lhs| @ |rhs|)), and
every row (ragged_dot) or group (transposed_ragged_dot) outside the groups of the window must
be exactly zero (unless the call leaves such rows unwritten).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import devices
import oxmoe
import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm
from oxmoe.model_shapes import EXPERT_GEMMS

MIXTRAL_UP, QWEN3_UP, DEEPSEEK_UP, DEEPSEEK_DOWN = EXPERT_GEMMS

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
DTYPE_PARAMS = pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
LAYOUTS = pytest.mark.parametrize("rhs_transposed", [False, True], ids=["rhs_KN", "rhs_NK"])


def out_dtype_of(dtype, preferred_element_type):
    return checks.np_dtype(dtype if preferred_element_type is None else preferred_element_type)


def draw_rhs(rng, num_local: int, k: int, n: int, dtype, rhs_transposed: bool) -> np.ndarray:
    return checks.draw(rng, (num_local, n, k) if rhs_transposed else (num_local, k, n), dtype)


def check_ragged_dot(out, lhs, rhs, group_sizes, *, group_offset=None, rhs_transposed=False, out_dtype=None,
                     what="ragged_dot", context=""):
    expected = ref.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset, rhs_transposed=rhs_transposed)
    checks.assert_gemm_close(out, expected, out_dtype or lhs.dtype, what=what, context=context)
    return expected


def check_transposed(out, lhs, rhs, group_sizes, *, num_groups=None, group_offset=None, out_dtype=None,
                     what="transposed_ragged_dot", context=""):
    expected = ref.transposed_ragged_dot(lhs, rhs, group_sizes, num_groups=num_groups, group_offset=group_offset)
    checks.assert_gemm_close(out, expected, out_dtype or lhs.dtype, what=what, context=context)
    return expected


def describe(sizes) -> str:
    sizes = np.asarray(sizes).tolist()
    return f"group_sizes={sizes}" if len(sizes) <= 16 else f"group_sizes={sizes[:16]}... (G={len(sizes)})"


def offset_array(g0) -> np.ndarray | None:
    return None if g0 is None else np.array([g0], np.int32)


def test_ragged_dot_is_exported_at_the_package_level():
    assert oxmoe.ragged_dot is grouped_gemm.ragged_dot
    assert oxmoe.transposed_ragged_dot is grouped_gemm.transposed_ragged_dot


# ------------------------------------------------------------- the reference itself


def test_reference_of_a_hand_computed_example():
    # Group 0 holds row 0, group 1 (empty), group 2 rows 1..2; row 3 is in no group.
    lhs = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    rhs = np.array([[[10.0], [1.0]], [[-1.0], [-1.0]], [[100.0], [1000.0]]])  # [3, K=2, N=1]
    sizes = np.array([1, 0, 2], np.int32)
    np.testing.assert_array_equal(ref.ragged_dot(lhs, rhs, sizes).value[:, 0], [12, 4300, 6500, 0])
    np.testing.assert_array_equal(ref.ragged_dot(lhs, rhs.transpose(0, 2, 1), sizes, rhs_transposed=True).value[:, 0],
                                  [12, 4300, 6500, 0])
    np.testing.assert_array_equal(ref.ragged_dot(-lhs, rhs, sizes).scale[:, 0], [12, 4300, 6500, 0])
    # A window of groups 1..2 with weights [rhs[1], rhs[2]]; g0 = 2 gives rhs[0] to group 2
    # and rhs[1] to (nonexistent) group 3; g0 = 3 = G touches nothing.
    np.testing.assert_array_equal(ref.ragged_dot(lhs, rhs[1:], sizes, group_offset=[1]).value[:, 0],
                                  [0, 4300, 6500, 0])
    np.testing.assert_array_equal(ref.ragged_dot(lhs, rhs[:2], sizes, group_offset=[2]).value[:, 0], [0, 34, 56, 0])
    np.testing.assert_array_equal(ref.ragged_dot(lhs, rhs[:2], sizes, group_offset=[3]).value[:, 0], [0, 0, 0, 0])
    # Clamping: negative sizes count as zero, bounds stop at M, g0 clamps to [0, G].
    assert ref.group_bounds(4, [-2, 3, 5]) == [(0, 0), (0, 3), (3, 4)]
    assert ref.local_group_rows(4, [1, 1], 2, group_offset=[-5]) == [(0, 1), (1, 2)]
    assert ref.local_group_rows(4, [1, 1], 1, group_offset=[9]) == [(0, 0)]
    # transposed: group 0 = row 0's outer product, group 1 zeros, group 2 rows 1..2 summed.
    t = ref.transposed_ragged_dot(lhs, np.array([[1.0], [2.0], [3.0], [4.0]]), sizes)
    np.testing.assert_array_equal(t.value[:, :, 0], [[1, 2], [0, 0], [3 * 2 + 5 * 3, 4 * 2 + 6 * 3]])
    np.testing.assert_array_equal(t.acc_len.ravel(), [1, 0, 2])


def test_reference_error_bound_admits_float32_rounding_and_rejects_a_wrong_row(seed, rng):
    # The bound is neither vacuous nor too tight: a float32 matmul of the same data passes, a
    # result with one element changed by a bfloat16 ulp of its terms fails.
    lhs, rhs = checks.draw(rng, (64, 1000), np.float32), checks.draw(rng, (1, 1000, 32), np.float32)
    expected = ref.ragged_dot(lhs, rhs, np.array([64], np.int32))
    f32 = (lhs @ rhs[0]).astype(np.float32)
    checks.assert_gemm_close(f32, expected, np.float32, what="numpy float32 matmul", context=f"seed={seed}")
    wrong = f32.copy()
    wrong[17, 3] += np.float32(2.0**-8 * expected.scale[17, 3])
    with pytest.raises(AssertionError, match=r"\(17, 3\)"):
        checks.assert_gemm_close(wrong, expected, np.float32, what="perturbed", context="")


# --------------------------------------------------------------- real-model shapes

# (shape, rows M, dtype, rhs_transposed, preferred_element_type, group size draw, window): a
# few hundred rows at most (the CPU implementation is the plain specification), every dtype and
# both rhs layouts for each shape somewhere, float32 outputs of half inputs too. window None:
# rhs holds all G groups; an int: rhs holds that many groups, a window at a random g0 (what an
# expert-parallel shard holds). The weights of all 128 Qwen3 or 32 DeepSeek-V3 experts hold
# 200M and 470M elements, more than the CPU suite's time allows to draw, copy and check: they
# take windows (test_ragged_dot_gpu.py multiplies all of them).
MODEL_CASES = [
    (MIXTRAL_UP, 256, jnp.bfloat16, False, None, "dirichlet", None),
    (MIXTRAL_UP, 256, jnp.float16, True, jnp.float32, "empty10", None),
    (MIXTRAL_UP, 200, jnp.float32, False, None, "empty10", None),
    (QWEN3_UP, 256, jnp.bfloat16, False, None, "dirichlet", 32),
    (QWEN3_UP, 300, jnp.float16, True, jnp.float32, "empty10", 16),
    (DEEPSEEK_UP, 128, jnp.bfloat16, True, None, "dirichlet", 4),
    (DEEPSEEK_UP, 128, jnp.float32, False, None, "empty10", 2),
    (DEEPSEEK_DOWN, 128, jnp.float16, False, jnp.float32, "empty10", 4),
    (DEEPSEEK_DOWN, 128, jnp.bfloat16, True, None, "dirichlet", 2),
]


def model_case_id(case):
    shape, m, dtype, transposed, pref, draw, window = case
    return (f"{shape.name}-M{m}-{jnp.dtype(dtype).name}-{'NK' if transposed else 'KN'}"
            f"-out_{'same' if pref is None else jnp.dtype(pref).name}-{draw}"
            f"-{'all_groups' if window is None else f'window{window}'}")


def sizes_for(rng, draw_kind, num_groups, num_rows):
    """Group sizes of a draw; the empty10 draw also leaves a few rows past the total."""
    total = num_rows if draw_kind == "dirichlet" else num_rows - int(rng.integers(1, 9))
    return checks.group_size_draw(rng, draw_kind, num_groups, total)


def window_for(rng, sizes, window):
    """kwargs of a window of `window` groups at a random g0 whose groups hold rows ({} for None)."""
    if window is None:
        return {}
    starts = [g for g in range(len(sizes) - window + 1) if sizes[g:g + window].sum() > 0]
    return dict(group_offset=offset_array(int(rng.choice(starts))))


@pytest.mark.parametrize("case", MODEL_CASES, ids=[model_case_id(c) for c in MODEL_CASES])
def test_ragged_dot_on_model_shapes(case, seed, rng):
    shape, m, dtype, rhs_transposed, pref, draw_kind, window = case
    sizes = sizes_for(rng, draw_kind, shape.groups, m)
    kwargs = window_for(rng, sizes, window)
    lhs = checks.draw(rng, (m, shape.k), dtype)
    rhs = draw_rhs(rng, window or shape.groups, shape.k, shape.n, dtype, rhs_transposed)
    out = grouped_gemm.ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed, preferred_element_type=pref, **kwargs)
    context = f"{model_case_id(case)}, {describe(sizes)}, {kwargs}, seed={seed}"
    check_ragged_dot(out, lhs, rhs, sizes, rhs_transposed=rhs_transposed, out_dtype=out_dtype_of(dtype, pref),
                     context=context, **kwargs)


# transposed_ragged_dot's output is [G, K, N] (and the reference's float64 copies of it): all
# groups for Mixtral, windows of the others.
TRANSPOSED_MODEL_CASES = [
    (MIXTRAL_UP, 256, jnp.bfloat16, None, "empty10", None),
    (MIXTRAL_UP, 200, jnp.float32, None, "dirichlet", 2),
    (QWEN3_UP, 256, jnp.float16, jnp.float32, "empty10", 16),
    (DEEPSEEK_UP, 128, jnp.bfloat16, jnp.float32, "dirichlet", 2),
    (DEEPSEEK_DOWN, 128, jnp.float16, None, "empty10", 2),
]


@pytest.mark.parametrize("case", TRANSPOSED_MODEL_CASES,
                         ids=[f"{c[0].name}-M{c[1]}-{jnp.dtype(c[2]).name}-out_{'same' if c[3] is None else 'f32'}"
                              f"-{c[4]}-{'all_groups' if c[5] is None else f'window{c[5]}'}"
                              for c in TRANSPOSED_MODEL_CASES])
def test_transposed_ragged_dot_on_model_shapes(case, seed, rng):
    # The weight gradient of the model's GEMM: lhs [M, K] the activations, rhs [M, N] the
    # output's cotangent.
    shape, m, dtype, pref, draw_kind, window = case
    sizes = sizes_for(rng, draw_kind, shape.groups, m)
    kwargs = window_for(rng, sizes, window)
    if window is not None:
        kwargs["num_groups"] = window
    lhs, rhs = checks.draw(rng, (m, shape.k), dtype), checks.draw(rng, (m, shape.n), dtype)
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=pref, **kwargs)
    context = f"{shape.name}, {jnp.dtype(dtype).name}, {describe(sizes)}, {kwargs}, seed={seed}"
    check_transposed(out, lhs, rhs, sizes, out_dtype=out_dtype_of(dtype, pref), context=context, **kwargs)


# ---------------------------------------------------------------- small odd shapes

# (M, K, N, G): nothing a multiple of 8; K = 1, N = 1, K = 7; one row; more groups than rows.
SMALL_SHAPES = [(37, 7, 5, 3), (1, 1, 1, 1), (50, 1, 9, 4), (64, 13, 1, 2), (129, 65, 130, 5), (23, 300, 3, 30)]
SMALL_IDS = [f"M{m}_K{k}_N{n}_G{g}" for m, k, n, g in SMALL_SHAPES]
SMALL = pytest.mark.parametrize("m, k, n, g", SMALL_SHAPES, ids=SMALL_IDS)
# (dtype, preferred_element_type): each input dtype to itself, the half ones to float32 too.
OUT_TYPES = [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float16, None), (jnp.bfloat16, jnp.float32),
             (jnp.float16, jnp.float32)]
OUT_TYPE_PARAMS = pytest.mark.parametrize("dtype, pref", OUT_TYPES,
                                          ids=["f32", "bf16", "f16", "bf16_to_f32", "f16_to_f32"])


def random_sizes(rng, num_groups, num_rows):
    """A Dirichlet split or one with empty groups, of all rows or of a few less."""
    kind = ["dirichlet", "empty10"][int(rng.integers(2))]
    total = num_rows - int(rng.integers(0, min(4, num_rows) + 1))
    return checks.group_size_draw(rng, kind, num_groups, total)


@SMALL
@OUT_TYPE_PARAMS
@LAYOUTS
def test_ragged_dot_on_small_odd_shapes(m, k, n, g, dtype, pref, rhs_transposed, seed, rng):
    sizes = random_sizes(rng, g, m)
    lhs, rhs = checks.draw(rng, (m, k), dtype), draw_rhs(rng, g, k, n, dtype, rhs_transposed)
    out = grouped_gemm.ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed, preferred_element_type=pref)
    check_ragged_dot(out, lhs, rhs, sizes, rhs_transposed=rhs_transposed, out_dtype=out_dtype_of(dtype, pref),
                     context=f"{describe(sizes)}, seed={seed}")


@SMALL
@OUT_TYPE_PARAMS
def test_transposed_ragged_dot_on_small_odd_shapes(m, k, n, g, dtype, pref, seed, rng):
    sizes = random_sizes(rng, g, m)
    lhs, rhs = checks.draw(rng, (m, k), dtype), checks.draw(rng, (m, n), dtype)
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, preferred_element_type=pref)
    check_transposed(out, lhs, rhs, sizes, out_dtype=out_dtype_of(dtype, pref),
                     context=f"{describe(sizes)}, seed={seed}")


# ------------------------------------------------------------------ group structure

M_EDGE, K_EDGE, N_EDGE = 41, 24, 19


def edge_sizes(name: str, rng) -> np.ndarray:
    """Group sizes of 6 groups over M_EDGE = 41 rows."""
    if name == "empty_groups":
        return np.array([0, 12, 0, 0, 29, 0], np.int32)
    if name == "one_group_holds_everything":
        return np.array([0, 0, 0, M_EDGE, 0, 0], np.int32)
    if name == "first_group_holds_everything":
        return np.array([M_EDGE, 0, 0, 0, 0, 0], np.int32)
    if name == "last_group_holds_everything":
        return np.array([0, 0, 0, 0, 0, M_EDGE], np.int32)
    if name == "all_groups_empty":
        return np.zeros(6, np.int32)
    if name == "rows_past_the_total":
        return np.array([3, 0, 9, 1, 0, 5], np.int32)  # 18 of 41 rows
    if name == "single_rows":
        return np.array([1, 1, 1, 1, 1, 1], np.int32)
    if name == "dirichlet":
        return checks.dirichlet_sizes(rng, 6, M_EDGE)
    raise ValueError(name)


EDGE_CASES = ["empty_groups", "one_group_holds_everything", "first_group_holds_everything",
              "last_group_holds_everything", "all_groups_empty", "rows_past_the_total", "single_rows", "dirichlet"]


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@LAYOUTS
def test_ragged_dot_group_structure(case, dtype, rhs_transposed, seed, rng):
    sizes = edge_sizes(case, rng)
    lhs, rhs = checks.draw(rng, (M_EDGE, K_EDGE), dtype), draw_rhs(rng, 6, K_EDGE, N_EDGE, dtype, rhs_transposed)
    out = grouped_gemm.ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed)
    expected = check_ragged_dot(out, lhs, rhs, sizes, rhs_transposed=rhs_transposed,
                                context=f"{case}, {describe(sizes)}, seed={seed}")
    if case == "all_groups_empty":
        assert expected.zero.all()


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_transposed_ragged_dot_group_structure(case, dtype, seed, rng):
    # Empty groups give exactly zero [K, N] blocks.
    sizes = edge_sizes(case, rng)
    lhs, rhs = checks.draw(rng, (M_EDGE, K_EDGE), dtype), checks.draw(rng, (M_EDGE, N_EDGE), dtype)
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes)
    check_transposed(out, lhs, rhs, sizes, context=f"{case}, {describe(sizes)}, seed={seed}")


# Degenerate sizes: no rows, nothing to contract, no columns, no local groups. (M, K, N,
# G_local, g0 or None), G = 4 groups.
EMPTY_DIMENSION_CASES = {
    "no_rows": (0, 8, 5, 4, None),
    "no_contraction": (6, 0, 5, 4, None),
    "no_columns": (6, 8, 0, 4, None),
    "no_local_groups": (6, 8, 5, 0, 1),
}


@pytest.mark.parametrize("case", EMPTY_DIMENSION_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_empty_dimensions(case, dtype, seed, rng):
    m, k, n, g_local, g0 = EMPTY_DIMENSION_CASES[case]
    sizes = checks.dirichlet_sizes(rng, 4, m)
    lhs, grad = checks.draw(rng, (m, k), dtype), checks.draw(rng, (m, n), dtype)
    rhs = draw_rhs(rng, g_local, k, n, dtype, False)
    offset = offset_array(g0)
    context = f"{case}, {describe(sizes)}, seed={seed}"
    out = grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset)
    check_ragged_dot(out, lhs, rhs, sizes, group_offset=offset, context=context)
    t = grouped_gemm.transposed_ragged_dot(lhs, grad, sizes, num_groups=g_local, group_offset=offset)
    check_transposed(t, lhs, grad, sizes, num_groups=g_local, group_offset=offset, context=context)


# ------------------------------------------------------------ windows (group_offset)

G_WIN, G_LOCAL = 8, 3
# g0: the first groups, the middle, the last three exactly, windows reaching past G (two, one,
# no group left), and g0 = G.
WINDOW_OFFSETS = [0, 2, 5, 6, 7, 8]


def window_sizes(rng, num_rows: int) -> np.ndarray:
    """8 groups, two of them empty, totalling a few rows less than num_rows."""
    return checks.sizes_with_empty_groups(rng, G_WIN, num_rows - 3, fraction=0.25)


@pytest.mark.parametrize("g0", WINDOW_OFFSETS, ids=lambda g: f"g0_{g}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@LAYOUTS
def test_ragged_dot_with_a_window_of_groups(g0, dtype, rhs_transposed, seed, rng):
    m = 97
    sizes = window_sizes(rng, m)
    lhs, rhs = checks.draw(rng, (m, 40), dtype), draw_rhs(rng, G_LOCAL, 40, 33, dtype, rhs_transposed)
    out = grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset_array(g0), rhs_transposed=rhs_transposed)
    expected = check_ragged_dot(out, lhs, rhs, sizes, group_offset=[g0], rhs_transposed=rhs_transposed,
                                context=f"g0={g0}, {describe(sizes)}, seed={seed}")
    if g0 == G_WIN:
        assert expected.zero.all()


@pytest.mark.parametrize("g0", WINDOW_OFFSETS, ids=lambda g: f"g0_{g}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_transposed_ragged_dot_with_a_window_of_groups(g0, dtype, seed, rng):
    # Local groups past G give zero blocks.
    m = 97
    sizes = window_sizes(rng, m)
    lhs, rhs = checks.draw(rng, (m, 40), dtype), checks.draw(rng, (m, 33), dtype)
    out = grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, num_groups=G_LOCAL, group_offset=offset_array(g0))
    check_transposed(out, lhs, rhs, sizes, num_groups=G_LOCAL, group_offset=[g0],
                     context=f"g0={g0}, {describe(sizes)}, seed={seed}")


@pytest.mark.parametrize("form", ["scalar", "array1", "jax_scalar"])
def test_group_offset_as_a_scalar_or_a_one_element_array(form, seed, rng):
    m, g0 = 60, 2
    sizes = window_sizes(rng, m)
    offset = {"scalar": np.int32(g0), "array1": np.array([g0], np.int32),
              "jax_scalar": jnp.asarray(g0, jnp.int32)}[form]
    lhs, rhs = checks.draw(rng, (m, 16), jnp.float32), draw_rhs(rng, G_LOCAL, 16, 8, jnp.float32, False)
    out = grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset)
    check_ragged_dot(out, lhs, rhs, sizes, group_offset=[g0], context=f"{form}, {describe(sizes)}, seed={seed}")
    grad_rhs = checks.draw(rng, (m, 8), jnp.float32)
    t = grouped_gemm.transposed_ragged_dot(lhs, grad_rhs, sizes, num_groups=G_LOCAL, group_offset=offset)
    check_transposed(t, lhs, grad_rhs, sizes, num_groups=G_LOCAL, group_offset=[g0], context=f"{form}, seed={seed}")


def test_a_full_window_at_offset_zero_equals_no_offset(seed, rng):
    m = 80
    sizes = checks.dirichlet_sizes(rng, G_WIN, m)
    lhs, rhs = checks.draw(rng, (m, 32), jnp.bfloat16), draw_rhs(rng, G_WIN, 32, 24, jnp.bfloat16, False)
    plain = np.asarray(grouped_gemm.ragged_dot(lhs, rhs, sizes))
    windowed = np.asarray(grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset_array(0)))
    np.testing.assert_array_equal(windowed.view(np.uint16), plain.view(np.uint16), err_msg=f"seed={seed}")


# ------------------------------------- rows outside the window left unwritten (zero_unused_rows)

# 91 of 97 rows in 8 groups; (g0, local groups, dtype, preferred_element_type): a window of
# groups 2..4 (rows 23..55), with rows of other groups before and after it, and every group,
# which leaves rows 91..97 in none.
UNUSED_ROWS_SIZES = np.array([9, 14, 0, 21, 11, 17, 0, 19], np.int32)
UNUSED_ROWS_CASES = {"window": (2, G_LOCAL, jnp.bfloat16, None),
                     "rows_past_the_total": (None, G_WIN, jnp.float16, jnp.float32)}


@pytest.mark.parametrize("case", UNUSED_ROWS_CASES)
@LAYOUTS
def test_rows_left_unwritten_change_neither_the_window_s_rows_nor_the_gradients(case, rhs_transposed, seed, rng):
    """With zero_unused_rows=False the window's rows are the default call's bit for bit (and
    within the reference's bound), and so are d lhs (zero outside the window) and d rhs; the
    rows outside the window are unspecified, and not compared."""
    m, k, n, sizes = 97, 40, 33, UNUSED_ROWS_SIZES
    g0, local, dtype, pref = UNUSED_ROWS_CASES[case]
    offset = offset_array(g0)
    lhs, rhs = checks.draw(rng, (m, k), dtype), draw_rhs(rng, local, k, n, dtype, rhs_transposed)
    dout = checks.draw(rng, (m, n), out_dtype_of(dtype, pref))

    def forward_and_vjp(zero_unused_rows):
        out, vjp = jax.vjp(lambda a, b: grouped_gemm.ragged_dot(
            a, b, sizes, group_offset=offset, rhs_transposed=rhs_transposed, preferred_element_type=pref,
            zero_unused_rows=zero_unused_rows), lhs, rhs)
        return (np.asarray(out), *map(np.asarray, vjp(dout)))

    (default, *default_grads), (out, *grads) = forward_and_vjp(True), forward_and_vjp(False)
    covered = ref.rows_in_window(m, sizes, local, offset)
    assert covered.any() and not covered.all()
    context = f"{case}, {describe(sizes)}, g0={g0}, seed={seed}"
    expected = check_ragged_dot(default, lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed,
                                out_dtype=out_dtype_of(dtype, pref), what="default ragged_dot", context=context)
    what = "ragged_dot(zero_unused_rows=False)'s window rows"
    checks.assert_gemm_close(out[covered], expected.rows(covered), out_dtype_of(dtype, pref), what=what,
                             context=context)
    checks.assert_same_bits(out[covered], default[covered], what=what, context=context)
    e_lhs, e_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, dout.astype(lhs.dtype), group_offset=offset,
                                           rhs_transposed=rhs_transposed)
    for name, got, want, expected in zip(("d lhs", "d rhs"), grads, default_grads, (e_lhs, e_rhs)):
        checks.assert_gemm_close(got, expected, dtype, what=f"{name} through zero_unused_rows=False", context=context)
        checks.assert_same_bits(got, want, what=f"{name} through zero_unused_rows=False", context=context)


@pytest.mark.parametrize("zero_unused_rows", [False, True])
def test_zero_unused_rows_reaches_the_handlers_as_an_attribute(zero_unused_rows):
    lhs, rhs, sizes = jnp.zeros((4, 8)), jnp.zeros((2, 8, 6)), jnp.array([2, 2], jnp.int32)
    for fn in (grouped_gemm.ragged_dot, grouped_gemm.ragged_dot_activation):
        text = jax.jit(functools.partial(fn, zero_unused_rows=zero_unused_rows)).lower(lhs, rhs, sizes).as_text()
        assert f"zero_unused_rows = {str(zero_unused_rows).lower()}" in text, f"{fn.__name__}: {text}"


def test_zero_unused_rows_must_be_a_bool():
    lhs, rhs = jnp.zeros((4, 8)), jnp.zeros((2, 8, 6))
    with pytest.raises(ValueError, match=r"zero_unused_rows must be a bool, got 0"):
        grouped_gemm.ragged_dot(lhs, rhs, jnp.array([2, 2]), zero_unused_rows=0)
    with pytest.raises(ValueError, match=r"zero_unused_rows must be a bool, got None"):
        grouped_gemm.ragged_dot_activation(lhs, rhs, jnp.array([2, 2]), zero_unused_rows=None)


# ---------------------------------------------------------------------------- jit


def test_under_jit_with_traced_group_sizes_and_offset_without_retracing(seed, rng):
    # One trace serves every group_sizes and group_offset value (they are device data).
    m, k, n = 90, 48, 20
    traces = []

    @jax.jit
    def fn(lhs, rhs, rhs_window, grad, sizes, offset):
        traces.append(1)
        return (grouped_gemm.ragged_dot(lhs, rhs, sizes),
                grouped_gemm.ragged_dot(lhs, rhs_window, sizes, group_offset=offset, rhs_transposed=True),
                grouped_gemm.transposed_ragged_dot(lhs, grad, sizes, num_groups=G_LOCAL, group_offset=offset))

    lhs, grad = checks.draw(rng, (m, k), jnp.float16), checks.draw(rng, (m, n), jnp.float16)
    rhs, rhs_window = draw_rhs(rng, G_WIN, k, n, jnp.float16, False), draw_rhs(rng, G_LOCAL, k, n, jnp.float16, True)
    for call in range(4):
        sizes = random_sizes(rng, G_WIN, m)
        g0 = int(rng.integers(0, G_WIN + 1))
        full, window, t = fn(lhs, rhs, rhs_window, grad, sizes, offset_array(g0))
        context = f"call {call}, g0={g0}, {describe(sizes)}, seed={seed}"
        check_ragged_dot(full, lhs, rhs, sizes, context=context)
        check_ragged_dot(window, lhs, rhs_window, sizes, group_offset=[g0], rhs_transposed=True, context=context)
        check_transposed(t, lhs, grad, sizes, num_groups=G_LOCAL, group_offset=[g0], context=context)
    assert len(traces) == 1, f"traced {len(traces)} times for 4 calls with new group sizes"


# The jit path clamps instead of raising: (group_sizes over 6 groups and 41 rows, g0).
CLAMP_CASES = {
    "negative_sizes": ([5, -3, 10, -100, 7, 2], 0),
    "sum_past_m": ([10, 20, 15, 30, 1, 4], 0),  # group 2 cut at row 41, groups 3.. empty
    "one_size_past_m": ([2, 1000, 3, 0, 0, 1], 0),
    "huge_sizes": ([2**31 - 1, 2**31 - 1, 5, 0, 0, 1], 0),  # their sum overflows int32
    "offset_negative": ([5, 6, 7, 8, 9, 6], -4),
    "offset_past_g": ([5, 6, 7, 8, 9, 6], 9),
    "negative_sizes_in_a_window": ([4, -5, 11, 3, -1, 20], 2),
}


@pytest.mark.parametrize("case", CLAMP_CASES)
def test_under_jit_out_of_range_sizes_and_offsets_are_clamped(case, seed, rng):
    sizes, g0 = CLAMP_CASES[case]
    sizes = np.array(sizes, np.int32)
    lhs = checks.draw(rng, (M_EDGE, K_EDGE), jnp.float32)
    rhs, grad = draw_rhs(rng, 4, K_EDGE, N_EDGE, jnp.float32, False), checks.draw(rng, (M_EDGE, N_EDGE), jnp.float32)

    @jax.jit
    def fn(lhs, rhs, grad, sizes, offset):
        return (grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset),
                grouped_gemm.transposed_ragged_dot(lhs, grad, sizes, num_groups=4, group_offset=offset))

    out, t = fn(lhs, rhs, grad, sizes, offset_array(g0))
    context = f"{case}: {describe(sizes)}, g0={g0}, seed={seed}"
    check_ragged_dot(out, lhs, rhs, sizes, group_offset=[g0], context=context)
    check_transposed(t, lhs, grad, sizes, num_groups=4, group_offset=[g0], context=context)


def test_under_jit_without_offset_negative_and_overlong_sizes_are_clamped(seed, rng):
    sizes = np.array([7, -2, 30, 25, 0, 9], np.int32)  # ends at 7, 7, 37, 41 (cut), 41, 41
    lhs = checks.draw(rng, (M_EDGE, K_EDGE), jnp.bfloat16)
    rhs, grad = draw_rhs(rng, 6, K_EDGE, N_EDGE, jnp.bfloat16, True), checks.draw(rng, (M_EDGE, N_EDGE), jnp.bfloat16)
    out = jax.jit(lambda *a: grouped_gemm.ragged_dot(*a, rhs_transposed=True))(lhs, rhs, sizes)
    check_ragged_dot(out, lhs, rhs, sizes, rhs_transposed=True, context=f"{describe(sizes)}, seed={seed}")
    t = jax.jit(grouped_gemm.transposed_ragged_dot)(lhs, grad, sizes)
    check_transposed(t, lhs, grad, sizes, context=f"{describe(sizes)}, seed={seed}")


# --------------------------------------------------------------------------- vmap

BATCH = 3


@LAYOUTS
def test_ragged_dot_under_vmap_over_lhs_equals_each_element(rhs_transposed, seed, rng):
    m, k, n, g = 70, 33, 40, 5
    sizes = random_sizes(rng, g, m)
    lhs = checks.draw(rng, (BATCH, m, k), jnp.bfloat16)
    rhs = draw_rhs(rng, g, k, n, jnp.bfloat16, rhs_transposed)
    fn = lambda x: grouped_gemm.ragged_dot(x, rhs, sizes, rhs_transposed=rhs_transposed,  # noqa: E731
                                           preferred_element_type=jnp.float32)
    batched = np.asarray(jax.vmap(fn)(lhs))
    assert batched.shape == (BATCH, m, n)
    for b in range(BATCH):
        context = f"batch element {b}, {describe(sizes)}, seed={seed}"
        check_ragged_dot(batched[b], lhs[b], rhs, sizes, rhs_transposed=rhs_transposed, out_dtype=np.float32,
                         what="vmap ragged_dot", context=context)
        one = np.asarray(fn(lhs[b]))
        check_ragged_dot(one, lhs[b], rhs, sizes, rhs_transposed=rhs_transposed, out_dtype=np.float32,
                         what="ragged_dot of the element", context=context)
        np.testing.assert_allclose(batched[b], one, rtol=2e-6, atol=1e-6, err_msg=context)


def test_ragged_dot_under_vmap_over_lhs_and_group_sizes(seed, rng):
    # Each batch element with its own sizes and offset (a batched device computation).
    m, k, n = 50, 16, 12
    sizes = np.stack([random_sizes(rng, G_WIN, m) for _ in range(BATCH)])
    offsets = np.array([[0], [4], [G_WIN - 1]], np.int32)
    lhs = checks.draw(rng, (BATCH, m, k), jnp.float32)
    rhs = draw_rhs(rng, G_LOCAL, k, n, jnp.float32, False)
    out = jax.vmap(lambda x, s, o: grouped_gemm.ragged_dot(x, rhs, s, group_offset=o))(lhs, sizes, offsets)
    for b in range(BATCH):
        check_ragged_dot(np.asarray(out)[b], lhs[b], rhs, sizes[b], group_offset=offsets[b], what="vmap ragged_dot",
                         context=f"batch element {b}, {describe(sizes[b])}, g0={offsets[b, 0]}, seed={seed}")


def test_transposed_ragged_dot_under_vmap_over_lhs(seed, rng):
    m, k, n, g = 70, 20, 24, 4
    sizes = random_sizes(rng, g, m)
    lhs, rhs = checks.draw(rng, (BATCH, m, k), jnp.float16), checks.draw(rng, (m, n), jnp.float16)
    out = jax.vmap(lambda x: grouped_gemm.transposed_ragged_dot(x, rhs, sizes))(lhs)
    assert out.shape == (BATCH, g, k, n)
    for b in range(BATCH):
        check_transposed(np.asarray(out)[b], lhs[b], rhs, sizes, what="vmap transposed_ragged_dot",
                         context=f"batch element {b}, {describe(sizes)}, seed={seed}")


# ------------------------------------------------ experts sharded over eight devices

SHARDS, G_SHARDED = 8, 32
G_PER_SHARD = G_SHARDED // SHARDS


def expert_mesh():
    return jax.make_mesh((SHARDS,), ("experts",), devices=devices.mesh_devices(SHARDS))


def shard_offset():
    """This shard's first group: shard index * groups per shard, as int32 [1]."""
    return (jax.lax.axis_index("experts") * G_PER_SHARD).astype(jnp.int32).reshape(1)


@LAYOUTS
def test_ragged_dot_inside_shard_map_with_experts_sharded(rhs_transposed, seed, rng):
    # Expert parallelism: each of 8 shards holds 4 of 32 experts' weights and multiplies the
    # rows of its own groups (group_offset = shard index * 4); every other row is zero, so the
    # shards' outputs sum to the whole ragged_dot.
    m, k, n = 200, 64, 48
    sizes = checks.sizes_with_empty_groups(rng, G_SHARDED, m - 5)
    lhs = checks.draw(rng, (m, k), jnp.bfloat16)
    rhs = draw_rhs(rng, G_SHARDED, k, n, jnp.bfloat16, rhs_transposed)
    mesh = expert_mesh()

    def per_shard(lhs, rhs_local, sizes):
        out = grouped_gemm.ragged_dot(lhs, rhs_local, sizes, group_offset=shard_offset(), rhs_transposed=rhs_transposed,
                                      preferred_element_type=jnp.float32)
        return out[None], jax.lax.psum(out, "experts")

    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("experts"), P()),
                               out_specs=(P("experts"), P())))
    rhs_sharded = jax.device_put(rhs, NamedSharding(mesh, P("experts")))
    per_shard_out, total = fn(lhs, rhs_sharded, sizes)
    per_shard_out = np.asarray(per_shard_out)
    for s in range(SHARDS):
        local = rhs[s * G_PER_SHARD:(s + 1) * G_PER_SHARD]
        check_ragged_dot(per_shard_out[s], lhs, local, sizes, group_offset=[s * G_PER_SHARD],
                         rhs_transposed=rhs_transposed, out_dtype=np.float32, what=f"shard {s}'s ragged_dot",
                         context=f"{describe(sizes)}, seed={seed}")
    check_ragged_dot(total, lhs, rhs, sizes, rhs_transposed=rhs_transposed, out_dtype=np.float32,
                     what="sum over the shards", context=f"{describe(sizes)}, seed={seed}")


def test_transposed_ragged_dot_inside_shard_map_with_experts_sharded(seed, rng):
    # The weight gradient of expert parallelism: each shard sums its 4 groups' outer products;
    # concatenated they are the whole transposed_ragged_dot.
    m, k, n = 200, 40, 56
    sizes = checks.sizes_with_empty_groups(rng, G_SHARDED, m - 2)
    lhs, rhs = checks.draw(rng, (m, k), jnp.float32), checks.draw(rng, (m, n), jnp.float32)

    def per_shard(lhs, rhs, sizes):
        return grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, num_groups=G_PER_SHARD, group_offset=shard_offset())

    fn = jax.jit(jax.shard_map(per_shard, mesh=expert_mesh(), in_specs=(P(), P(), P()), out_specs=P("experts")))
    check_transposed(fn(lhs, rhs, sizes), lhs, rhs, sizes, what="shard_map transposed_ragged_dot",
                     context=f"{describe(sizes)}, seed={seed}")
