"""Every bad argument in the contract raises its error type, naming the argument, before
anything runs: both on concrete arrays and while tracing abstract ones (jax.eval_shape)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from error_cases import check_raises, check_raises_while_tracing
from oxmoe import router

T, E = 5, 8
LOGITS = jnp.zeros((T, E), jnp.float32)
PROBS = jnp.zeros((T, E), jnp.float32)
COUNTS = jnp.zeros((E,), jnp.int32)
BIAS = jnp.zeros((E,), jnp.float32)
AUX = dict(total_num_tokens=T, topk=2, coeff=0.1)

topk = router.topk
scores = router.aux_loss_scores
aux = router.aux_loss

# name: (function of the array arguments, array arguments, error type, pattern the message must match)
CASES = {
    # topk: dtypes
    "topk_int32_logits": (functools.partial(topk, topk=2), [LOGITS.astype(jnp.int32)], TypeError, "logits"),
    "topk_bool_logits": (functools.partial(topk, topk=2), [LOGITS.astype(bool)], TypeError, "logits"),
    "topk_f16_expert_bias": (
        lambda x, b: topk(x, 2, score_function="sigmoid", expert_bias=b),
        [LOGITS, BIAS.astype(jnp.float16)],
        TypeError,
        "expert_bias",
    ),
    "topk_bf16_expert_bias": (
        lambda x, b: topk(x, 2, score_function="sigmoid", expert_bias=b),
        [LOGITS, BIAS.astype(jnp.bfloat16)],
        TypeError,
        "expert_bias",
    ),
    # topk: values
    "topk_rank1_logits": (functools.partial(topk, topk=2), [LOGITS[0]], ValueError, "logits"),
    "topk_zero": (functools.partial(topk, topk=0), [LOGITS], ValueError, "topk"),
    "topk_negative": (functools.partial(topk, topk=-1), [LOGITS], ValueError, "topk"),
    "topk_more_than_experts": (functools.partial(topk, topk=E + 1), [LOGITS], ValueError, "topk"),
    "topk_not_an_int": (functools.partial(topk, topk=2.0), [LOGITS], ValueError, "topk"),
    "topk_unknown_score_function": (
        functools.partial(topk, topk=2, score_function="relu"),
        [LOGITS],
        ValueError,
        "score_function",
    ),
    "topk_pre_softmax_with_sigmoid": (
        functools.partial(topk, topk=2, score_function="sigmoid", use_pre_softmax=True),
        [LOGITS],
        ValueError,
        "use_pre_softmax",
    ),
    "topk_expert_bias_with_softmax": (
        lambda x, b: topk(x, 2, score_function="softmax", expert_bias=b),
        [LOGITS, BIAS],
        ValueError,
        "expert_bias",
    ),
    "topk_expert_bias_too_short": (
        lambda x, b: topk(x, 2, score_function="sigmoid", expert_bias=b),
        [LOGITS, BIAS[:-1]],
        ValueError,
        "expert_bias",
    ),
    "topk_expert_bias_2d": (
        lambda x, b: topk(x, 2, score_function="sigmoid", expert_bias=b),
        [LOGITS, BIAS[None, :]],
        ValueError,
        "expert_bias",
    ),
    "topk_num_groups_without_group_topk": (
        functools.partial(topk, topk=2, num_groups=2),
        [LOGITS],
        ValueError,
        "num_groups|group_topk",
    ),
    "topk_group_topk_without_num_groups": (
        functools.partial(topk, topk=2, group_topk=1),
        [LOGITS],
        ValueError,
        "num_groups|group_topk",
    ),
    "topk_zero_groups": (functools.partial(topk, topk=2, num_groups=0, group_topk=1), [LOGITS], ValueError, "num_groups"),
    "topk_groups_not_dividing_experts": (
        functools.partial(topk, topk=2, num_groups=3, group_topk=1),
        [LOGITS],
        ValueError,
        "num_groups",
    ),
    "topk_zero_group_topk": (functools.partial(topk, topk=2, num_groups=4, group_topk=0), [LOGITS], ValueError, "group_topk"),
    "topk_group_topk_above_num_groups": (
        functools.partial(topk, topk=4, num_groups=2, group_topk=3),
        [LOGITS],
        ValueError,
        "group_topk",
    ),
    "topk_group_topk_above_topk": (
        functools.partial(topk, topk=2, num_groups=4, group_topk=3),
        [LOGITS],
        ValueError,
        "group_topk",
    ),
    "topk_more_than_the_allowed_groups_hold": (
        # group_topk 1 of 4 groups of 2 experts: at most 2 experts can be selected.
        functools.partial(topk, topk=3, num_groups=4, group_topk=1),
        [LOGITS],
        ValueError,
        "topk",
    ),
    "topk_pre_softmax_an_int": (functools.partial(topk, topk=2, use_pre_softmax=1), [LOGITS], ValueError,
                                r"use_pre_softmax must be a bool, got 1"),
    "topk_nan_scaling_factor": (functools.partial(topk, topk=2, scaling_factor=float("nan")), [LOGITS], ValueError,
                                r"scaling_factor must be a finite real number, got nan"),
    "topk_inf_scaling_factor": (functools.partial(topk, topk=2, scaling_factor=np.inf), [LOGITS], ValueError,
                                r"scaling_factor must be a finite real number, got inf"),
    "topk_scaling_factor_a_string": (functools.partial(topk, topk=2, scaling_factor="2"), [LOGITS], ValueError,
                                     r"scaling_factor must be a finite real number, got '2'"),
    # aux_loss_scores
    "scores_int32_logits": (functools.partial(scores, topk=2), [LOGITS.astype(jnp.int32)], TypeError, "logits"),
    "scores_rank1_logits": (functools.partial(scores, topk=2), [LOGITS[0]], ValueError, "logits"),
    "scores_zero_topk": (functools.partial(scores, topk=0), [LOGITS], ValueError, "topk"),
    "scores_topk_above_experts": (functools.partial(scores, topk=E + 1), [LOGITS], ValueError, "topk"),
    "scores_unknown_score_function": (
        functools.partial(scores, topk=2, score_function="tanh"),
        [LOGITS],
        ValueError,
        "score_function",
    ),
    # aux_loss
    "aux_int32_probs": (functools.partial(aux, **AUX), [PROBS.astype(jnp.int32), COUNTS], TypeError, "probs"),
    "aux_bool_counts": (functools.partial(aux, **AUX), [PROBS, COUNTS.astype(bool)], TypeError, "tokens_per_expert"),
    "aux_int16_counts": (
        functools.partial(aux, **AUX),
        [PROBS, COUNTS.astype(jnp.int16)],
        TypeError,
        "tokens_per_expert",
    ),
    "aux_rank1_probs": (functools.partial(aux, **AUX), [PROBS[0], COUNTS], ValueError, "probs"),
    "aux_counts_too_short": (functools.partial(aux, **AUX), [PROBS, COUNTS[:-1]], ValueError, "tokens_per_expert"),
    "aux_counts_2d": (functools.partial(aux, **AUX), [PROBS, COUNTS[None, :]], ValueError, "tokens_per_expert"),
    "aux_zero_total_tokens": (
        functools.partial(aux, **dict(AUX, total_num_tokens=0)),
        [PROBS, COUNTS],
        ValueError,
        "total_num_tokens",
    ),
    "aux_zero_topk": (functools.partial(aux, **dict(AUX, topk=0)), [PROBS, COUNTS], ValueError, "topk"),
    "aux_topk_above_experts": (functools.partial(aux, **dict(AUX, topk=E + 1)), [PROBS, COUNTS], ValueError, "topk"),
    "aux_nan_coeff": (functools.partial(aux, **dict(AUX, coeff=np.float32("nan"))), [PROBS, COUNTS], ValueError,
                      r"coeff must be a finite real number, got np.float32\(nan\)"),
    "aux_minus_inf_coeff": (functools.partial(aux, **dict(AUX, coeff=-np.inf)), [PROBS, COUNTS], ValueError,
                            r"coeff must be a finite real number, got -inf"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_naming_it(case):
    check_raises(CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_bad_argument_raises_while_tracing(case):
    check_raises_while_tracing(CASES[case])


@pytest.mark.parametrize(
    "fn, args, num_selected",
    [
        (functools.partial(topk, topk=E, num_groups=4, group_topk=4), [LOGITS], E),
        (functools.partial(topk, topk=4, num_groups=4, group_topk=4), [LOGITS], 4),
        (lambda x, b: topk(x, 1, score_function="sigmoid", expert_bias=b), [LOGITS, BIAS], 1),
        (functools.partial(scores, topk=E), [LOGITS], E),
    ],
    ids=["topk_at_every_limit", "group_topk_equal_to_topk", "sigmoid_bias_top1", "scores_topk_equals_experts"],
)
def test_arguments_at_their_limits_are_accepted(fn, args, num_selected):
    # The boundary values of the rules above are valid; on equal logits every tie goes to
    # the lowest experts.
    routing_map = [np.asarray(o) for o in jax.tree.leaves(fn(*args)) if o.dtype == bool][0]
    np.testing.assert_array_equal(routing_map, np.broadcast_to(np.arange(E) < num_selected, routing_map.shape))


def test_aux_loss_accepts_f16_counts_and_topk_equal_to_experts():
    probs = jnp.full((T, E), 0.5, jnp.float32)
    counts = jnp.arange(E, dtype=jnp.float16)
    loss = aux(probs, counts, total_num_tokens=1, topk=E, coeff=0.1)
    # 0.1 * E / (E * 1) * sum_e (T * 0.5) * e = 0.1 * 2.5 * 28
    np.testing.assert_allclose(np.asarray(loss), 0.1 * 2.5 * 28, rtol=1e-6)
