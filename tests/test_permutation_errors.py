"""Every bad argument in oxmoe.permutation's contract raises its error type with a message
that names the argument (and, where it helps, the bad value), both on concrete arrays and
while tracing abstract ones (jax.eval_shape); the one eager-only check (a concrete routing
map with more entries than num_out_tokens) raises eagerly and is silent under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import permutation_checks as checks
import permutation_reference as ref
from error_cases import check_raises, check_raises_while_tracing
from oxmoe import permutation

T, E, H = 5, 8, 16
TOKENS = jnp.zeros((T, H), jnp.float32)
# Tokens 0..4 each routed to experts t % 8 and (t + 3) % 8: 10 entries.
_t, _e = np.arange(T)[:, None], np.arange(E)[None, :]
MAP = jnp.asarray((_e == _t % E) | (_e == (_t + 3) % E))
PROBS = jnp.full((T, E), 0.5, jnp.float32)
SPLITS = jnp.asarray([2, 0, 3], jnp.int32)
ORDER = jnp.asarray([2, 0, 1], jnp.int32)

dispatch = permutation.dispatch
combine = permutation.combine
sort_chunks = permutation.sort_chunks
unsort_chunks = permutation.unsort_chunks

_D = dispatch(TOKENS, MAP, probs=PROBS, topk=2)  # R = 10
_D_ALIGNED = dispatch(TOKENS, MAP, topk=2, align_size=4)  # R = dispatched_rows(10, 8, 4) = 32
ROWS = jnp.zeros((10, H), jnp.float32)
ROW_ID_MAP = _D.row_id_map


def d(**kwargs):
    """dispatch(tokens, routing_map) with keyword arguments (topk=2 unless given)."""
    if "topk" not in kwargs and "num_out_tokens" not in kwargs and not kwargs.pop("neither", False):
        kwargs["topk"] = 2
    return lambda tokens, routing_map: dispatch(tokens, routing_map, **kwargs)


def d_probs(**kwargs):
    return lambda tokens, routing_map, probs: dispatch(tokens, routing_map, probs=probs, topk=2, **kwargs)


def both_numbers(a, b, name):
    """A pattern matching a message that contains `name` and both numbers a and b."""
    return rf"(?s)(?=.*{name})(?=.*\b{a}\b)(?=.*\b{b}\b)"


# name: (function of the array arguments, array arguments, error type, pattern the message must match)
CASES = {
    # dispatch: dtypes
    "dispatch_int32_tokens": (d(), [TOKENS.astype(jnp.int32), MAP], TypeError, "tokens"),
    "dispatch_bool_tokens": (d(), [TOKENS.astype(bool), MAP], TypeError, "tokens"),
    "dispatch_int32_routing_map": (d(), [TOKENS, MAP.astype(jnp.int32)], TypeError,
                                   "routing_map must be bool, got int32"),
    "dispatch_f32_routing_map": (d(), [TOKENS, MAP.astype(jnp.float32)], TypeError,
                                 "routing_map must be bool, got float32"),
    "dispatch_uint8_routing_map": (d(), [TOKENS, MAP.astype(jnp.uint8)], TypeError, "routing_map must be bool"),
    "dispatch_int32_probs": (d_probs(), [TOKENS, MAP, PROBS.astype(jnp.int32)], TypeError, "probs"),
    "dispatch_bool_probs": (d_probs(), [TOKENS, MAP, MAP], TypeError, "probs"),
    # dispatch: shapes
    "dispatch_rank1_tokens": (d(), [TOKENS[0], MAP], ValueError, "tokens"),
    "dispatch_rank3_tokens": (d(), [TOKENS[None], MAP], ValueError, "tokens"),
    "dispatch_rank1_routing_map": (d(), [TOKENS, MAP[0]], ValueError, "routing_map"),
    "dispatch_routing_map_of_other_token_count": (d(), [TOKENS, jnp.zeros((9, E), bool)], ValueError,
                                                  both_numbers(T, 9, "routing_map")),
    "dispatch_probs_of_other_shape": (d_probs(), [TOKENS, MAP, PROBS[:, :-1]], ValueError, "probs"),
    "dispatch_probs_transposed": (d_probs(), [TOKENS, MAP, jnp.zeros((E, T), jnp.float32)], ValueError, "probs"),
    # dispatch: align_size
    "dispatch_align_size_zero": (d(align_size=0), [TOKENS, MAP], ValueError,
                                 r"(?s)(?=.*align_size)(?=.*\b0\b)"),
    "dispatch_align_size_negative": (d(align_size=-3), [TOKENS, MAP], ValueError,
                                     r"(?s)(?=.*align_size)(?=.*-3\b)"),
    "dispatch_align_size_float": (d(align_size=2.5), [TOKENS, MAP], ValueError,
                                  r"(?s)(?=.*align_size)(?=.*2\.5)"),
    "dispatch_align_size_past_int32": (d(align_size=2**62), [TOKENS, MAP], ValueError,
                                       r"(?s)(?=.*align_size)(?=.*2147483647)(?=.*4611686018427387904)"),
    # 10 copies padded for 8 experts to a multiple of 2^30: 8 * 2^30 rows, past int32 row indices.
    "dispatch_padding_past_int32_rows": (d(align_size=2**30), [TOKENS, MAP], ValueError,
                                         r"(?s)(?=.*8589934592 rows)(?=.*align_size=1073741824)"
                                         r"(?=.*num_out_tokens=10)"),
    # dispatch: topk / num_out_tokens
    "dispatch_neither_topk_nor_num_out_tokens": (d(neither=True), [TOKENS, MAP], ValueError,
                                                 "(?s)(?=.*topk)(?=.*num_out_tokens)"),
    "dispatch_both_topk_and_num_out_tokens": (d(topk=2, num_out_tokens=10), [TOKENS, MAP], ValueError,
                                              "(?s)(?=.*topk)(?=.*num_out_tokens)"),
    "dispatch_topk_zero": (d(topk=0), [TOKENS, MAP], ValueError, "topk"),
    "dispatch_topk_above_experts": (d(topk=E + 1), [TOKENS, MAP], ValueError, "topk"),
    "dispatch_num_out_tokens_negative": (d(num_out_tokens=-1), [TOKENS, MAP], ValueError,
                                        r"(?s)(?=.*num_out_tokens)(?=.*-1\b)"),
    "dispatch_num_out_tokens_past_int32": (d(num_out_tokens=2**31), [TOKENS, MAP], ValueError,
                                          r"(?s)(?=.*2147483648 rows)(?=.*num_out_tokens=2147483648)"),
    # combine
    "combine_int32_expert_tokens": (lambda y: combine(y, ROW_ID_MAP), [ROWS.astype(jnp.int32)], TypeError,
                                    "expert_tokens"),
    "combine_int32_merging_probs": (lambda y, w: combine(y, ROW_ID_MAP, merging_probs=w),
                                    [ROWS, PROBS.astype(jnp.int32)], TypeError, "merging_probs"),
    "combine_row_id_map_a_tuple": (lambda y, dest, src: combine(y, (dest, src)),
                                   [ROWS, ROW_ID_MAP.dest_rows, ROW_ID_MAP.source_tokens], TypeError, "row_id_map"),
    "combine_row_id_map_the_dispatched": (lambda y: combine(y, _D), [ROWS], TypeError, "row_id_map"),
    "combine_row_id_map_of_another_dispatch_size": (lambda y: combine(y, _D_ALIGNED.row_id_map), [ROWS], ValueError,
                                                    "expert_tokens"),
    "combine_rows_one_short": (lambda y: combine(y, ROW_ID_MAP), [ROWS[:-1]], ValueError, "expert_tokens"),
    "combine_rank1_expert_tokens": (lambda y: combine(y, ROW_ID_MAP), [ROWS[:, 0]], ValueError, "expert_tokens"),
    "combine_merging_probs_of_other_shape": (lambda y, w: combine(y, ROW_ID_MAP, merging_probs=w),
                                             [ROWS, PROBS[:-1]], ValueError, "merging_probs"),
    "combine_num_tokens_not_the_dispatch's": (lambda y: combine(y, ROW_ID_MAP, num_tokens=MAP.shape[0] + 1), [ROWS],
                                              ValueError, both_numbers(MAP.shape[0] + 1, MAP.shape[0], "num_tokens")),
    "combine_pad_offsets_of_other_length": (lambda y, p: combine(y, ROW_ID_MAP, pad_offsets=p),
                                            [ROWS, jnp.zeros((MAP.shape[1] + 1,), jnp.int32)], ValueError, "pad_offsets"),
    "combine_float_pad_offsets": (lambda y, p: combine(y, ROW_ID_MAP, pad_offsets=p),
                                  [ROWS, jnp.zeros((MAP.shape[1],), jnp.float32)], ValueError, "pad_offsets"),
    # sort_chunks / unsort_chunks
    "sort_int32_tokens": (sort_chunks, [TOKENS.astype(jnp.int32), SPLITS, ORDER], TypeError, "tokens"),
    "sort_f32_split_sizes": (sort_chunks, [TOKENS, SPLITS.astype(jnp.float32), ORDER], TypeError, "split_sizes"),
    "sort_int16_split_sizes": (sort_chunks, [TOKENS, SPLITS.astype(jnp.int16), ORDER], TypeError, "split_sizes"),
    "sort_f32_sorted_indices": (sort_chunks, [TOKENS, SPLITS, ORDER.astype(jnp.float32)], TypeError,
                                "sorted_indices"),
    "sort_2d_split_sizes": (sort_chunks, [TOKENS, SPLITS[None], ORDER], ValueError, "split_sizes"),
    "sort_lengths_differ": (sort_chunks, [TOKENS, SPLITS, ORDER[:2]], ValueError, "split_sizes|sorted_indices"),
    "unsort_int32_tokens": (unsort_chunks, [TOKENS.astype(jnp.int32), SPLITS, ORDER], TypeError, "tokens"),
    "unsort_f32_sorted_indices": (unsort_chunks, [TOKENS, SPLITS, ORDER.astype(jnp.float32)], TypeError,
                                  "sorted_indices"),
    "unsort_2d_sorted_indices": (unsort_chunks, [TOKENS, SPLITS, ORDER[None]], ValueError, "sorted_indices"),
    "unsort_lengths_differ": (unsort_chunks, [TOKENS, SPLITS[:1], ORDER], ValueError, "split_sizes|sorted_indices"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_naming_it(case):
    check_raises(CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_while_tracing(case):
    check_raises_while_tracing(CASES[case])


# --------------------------------------------- num_out_tokens too small (eager only)


@pytest.mark.parametrize("align_size", [None, 4])
def test_num_out_tokens_below_the_routed_count_raises_eagerly(align_size):
    # MAP holds 10 entries; 9 rows of capacity is one too few.
    with pytest.raises(ValueError, match=r"(?s)num_out_tokens.*too small"):
        dispatch(TOKENS, MAP, num_out_tokens=9, align_size=align_size)
    with pytest.raises(ValueError, match=r"(?s)num_out_tokens.*too small"):
        dispatch(TOKENS, np.asarray(MAP), num_out_tokens=0, align_size=align_size)


@pytest.mark.parametrize("align_size", [None, 4])
def test_topk_below_the_routed_count_names_topk_not_num_out_tokens(align_size):
    # MAP routes each token to 2 experts; topk=1 leaves room for 5 copies of 10. The caller gave
    # topk, so the message names topk (and the room it made), never num_out_tokens.
    with pytest.raises(ValueError) as raised:
        dispatch(TOKENS, MAP, topk=1, align_size=align_size)
    message = str(raised.value)
    assert message.startswith("topk=1 (room for 5 tokens x 1 = 5 copies) is too small: routing_map routes 10 "), message
    assert "num_out_tokens" not in message, message


def test_num_out_tokens_below_the_routed_count_is_a_silent_drop_under_jit():
    # The same call under jit (the map abstract) drops the entries past the capacity instead.
    dispatched = jax.jit(lambda x, m: dispatch(x, m, num_out_tokens=9))(TOKENS, MAP)
    layout = ref.dispatch_layout(np.asarray(MAP), num_out_tokens=9)
    assert layout.dropped.sum() == 1
    checks.check_dispatch_layout(dispatched, layout, context="jit, num_out_tokens=9 of 10")


# name: dispatch(tokens, MAP as a constant, num_out_tokens=9) under a transformation -> its Dispatched
CONSTANT_MAP_CALLS = {
    "jit": lambda x: jax.jit(lambda x: dispatch(x, MAP, num_out_tokens=9))(x),
    "jit_numpy_map": lambda x: jax.jit(lambda x: dispatch(x, np.asarray(MAP), num_out_tokens=9))(x),
    "vmap": lambda x: jax.tree.map(lambda a: a[1], jax.vmap(lambda x: dispatch(x, MAP, num_out_tokens=9))(
        jnp.stack([x + 1, x]))),
}


@pytest.mark.parametrize("call", CONSTANT_MAP_CALLS)
def test_a_constant_map_below_num_out_tokens_is_a_silent_drop_under_a_transformation(call, seed, rng):
    # Only an eager call counts the map; under a transformation (here a map closed over as a
    # constant) the copies past the capacity are dropped as for a traced map.
    x = rng.standard_normal((T, H)).astype(np.float32)
    dispatched = CONSTANT_MAP_CALLS[call](jnp.asarray(x))
    layout = checks.check_dispatch(dispatched, x, np.asarray(MAP), None, num_out_tokens=9, align_size=None,
                                context=f"{call}, num_out_tokens=9 of 10, seed={seed}")
    assert layout.dropped.sum() == 1


def test_a_constant_map_below_num_out_tokens_drops_the_copy_s_gradient_under_grad(seed, rng):
    x = rng.standard_normal((T, H)).astype(np.float32)
    g = rng.standard_normal((9, H)).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(dispatch(x, MAP, num_out_tokens=9).tokens * g))(jnp.asarray(x))
    layout = ref.dispatch_layout(np.asarray(MAP), num_out_tokens=9)
    expected, _ = ref.dispatch_backward(g, None, layout.dest_rows)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-6, err_msg=f"seed={seed}")


def test_num_out_tokens_equal_to_the_routed_count_is_accepted_eagerly():
    dispatched = dispatch(TOKENS, MAP, num_out_tokens=10, align_size=4)
    checks.check_dispatch_layout(dispatched, ref.dispatch_layout(np.asarray(MAP), num_out_tokens=10, align_size=4),
                              context="num_out_tokens=10 of 10")


# ---------------------------------------------- sorted_indices a permutation (eager only)


@pytest.mark.parametrize("fn", [sort_chunks, unsort_chunks], ids=["sort", "unsort"])
@pytest.mark.parametrize("order, pattern", [
    ([0, 0, 0], r"permutation of range\(3\), got 0 again at position 1"),
    ([2, 0, 2], r"permutation of range\(3\), got 2 again at position 2"),
    ([2, 0, 3], r"permutation of range\(3\), got 3 at position 2"),
    ([-1, 0, 1], r"permutation of range\(3\), got -1 at position 0"),
], ids=["all_zero", "repeat", "past_the_end", "negative"])
def test_sorted_indices_that_are_not_a_permutation_raise_eagerly(fn, order, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn(TOKENS, SPLITS, jnp.asarray(order, jnp.int32))
    with pytest.raises(ValueError, match=pattern):
        fn(TOKENS, SPLITS, np.asarray(order, np.int32))


def test_sorted_indices_that_are_not_a_permutation_are_not_checked_under_jit(seed, rng):
    # Under jit the indices are taken as they come (a repeat lists nothing; see
    # test_permutation_values), even as a constant.
    x = rng.standard_normal((T, H)).astype(np.float32)
    order = np.asarray([0, 0, 0], np.int32)
    out = jax.jit(lambda x: sort_chunks(x, SPLITS, order))(x)
    checks.assert_bitwise_equal(out, ref.sort_chunks(x, SPLITS, order).astype(np.float32), what="jit sort_chunks",
                             context=f"order={order.tolist()}, seed={seed}")


# ------------------------------------------------------------ limits that are valid


@pytest.mark.parametrize("kwargs", [dict(topk=1), dict(topk=E), dict(num_out_tokens=T * E), dict(topk=2, align_size=1),
                                    dict(num_out_tokens=10, align_size=128)],
                         ids=["topk_1", "topk_E", "num_out_tokens_all", "align_size_1", "align_size_128"])
def test_arguments_at_their_limits_are_accepted(kwargs):
    # topk=1 routes fewer entries than MAP holds only by the caller's word: MAP has 2 per token,
    # so use a one-per-token map there.
    routing_map = np.asarray(MAP)
    if kwargs.get("topk") == 1:
        routing_map = np.eye(T, E, dtype=bool)
    dispatched = dispatch(TOKENS, routing_map, **kwargs)
    num_out_tokens = kwargs.get("num_out_tokens", T * kwargs.get("topk", 0))
    checks.check_dispatch(dispatched, np.asarray(TOKENS), routing_map, None, num_out_tokens=num_out_tokens,
                       align_size=kwargs.get("align_size"), context=str(kwargs))


@pytest.mark.parametrize("args, rows", [((2**31 - 1, E), 2**31 - 1), ((1, E, 2**31 - 1), 2**31 - 1),
                                        ((2**31 - 2**20, 1, 2**20), 2**31 - 2**20)],
                         ids=["num_out_tokens", "align_size", "padded"])
def test_dispatched_rows_reach_int32_s_limit_and_not_past_it(args, rows):
    # Row indices are int32 in the handlers: 2^31 - 1 rows is the most a dispatch can have.
    assert permutation.dispatched_rows(*args) == ref.dispatched_rows(*args) == rows
    past = (args[0] + 1, *args[1:])  # one more copy
    with pytest.raises(ValueError, match=rf"{ref.dispatched_rows(*past)} rows.*2\*\*31 - 1"):
        permutation.dispatched_rows(*past)


# ------------------------------------------------- a hand-made, broken row id map


def test_combine_with_out_of_range_dest_rows_gives_nan_for_those_tokens(seed, rng):
    # The contract: a dest_rows entry < -1 or >= R makes out[t] NaN (never a read out of bounds).
    y = jnp.asarray(rng.standard_normal((10, H)).astype(np.float32))
    dest_rows = np.asarray(ROW_ID_MAP.dest_rows).copy()
    dest_rows[1, np.flatnonzero(dest_rows[1] >= 0)[0]] = 10  # == R
    dest_rows[3, np.flatnonzero(dest_rows[3] >= 0)[0]] = -2
    dest_rows[4, np.flatnonzero(dest_rows[4] < 0)[0]] = 1 << 30
    broken = permutation.RowIdMap(dest_rows=jnp.asarray(dest_rows, jnp.int32), source_tokens=ROW_ID_MAP.source_tokens)
    out = np.asarray(combine(y, broken))
    assert np.isnan(out[[1, 3, 4]]).all(), f"rows 1, 3, 4 should be NaN, got {out[[1, 3, 4], :4]}"
    good = [0, 2]
    expected = ref.combine(np.asarray(y), dest_rows[good])
    checks.assert_rounded_sum_close(out[good], expected, ref.combine(np.abs(np.asarray(y)), dest_rows[good]),
                                 np.float32, num_terms=2, what="combine of the untouched tokens", context=f"seed={seed}")


def test_combine_accepts_the_dispatch_s_pad_offsets_and_num_tokens(seed, rng):
    # The signature TransformerEngine users write: the same result as without them.
    y = jnp.asarray(rng.normal(size=(_D_ALIGNED.tokens.shape[0], H)), jnp.float32)
    plain = combine(y, _D_ALIGNED.row_id_map)
    spelled_out = combine(y, _D_ALIGNED.row_id_map, pad_offsets=_D_ALIGNED.pad_offsets, num_tokens=MAP.shape[0])
    checks.assert_bitwise_equal(spelled_out, plain, what="combine with pad_offsets and num_tokens", context=f"seed={seed}")
