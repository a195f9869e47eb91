"""Property-based tests: for shapes, options and data drawn by hypothesis, every router
primitive's forward and backward agree with the float64 reference.

Hypothesis draws the shapes and options and a seed; the arrays come from a numpy
generator with that seed, so a failing example replays exactly."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import router_checks as rc
import router_reference as ref
from oxmoe import router

DTYPES = st.sampled_from(list(rc.DTYPES.values()))
SEEDS = st.integers(0, 2**32 - 1)
# normal: N(0, 2); wide: N(0, 4); integer: 0..4, exact ties everywhere; constant: some rows all equal.
DATA_KINDS = st.sampled_from(["normal", "wide", "integer", "constant"])


@st.composite
def token_shapes(draw):
    """[T] or [B, S] leading dimensions, T (or B*S) from 1 to 64."""
    if draw(st.booleans()):
        return (draw(st.integers(1, 64)),)
    return (draw(st.integers(1, 4)), draw(st.integers(1, 16)))


def make_logits(seed, kind, shape, dtype):
    rng = np.random.default_rng(seed)
    if kind == "integer":
        x = rng.integers(0, 5, shape).astype(np.float32)
    elif kind == "wide":
        x = rng.standard_normal(shape) * 4.0
    else:
        x = rng.standard_normal(shape) * 2.0
    if kind == "constant":
        rows = x.reshape(-1, shape[-1])
        equal = rng.random(rows.shape[0]) < 0.5
        rows[equal] = rows[equal, :1]
    return jnp.asarray(np.asarray(x, np.float32)).astype(dtype), rng


@st.composite
def topk_problems(draw):
    if draw(st.booleans()):
        num_groups = draw(st.integers(1, 8))
        per_group = draw(st.integers(1, 12))
        num_experts = num_groups * per_group
        group_topk = draw(st.integers(1, num_groups))
        topk = draw(st.integers(group_topk, group_topk * per_group))
    else:
        num_experts = draw(st.integers(1, 96))
        num_groups = group_topk = None
        topk = draw(st.integers(1, num_experts))
    score_function = draw(st.sampled_from(["softmax", "sigmoid"]))
    kwargs = dict(
        score_function=score_function,
        use_pre_softmax=score_function == "softmax" and draw(st.booleans()),
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=draw(st.one_of(st.none(), st.floats(0.125, 4.0, width=32))),
    )
    use_bias = score_function == "sigmoid" and draw(st.booleans())
    return dict(
        shape=draw(token_shapes()) + (num_experts,),
        topk=topk,
        kwargs=kwargs,
        use_bias=use_bias,
        dtype=draw(DTYPES),
        kind=draw(DATA_KINDS),
        seed=draw(SEEDS),
    )


@settings(max_examples=50)
@given(topk_problems())
def test_topk_forward_and_backward_agree_with_the_reference(problem):
    logits, rng = make_logits(problem["seed"], problem["kind"], problem["shape"], problem["dtype"])
    num_experts, topk, kwargs = problem["shape"][-1], problem["topk"], problem["kwargs"]
    bias = rc.draw_expert_bias(rng, num_experts) if problem["use_bias"] else None
    probs, vjp, routing_map = jax.vjp(
        lambda x: router.topk(x, topk, expert_bias=bias, **kwargs), logits, has_aux=True
    )
    context = f"{problem}"
    rc.check_topk(probs, routing_map, logits, topk, kwargs, bias, context=context)
    grad_probs = rc.draw_like(rng, probs.shape, probs.dtype)
    (grad_logits,) = vjp(grad_probs)
    rc.check_topk_grad(grad_logits, grad_probs, logits, routing_map, topk, kwargs, context=context)


@st.composite
def scores_problems(draw):
    num_experts = draw(st.integers(1, 96))
    return dict(
        shape=draw(token_shapes()) + (num_experts,),
        topk=draw(st.integers(1, num_experts)),
        score_function=draw(st.sampled_from(["softmax", "sigmoid"])),
        dtype=draw(DTYPES),
        kind=draw(DATA_KINDS),
        seed=draw(SEEDS),
    )


@settings(max_examples=30)
@given(scores_problems())
def test_aux_loss_scores_forward_and_backward_agree_with_the_reference(problem):
    logits, rng = make_logits(problem["seed"], problem["kind"], problem["shape"], problem["dtype"])
    topk, score_function = problem["topk"], problem["score_function"]
    scores, vjp, routing_map = jax.vjp(
        lambda x: router.aux_loss_scores(x, topk, score_function=score_function)[::-1], logits, has_aux=True
    )
    context = f"{problem}"
    rc.check_aux_loss_scores(routing_map, scores, logits, topk, score_function, context=context)
    grad_scores = rc.draw_like(rng, scores.shape, jnp.float32)
    (grad_logits,) = vjp(grad_scores)
    rc.check_aux_loss_scores_grad(grad_logits, grad_scores, logits, score_function, context=context)


@st.composite
def aux_loss_problems(draw):
    shape = draw(token_shapes()) + (draw(st.integers(1, 96)),)
    num_tokens = int(np.prod(shape[:-1]))
    return dict(
        shape=shape,
        topk=draw(st.integers(1, shape[-1])),
        total_num_tokens=draw(st.integers(1, 64 * num_tokens)),
        coeff=draw(st.floats(float(np.float32(1e-4)), 10.0, width=32)),
        counts_dtype=draw(st.sampled_from([jnp.int32, jnp.float32, jnp.bfloat16, jnp.float16])),
        dtype=draw(DTYPES),
        seed=draw(SEEDS),
    )


@settings(max_examples=30)
@given(aux_loss_problems())
def test_aux_loss_forward_and_backward_agree_with_the_reference(problem):
    rng = np.random.default_rng(problem["seed"])
    shape = problem["shape"]
    probs = jnp.asarray(rng.random(shape).astype(np.float32)).astype(problem["dtype"])
    counts = jnp.asarray(rng.integers(0, 1000, shape[-1])).astype(problem["counts_dtype"])
    kwargs = dict(total_num_tokens=problem["total_num_tokens"], topk=problem["topk"], coeff=float(problem["coeff"]))
    loss, vjp = jax.vjp(lambda p: router.aux_loss(p, counts, **kwargs), probs)
    context = f"{problem}"
    rc.check_aux_loss(loss, probs, counts, **kwargs, context=context)
    grad_loss = np.float32(rng.standard_normal())
    (grad_probs,) = vjp(jnp.asarray(grad_loss))
    assert grad_probs.dtype == probs.dtype, context
    expected = ref.aux_loss_backward(grad_loss, shape, counts, **kwargs)
    # A gradient that rounds past the largest finite value of its dtype must be
    # inf (e.g. float16 above 65519), on every backend. The cast finds them: its
    # overflow is expected, not a warning.
    with np.errstate(over="ignore"):
        overflow = np.isinf(np.asarray(expected).astype(probs.dtype))
    np.testing.assert_array_equal(np.isinf(np.asarray(grad_probs, np.float64)), overflow, err_msg=context)
    rc.assert_close(np.where(overflow, 0.0, grad_probs), np.where(overflow, 0.0, expected), probs.dtype,
                    what="d probs", context=context)
