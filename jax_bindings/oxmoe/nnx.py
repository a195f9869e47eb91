"""The MoE layer as a Flax NNX module: :class:`MoE`.

The NNX twin of :class:`oxmoe.flax.MoEBlock`: the same parameters, logical
axis names and call (see :mod:`oxmoe.flax`), held as ``nnx.Param`` variables whose
``out_sharding`` metadata is the logical names. Under a mesh (``jax.set_mesh``
or the module's ``mesh``) and flax's eager sharding (its default), the
parameters are placed as they are created, so the names must then resolve
through ``nnx.logical_axis_rules``::

    rules = (("exp", "expert"), ("embed", None), ("mlp", None))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        layer = MoE(config, hidden, ffn, rngs=nnx.Rngs(0), expert_axis="expert", data_axes=("data",))

Without a mesh the parameters are created whole and keep their names for
``nnx.get_partition_spec`` / ``nnx.get_named_sharding``.

The expert bias is an :class:`ExpertBias`, a variable that is not an
``nnx.Param``: optimisers and ``nnx.grad`` over ``nnx.Param`` leave it alone,
and :meth:`MoE.update_expert_bias` moves it.

This module needs ``flax`` (the ``oxmoe[flax]`` extra).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from oxmoe import moe as _moe
from oxmoe.flax import (EXPERT_BIAS_AXES, GATE_AXES, UP_AXES, Initializer, ParamSpec, call_moe, check_hidden,
                        default_expert_init, default_gate_init, layout_shapes, params_from_layout)
from oxmoe.moe import MoEAux, MoEConfig, MoEParams, QuantizedExpertWeights

__all__ = ["MoE", "ExpertBias", "ParamGroup"]


class ExpertBias(nnx.Variable):
    """The ``[E]`` float32 expert bias of aux-loss-free balancing: state, not a trained parameter."""


class ParamGroup(nnx.Module):
    """One level of a peer's parameter layout (``param_layout``): its
    ``nnx.Param`` weights and sub-levels as attributes of their names."""

    def __init__(self, values: dict):
        for name, value in values.items():
            setattr(self, name, value)
        self._names = tuple(values)

    def values(self) -> dict:
        """The weights' values, nested by name."""
        return {name: _value(getattr(self, name)) for name in self._names}


def _value(variable):
    if variable is None:
        return None
    return variable.values() if isinstance(variable, ParamGroup) else variable[...]


def _mesh_in_scope(mesh) -> bool:
    return mesh is not None or not jax.sharding.get_abstract_mesh().empty


def _check_rules(mesh) -> None:
    # Without a rule, flax would pass "exp" to jax as a mesh axis and fail far from the cause.
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    ruled = {name for name, _ in nn.get_logical_axis_rules()}
    missing = sorted({a for a in (*GATE_AXES, *UP_AXES) if a is not None} - ruled - set(mesh.axis_names))
    if missing:
        raise ValueError(
            f"MoE's parameters are created sharded under a mesh (axes {mesh.axis_names}), but the logical axes "
            f"{missing} have no rule: create the module under nnx.logical_axis_rules(...), e.g. "
            '(("exp", <expert axis>), ("embed", None), ("mlp", None)), or under nnx.use_eager_sharding(False)')


