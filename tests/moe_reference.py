"""Plain-JAX dense reference of the MoE layer oxmoe.moe.moe, written from the contract's
"Semantics" (notes: issue 6), not from the implementation.

Every token is multiplied by every expert (one einsum over all E experts) and the routing
weights, zero off the chosen experts, pick the results: no dispatch, no exchange, no padding,
so it holds for every expert / data sharding, exchange and align_size of the layer. The
rounding points are the contract's: tokens and weights in config.dtype, products accumulated
in float32 (precision HIGHEST, so a GPU does not take TF32) and rounded to config.dtype after
each GEMM and after the activation; the router's product of the tokens and its weight taken in
config.dtype, or in float32 with config.float32_gate_logits; the router and the losses in
float32. It is differentiable
with jax.grad (the choice of experts is held fixed, as in the layer).

The router (top-k of softmax or of sigmoid scores with groups and expert bias) and the losses
are oxmoe.reference's, plain JAX rather than oxmoe.router's primitives: the reference shares
no code with what it checks. `config` is any object with MoEConfig's fields, `params` any with
MoEParams'.

Random inputs and the comparison of a result with this reference: moe_checks.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from oxmoe import reference
from oxmoe.reference.moe import load_balancing_loss, z_loss

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def _gelu(u):
    return jax.nn.gelu(u, approximate=True)


# u -> h, in float32 (u already rounded to the compute dtype); GLU ones split u [..., 2F] into
# the gate half [..., :F] and the up half [..., F:].
ACTIVATIONS = {
    "swiglu": lambda u: jax.nn.silu(u[..., : u.shape[-1] // 2]) * u[..., u.shape[-1] // 2:],
    "geglu": lambda u: _gelu(u[..., : u.shape[-1] // 2]) * u[..., u.shape[-1] // 2:],
    "gelu": _gelu,
    "silu": jax.nn.silu,
}
GLU_ACTIVATIONS = ("swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class Aux:
    load_balancing_loss: Any  # f32 scalar, times aux_loss_coeff
    z_loss: Any  # f32 scalar, times z_loss_coeff
    tokens_per_expert: Any  # [E] int32, before capacity drops
    dropped_copies: Any  # int32 scalar


jax.tree_util.register_dataclass(Aux, data_fields=["load_balancing_loss", "z_loss", "tokens_per_expert",
                                                   "dropped_copies"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class Params:
    """MoEParams' fields, for the reference's own use (the tests pass oxmoe's MoEParams)."""

    gate: Any
    up: Any
    down: Any
    expert_bias: Any = None
    shared_up: Any = None
    shared_down: Any = None
    shared_gate: Any = None


jax.tree_util.register_dataclass(Params, data_fields=["gate", "up", "down", "expert_bias", "shared_up", "shared_down",
                                                      "shared_gate"], meta_fields=[])



# ------------------------------------------------------------------------ router


def route(logits, config, expert_bias=None):
    """(probs [T, E] float32, routing_map [T, E] bool) of float32 logits [T, E]: the plain-JAX
    router with config's options; expert_bias only counts with config.use_expert_bias."""
    return reference.router.topk(logits, config.topk, score_function=config.score_function,
                                 use_pre_softmax=config.use_pre_softmax, num_groups=config.num_groups,
                                 group_topk=config.group_topk, scaling_factor=config.scaling_factor,
                                 expert_bias=expert_bias if config.use_expert_bias else None)


# ------------------------------------------------------------------------- layer


def router_dtype(config):
    """The dtype the router's product takes the tokens and its weight in."""
    return F32 if config.float32_gate_logits else config.dtype


def router_logits(x, gate, dtype):
    """[T, E] float32 logits of the tokens x [..., H] and the router weight, both cast to dtype."""
    xs = x.reshape(-1, x.shape[-1]).astype(dtype)
    return jnp.dot(xs, gate.astype(dtype), preferred_element_type=F32, precision=HIGHEST)


def expert_outputs(xs, up, down, config):
    """[E, T, H] in config.dtype: every expert applied to every token (rounded as the contract
    says: after the up GEMM, the activation and the down GEMM)."""
    dtype = config.dtype
    u = jnp.einsum("th,ehf->etf", xs, up.astype(dtype), preferred_element_type=F32, precision=HIGHEST).astype(dtype)
    h = ACTIVATIONS[config.activation](u.astype(F32)).astype(dtype)
    return jnp.einsum("etf,efh->eth", h, down.astype(dtype), preferred_element_type=F32,
                      precision=HIGHEST).astype(dtype)


def shared_experts(xs, params, config):
    """[T, H] float32: the contract's shared experts (config.shared_ffn, issue 20): a dense MLP
    of the tokens xs [T, H] (in config.dtype) with the experts' activation, rounded to
    config.dtype after the up product [H, 2Fs] (or [H, Fs]), the activation and the down
    product [Fs, H]; with config.shared_gate, times sigmoid(xs @ shared_gate [H, 1]) (a float32
    product of config.dtype operands). Zero without shared experts."""
    if getattr(config, "shared_ffn", None) is None:
        return jnp.zeros(xs.shape, F32)
    dtype = config.dtype

    def dot(a, b):
        return jnp.dot(a, b.astype(dtype), preferred_element_type=F32, precision=HIGHEST)

    u = dot(xs, params.shared_up).astype(dtype)
    out = dot(ACTIVATIONS[config.activation](u.astype(F32)).astype(dtype), params.shared_down).astype(dtype)
    out = out.astype(F32)
    if config.shared_gate:
        out = jax.nn.sigmoid(dot(xs, params.shared_gate)) * out
    return out


def moe(x, params, config):
    """(y, Aux) of the whole layer on all tokens x [B, S, H] or [T, H]: y like x in config.dtype."""
    dtype = config.dtype
    xs = x.reshape(-1, x.shape[-1]).astype(dtype)
    logits = router_logits(x, params.gate, router_dtype(config))
    probs, chosen = route(logits, config, params.expert_bias)
    kept = within_capacity(chosen, config)
    o = expert_outputs(xs, params.up, params.down, config)
    y = jnp.einsum("te,eth->th", jnp.where(kept, probs, 0), o.astype(F32), precision=HIGHEST).astype(dtype)
    y = (y.astype(F32) + shared_experts(xs, params, config)).astype(dtype)  # routed output rounded, then the sum
    aux = Aux(load_balancing_loss(logits, config), z_loss(logits, config), chosen.sum(axis=0).astype(jnp.int32),
              (chosen & ~kept).sum(dtype=jnp.int32))
    return y.reshape(x.shape), aux


def within_capacity(chosen, config):
    """[T, E] bool: the chosen copies within capacity_factor's room, ceil(factor * T k / E) per
    expert, taken in token order (all of them without a capacity_factor)."""
    factor = getattr(config, "capacity_factor", None)
    if factor is None:
        return chosen
    tokens, experts = chosen.shape
    room = max(1, math.ceil(factor * tokens * config.topk / experts))
    earlier = jnp.cumsum(chosen, axis=0, dtype=jnp.int32) - chosen  # earlier tokens that chose the expert
    return chosen & (earlier < room)


def total_loss(y, aux, y_weight):
    """What the tests differentiate: sum(y * y_weight) (in float32) plus both losses."""
    return jnp.sum(y.astype(F32) * y_weight) + aux.load_balancing_loss + aux.z_loss


def layer_value_and_grads(layer, x, params, y_weight):
    """((y, aux), (d x, d params)) of `layer(x, params) -> (y, aux)` for the loss `total_loss`."""

    def loss(x, params):
        y, aux = layer(x, params)
        return total_loss(y, aux, y_weight), (y, aux)

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return out, grads


def value_and_grads(x, params, config, y_weight):
    """:func:`layer_value_and_grads` of the reference."""
    return layer_value_and_grads(lambda x, params: moe(x, params, config), x, params, y_weight)
