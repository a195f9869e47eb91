"""Backward passes: jax.vjp of oxmoe's router functions against the analytic float64
reference backward (whose own correctness test_router_reference.py checks by finite
differences), and oxmoe's float32 gradients against finite differences of oxmoe itself."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import router_checks as rc
import router_reference as ref
from oxmoe.model_shapes import DEEPSEEK_V3, ROUTER_CONFIGS
from oxmoe import reference, router

NUM_TOKENS = [333, 4097]
CONFIGS = pytest.mark.parametrize("config", ROUTER_CONFIGS, ids=lambda c: c.name)
DTYPES = pytest.mark.parametrize("dtype", list(rc.DTYPES.values()), ids=list(rc.DTYPES))


@CONFIGS
@DTYPES
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_topk_vjp_matches_analytic_reference(config, dtype, num_tokens, seed, rng):
    logits = rc.draw_logits(rng, (num_tokens, config.num_experts), dtype)
    bias = rc.draw_expert_bias(rng, config.num_experts) if config.use_expert_bias else None
    kwargs = config.topk_kwargs()
    probs, vjp, routing_map = jax.vjp(
        lambda x: router.topk(x, config.topk, expert_bias=bias, **kwargs), logits, has_aux=True
    )
    context = f"seed={seed}"
    rc.check_topk(probs, routing_map, logits, config.topk, kwargs, bias, context=context)
    grad_probs = rc.draw_like(rng, probs.shape, dtype)
    (grad_logits,) = vjp(grad_probs)
    rc.check_topk_grad(grad_logits, grad_probs, logits, routing_map, config.topk, kwargs, context=context)


@DTYPES
def test_sigmoid_topk_vjp_of_chosen_experts_far_below_zero_matches_analytic_reference(dtype, seed, rng):
    """Experts the bias chooses although their logits are so far below zero that e^-x
    overflows float32 (sigmoid 0): their weights and gradients are 0, as the reference's
    (below float32's smallest number) round, and every other gradient is as usual."""
    num_experts, topk = 32, 4
    logits = np.array(rc.draw_logits(rng, (333, num_experts), jnp.float32))
    logits[:, :2] = rng.uniform(-120.0, -89.0, (333, 2))
    logits = jnp.asarray(logits).astype(dtype)
    bias = jnp.asarray(np.where(np.arange(num_experts) < 2, 10.0, 0.0).astype(np.float32))
    kwargs = dict(score_function="sigmoid")
    probs, vjp, routing_map = jax.vjp(lambda x: router.topk(x, topk, expert_bias=bias, **kwargs), logits,
                                      has_aux=True)
    context = f"seed={seed}"
    assert np.asarray(routing_map)[:, :2].all(), context
    rc.check_topk(probs, routing_map, logits, topk, kwargs, bias, context=context)
    grad_probs = rc.draw_like(rng, probs.shape, dtype)
    (grad_logits,) = vjp(grad_probs)
    rc.check_topk_grad(grad_logits, grad_probs, logits, routing_map, topk, kwargs, context=context)


@DTYPES
def test_sigmoid_weights_and_scores_of_tokens_whose_every_logit_is_far_below_zero(dtype, seed, rng):
    """DeepSeek-V3's router on tokens whose every logit is in [-110, -89] (there e^-x
    overflows float32 and every sigmoid is 0: the expert bias makes the choice) or in
    [-60, -25], beside ordinary ones. The weights s_i / sum(s) over the selection, and the
    loss's scores over each row, must still be the float64 reference's (about the softmax of
    the logits), not 0 / 0; so must their gradients, and the plain-JAX reference's values.
    (Within a row the logits differ by less than 88, so no share is below float32's smallest
    number.)"""
    config, num_tokens = DEEPSEEK_V3, 333
    logits = np.array(rc.draw_logits(rng, (num_tokens, config.num_experts), jnp.float32))
    band = rng.integers(0, 3, num_tokens)
    for b, (low, high) in ((1, (-110.0, -89.0)), (2, (-60.0, -25.0))):
        logits[band == b] = rng.uniform(low, high, (int((band == b).sum()), config.num_experts))
    far = band > 0
    logits = jnp.asarray(logits).astype(dtype)
    bias = rc.draw_expert_bias(rng, config.num_experts)
    kwargs = config.topk_kwargs()
    context = f"{int(far.sum())} tokens far below zero, seed={seed}"

    probs, vjp, routing_map = jax.vjp(lambda x: router.topk(x, config.topk, expert_bias=bias, **kwargs), logits,
                                      has_aux=True)
    rc.check_topk(probs, routing_map, logits, config.topk, kwargs, bias, context=context)
    grad_probs = rc.draw_like(rng, probs.shape, dtype)
    (grad_logits,) = vjp(grad_probs)
    rc.check_topk_grad(grad_logits, grad_probs, logits, routing_map, config.topk, kwargs, context=context)
    plain_probs, plain_map = reference.router.topk(logits, config.topk, expert_bias=bias, **kwargs)
    np.testing.assert_array_equal(plain_map, routing_map, err_msg=context)
    rc.assert_close(plain_probs, ref.topk_probs(logits, np.asarray(plain_map), config.topk, **rc.weight_options(kwargs)),
                    dtype, what="plain-JAX probs", context=context)

    scores_fn = functools.partial(router.aux_loss_scores, topk=config.topk, score_function="sigmoid")
    (scores_map, scores), scores_vjp = jax.vjp(scores_fn, logits)
    rc.check_aux_loss_scores(scores_map, scores, logits, config.topk, "sigmoid", context=context)
    grad_scores = rc.draw_like(rng, scores.shape, jnp.float32)
    (grad_logits,) = scores_vjp((np.zeros(scores_map.shape, jax.dtypes.float0), grad_scores))
    rc.check_aux_loss_scores_grad(grad_logits, grad_scores, logits, "sigmoid", context=context)
    _, plain_scores = reference.router.aux_loss_scores(logits, config.topk, score_function="sigmoid")
    rc.assert_close(plain_scores, ref.aux_loss_scores(logits, config.topk, score_function="sigmoid").scores,
                    rc.F32, what="plain-JAX scores", context=context)


@CONFIGS
@DTYPES
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_aux_loss_scores_vjp_matches_analytic_reference(config, dtype, num_tokens, seed, rng):
    logits = rc.draw_logits(rng, (num_tokens, config.num_experts), dtype)
    fn = functools.partial(router.aux_loss_scores, topk=config.topk, score_function=config.score_function)
    scores, vjp, _ = jax.vjp(lambda x: fn(x)[::-1], logits, has_aux=True)
    grad_scores = rc.draw_like(rng, scores.shape, jnp.float32)
    (grad_logits,) = vjp(grad_scores)
    rc.check_aux_loss_scores_grad(grad_logits, grad_scores, logits, config.score_function, context=f"seed={seed}")


@DTYPES
@pytest.mark.parametrize("num_tokens", [333, 4097])
@pytest.mark.parametrize("counts_dtype", [jnp.int32, jnp.float32], ids=["int32_counts", "f32_counts"])
def test_aux_loss_vjp_is_the_constant_times_tokens_per_expert(dtype, num_tokens, counts_dtype, seed, rng):
    num_experts, topk = 128, 8
    probs = jnp.asarray(rng.random((num_tokens, num_experts)).astype(np.float32)).astype(dtype)
    counts = jnp.asarray(rng.integers(0, num_tokens, num_experts), dtype=counts_dtype)
    kwargs = dict(total_num_tokens=num_tokens, topk=topk, coeff=1e-2)
    loss, vjp = jax.vjp(lambda p: router.aux_loss(p, counts, **kwargs), probs)
    grad_loss = np.float32(rng.standard_normal())
    (grad_probs,) = vjp(jnp.asarray(grad_loss))
    context = f"seed={seed}"
    rc.check_aux_loss(loss, probs, counts, **kwargs, context=context)
    assert grad_probs.dtype == probs.dtype, f"grad dtype {grad_probs.dtype} != {probs.dtype}"
    expected = ref.aux_loss_backward(grad_loss, probs.shape, counts, **kwargs)
    rc.assert_close(grad_probs, expected, dtype, what="d probs", context=context)


def test_expert_bias_gets_a_zero_gradient(seed, rng):
    logits = rc.draw_logits(rng, (1000, 64), jnp.float32)
    bias = rc.draw_expert_bias(rng, 64)
    grad_probs = rc.draw_like(rng, logits.shape, jnp.float32)

    def loss(x, b):
        probs, _ = router.topk(x, 8, score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=b)
        return jnp.sum(probs * grad_probs)

    grad_logits, grad_bias = jax.grad(loss, argnums=(0, 1))(logits, bias)
    np.testing.assert_array_equal(np.asarray(grad_bias), np.zeros(64, np.float32), err_msg=f"seed={seed}")
    _, routing_map = router.topk(logits, 8, score_function="sigmoid", num_groups=8, group_topk=4, expert_bias=bias)
    rc.check_topk_grad(
        grad_logits, grad_probs, logits, routing_map, 8, dict(score_function="sigmoid"), context=f"seed={seed}"
    )


def test_tokens_per_expert_gets_no_gradient(seed, rng):
    probs = jnp.asarray(rng.random((333, 16)).astype(np.float32))
    counts = jnp.asarray(rng.integers(0, 100, 16).astype(np.float32))
    kwargs = dict(total_num_tokens=333, topk=2, coeff=0.1)
    grad_probs, grad_counts = jax.grad(lambda p, c: router.aux_loss(p, c, **kwargs), argnums=(0, 1))(probs, counts)
    np.testing.assert_array_equal(np.asarray(grad_counts), np.zeros(16, np.float32), err_msg=f"seed={seed}")
    expected = ref.aux_loss_backward(1.0, probs.shape, counts, **kwargs)
    rc.assert_close(grad_probs, expected, jnp.float32, what="d probs", context=f"seed={seed}")


def test_routing_map_of_aux_loss_scores_carries_no_gradient(seed, rng):
    # A loss built from the (bool) routing map and the scores differentiates through the scores only.
    logits = rc.draw_logits(rng, (333, 32), jnp.float32)
    weights = rc.draw_like(rng, logits.shape, jnp.float32)

    def loss(x):
        routing_map, scores = router.aux_loss_scores(x, 4)
        return jnp.sum(jnp.where(routing_map, scores, 0.0) * weights)

    grad = jax.grad(loss)(logits)
    routing_map, scores = router.aux_loss_scores(logits, 4)
    rc.check_aux_loss_scores(routing_map, scores, logits, 4, "softmax", context=f"seed={seed}")
    grad_scores = np.where(routing_map, np.asarray(weights), 0.0)
    rc.check_aux_loss_scores_grad(grad, grad_scores, logits, "softmax", context=f"seed={seed}")


# Finite differences of oxmoe itself, float32. The logits keep every token's selection
# margin above 5% of its score scale, far beyond what the eps=1e-3 steps can move.
FD_CASES = {
    "softmax_post": (4, dict(score_function="softmax"), False),
    "softmax_pre": (4, dict(score_function="softmax", use_pre_softmax=True), False),
    "softmax_post_grouped": (4, dict(score_function="softmax", num_groups=4, group_topk=2), False),
    "sigmoid_grouped_bias_scaled": (
        4,
        dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5),
        True,
    ),
    "sigmoid_top1": (1, dict(score_function="sigmoid"), False),
}
F32_FD = dict(order=1, modes=["rev"], eps=1e-3, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("case", FD_CASES)
def test_topk_float32_gradient_equals_finite_differences(case, seed, rng):
    topk, kwargs, with_bias = FD_CASES[case]
    bias = rc.draw_expert_bias(rng, 16) if with_bias else None
    logits = jnp.asarray(rc.draw_logits_with_margin(rng, 64, 16, topk, kwargs, bias, 0.05))
    check_grads(lambda x: router.topk(x, topk, expert_bias=bias, **kwargs)[0], (logits,), **F32_FD)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_scores_float32_gradient_equals_finite_differences(score_function, seed, rng):
    logits = rc.draw_logits(rng, (64, 16), jnp.float32)
    check_grads(lambda x: router.aux_loss_scores(x, 4, score_function=score_function)[1], (logits,), **F32_FD)


def test_aux_loss_float32_gradient_equals_finite_differences(seed, rng):
    probs = jnp.asarray(rng.random((64, 16)).astype(np.float32))
    counts = jnp.asarray(rng.integers(0, 50, 16), dtype=jnp.int32)
    check_grads(lambda p: router.aux_loss(p, counts, total_num_tokens=64, topk=4, coeff=1.0), (probs,), **F32_FD)
