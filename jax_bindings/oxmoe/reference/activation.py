"""The expert MLP's activation and its backward in plain JAX: the semantics of
:func:`oxmoe.activation.activation_bwd`, as the MoE layer wrote it before that primitive.

The activation in float32, rounded to the dtype asked for; its backward is ``jax.vjp`` of it,
applied to the hidden activation's gradient times each row's weight, rounded to the
input dtype; the weighted hidden activation and the row dot products with ``jnp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["activate", "activation_bwd"]

_F32 = jnp.float32


def activate(u, activation: str, dtype):
    """The activation of the up projection ``u`` ``[..., 2F]`` (gated: gate then up) or
    ``[..., F]``, in float32, rounded to ``dtype``."""
    u = u.astype(_F32)
    nonlinearity = jax.nn.silu if activation in ("swiglu", "silu") else lambda x: jax.nn.gelu(x, approximate=True)
    if activation in ("swiglu", "geglu"):
        gate, up = jnp.split(u, 2, axis=-1)
        return (nonlinearity(gate) * up).astype(dtype)
    return nonlinearity(u).astype(dtype)


def activation_bwd(grad_hidden, pre_activation, row_probs, activation: str = "swiglu"):
    """``(grad_pre_activation, weighted_hidden, grad_row_probs)`` of
    :func:`oxmoe.activation.activation_bwd`."""
    dtype = grad_hidden.dtype
    hidden, vjp = jax.vjp(lambda u: activate(u, activation, dtype), pre_activation)
    grad = grad_hidden.astype(_F32)
    (grad_pre,) = vjp((grad * row_probs[:, None]).astype(dtype))
    weighted = (hidden.astype(_F32) * row_probs[:, None]).astype(dtype)
    return grad_pre, weighted, jnp.sum(hidden.astype(_F32) * grad, axis=-1)
