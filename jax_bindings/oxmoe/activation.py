"""The expert MLP's activation backward, in one pass over the rows.

In a MoE layer's backward, each dispatched row ``r`` (routing weight ``p_r``)
has its hidden activation's gradient before the weight, ``grad_hidden[r]``
(the down projection's d lhs product), and its up projection's output before
the activation, ``pre_activation[r]``, kept from the forward. From them the
backward needs the up projection's gradient, the hidden activation times the
weight (the down weight gradient's operand) and the weight's gradient, the
dot of the hidden activation with ``grad_hidden[r]``. :func:`activation_bwd`
computes the three reading each input once, where XLA's fusions read the
pre-activation twice and wrote and read the gradient after the weight.
"""

from __future__ import annotations

import typing

import jax
import numpy as np

from oxmoe._checks import called_eagerly, check_array, check_float_dtype
from oxmoe._primitive import FfiPrimitive, Layout, vary_alike

__all__ = ["ACTIVATIONS", "ActivationGrads", "activation_bwd", "gated"]

ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu")
"""The expert MLP's activations: ``"swiglu"`` (``silu(gate) * up``), ``"geglu"``
(``gelu(gate) * up``), ``"gelu"`` and ``"silu"``; GELU is the tanh approximation."""

ROWS, DISPATCHED, WHOLE = Layout.ROWS, Layout.DISPATCHED, Layout.WHOLE


def gated(activation: str) -> bool:
    """Whether ``activation`` takes the up projection's output as ``[gate, up]``."""
    return activation in ("swiglu", "geglu")


def _check_activation(activation) -> None:
    """``activation`` is one of :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _hidden_columns(activation: str, columns: int) -> int:
    """The hidden activation's columns of an up projection's output of ``columns``:
    half of them when gated."""
    return columns // 2 if gated(activation) else columns


class ActivationGrads(typing.NamedTuple):
    """The result of :func:`activation_bwd`.

    Attributes:
      grad_pre_activation: shaped and typed as ``pre_activation``: the up
        projection's gradient.
      weighted_hidden: ``[R, F]`` in the input dtype: each row's hidden activation
        times its weight.
      grad_row_probs: ``[R]`` float32: each row weight's gradient.
    """

    grad_pre_activation: jax.Array
    weighted_hidden: jax.Array
    grad_row_probs: jax.Array


def _result_specs(grad_hidden, pre_activation, row_probs, *_, **__):
    return [jax.ShapeDtypeStruct(pre_activation.shape, pre_activation.dtype),
            jax.ShapeDtypeStruct(grad_hidden.shape, grad_hidden.dtype),
            jax.ShapeDtypeStruct(row_probs.shape, np.float32)]


_activation_bwd_p = FfiPrimitive(
    "oxmoe_activation_bwd", operands=(ROWS, ROWS, ROWS), results=(ROWS, ROWS, ROWS), result_specs=_result_specs)
# With group_sizes, which rows are computed depends on the rows before them (the groups' first
# rows): the rows are a dispatch's, seen whole, no longer independent rows of tokens.
_activation_bwd_of_groups_p = FfiPrimitive(
    "oxmoe_activation_bwd", operands=(DISPATCHED, DISPATCHED, DISPATCHED, WHOLE),
    results=(DISPATCHED, DISPATCHED, DISPATCHED), result_specs=_result_specs)


def activation_bwd(grad_hidden, pre_activation, row_probs, activation: str = "swiglu", *,
                   group_sizes=None) -> ActivationGrads:
    """The activation's backward of each row, weighted by its routing weight.

    For row ``r`` with weight ``p = row_probs[r]``, in float32, ``round`` the
    rounding to the input dtype: ``h = round(act(gate) * up)`` (gated;
    ``round(act(x))`` otherwise), the forward's hidden activation;
    ``c = round(grad_hidden[r] * p)``. Then

    - ``grad_pre_activation[r] = [round(c * up * act'(gate)), round(c * act(gate))]``
      (gated; ``round(c * act'(x))`` otherwise),
    - ``weighted_hidden[r] = round(h * p)``,
    - ``grad_row_probs[r] = sum(h * grad_hidden[r])``, summed in float32,

    which is the VJP of ``y = (act(gate) * up) @ down * p``'s rows with the
    layer's roundings. Not differentiable itself.

    Args:
      grad_hidden: ``[R, F]`` float32, bfloat16 or float16.
      pre_activation: ``[R, 2F]`` (gated activations: gate then up) or
        ``[R, F]``, ``grad_hidden``'s dtype.
      row_probs: ``[R]`` float32, each row's routing weight.
      activation: one of :data:`ACTIVATIONS`.
      group_sizes: None, or ``[G]`` int32 (``G >= 1``, on the device): the row
        groups of a dispatch, as the grouped products take them
        (:func:`oxmoe.grouped_gemm.ragged_dot`'s). Then only the rows the groups
        cover, the first ``min(R, sum(group_sizes))``, are computed; the
        results' rows past them are left unwritten (their values are
        unspecified; NaN on the CPU): for callers that read only the groups' rows. Called
        eagerly, a negative size raises; on the device negative sizes count
        as zero.

    Returns:
      :class:`ActivationGrads`.
    """
    _check_inputs(grad_hidden, pre_activation, row_probs, activation)
    if group_sizes is None:
        return ActivationGrads(*_activation_bwd_p(grad_hidden, pre_activation, row_probs, activation=activation))
    _check_group_sizes(group_sizes)
    operands = vary_alike(grad_hidden, pre_activation, row_probs, group_sizes)
    return ActivationGrads(*_activation_bwd_of_groups_p(*operands, activation=activation))


def _check_group_sizes(group_sizes) -> None:
    """``group_sizes`` is ``int32[G]``, ``G >= 1``; called eagerly, no size is negative, as
    :mod:`oxmoe.grouped_gemm` checks its sizes (whose checks cannot be imported here: that
    module imports this one)."""
    check_array("group_sizes", group_sizes)
    if group_sizes.dtype != np.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise ValueError(f"group_sizes must have shape [num_groups] with at least one group, got "
                         f"{tuple(group_sizes.shape)}")
    if called_eagerly():
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            group = int(np.argmax(sizes < 0))
            raise ValueError(f"group_sizes must be >= 0, got {sizes[group]} at group {group}")


def _check_inputs(grad_hidden, pre_activation, row_probs, activation: str) -> None:
    """:func:`activation_bwd`'s operands and activation, checked (also for
    :func:`oxmoe.fp8.activation_bwd`)."""
    _check_activation(activation)
    for name, x in (("grad_hidden", grad_hidden), ("pre_activation", pre_activation), ("row_probs", row_probs)):
        check_array(name, x)
    check_float_dtype("grad_hidden", grad_hidden)
    if grad_hidden.ndim != 2:
        raise ValueError(f"grad_hidden must be [rows, features], got shape {tuple(grad_hidden.shape)}")
    rows, features = grad_hidden.shape
    expected = (rows, 2 * features if gated(activation) else features)
    if tuple(pre_activation.shape) != expected or pre_activation.dtype != grad_hidden.dtype:
        raise ValueError(f"pre_activation must be {grad_hidden.dtype}{list(expected)} for {activation!r} "
                         f"with grad_hidden {grad_hidden.dtype}{list(grad_hidden.shape)}, got "
                         f"{pre_activation.dtype}{list(pre_activation.shape)}")
    if tuple(row_probs.shape) != (rows,) or row_probs.dtype != np.float32:
        raise ValueError(f"row_probs must be float32[{rows}] (one weight a row of grad_hidden), got "
                         f"{row_probs.dtype}{list(row_probs.shape)}")
