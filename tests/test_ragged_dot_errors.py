"""Every bad argument in the contract of oxmoe.ragged_dot / oxmoe.transposed_ragged_dot raises
its error type (TypeError for dtypes, ValueError for shapes and values) with a message that
names the argument (and, where it helps, the sizes involved), both on concrete arrays and
while tracing abstract ones (jax.eval_shape). The value checks (negative group sizes, sizes
summing past M, a group_offset outside [0, G]) raise only when called eagerly; under jit the
same values are clamped (test_ragged_dot_values.py checks the clamped results)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ragged_dot_checks as checks
import ragged_dot_reference as ref
from error_cases import check_raises, check_raises_while_tracing
from oxmoe import grouped_gemm

M, K, N, G, G_LOCAL = 7, 5, 6, 4, 3
LHS = jnp.zeros((M, K), jnp.float32)
RHS = jnp.zeros((G, K, N), jnp.float32)
RHS_T = jnp.zeros((G, N, K), jnp.float32)
RHS_WINDOW = jnp.zeros((G_LOCAL, K, N), jnp.float32)
SIZES = jnp.asarray([2, 0, 3, 1], jnp.int32)
OFFSET = jnp.asarray([1], jnp.int32)
GRAD = jnp.zeros((M, N), jnp.float32)  # transposed_ragged_dot's rhs


def rd(**kwargs):
    """ragged_dot(lhs, rhs, group_sizes) with keyword arguments."""
    return lambda lhs, rhs, sizes: grouped_gemm.ragged_dot(lhs, rhs, sizes, **kwargs)


def rd_offset(**kwargs):
    return lambda lhs, rhs, sizes, offset: grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset, **kwargs)


def trd(**kwargs):
    return lambda lhs, rhs, sizes: grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, **kwargs)


def trd_offset(**kwargs):
    return lambda lhs, rhs, sizes, offset: grouped_gemm.transposed_ragged_dot(lhs, rhs, sizes, group_offset=offset,
                                                                              **kwargs)


def all_of(*parts):
    """A pattern matching a message that contains every one of `parts` (regexes), in any order."""
    return "(?s)" + "".join(f"(?=.*{p})" for p in parts)


def number(n) -> str:
    return rf"(?<![\d.]){n}(?![\d.])"


# name: (function of the array arguments, array arguments, error type, pattern the message must match)
CASES = {
    # ragged_dot: dtypes
    "lhs_int32": (rd(), [LHS.astype(jnp.int32), RHS.astype(jnp.int32), SIZES], TypeError, "lhs"),
    "lhs_bool": (rd(), [LHS.astype(bool), RHS.astype(bool), SIZES], TypeError, "lhs"),
    "group_sizes_f32": (rd(), [LHS, RHS, SIZES.astype(jnp.float32)], TypeError, "group_sizes"),
    "preferred_int32": (rd(preferred_element_type=jnp.int32), [LHS, RHS, SIZES], TypeError, "preferred_element_type"),
    "rhs_int32": (rd(), [LHS, RHS.astype(jnp.int32), SIZES], TypeError, "rhs must be float32, bfloat16 or float16"),
    "preferred_f64": (rd(preferred_element_type=np.float64), [LHS, RHS, SIZES], TypeError, "preferred_element_type"),
    "precision_a_dot_algorithm": (rd(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32), [LHS, RHS, SIZES],
                                  ValueError, r"precision.*accumulate in float32 always.*BF16_BF16_F32"),
    "precision_unknown_name": (rd(precision="nonsense"), [LHS, RHS, SIZES], ValueError, r"precision.*'nonsense'"),
    "out_sharding": (rd(out_sharding=jax.sharding.PartitionSpec()), [LHS, RHS, SIZES], ValueError,
                     r"out_sharding is not supported.*None only"),
    # ragged_dot: ranks
    "lhs_rank1": (rd(), [LHS[0], RHS, SIZES], ValueError, "lhs"),
    "lhs_rank3": (rd(), [LHS[None], RHS, SIZES], ValueError, "lhs"),
    "rhs_rank2": (rd(), [LHS, RHS[0], SIZES], ValueError, "rhs"),
    "rhs_rank4": (rd(), [LHS, RHS[None], SIZES], ValueError, "rhs"),
    "group_sizes_rank0": (rd(), [LHS, RHS, SIZES[0]], ValueError, "group_sizes"),
    "group_sizes_rank2": (rd(), [LHS, RHS, SIZES[None]], ValueError, "group_sizes"),
    # ragged_dot: K
    "k_mismatch": (rd(), [LHS, jnp.zeros((G, K + 3, N), jnp.float32), SIZES], ValueError,
                   all_of("rhs", number(K), number(K + 3))),
    "k_mismatch_rhs_transposed": (rd(rhs_transposed=True), [LHS, jnp.zeros((G, N, K + 3), jnp.float32), SIZES],
                                  ValueError, all_of("rhs", number(K), number(K + 3))),
    "kn_rhs_read_as_nk": (rd(rhs_transposed=True), [LHS, RHS, SIZES], ValueError, all_of("rhs", number(K))),
    "nk_rhs_read_as_kn": (rd(), [LHS, RHS_T, SIZES], ValueError, all_of("rhs", number(K))),
    # ragged_dot: group counts
    "group_count_mismatch": (rd(), [LHS, RHS_WINDOW, SIZES], ValueError,
                             all_of("group_sizes|rhs", number(G_LOCAL), number(G))),
    "more_groups_in_rhs_than_group_sizes": (rd(), [LHS, jnp.zeros((G + 2, K, N)), SIZES], ValueError,
                                            all_of("group_sizes|rhs", number(G + 2), number(G))),
    "window_larger_than_g": (rd_offset(), [LHS, jnp.zeros((G + 1, K, N)), SIZES, OFFSET], ValueError,
                             all_of("group_sizes|rhs", number(G + 1), number(G))),
    # ragged_dot: group_offset
    "group_offset_shape_2": (rd_offset(), [LHS, RHS_WINDOW, SIZES, jnp.asarray([1, 2], jnp.int32)], ValueError,
                             "group_offset"),
    "group_offset_rank2": (rd_offset(), [LHS, RHS_WINDOW, SIZES, OFFSET[None]], ValueError, "group_offset"),
    "group_offset_f32": (rd_offset(), [LHS, RHS_WINDOW, SIZES, OFFSET.astype(jnp.float32)], ValueError,
                         "group_offset"),
    "rhs_transposed_an_int": (rd(rhs_transposed=1), [LHS, RHS_T, SIZES], ValueError,
                              r"rhs_transposed must be a bool, got 1"),
    # transposed_ragged_dot
    "t_lhs_int32": (trd(), [LHS.astype(jnp.int32), GRAD.astype(jnp.int32), SIZES], TypeError, "lhs"),
    "t_rhs_of_another_dtype": (trd(), [LHS, GRAD.astype(jnp.float16), SIZES], TypeError, "rhs"),
    "t_group_sizes_f32": (trd(), [LHS, GRAD, SIZES.astype(jnp.float32)], TypeError, "group_sizes"),
    "t_preferred_int32": (trd(preferred_element_type=jnp.int32), [LHS, GRAD, SIZES], TypeError,
                          "preferred_element_type"),
    "t_preferred_bf16_for_f16": (trd(preferred_element_type=jnp.bfloat16),
                                 [LHS.astype(jnp.float16), GRAD.astype(jnp.float16), SIZES], TypeError,
                                 "preferred_element_type"),
    "t_lhs_rank1": (trd(), [LHS[0], GRAD, SIZES], ValueError, "lhs"),
    "t_lhs_rank3": (trd(), [LHS[None], GRAD, SIZES], ValueError, "lhs"),
    "t_rhs_rank3": (trd(), [LHS, GRAD[None], SIZES], ValueError, "rhs"),
    "t_rows_mismatch": (trd(), [LHS, jnp.zeros((M + 2, N)), SIZES], ValueError,
                        all_of("rhs", number(M), number(M + 2))),
    "t_group_sizes_rank2": (trd(), [LHS, GRAD, SIZES[None]], ValueError, "group_sizes"),
    "t_group_offset_without_num_groups": (trd_offset(), [LHS, GRAD, SIZES, OFFSET], ValueError, "num_groups"),
    # (rhs has no groups here: the message names num_groups)
    "t_num_groups_not_g_without_offset": (trd(num_groups=G_LOCAL), [LHS, GRAD, SIZES], ValueError,
                                          rf"num_groups is {G_LOCAL} but group_sizes has {G} groups"),
    "t_num_groups_above_g": (trd_offset(num_groups=G + 1), [LHS, GRAD, SIZES, OFFSET], ValueError,
                             rf"num_groups is {G + 1}, more than the {G} groups of group_sizes"),
    "t_num_groups_negative": (trd_offset(num_groups=-1), [LHS, GRAD, SIZES, OFFSET], ValueError, "num_groups"),
    "t_group_offset_shape_2": (trd_offset(num_groups=2), [LHS, GRAD, SIZES, jnp.asarray([0, 1], jnp.int32)],
                               ValueError, "group_offset"),
    "t_group_offset_f32": (trd_offset(num_groups=2), [LHS, GRAD, SIZES, OFFSET.astype(jnp.float32)], ValueError,
                           "group_offset"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_naming_it(case):
    check_raises(CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_while_tracing(case):
    check_raises_while_tracing(CASES[case])


# ------------------------------------------ values: eager errors, silent under jit

# name: (function, group_sizes, group_offset or None, pattern). Sizes over M = 7 rows, G = 4.
VALUE_CASES = {
    "negative_size": (rd(), [2, -1, 3, 1], None, all_of("group_sizes", number(-1))),
    "sum_past_m": (rd(), [2, 4, 3, 1], None, all_of("group_sizes", number(10), number(M))),
    "one_size_past_m": (rd(), [0, 0, 8, 0], None, all_of("group_sizes", number(8), number(M))),
    "offset_negative": (rd_offset(), [2, 0, 3, 1], -1, all_of("group_offset", number(-1))),
    "offset_past_g": (rd_offset(), [2, 0, 3, 1], G + 1, all_of("group_offset", number(G + 1))),
    "negative_size_with_offset": (rd_offset(), [2, 0, -3, 1], 1, all_of("group_sizes", number(-3))),
    "t_negative_size": (trd(), [2, -1, 3, 1], None, all_of("group_sizes", number(-1))),
    "t_sum_past_m": (trd(), [2, 4, 3, 1], None, all_of("group_sizes", number(10), number(M))),
    "t_offset_negative": (trd_offset(num_groups=G_LOCAL), [2, 0, 3, 1], -1, all_of("group_offset", number(-1))),
    "t_offset_past_g": (trd_offset(num_groups=G_LOCAL), [2, 0, 3, 1], G + 1, all_of("group_offset", number(G + 1))),
}


def value_case_args(case):
    fn, sizes, g0, pattern = VALUE_CASES[case]
    transposed = case.startswith("t_")
    rhs = GRAD if transposed else (RHS if g0 is None else RHS_WINDOW)
    args = [LHS, rhs, jnp.asarray(sizes, jnp.int32)]
    if g0 is not None:
        args.append(jnp.asarray([g0], jnp.int32))
    return fn, args, pattern


@pytest.mark.parametrize("case", VALUE_CASES)
def test_out_of_range_sizes_and_offsets_raise_eagerly(case):
    fn, args, pattern = value_case_args(case)
    check_raises((fn, args, ValueError, pattern))
    # NumPy arrays are concrete too.
    check_raises((fn, [np.asarray(a) for a in args], ValueError, pattern))


@pytest.mark.parametrize("case", VALUE_CASES)
def test_out_of_range_sizes_and_offsets_are_silent_while_tracing_and_under_jit(case):
    fn, args, _ = value_case_args(case)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    jax.eval_shape(fn, *abstract)
    out = jax.jit(fn)(*args)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("case", VALUE_CASES)
def test_out_of_range_constants_under_jit_are_clamped_as_traced_ones(case, seed, rng):
    # Only an eager call reads the sizes: under jit, sizes and offset closed over as constants are
    # clamped on the device like traced ones, as the reference says.
    fn, args, _ = value_case_args(case)
    lhs, rhs = (rng.standard_normal(a.shape).astype(np.float32) for a in args[:2])
    sizes, *offset = args[2:]
    out = jax.jit(lambda lhs, rhs: fn(lhs, rhs, *args[2:]))(lhs, rhs)
    g0 = offset[0] if offset else None
    if case.startswith("t_"):
        expected = ref.transposed_ragged_dot(lhs, rhs, sizes, num_groups=None if g0 is None else G_LOCAL,
                                             group_offset=g0)
    else:
        expected = ref.ragged_dot(lhs, rhs, sizes, group_offset=g0)
    checks.assert_gemm_close(out, expected, np.float32, what=case, context=f"seed={seed}")


@pytest.mark.parametrize("g0", [0, G], ids=["g0_0", "g0_G"])
def test_limits_that_are_valid_are_accepted_eagerly(g0):
    # sum(group_sizes) == M, zero sizes, g0 = 0 and g0 = G (an empty window).
    sizes = jnp.asarray([2, 0, 4, 1], jnp.int32)
    offset = jnp.asarray([g0], jnp.int32)
    out = grouped_gemm.ragged_dot(LHS + 1, RHS_WINDOW + 1, sizes, group_offset=offset)
    assert out.shape == (M, N)
    t = grouped_gemm.transposed_ragged_dot(LHS + 1, GRAD + 1, sizes, num_groups=G_LOCAL, group_offset=offset)
    assert t.shape == (G_LOCAL, K, N)
    if g0 == G:
        assert not np.asarray(out).any() and not np.asarray(t).any()
    assert not np.asarray(grouped_gemm.ragged_dot(LHS + 1, RHS + 1, jnp.zeros((G,), jnp.int32))).any()
