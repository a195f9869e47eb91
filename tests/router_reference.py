"""Float64 NumPy reference for the oxmoe router primitives.

Written from the semantics in the API contract, not from the implementation:
every quantity is recomputed in float64 from the inputs exactly as given (a
bfloat16 logit is upcast exactly). Selections use a stable argsort of the
negated scores, so equal scores go to the lower index.

Besides the values, `topk` and `aux_loss_scores` report each token's selection
margin: how far the chosen experts (and chosen groups) are ahead of the best
ones left out, relative to the token's score scale. An implementation that
computes in float32 may order two different experts differently from this
float64 reference only when that margin is tiny; tests use it to tell a genuine
near-tie from a wrong selection. An exact tie has margin 0, and there the
lower-index rule decides.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Relative margin below which float32 and float64 may legitimately disagree.
NEAR_TIE_RTOL = 1e-5


def as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so that exp never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores of each row; equal scores: lower index first."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def indices_to_mask(indices: np.ndarray, width: int) -> np.ndarray:
    mask = np.zeros(indices.shape[:-1] + (width,), dtype=bool)
    np.put_along_axis(mask, indices, True, axis=-1)
    return mask


def _relative(gap: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return gap / np.maximum(scale, np.finfo(np.float64).tiny)


def _selection_gap(scores: np.ndarray, chosen: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Smallest chosen score minus largest eligible unchosen score, per row (inf if none left out)."""
    worst_chosen = np.where(chosen, scores, np.inf).min(axis=-1)
    best_left_out = np.where(eligible & ~chosen, scores, -np.inf).max(axis=-1)
    return worst_chosen - best_left_out


# --------------------------------------------------------------------------- topk


@dataclasses.dataclass(frozen=True)
class TopkResult:
    probs: np.ndarray  # [..., E] float64, zero off the selection
    routing_map: np.ndarray  # [..., E] bool
    selection_scores: np.ndarray  # [..., E] float64: what the top-k is taken of
    group_scores: np.ndarray | None  # [..., G] float64 when grouped
    margin: np.ndarray  # [...] float64, relative (0: exact tie at the boundary; inf: nothing left out)


def selection_scores(logits, *, score_function="softmax", use_pre_softmax=False, expert_bias=None) -> np.ndarray:
    x = as_f64(logits)
    if score_function == "softmax":
        return softmax(x) if use_pre_softmax else x
    if score_function == "sigmoid":
        bias = np.zeros(x.shape[-1]) if expert_bias is None else as_f64(expert_bias)
        return sigmoid(x) + bias
    raise ValueError(f"unknown score_function {score_function!r}")