class MoE(nnx.Module):
    """A Mixture-of-Experts feed-forward layer (Flax NNX).

    ``layer(x)`` returns ``(y, aux)`` as :func:`oxmoe.moe.moe`: ``x`` is
    ``[B, S, H]`` or ``[T, H]`` (global arrays; the layer shards them itself
    when given mesh axes), ``y`` has ``x``'s shape and dtype ``config.dtype``,
    ``aux`` is an :class:`oxmoe.moe.MoEAux` whose losses the caller adds to its own.

    ``layer(x, fp8_weights=layer.quantize_expert_weights())``, with ``config.fp8``,
    takes the expert weights quantized once (:meth:`quantize_expert_weights`)
    instead of quantizing them in every call, as :func:`oxmoe.moe.moe`'s
    ``fp8_weights``: once per optimizer step for all of its micro-batches.

    Args:
      config: the routing and expert configuration.
      hidden: the model's hidden size H.
      ffn: each expert's intermediate size F.
      rngs: the ``params`` stream initialises the weights.
      expert_axis: the mesh axis the experts are split over, or ``None``.
      data_axes: further mesh axes the tokens are split over.
      weight_axes: those of ``data_axes`` that also split the expert weights'
        experts (FSDP; map ``"exp"`` to ``(expert_axis, *weight_axes)`` in the
        rules).
      mesh: the mesh of those axes; ``None``: the context mesh (``jax.set_mesh``).
      param_dtype: the parameters' dtype (cast to ``config.dtype`` for compute).
      gate_init, up_init, down_init: initialisers ``(key, shape, dtype)`` of the
        ``[H, E]``, ``[E, H, 2F]`` and ``[E, F, H]`` weights (default: LeCun
        normal, fan-in H, H and F).
      shared_init: the initialiser of the shared experts' weights (with
        ``config.shared_ffn``; default: LeCun normal).
      param_layout: ``"oxmoe"`` (default), ``"maxtext"`` or
        ``"transformer_engine"``: the weights' attribute names and shapes,
        those of :func:`oxmoe.flax.layout_shapes` (a nested level is a
        :class:`ParamGroup`: MaxText's ``gate.kernel``, ``wi_0``, ``wi_1``,
        ``wo``, and with shared experts ``MoeBlock_0.*`` and
        ``shared_experts.wi_0.kernel`` ...), so that a peer's checkpoint loads
        unchanged. MaxText's ``wi_0``/``wi_1`` are concatenated into the fused
        up weight in every call (a copy).

    Attributes:
      gate, up, down: the ``nnx.Param`` weights (see :mod:`oxmoe.flax` for
        shapes and logical axes), with ``param_layout="oxmoe"``; another
        layout has its own names instead.
      expert_bias: an :class:`ExpertBias` of zeros with ``config.use_expert_bias``,
        else ``None``.
      shared_up, shared_down, shared_gate: the shared experts' ``nnx.Param``
        weights with ``config.shared_ffn`` (``shared_gate`` with
        ``config.shared_gate``), else ``None``.
    """

    # The oxmoe layout's weights (set by name in __init__; another layout has its own names).
    gate: nnx.Param
    up: nnx.Param
    down: nnx.Param

    def __init__(self, config: MoEConfig, hidden: int, ffn: int, *, rngs: nnx.Rngs,
                 expert_axis: str | None = None, data_axes: tuple[str, ...] = (),
                 weight_axes: tuple[str, ...] = (), mesh: jax.sharding.Mesh | None = None, param_dtype: Any = jnp.float32,
                 gate_init: Initializer = default_gate_init, up_init: Initializer = default_expert_init,
                 down_init: Initializer = default_expert_init, shared_init: Initializer = default_gate_init,
                 param_layout: str = "oxmoe"):
        self.config = config
        self.hidden = hidden
        self.expert_axis = expert_axis
        self.data_axes = tuple(data_axes)
        self.weight_axes = tuple(weight_axes)
        self.mesh = mesh
        # Eager sharding needs a mesh; without one the names are kept for later placement.
        eager = nnx.using_eager_sharding() and _mesh_in_scope(mesh)
        if eager:
            _check_rules(mesh)
        placement: dict[str, Any] = dict(eager_sharding=eager, **({} if mesh is None else {"mesh": mesh}))

        inits = {"gate": gate_init, "up": up_init, "down": down_init, "shared": shared_init}

        def create(specs):
            return {name: nnx.Param(inits[spec.role](rngs.params(), spec.shape, param_dtype), out_sharding=spec.axes,
                                    **placement)
                    if isinstance(spec, ParamSpec) else ParamGroup(create(spec))
                    for name, spec in specs.items()}

        self.param_layout = param_layout
        weights = create(layout_shapes(param_layout, config, hidden, ffn))
        self._weight_names = tuple(weights)
        for name, weight in weights.items():
            setattr(self, name, weight)
        if param_layout == "oxmoe":  # the attributes the oxmoe layout documents, None when off
            for name in ("shared_up", "shared_down", "shared_gate"):
                weights.setdefault(name, None)
                setattr(self, name, weights[name])
        self.expert_bias = (ExpertBias(jnp.zeros((config.num_experts,), jnp.float32), out_sharding=EXPERT_BIAS_AXES,
                                       **placement)
                            if config.use_expert_bias else None)

    def __call__(self, x, fp8_weights: QuantizedExpertWeights | None = None) -> tuple[jax.Array, MoEAux]:
        check_hidden(x, self.hidden)
        return call_moe(x, self._params(), self.config, expert_axis=self.expert_axis, data_axes=self.data_axes,
                        weight_axes=self.weight_axes, mesh=self.mesh, fp8_weights=fp8_weights)

    def quantize_expert_weights(self) -> QuantizedExpertWeights:
        """:func:`oxmoe.moe.quantize_expert_weights` of the module's current expert weights,
        for its call's ``fp8_weights``; quantize again after each update (``config.fp8``
        must be set)."""
        return _moe.quantize_expert_weights(self._params(), self.config)

    def _params(self) -> MoEParams:
        tree = {name: _value(getattr(self, name)) for name in self._weight_names}
        return params_from_layout(self.param_layout, tree, self.config, _value(self.expert_bias))

    def update_expert_bias(self, tokens_per_expert, rate) -> None:
        """Moves the expert bias in place by :func:`oxmoe.moe.update_expert_bias`.

        Args:
          tokens_per_expert: ``[E]`` int32, ``aux.tokens_per_expert`` of a call.
          rate: the bias update rate (DeepSeek-V3's gamma).
        """
        if self.expert_bias is None:
            raise ValueError("this MoE has no expert bias (config.use_expert_bias is False)")
        self.expert_bias[...] = _moe.update_expert_bias(self.expert_bias[...], tokens_per_expert, rate)
