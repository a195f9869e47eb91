"""The router ops in plain JAX: the semantics :mod:`oxmoe.router` matches.

Float32 arithmetic whatever the input dtype, ``jax.lax.top_k`` for every
selection (equal scores: the lower index first) and scatters for the dense
``[T, E]`` outputs. Differentiable in the logits (probs) with the choice of
experts held fixed, as oxmoe's ops are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["top_experts", "topk", "aux_loss_scores", "aux_loss"]


def _normalised_sigmoid(x):
    """``sigmoid(x)`` normalised to sum 1 over the last axis (float32 ``x``), as oxmoe's
    kernels compute it: each sigmoid times e^-c, c = min(0, the largest x), which cancels,
    so the largest term stays at least 1/2 and the sum cannot underflow to 0 (every sigmoid
    is 0 below about -88) and leave 0 / 0."""
    c = jax.lax.stop_gradient(jnp.minimum(x.max(-1, keepdims=True), 0.0))
    u = 1.0 / (jnp.exp(c) + jnp.exp(c - x))
    return u / u.sum(-1, keepdims=True)


def _scatter_rows(shape, indices, values, dtype):
    """A ``shape`` array of zeros with ``values [T, k]`` at ``indices [T, k]`` of each row."""
    rows = jnp.arange(shape[0])[:, None]
    return jnp.zeros(shape, dtype).at[rows, indices].set(values.astype(dtype))


def _best_groups_only(selection, num_groups: int, group_topk: int, topk: int):
    """``selection [T, E]`` with -inf outside each token's ``group_topk`` best groups;
    a group's score is the sum of its best ``topk // group_topk`` selection scores."""
    t, e = selection.shape
    grouped = selection.reshape(t, num_groups, e // num_groups)
    group_scores = jax.lax.top_k(grouped, topk // group_topk)[0].sum(-1)
    _, best = jax.lax.top_k(group_scores, group_topk)  # ties: the lower group
    keep = _scatter_rows((t, num_groups), best, jnp.ones_like(best), jnp.bool_)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)


def top_experts(logits, topk: int, *, score_function="softmax", use_pre_softmax=False, num_groups=None,
                group_topk=None, scaling_factor=None, expert_bias=None):
    """The choice :func:`oxmoe.router.topk` makes, as the top-k indices a JAX user keeps.

    Args:
      logits: ``[T, E]`` router logits (any float dtype).
      topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias: as
        :func:`oxmoe.router.topk`.

    Returns:
      ``(weights [T, k] float32, experts [T, k] int32)``: each token's experts in
      decreasing selection score and their routing weights; differentiable in
      ``logits`` (the choice itself is not).
    """
    x = logits.astype(jnp.float32)
    if score_function == "sigmoid":
        scores = jax.nn.sigmoid(x)
        selection = scores if expert_bias is None else scores + expert_bias
    elif use_pre_softmax:
        scores = selection = jax.nn.softmax(x, axis=-1)
    else:
        scores, selection = None, x
    if num_groups is not None:
        selection = _best_groups_only(selection, num_groups, group_topk, topk)
    _, chosen = jax.lax.top_k(selection, topk)  # ties: the lower expert
    if score_function == "sigmoid" and topk > 1:
        weights = _normalised_sigmoid(jnp.take_along_axis(x, chosen, axis=-1))
    elif scores is not None:  # sigmoid of one expert, or softmax before the choice
        weights = jnp.take_along_axis(scores, chosen, axis=-1)
    else:
        weights = jax.nn.softmax(jnp.take_along_axis(x, chosen, axis=-1), axis=-1)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    return weights, chosen


def topk(logits, topk: int, *, score_function="softmax", use_pre_softmax=False, num_groups=None,
         group_topk=None, scaling_factor=None, expert_bias=None):
    """:func:`oxmoe.router.topk` in plain JAX: the weights of :func:`top_experts` scattered
    into the experts' columns.

    Args:
      logits: ``[T, E]`` router logits (any float dtype).
      topk, score_function, use_pre_softmax, num_groups, group_topk, scaling_factor, expert_bias: as
        :func:`oxmoe.router.topk` (``expert_bias`` counts with sigmoid only).

    Returns:
      ``(probs, routing_map)``: ``probs [T, E]`` in the logits' dtype, zero off the
      selection; ``routing_map [T, E]`` bool.
    """
    weights, chosen = top_experts(logits, topk, score_function=score_function, use_pre_softmax=use_pre_softmax,
                                  num_groups=num_groups, group_topk=group_topk, scaling_factor=scaling_factor,
                                  expert_bias=expert_bias)
    probs = _scatter_rows(logits.shape, chosen, weights, logits.dtype)
    routing_map = _scatter_rows(logits.shape, chosen, jnp.ones_like(chosen), jnp.bool_)
    return probs, routing_map


def aux_loss_scores(logits, topk: int, *, score_function="softmax"):
    """:func:`oxmoe.router.aux_loss_scores` in plain JAX.

    Args:
      logits: ``[T, E]`` router logits (any float dtype).
      topk: experts per token.
      score_function: ``"softmax"`` (scores = softmax(logits)) or ``"sigmoid"``
        (sigmoid(logits) normalised to sum 1 per token).

    Returns:
      ``(routing_map [T, E] bool, scores [T, E] float32)``: the plain top-k of the
      scores (no groups, no bias) and the scores, differentiable.
    """
    x = logits.astype(jnp.float32)
    if score_function == "softmax":
        scores = jax.nn.softmax(x, axis=-1)
    else:
        scores = _normalised_sigmoid(x)
    _, chosen = jax.lax.top_k(scores, topk)
    return _scatter_rows(x.shape, chosen, jnp.ones_like(chosen), jnp.bool_), scores


def aux_loss(probs, tokens_per_expert, *, total_num_tokens: int, topk: int, coeff: float):
    """:func:`oxmoe.router.aux_loss` in plain JAX:
    ``coeff * E / (topk * total_num_tokens**2) * sum_e P_e * tokens_per_expert[e]`` with
    ``P_e = sum_t probs[t, e]``.

    Args:
      probs: ``[T, E]`` routing probabilities (any float dtype).
      tokens_per_expert: ``[E]`` token counts (int or float).
      total_num_tokens, topk, coeff: as :func:`oxmoe.router.aux_loss`.

    Returns:
      The loss, a float32 scalar, differentiable in ``probs``.
    """
    scale = coeff * probs.shape[-1] / (topk * float(total_num_tokens) ** 2)
    per_expert = probs.astype(jnp.float32).sum(0)
    return scale * jnp.sum(per_expert * tokens_per_expert.astype(jnp.float32))