def group_scores(scores: np.ndarray, num_groups: int, topk: int, group_topk: int) -> np.ndarray:
    """Per group, the sum of its best floor(topk / group_topk) scores: [..., G]."""
    per_group = scores.reshape(scores.shape[:-1] + (num_groups, scores.shape[-1] // num_groups))
    best_first = -np.sort(-per_group, axis=-1)
    return best_first[..., : topk // group_topk].sum(axis=-1)


def topk_probs(
    logits, routing_map, topk: int, *, score_function="softmax", use_pre_softmax=False, scaling_factor=None
) -> np.ndarray:
    """The weights of a given selection (the selection held fixed): [..., E] float64."""
    x = as_f64(logits)
    chosen = np.asarray(routing_map, dtype=bool)
    if score_function == "softmax" and use_pre_softmax:
        weights = np.where(chosen, softmax(x), 0.0)
    elif score_function == "softmax":
        chosen_max = np.where(chosen, x, -np.inf).max(axis=-1, keepdims=True)
        e = np.where(chosen, np.exp(x - chosen_max), 0.0)
        weights = e / e.sum(axis=-1, keepdims=True)
    else:
        weights = np.where(chosen, sigmoid(x), 0.0)
        if topk > 1:
            weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights * (1.0 if scaling_factor is None else float(scaling_factor))


def topk(
    logits,
    topk: int,
    *,
    score_function="softmax",
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=None,
    expert_bias=None,
) -> TopkResult:
    scores = selection_scores(
        logits, score_function=score_function, use_pre_softmax=use_pre_softmax, expert_bias=expert_bias
    )
    num_experts = scores.shape[-1]
    if num_groups is None:
        eligible = np.ones(scores.shape, dtype=bool)
        groups = None
        group_margin = np.full(scores.shape[:-1], np.inf)
    else:
        groups = group_scores(scores, num_groups, topk, group_topk)
        chosen_groups = indices_to_mask(top_indices(groups, group_topk), num_groups)
        eligible = np.repeat(chosen_groups, num_experts // num_groups, axis=-1)
        group_gap = _selection_gap(groups, chosen_groups, np.ones_like(chosen_groups))
        group_margin = _relative(group_gap, np.abs(groups).max(axis=-1))
    routing_map = indices_to_mask(top_indices(np.where(eligible, scores, -np.inf), topk), num_experts)
    expert_gap = _selection_gap(scores, routing_map, eligible)
    expert_margin = _relative(expert_gap, np.abs(scores).max(axis=-1))
    probs = topk_probs(
        logits,
        routing_map,
        topk,
        score_function=score_function,
        use_pre_softmax=use_pre_softmax,
        scaling_factor=scaling_factor,
    )
    return TopkResult(probs, routing_map, scores, groups, np.minimum(expert_margin, group_margin))


def topk_backward(
    grad_probs, logits, routing_map, topk: int, *, score_function="softmax", use_pre_softmax=False, scaling_factor=None
) -> np.ndarray:
    """d logits from d probs with the selection held fixed (analytic): [..., E] float64."""
    x = as_f64(logits)
    chosen = np.asarray(routing_map, dtype=bool)
    g = np.where(chosen, as_f64(grad_probs), 0.0) * (1.0 if scaling_factor is None else float(scaling_factor))
    if score_function == "softmax" and use_pre_softmax:
        # probs = s * chosen with s = softmax(x): the Jacobian of softmax applied to g.
        s = softmax(x)
        return s * (g - (g * s).sum(axis=-1, keepdims=True))
    if score_function == "softmax":
        # probs = softmax over the chosen logits only.
        w = topk_probs(x, chosen, topk)
        return w * (g - (g * w).sum(axis=-1, keepdims=True))
    s = sigmoid(x)
    if topk == 1:
        grad_s = g
    else:
        # w_i = s_i / S over the chosen: d s_j = (g_j - sum_i g_i w_i) / S on the chosen.
        total = np.where(chosen, s, 0.0).sum(axis=-1, keepdims=True)
        w = np.where(chosen, s, 0.0) / total
        grad_s = np.where(chosen, (g - (g * w).sum(axis=-1, keepdims=True)) / total, 0.0)
    return grad_s * s * (1.0 - s)


# --------------------------------------------------------------- aux_loss_scores


@dataclasses.dataclass(frozen=True)
class AuxLossScoresResult:
    routing_map: np.ndarray  # [..., E] bool
    scores: np.ndarray  # [..., E] float64
    margin: np.ndarray  # [...] float64, relative


def aux_loss_scores(logits, topk: int, *, score_function="softmax") -> AuxLossScoresResult:
    x = as_f64(logits)
    if score_function == "softmax":
        scores = softmax(x)
    elif score_function == "sigmoid":
        s = sigmoid(x)
        scores = s / s.sum(axis=-1, keepdims=True)
    else:
        raise ValueError(f"unknown score_function {score_function!r}")
    routing_map = indices_to_mask(top_indices(scores, topk), scores.shape[-1])
    gap = _selection_gap(scores, routing_map, np.ones_like(routing_map))
    return AuxLossScoresResult(routing_map, scores, _relative(gap, np.abs(scores).max(axis=-1)))


def aux_loss_scores_backward(grad_scores, logits, *, score_function="softmax") -> np.ndarray:
    x = as_f64(logits)
    g = as_f64(grad_scores)
    if score_function == "softmax":
        s = softmax(x)
        return s * (g - (g * s).sum(axis=-1, keepdims=True))
    s = sigmoid(x)
    total = s.sum(axis=-1, keepdims=True)
    p = s / total
    grad_s = (g - (g * p).sum(axis=-1, keepdims=True)) / total
    return grad_s * s * (1.0 - s)


# ---------------------------------------------------------------------- aux_loss


def aux_loss_constant(num_experts: int, *, total_num_tokens: int, topk: int, coeff: float) -> float:
    return float(coeff) * num_experts / (topk * float(total_num_tokens) ** 2)


def aux_loss(probs, tokens_per_expert, *, total_num_tokens: int, topk: int, coeff: float) -> float:
    p = as_f64(probs)
    num_experts = p.shape[-1]
    per_expert = p.reshape(-1, num_experts).sum(axis=0)
    c = aux_loss_constant(num_experts, total_num_tokens=total_num_tokens, topk=topk, coeff=coeff)
    return c * float((per_expert * as_f64(tokens_per_expert)).sum())


def aux_loss_backward(grad_loss, probs_shape, tokens_per_expert, *, total_num_tokens: int, topk: int, coeff: float):
    num_experts = probs_shape[-1]
    c = aux_loss_constant(num_experts, total_num_tokens=total_num_tokens, topk=topk, coeff=coeff)
    row = c * as_f64(tokens_per_expert) * float(grad_loss)
    return np.broadcast_to(row, tuple(probs_shape)).copy()
