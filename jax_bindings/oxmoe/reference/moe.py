"""The MoE layer in plain JAX: the semantics :func:`oxmoe.moe.moe` matches on one device,
as MaxText writes the layer.

``jax.lax.top_k`` routing (:func:`oxmoe.reference.router.top_experts`), the token
copies sorted by expert with ``argsort``, ``jax.lax.ragged_dot`` for the fused
``[E, H, 2F]`` (or ``[E, H, F]``) up and the ``[E, F, H]`` down projection, the
rows unsorted with ``argsort`` and summed weighted. The rounding points are the
layer's: tokens and weights in ``config.dtype``, products accumulated in float32
and rounded to ``config.dtype`` after each GEMM and after the activation; the
router's product in ``config.dtype`` (float32 with ``float32_gate_logits``); the
router and the losses in float32. Differentiable by JAX's autodiff (the choice of
experts held fixed, as in the layer). With ``capacity_factor``, each expert's copies
past its capacity (in token order) get weight zero. With ``shared_ffn``, the shared
experts' dense MLP (``jnp.dot``, rounded the same way) times the optional
``sigmoid(x @ shared_gate)`` is added to the routed sum in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe.moe import MoEAux, MoEConfig, MoEParams
from oxmoe.reference.activation import activate
from oxmoe.reference.router import top_experts

__all__ = ["moe", "shared_experts", "load_balancing_loss", "z_loss"]

_F32 = jnp.float32


def load_balancing_loss(logits, config: MoEConfig):
    """The layer's ``load_balancing_loss``: ``aux_loss_coeff * E / (k T^2) * sum_e P_e f_e``
    over the ``[T, E]`` float32 logits, ``P_e`` the sum of the dense scores (softmax, or sigmoid
    normalised per token) and ``f_e`` the count of the plain top-k of those scores (no groups,
    no bias)."""
    t, e = logits.shape
    if config.score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        scores = scores / scores.sum(-1, keepdims=True)
    _, chosen = jax.lax.top_k(scores, config.topk)
    counts = jnp.bincount(chosen.reshape(-1), length=e).astype(_F32)
    scale = config.aux_loss_coeff * e / (config.topk * float(t) ** 2)
    return scale * jnp.sum(scores.sum(0) * counts)


def z_loss(logits, config: MoEConfig):
    """The layer's ``z_loss``: ``z_loss_coeff * mean_t logsumexp(logits[t])^2``."""
    return config.z_loss_coeff * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def shared_experts(xs, params: MoEParams, config: MoEConfig):
    """``[T, H]`` float32: the shared experts' MLP of the tokens ``xs`` (in ``config.dtype``),
    rounded to ``config.dtype``, times ``sigmoid(xs @ shared_gate)`` with ``config.shared_gate``."""
    dtype = config.dtype
    up, down, gate = params.shared_up, params.shared_down, params.shared_gate
    assert up is not None and down is not None, "shared_ffn needs params.shared_up and shared_down"
    u = jnp.dot(xs, up.astype(dtype), preferred_element_type=_F32).astype(dtype)
    out = jnp.dot(activate(u, config.activation, dtype), down.astype(dtype),
                  preferred_element_type=_F32).astype(dtype).astype(_F32)
    if config.shared_gate:
        assert gate is not None, "shared_gate needs params.shared_gate"
        out = jax.nn.sigmoid(jnp.dot(xs, gate.astype(dtype), preferred_element_type=_F32)) * out
    return out


def moe(x, params: MoEParams, config: MoEConfig):
    """:func:`oxmoe.moe.moe` on one device in plain JAX.

    Args:
      x: ``[..., H]`` tokens.
      params: the layer's weights (:class:`oxmoe.moe.MoEParams`).
      config: what the layer computes (:class:`oxmoe.moe.MoEConfig`; ``exchange`` and
        ``align_size`` do not change the result; with ``capacity_factor``, ``x``'s tokens
        are those of the expert axis, in its order).

    Returns:
      ``(y, aux)``: ``y`` like ``x`` in ``config.dtype`` and an :class:`oxmoe.moe.MoEAux`.
    """
    dtype = config.dtype
    h, e, k = x.shape[-1], config.num_experts, config.topk
    xs = x.reshape(-1, h).astype(dtype)
    t = xs.shape[0]
    if config.float32_gate_logits:
        logits = jnp.dot(x.reshape(-1, h).astype(_F32), params.gate.astype(_F32), preferred_element_type=_F32)
    else:
        logits = jnp.dot(xs, params.gate.astype(dtype), preferred_element_type=_F32)
    weights, experts = top_experts(
        logits, k, score_function=config.score_function, use_pre_softmax=config.use_pre_softmax,
        num_groups=config.num_groups, group_topk=config.group_topk, scaling_factor=config.scaling_factor,
        expert_bias=params.expert_bias if config.use_expert_bias else None)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)  # the token copies grouped by expert, in token order (a stable sort)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    dropped = jnp.zeros((), jnp.int32)
    capacity = config.expert_capacity(t)
    if capacity is not None:
        starts = jnp.cumsum(group_sizes) - group_sizes
        position = jnp.zeros_like(flat).at[order].set(jnp.arange(t * k) - starts[flat[order]])
        kept = (position < capacity).reshape(t, k)
        weights = jnp.where(kept, weights, 0)
        dropped = (~kept).sum(dtype=jnp.int32)
    rows = jnp.take(xs, order // k, axis=0)
    hidden = activate(jax.lax.ragged_dot(rows, params.up.astype(dtype), group_sizes), config.activation, dtype)
    out = jax.lax.ragged_dot(hidden, params.down.astype(dtype), group_sizes)
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(t, k, h)
    # An elementwise sum, not an einsum: a float32 dot could run in TF32 on a GPU.
    y = (out.astype(_F32) * weights[..., None]).sum(1).astype(dtype)
    if config.shared_ffn is not None:
        y = (y.astype(_F32) + shared_experts(xs, params, config)).astype(dtype)
    aux = MoEAux(load_balancing_loss=load_balancing_loss(logits, config), z_loss=z_loss(logits, config),
                 tokens_per_expert=group_sizes, dropped_copies=dropped)
    return y.reshape(x.shape), aux
