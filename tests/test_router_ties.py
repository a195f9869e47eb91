"""Exact ties go to the lower index: equal selection scores and equal group scores.

Equal inputs give equal scores in any precision, so here the routing map must equal the
reference's exactly, with no near-tie allowance."""

import jax.numpy as jnp
import numpy as np
import pytest

import router_checks as rc
import router_reference as ref
from oxmoe import router

DTYPES = pytest.mark.parametrize("dtype", list(rc.DTYPES.values()), ids=list(rc.DTYPES))
MODES = {
    "softmax_post": dict(score_function="softmax"),
    "softmax_pre": dict(score_function="softmax", use_pre_softmax=True),
    "sigmoid": dict(score_function="sigmoid"),
}
MODE_PARAMS = pytest.mark.parametrize("mode", MODES)


def chosen(routing_map):
    return [np.flatnonzero(row).tolist() for row in np.asarray(routing_map).reshape(-1, routing_map.shape[-1])]


@DTYPES
@MODE_PARAMS
def test_equal_logits_select_the_lowest_experts(mode, dtype):
    logits = jnp.asarray(
        [[0.0] * 8, [1.5] * 8, [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 1.0, 1.0], [2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0]],
        dtype=dtype,
    )
    probs, routing_map = router.topk(logits, 2, **MODES[mode])
    assert chosen(routing_map) == [[0, 1], [0, 1], [1, 2], [0, 2]]
    assert chosen(ref.topk(logits, 2, **MODES[mode]).routing_map) == chosen(routing_map)
    rc.check_topk(probs, routing_map, logits, 2, MODES[mode], None, context=mode)


@DTYPES
@MODE_PARAMS
def test_equal_logits_select_the_lowest_expert_for_top1(mode, dtype):
    logits = jnp.asarray([[0.0, 0.0, 0.0], [-1.0, 2.0, 2.0], [4.0, 1.0, 4.0]], dtype=dtype)
    probs, routing_map = router.topk(logits, 1, **MODES[mode])
    assert chosen(routing_map) == [[0], [1], [0]]
    rc.check_topk(probs, routing_map, logits, 1, MODES[mode], None, context=mode)


def test_equal_biased_sigmoid_scores_select_the_lowest_expert():
    # Bias ties the otherwise different experts 1 and 3 (same logit, same bias) above the rest.
    logits = jnp.asarray([[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]], dtype=jnp.float32)
    bias = jnp.asarray([0.0, 0.25, 0.0, 0.25, 0.0, -0.25], dtype=jnp.float32)
    probs, routing_map = router.topk(logits, 1, score_function="sigmoid", expert_bias=bias)
    assert chosen(routing_map) == [[1]]
    rc.check_topk(probs, routing_map, logits, 1, dict(score_function="sigmoid"), bias, context="")


@DTYPES
@MODE_PARAMS
def test_equal_group_scores_select_the_lowest_groups(mode, dtype):
    # Four identical groups of three: every group score ties, so groups 0 and 1 are allowed,
    # and inside them the equal experts again go to the lower index.
    group = [0.5, -1.0, 2.0]
    logits = jnp.asarray([group * 4, [1.0] * 12], dtype=dtype)
    kwargs = dict(MODES[mode], num_groups=4, group_topk=2)
    probs, routing_map = router.topk(logits, 4, **kwargs)
    assert chosen(routing_map) == [[0, 2, 3, 5], [0, 1, 2, 3]]
    assert chosen(ref.topk(logits, 4, **kwargs).routing_map) == chosen(routing_map)
    rc.check_topk(probs, routing_map, logits, 4, kwargs, None, context=mode)


@DTYPES
def test_equal_group_sums_of_different_logits_select_the_lowest_group(dtype):
    # Post-softmax group scores are sums of logits, exact for small integers:
    # groups (top-2 sums) 4, 4, 4, 4 -> groups 0, 1; experts by logit then index: 4, 0, 2, 3.
    logits = jnp.asarray([[2.0, 0.0, 2.0, 1.0, 3.0, 0.0, 3.0, 1.0, 0.0, 2.0, 2.0, 2.0]], dtype=dtype)
    kwargs = dict(num_groups=4, group_topk=2)
    probs, routing_map = router.topk(logits, 4, **kwargs)
    assert chosen(routing_map) == [[0, 2, 3, 4]]
    rc.check_topk(probs, routing_map, logits, 4, kwargs, None, context="")


@DTYPES
@MODE_PARAMS
def test_groups_holding_the_same_scores_in_any_order_tie(mode, dtype, seed, rng):
    # Every token's four groups are permutations of the same three values, so all group
    # scores are equal (whatever order a group's best three are summed in) and groups 0
    # and 1 must win, on every token.
    values = rng.standard_normal((1000, 1, 3)) * 2.0
    groups = np.concatenate([rng.permuted(values, axis=-1) for _ in range(4)], axis=1)
    logits = jnp.asarray(groups.reshape(1000, 12).astype(np.float32), dtype=dtype)
    kwargs = dict(MODES[mode], num_groups=4, group_topk=2)
    probs, routing_map = router.topk(logits, 6, **kwargs)
    in_groups_0_and_1 = np.asarray(routing_map)[:, :6].all(axis=-1)
    assert in_groups_0_and_1.all(), (
        f"tokens {np.flatnonzero(~in_groups_0_and_1)[:10].tolist()} chose other groups: "
        f"{chosen(routing_map[~in_groups_0_and_1][:3])} (seed={seed})"
    )
    rc.check_topk(probs, routing_map, logits, 6, kwargs, None, context=f"seed={seed}")


@DTYPES
@MODE_PARAMS
def test_integer_logits_route_exactly_as_the_reference(mode, dtype, seed, rng):
    # Small non-negative integers: many exact ties, and no two different inputs whose
    # scores could round together, so every token must match exactly. (Groups sum their
    # best two, so a group score does not depend on the order of the sum.)
    logits = jnp.asarray(rng.integers(0, 5, (1000, 64)).astype(np.float32), dtype=dtype)
    for kwargs in (MODES[mode], dict(MODES[mode], num_groups=8, group_topk=3)):
        probs, routing_map = router.topk(logits, 6, **kwargs)
        expected = ref.topk(logits, 6, **kwargs)
        np.testing.assert_array_equal(
            np.asarray(routing_map), expected.routing_map, err_msg=f"{kwargs} seed={seed}"
        )
        rc.check_topk(probs, routing_map, logits, 6, kwargs, None, context=f"{kwargs} seed={seed}")


@DTYPES
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_scores_ties_select_the_lowest_experts(score_function, dtype, seed, rng):
    rows = [[0.0] * 8, [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 1.0, 1.0]]
    logits = jnp.asarray(np.concatenate([rows, rng.integers(0, 5, (998, 8))]).astype(np.float32), dtype=dtype)
    routing_map, scores = router.aux_loss_scores(logits, 2, score_function=score_function)
    assert chosen(routing_map[:2]) == [[0, 1], [1, 2]]
    expected = ref.aux_loss_scores(logits, 2, score_function=score_function)
    np.testing.assert_array_equal(np.asarray(routing_map), expected.routing_map, err_msg=f"seed={seed}")
    rc.check_aux_loss_scores(routing_map, scores, logits, 2, score_function, context=f"seed={seed}")
