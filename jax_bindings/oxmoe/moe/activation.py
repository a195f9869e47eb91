"""The experts' activation as an oxmoe primitive over a grouped GEMM's rows
(``src/activation``): computed in float32 on the rows the groups cover, each result
rounded once to the rows' dtype; past them nothing is read and zeros are written (the
activation of the zero rows a grouped GEMM writes there). An expert-parallel layer's row
buffers are sized for the worst case, about twice the rows a shard gets on average, and
XLA's elementwise fusions ran over all of them.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from oxmoe._primitive import FfiPrimitive, Layout

DISPATCHED, WHOLE = Layout.DISPATCHED, Layout.WHOLE

#: (gated, GELU) of each activation of :class:`oxmoe.moe.MoEConfig`.
_KINDS = {"silu": (False, False), "gelu": (False, True), "swiglu": (True, False), "geglu": (True, True)}


def _hidden_spec(up, glu):
    return jax.ShapeDtypeStruct((up.shape[0], up.shape[1] // 2 if glu else up.shape[1]), up.dtype)


_forward_p = FfiPrimitive(
    "oxmoe_activation_fwd", operands=(DISPATCHED, WHOLE), results=(DISPATCHED,),
    result_specs=lambda up, sizes, *, glu, gelu: [_hidden_spec(up, glu)])
_backward_p = FfiPrimitive(
    "oxmoe_activation_bwd", operands=(DISPATCHED, DISPATCHED, WHOLE), results=(DISPATCHED, DISPATCHED),
    result_specs=lambda up, grad, sizes, *, glu, gelu: [jax.ShapeDtypeStruct(up.shape, up.dtype),
                                                         _hidden_spec(up, glu)])


def _flags(up, activation: str) -> dict:
    glu, gelu = _KINDS[activation]
    if glu and up.shape[1] % 2:
        raise ValueError(f"up has {up.shape[1]} columns: the gated activation {activation!r} takes an even number "
                         "(the gate, then the linear half)")
    return dict(glu=np.bool_(glu), gelu=np.bool_(gelu))


def forward(up, group_sizes, activation: str):
    """``[R, F]``: the activation of ``up`` (``[R, 2F]`` gated, ``[R, F]`` otherwise) on the
    rows ``group_sizes`` covers, zero past them. Not differentiable: see :func:`activate`."""
    (hidden,) = _forward_p(up, group_sizes, **_flags(up, activation))
    return hidden


def backward(up, grad_hidden, group_sizes, activation: str):
    """``(grad_up, hidden)``: the gradient of :func:`forward` for ``grad_hidden`` (cast to
    ``up``'s dtype), and the forward's result again (one pass reads ``up`` for both)."""
    grad_up, hidden = _backward_p(up, grad_hidden.astype(up.dtype), group_sizes, **_flags(up, activation))
    return grad_up, hidden


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def activate(up, group_sizes, activation: str):
    """:func:`forward`, differentiable in ``up``."""
    return forward(up, group_sizes, activation)


def _activate_fwd(up, group_sizes, activation):
    return forward(up, group_sizes, activation), (up, group_sizes)


def _activate_bwd(activation, residuals, grad_hidden):
    up, group_sizes = residuals
    return backward(up, grad_hidden, group_sizes, activation)[0], None


activate.defvjp(_activate_fwd, _activate_bwd)
