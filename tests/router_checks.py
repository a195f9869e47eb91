"""Shared test helpers: input dtypes and their tolerances, random inputs, and the
comparisons of oxmoe's router outputs with the float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import router_reference as ref

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}

# Elementwise relative tolerance of a value rounded to the dtype after float32 arithmetic
# (bf16 keeps 8 mantissa bits, f16 11, f32 24 less a few ulps of arithmetic).
RTOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 1e-3}
# Absolute slack of a forward value: a few float32 ulps of the tensor's largest magnitude.
ATOL_OF_MAX = 1e-6
# Absolute slack of a gradient element: float32 cancellation (g - sum g s, 1 - sigmoid) loses
# precision relative to the terms it subtracts, not to the result; ~30 ulps of those terms.
ATOL_OF_TERMS = 2e-6
# The floor: the kernels compute in float32, whose values below its smallest normal number
# keep few digits or none (a sigmoid whose e^-x overflows is 0); f16 also has subnormal
# spacing 6e-8.
F32_TINY = float(np.finfo(np.float32).tiny)
ATOL_FLOOR = {jnp.dtype(jnp.float32): F32_TINY, jnp.dtype(jnp.bfloat16): F32_TINY, jnp.dtype(jnp.float16): 6e-8}
# The float32 outputs (scores, loss) whatever the input dtype.
F32 = jnp.dtype(jnp.float32)


def draw_logits(rng: np.random.Generator, shape, dtype, scale: float = 2.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def draw_expert_bias(rng: np.random.Generator, num_experts: int):
    return jnp.asarray((rng.standard_normal(num_experts) * 0.1).astype(np.float32))


def draw_like(rng: np.random.Generator, shape, dtype):
    """A random cotangent (or other dense array) of the given shape and dtype."""
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def assert_close(actual, expected, dtype, *, what: str, context: str, terms=None) -> None:
    """Elementwise closeness for a value rounded to dtype; `terms` is the per-element magnitude
    of what a gradient formula subtracts (see *_backward_terms), None for a forward value."""
    dtype = jnp.dtype(dtype)
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual).astype(np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape} ({context})"
    if terms is None:
        atol = ATOL_OF_MAX * (float(np.abs(expected).max()) if expected.size else 0.0)
    else:
        atol = ATOL_OF_TERMS * np.asarray(terms, dtype=np.float64)
    atol = atol + ATOL_FLOOR[dtype]
    # assert_allclose takes a scalar atol: compare |actual - expected| <= atol + rtol |expected| directly.
    bad = ~(np.abs(actual - expected) <= atol + RTOL[dtype] * np.abs(expected))
    if bad.any():
        where = [tuple(int(i) for i in w) for w in np.argwhere(bad)[:6]]
        lines = [
            f"{w}: got {actual[w]!r}, expected {expected[w]!r}, allowed {np.broadcast_to(atol, bad.shape)[w] + RTOL[dtype] * abs(expected[w]):.3g}"
            for w in where
        ]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ beyond rtol={RTOL[dtype]} "
            f"({'atol from terms' if terms is not None else f'atol={float(np.max(atol)):.3g}'}):\n  "
            + "\n  ".join(lines) + f"\n({context})"
        )


def topk_backward_terms(grad_probs, logits, routing_map, topk: int, kwargs: dict) -> np.ndarray:
    """Per element, the magnitude of the terms topk's backward combines (its float32 error scale)."""
    x = ref.as_f64(logits)
    chosen = np.asarray(routing_map, dtype=bool)
    scale = abs(kwargs.get("scaling_factor") or 1.0)
    g = np.abs(np.where(chosen, ref.as_f64(grad_probs), 0.0)) * scale
    if kwargs.get("score_function", "softmax") == "softmax":
        if kwargs.get("use_pre_softmax", False):
            w = ref.softmax(x)
        else:
            w = ref.topk_probs(x, chosen, topk)
        return w * (g + (g * w).sum(axis=-1, keepdims=True))
    s = ref.sigmoid(x)
    if topk == 1:
        return g * s
    total = np.where(chosen, s, 0.0).sum(axis=-1, keepdims=True)
    w = np.where(chosen, s, 0.0) / total
    return np.where(chosen, (g + (g * w).sum(axis=-1, keepdims=True)) / total * s, 0.0)


def aux_loss_scores_backward_terms(grad_scores, logits, score_function: str) -> np.ndarray:
    x = ref.as_f64(logits)
    g = np.abs(ref.as_f64(grad_scores))
    if score_function == "softmax":
        s = ref.softmax(x)
        return s * (g + (g * s).sum(axis=-1, keepdims=True))
    s = ref.sigmoid(x)
    total = s.sum(axis=-1, keepdims=True)
    return (g + (g * s / total).sum(axis=-1, keepdims=True)) / total * s


