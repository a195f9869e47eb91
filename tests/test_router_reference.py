"""The float64 reference itself: hand-computed cases, and its analytic backward passes
against central finite differences of its forward. Needs no oxmoe library."""

import numpy as np
import pytest

import router_checks
import router_reference as ref

E1, E2, E3 = np.e, np.e**2, np.e**3


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_post_softmax_selects_largest_logits_and_softmaxes_over_them():
    out = ref.topk(np.array([[1.0, 3.0, 2.0, 0.0]]), 2)
    np.testing.assert_array_equal(out.routing_map, [[False, True, True, False]])
    np.testing.assert_allclose(out.probs, [[0.0, E1 / (E1 + 1), 1 / (E1 + 1), 0.0]], rtol=1e-15)
    np.testing.assert_allclose(out.margin, [1.0 / 3.0], rtol=1e-15)


def test_pre_softmax_weights_are_the_full_softmax_at_the_selection():
    z = E1 + E3 + E2 + 1.0
    out = ref.topk(np.array([[1.0, 3.0, 2.0, 0.0]]), 2, use_pre_softmax=True)
    np.testing.assert_allclose(out.probs, [[0.0, E3 / z, E2 / z, 0.0]], rtol=1e-15)


def test_sigmoid_weights_are_normalised_over_the_selection_and_scaled():
    out = ref.topk(np.array([[1.0, 3.0, 2.0, 0.0]]), 2, score_function="sigmoid", scaling_factor=2.5)
    total = sig(3.0) + sig(2.0)
    np.testing.assert_allclose(out.probs, [[0.0, 2.5 * sig(3.0) / total, 2.5 * sig(2.0) / total, 0.0]], rtol=1e-15)


def test_sigmoid_bias_steers_the_choice_and_top1_weight_is_not_normalised():
    out = ref.topk(
        np.array([[1.0, 3.0, 2.0, 0.0]]), 1, score_function="sigmoid", expert_bias=np.array([0.0, 0.0, 0.5, 0.0])
    )
    np.testing.assert_array_equal(out.routing_map, [[False, False, True, False]])
    np.testing.assert_allclose(out.probs, [[0.0, 0.0, sig(2.0), 0.0]], rtol=1e-15)


def test_groups_restrict_the_choice_and_group_ties_go_to_the_lower_group():
    # topk 2, group_topk 1: a group scores the sum of its best 2 logits: 4, 2, 4, -5.
    # Groups 0 and 2 tie; group 0 wins, so experts 0 and 1 although 4 has the largest logit.
    logits = np.array([[1.0, 3.0, 2.0, 0.0, 5.0, -1.0, -2.0, -3.0]])
    out = ref.topk(logits, 2, num_groups=4, group_topk=1)
    np.testing.assert_array_equal(out.group_scores, [[4.0, 2.0, 4.0, -5.0]])
    np.testing.assert_array_equal(np.flatnonzero(out.routing_map[0]), [0, 1])
    np.testing.assert_allclose(out.probs[0, :2], [1 / (1 + E2), E2 / (1 + E2)], rtol=1e-15)
    assert out.margin[0] == 0.0


def test_equal_scores_go_to_the_lower_index_with_zero_margin():
    out = ref.topk(np.zeros((1, 6)), 3)
    np.testing.assert_array_equal(np.flatnonzero(out.routing_map[0]), [0, 1, 2])
    assert out.margin[0] == 0.0


def test_aux_loss_scores_sigmoid_is_normalised_per_token():
    x = np.array([[0.0, 1.0, -1.0]])
    out = ref.aux_loss_scores(x, 1, score_function="sigmoid")
    total = sig(0.0) + sig(1.0) + sig(-1.0)  # = 1.5
    np.testing.assert_allclose(out.scores, [[0.5 / total, sig(1.0) / total, sig(-1.0) / total]], rtol=1e-15)
    np.testing.assert_array_equal(out.routing_map, [[False, True, False]])


def test_aux_loss_is_coeff_e_over_k_t2_times_load_dot_importance():
    probs = np.array([[0.5, 0.5, 0.0], [0.25, 0.0, 0.75]])
    tokens_per_expert = np.array([2, 1, 1])
    loss = ref.aux_loss(probs, tokens_per_expert, total_num_tokens=2, topk=2, coeff=0.1)
    # coeff * E / (k * T^2) = 0.1 * 3 / 8; sum_e P_e f_e = 0.75*2 + 0.5*1 + 0.75*1 = 2.75
    np.testing.assert_allclose(loss, 0.1 * 3 / 8 * 2.75, rtol=1e-15)


FD_CASES = {
    "softmax_post": (4, dict(score_function="softmax"), False),
    "softmax_pre": (4, dict(score_function="softmax", use_pre_softmax=True), False),
    "softmax_post_grouped_scaled": (4, dict(num_groups=4, group_topk=2, scaling_factor=1.5), False),
    "sigmoid_grouped_bias_scaled": (
        4,
        dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5),
        True,
    ),
    "sigmoid_top1": (1, dict(score_function="sigmoid"), False),
}


def _central_difference(f, x, eps):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += eps
        down[index] -= eps
        grad[index] = (f(up) - f(down)) / (2 * eps)
    return grad


@pytest.mark.parametrize("case", FD_CASES)
def test_topk_backward_equals_finite_differences_of_the_forward(case, seed, rng):
    topk, kwargs, with_bias = FD_CASES[case]
    num_experts = 16
    bias = rng.standard_normal(num_experts) * 0.1 if with_bias else None
    x = router_checks.draw_logits_with_margin(rng, 5, num_experts, topk, kwargs, bias, 1e-3).astype(np.float64)
    g = rng.standard_normal(x.shape)
    chosen = ref.topk(x, topk, expert_bias=bias, **kwargs).routing_map

    def loss(y):
        out = ref.topk(y, topk, expert_bias=bias, **kwargs)
        assert (out.routing_map == chosen).all(), "finite-difference step changed the selection"
        return float((g * out.probs).sum())

    expected = _central_difference(loss, x, 1e-6)
    got = ref.topk_backward(g, x, chosen, topk, **{k: v for k, v in kwargs.items() if "group" not in k})
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8, err_msg=f"seed={seed}")


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_scores_backward_equals_finite_differences(score_function, seed, rng):
    x = rng.standard_normal((4, 12)) * 2
    g = rng.standard_normal(x.shape)
    expected = _central_difference(
        lambda y: float((g * ref.aux_loss_scores(y, 3, score_function=score_function).scores).sum()), x, 1e-6
    )
    got = ref.aux_loss_scores_backward(g, x, score_function=score_function)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9, err_msg=f"seed={seed}")


def test_aux_loss_backward_equals_finite_differences(seed, rng):
    probs = rng.random((2, 3, 8))
    tokens_per_expert = rng.integers(0, 20, 8)
    kwargs = dict(total_num_tokens=11, topk=2, coeff=0.01)
    expected = _central_difference(lambda p: 0.7 * ref.aux_loss(p, tokens_per_expert, **kwargs), probs, 1e-6)
    got = ref.aux_loss_backward(0.7, probs.shape, tokens_per_expert, **kwargs)
    np.testing.assert_allclose(got, expected, rtol=1e-7, atol=1e-12, err_msg=f"seed={seed}")
