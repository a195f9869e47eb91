"""Forward values of the router primitives against the float64 reference, on fresh random
data, for the router configurations of real models and token counts that are not powers of two."""

import jax.numpy as jnp
import numpy as np
import pytest

import router_checks as rc
from oxmoe.model_shapes import ROUTER_CONFIGS
from oxmoe import router

NUM_TOKENS = [333, 1000, 4097]
CONFIGS = pytest.mark.parametrize("config", ROUTER_CONFIGS, ids=lambda c: c.name)
DTYPES = pytest.mark.parametrize("dtype", list(rc.DTYPES.values()), ids=list(rc.DTYPES))


@CONFIGS
@DTYPES
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_topk_matches_float64_reference(config, dtype, num_tokens, seed, rng):
    logits = rc.draw_logits(rng, (num_tokens, config.num_experts), dtype)
    bias = rc.draw_expert_bias(rng, config.num_experts) if config.use_expert_bias else None
    probs, routing_map = router.topk(logits, config.topk, expert_bias=bias, **config.topk_kwargs())
    rc.check_topk(probs, routing_map, logits, config.topk, config.topk_kwargs(), bias, context=f"seed={seed}")


@CONFIGS
@DTYPES
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_aux_loss_scores_match_float64_reference(config, dtype, num_tokens, seed, rng):
    logits = rc.draw_logits(rng, (num_tokens, config.num_experts), dtype)
    routing_map, scores = router.aux_loss_scores(logits, config.topk, score_function=config.score_function)
    rc.check_aux_loss_scores(
        routing_map, scores, logits, config.topk, config.score_function, context=f"seed={seed}"
    )


def _router_probs(rng, num_tokens, num_experts, topk, dtype):
    """Realistic aux-loss inputs: top-k softmax probabilities and the per-expert token counts."""
    logits = rng.standard_normal((num_tokens, num_experts))
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :topk]
    mask = np.zeros_like(logits, dtype=bool)
    np.put_along_axis(mask, chosen, True, axis=-1)
    weights = np.where(mask, np.exp(logits), 0.0)
    probs = jnp.asarray((weights / weights.sum(-1, keepdims=True)).astype(np.float32)).astype(dtype)
    return probs, mask.sum(axis=0).astype(np.int32)


@CONFIGS
@DTYPES
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("counts_dtype", [jnp.int32, jnp.float32], ids=["int32_counts", "f32_counts"])
def test_aux_loss_matches_float64_reference(config, dtype, num_tokens, counts_dtype, seed, rng):
    probs, counts = _router_probs(rng, num_tokens, config.num_experts, config.topk, dtype)
    tokens_per_expert = jnp.asarray(counts, dtype=counts_dtype)
    kwargs = dict(total_num_tokens=num_tokens, topk=config.topk, coeff=1e-2)
    loss = router.aux_loss(probs, tokens_per_expert, **kwargs)
    rc.check_aux_loss(loss, probs, tokens_per_expert, **kwargs, context=f"seed={seed}")


def test_aux_loss_with_more_global_tokens_than_int32_can_square(seed, rng):
    # total_num_tokens counts every data-parallel rank; 300_000**2 overflows int32.
    probs, counts = _router_probs(rng, 333, 64, 4, jnp.float32)
    kwargs = dict(total_num_tokens=300_000, topk=4, coeff=0.5)
    loss = router.aux_loss(probs, jnp.asarray(counts * 900), **kwargs)
    rc.check_aux_loss(loss, probs, counts * 900, **kwargs, context=f"seed={seed}")


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_topk_scaling_factor_multiplies_the_weights(score_function, seed, rng):
    logits = rc.draw_logits(rng, (1000, 64), jnp.float32)
    kwargs = dict(score_function=score_function, scaling_factor=0.37)
    probs, routing_map = router.topk(logits, 6, **kwargs)
    rc.check_topk(probs, routing_map, logits, 6, kwargs, None, context=f"seed={seed}")


@pytest.mark.parametrize("dtype", list(rc.DTYPES.values()), ids=list(rc.DTYPES))
def test_topk_with_all_experts_selected_returns_the_full_weights(dtype, seed, rng):
    logits = rc.draw_logits(rng, (333, 16), dtype)
    probs, routing_map = router.topk(logits, 16)
    assert np.asarray(routing_map).all(), f"seed={seed}"
    rc.check_topk(probs, routing_map, logits, 16, {}, None, context=f"seed={seed}")


def test_topk_expert_bias_changes_the_choice_but_not_the_weights(seed, rng):
    logits = rc.draw_logits(rng, (1000, 32), jnp.float32)
    # A bias this large overrides the logits: experts 0..3 are always chosen.
    bias = jnp.asarray(np.where(np.arange(32) < 4, 10.0, 0.0).astype(np.float32))
    probs, routing_map = router.topk(logits, 4, score_function="sigmoid", expert_bias=bias)
    np.testing.assert_array_equal(
        np.asarray(routing_map), np.broadcast_to(np.arange(32) < 4, (1000, 32)), err_msg=f"seed={seed}"
    )
    rc.check_topk(probs, routing_map, logits, 4, dict(score_function="sigmoid"), bias, context=f"seed={seed}")