def assert_routing_matches(actual, expected_map, margin, topk: int, *, what: str, context: str) -> None:
    """The routing map equals the reference's, except on genuine float32-vs-float64 near-ties.

    A token may differ only if the reference's relative selection margin is above zero
    (an exact tie must go to the lower index) and below NEAR_TIE_RTOL, such tokens must be
    rare, and every token still selects exactly topk experts.
    """
    actual = np.asarray(actual)
    assert actual.dtype == np.bool_, f"{what}: dtype {actual.dtype}, expected bool ({context})"
    assert actual.shape == expected_map.shape, f"{what}: shape {actual.shape} != {expected_map.shape} ({context})"
    num_experts = actual.shape[-1]
    rows = actual.reshape(-1, num_experts)
    counts = rows.sum(axis=-1)
    assert (counts == topk).all(), (
        f"{what}: tokens {np.flatnonzero(counts != topk)[:10].tolist()} select "
        f"{counts[counts != topk][:10].tolist()} experts, expected {topk} ({context})"
    )
    expected_rows = expected_map.reshape(-1, num_experts)
    margins = np.asarray(margin).reshape(-1)
    differs = np.flatnonzero((rows != expected_rows).any(axis=-1))
    if differs.size == 0:
        return
    details = [
        f"token {t}: got {np.flatnonzero(rows[t]).tolist()}, reference {np.flatnonzero(expected_rows[t]).tolist()}, "
        f"reference margin {margins[t]:.3g}"
        for t in differs[:8]
    ]
    not_near_tie = differs[~((margins[differs] > 0) & (margins[differs] < ref.NEAR_TIE_RTOL))]
    assert not_near_tie.size == 0, (
        f"{what}: {not_near_tie.size} token(s) select differently from the float64 reference without being "
        f"a near-tie (exact ties must go to the lower index):\n  " + "\n  ".join(details) + f"\n({context})"
    )
    allowed = 1 + rows.shape[0] // 100
    assert differs.size <= allowed, (
        f"{what}: {differs.size} near-tie tokens differ from the reference, more than the {allowed} expected of "
        f"float32 rounding:\n  " + "\n  ".join(details) + f"\n({context})"
    )


def weight_options(kwargs: dict) -> dict:
    """The options of topk's kwargs that decide the weights of a given selection."""
    return dict(
        score_function=kwargs.get("score_function", "softmax"),
        use_pre_softmax=kwargs.get("use_pre_softmax", False),
        scaling_factor=kwargs.get("scaling_factor"),
    )


def check_topk(probs, routing_map, logits, topk: int, kwargs: dict, expert_bias, *, context: str) -> ref.TopkResult:
    """oxmoe.router.topk's outputs against the reference; returns the reference result."""
    expected = ref.topk(logits, topk, expert_bias=expert_bias, **kwargs)
    assert probs.dtype == logits.dtype, f"probs dtype {probs.dtype} != logits dtype {logits.dtype} ({context})"
    assert_routing_matches(routing_map, expected.routing_map, expected.margin, topk, what="routing_map", context=context)
    # Weights of the selection actually made (equal to the reference's wherever the selection agrees).
    expected_probs = ref.topk_probs(
        logits,
        np.asarray(routing_map),
        topk,
        **weight_options(kwargs),
    )
    assert_close(probs, expected_probs, logits.dtype, what="probs", context=context)
    return expected


def check_topk_grad(grad_logits, grad_probs, logits, routing_map, topk: int, kwargs: dict, *, context: str) -> None:
    expected = ref.topk_backward(
        grad_probs,
        logits,
        np.asarray(routing_map),
        topk,
        **weight_options(kwargs),
    )
    assert grad_logits.dtype == logits.dtype, f"grad dtype {grad_logits.dtype} != {logits.dtype} ({context})"
    terms = topk_backward_terms(grad_probs, logits, routing_map, topk, kwargs)
    assert_close(grad_logits, expected, logits.dtype, what="d logits", context=context, terms=terms)


def check_aux_loss_scores_grad(grad_logits, grad_scores, logits, score_function: str, *, context: str) -> None:
    expected = ref.aux_loss_scores_backward(grad_scores, logits, score_function=score_function)
    assert grad_logits.dtype == logits.dtype, f"grad dtype {grad_logits.dtype} != {logits.dtype} ({context})"
    terms = aux_loss_scores_backward_terms(grad_scores, logits, score_function)
    assert_close(grad_logits, expected, logits.dtype, what="d logits", context=context, terms=terms)


def check_aux_loss_scores(
    routing_map, scores, logits, topk: int, score_function: str, *, context: str
) -> ref.AuxLossScoresResult:
    """oxmoe.router.aux_loss_scores' outputs against the reference; returns the reference result."""
    expected = ref.aux_loss_scores(logits, topk, score_function=score_function)
    assert scores.dtype == F32, f"scores dtype {scores.dtype}, expected float32 ({context})"
    assert_close(scores, expected.scores, F32, what="scores", context=context)
    assert_routing_matches(routing_map, expected.routing_map, expected.margin, topk, what="routing_map", context=context)
    return expected


def check_aux_loss(loss, probs, tokens_per_expert, *, total_num_tokens, topk, coeff, context: str) -> None:
    expected = ref.aux_loss(probs, tokens_per_expert, total_num_tokens=total_num_tokens, topk=topk, coeff=coeff)
    assert loss.dtype == F32 and loss.shape == (), f"loss {loss.dtype}{loss.shape}, expected float32 scalar ({context})"
    assert_close(loss, expected, F32, what="loss", context=context)


def draw_logits_with_margin(
    rng: np.random.Generator, num_tokens: int, num_experts: int, topk: int, kwargs: dict, expert_bias, min_margin: float
) -> np.ndarray:
    """float32 logits [T, E] whose reference selection margins all exceed min_margin (relative),
    so that a small perturbation (finite differences) cannot change the selection."""
    rows = []
    while sum(len(r) for r in rows) < num_tokens:
        candidates = (rng.standard_normal((4 * num_tokens, num_experts)) * 2.0).astype(np.float32)
        margin = ref.topk(candidates, topk, expert_bias=expert_bias, **kwargs).margin
        rows.append(candidates[margin > min_margin])
    return np.concatenate(rows)[:num_tokens]
