"""The MoE layer as a Flax Linen module: :class:`MoEBlock`.

``MoEBlock`` owns the parameters of :func:`oxmoe.moe.moe` and calls it (or
:func:`oxmoe.moe.shard_map_moe` when it is given mesh axes). Its parameters
carry logical axis names, so a model's sharding is written once as rules::

    rules = (("exp", "expert"), ("embed", None), ("mlp", None))
    specs = nn.get_partition_spec(jax.eval_shape(block.init, key, x))
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    variables = jax.jit(block.init, out_shardings=shardings)(key, x)

- ``params/gate``: ``[H, E]``, axes ``("embed", None)``;
- ``params/up``: ``[E, H, 2F]`` (``[E, H, F]`` without a GLU), axes
  ``("exp", "embed", "mlp")``;
- ``params/down``: ``[E, F, H]``, axes ``("exp", "mlp", "embed")``;
- ``moe_state/expert_bias``: ``[E]`` float32 zeros, axes ``(None,)``, only
  with ``config.use_expert_bias``;
- with ``config.shared_ffn`` (``Fs``), the shared experts: ``params/shared_up``
  ``[H, 2Fs]`` (``[H, Fs]`` without a GLU), axes ``("embed", "mlp")``;
  ``params/shared_down`` ``[Fs, H]``, axes ``("mlp", "embed")``; and with
  ``config.shared_gate``, ``params/shared_gate`` ``[H, 1]``, axes
  ``("embed", None)``. The layer takes them whole on every shard (a layout
  the rules give otherwise is gathered at the shard map's edge).

The gate's expert dimension has no name: every token shard routes over all
experts, so :func:`~oxmoe.moe.shard_map_moe` wants the gate whole. ``"exp"``
should map to the block's ``expert_axis`` (the experts' weights are split
over it inside the shard map; any other layout is resharded at its edge).
To shard the expert weights over the data axes as well (FSDP), map
``"exp"`` to the expert axis then those axes, and give them as ``weight_axes``::

    rules = (("exp", ("expert", "data")), ("embed", None), ("mlp", None))
    block = MoEBlock(config=config, ffn=ffn, expert_axis="expert", data_axes=("data",),
                     weight_axes=("data",), mesh=mesh)

Peers' checkpoint layouts (``param_layout``; the layer computes with its own
fused weights, so the peers' separate ``wi_0``/``wi_1`` are concatenated into
the ``[E, H, 2F]`` up weight inside every call: a copy of the up weights per
step, and their gradient is split back):

- ``"oxmoe"`` (default): the names above;
- ``"maxtext"``: MaxText's ``RoutedMoE``: ``params/gate/kernel`` ``[H, E]``,
  ``params/wi_0`` and ``params/wi_1`` ``[E, H, F]`` (gate and up), ``params/wo``
  ``[E, F, H]``. With ``config.shared_ffn``, its ``RoutedAndSharedMoE``: those
  under ``params/MoeBlock_0/``, and the shared experts' ``MlpBlock`` as
  ``params/shared_experts/wi_0/kernel``, ``.../wi_1/kernel`` ``[H, Fs]`` and
  ``.../wo/kernel`` ``[Fs, H]``. Gated activations only; no ``shared_gate``;
- ``"transformer_engine"``: TransformerEngine's ``flax.moe._MoEBlock``:
  ``params/gate_kernel`` ``[H, E]``, ``params/wi`` ``[E, H, 2F]`` (gate half
  first, the fused layout: no copy), ``params/wo`` ``[E, F, H]``. Gated
  activations only; TE's block has no shared experts.

Either way the expert bias stays state (below): a peer's ``expert_bias``
(TE's ``params/expert_bias``, MaxText's ``gate/bias``) goes to
``moe_state/expert_bias``. :func:`layout_shapes` gives each layout's names
and shapes, :func:`params_from_layout` turns such a tree into
:class:`~oxmoe.moe.MoEParams`.

The expert bias (aux-loss-free balancing) is state, not a trained parameter:
it lives in the ``"moe_state"`` collection, receives no gradient, and is moved
by :func:`update_expert_bias` from the ``tokens_per_expert`` the block returns.

This module needs ``flax`` (the ``oxmoe[flax]`` extra); ``import oxmoe`` alone
does not import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from oxmoe import moe as _moe
from oxmoe.moe import MoEAux, MoEConfig, MoEParams, QuantizedExpertWeights

__all__ = ["MoEBlock", "quantize_expert_weights", "update_expert_bias", "PARAM_LAYOUTS", "ParamSpec", "layout_shapes",
           "params_from_layout", "GATE_AXES", "UP_AXES", "DOWN_AXES", "EXPERT_BIAS_AXES",
           "SHARED_UP_AXES", "SHARED_DOWN_AXES", "SHARED_GATE_AXES", "STATE_COLLECTION"]

GATE_AXES = ("embed", None)
UP_AXES = ("exp", "embed", "mlp")
DOWN_AXES = ("exp", "mlp", "embed")
EXPERT_BIAS_AXES = (None,)
SHARED_UP_AXES = ("embed", "mlp")
SHARED_DOWN_AXES = ("mlp", "embed")
SHARED_GATE_AXES = ("embed", None)

STATE_COLLECTION = "moe_state"

Initializer = Callable[..., jax.Array]

# Fan-in is the contracted dimension: H for the gate [H, E] and up [E, H, 2F], F for down
# [E, F, H]; the leading expert dimension is a batch of independent matrices, not fan-in.
default_gate_init = nn.initializers.lecun_normal()
default_expert_init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


def expert_shapes(config: MoEConfig, hidden: int, ffn: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes ``(up, down)`` of the expert weights: ``[E, H, 2F]`` (GLU) or ``[E, H, F]``, and ``[E, F, H]``."""
    e = config.num_experts
    return (e, hidden, 2 * ffn if config.glu else ffn), (e, ffn, hidden)


def shared_shapes(config: MoEConfig, hidden: int) -> dict[str, tuple[int, int]]:
    """The shared experts' weights' shapes by name (none without ``config.shared_ffn``):
    ``shared_up`` ``[H, 2Fs]`` (GLU) or ``[H, Fs]``, ``shared_down`` ``[Fs, H]``, and
    ``shared_gate`` ``[H, 1]`` with ``config.shared_gate``."""
    fs = config.shared_ffn
    if fs is None:
        return {}
    shapes = {"shared_up": (hidden, 2 * fs if config.glu else fs), "shared_down": (fs, hidden)}
    return shapes | ({"shared_gate": (hidden, 1)} if config.shared_gate else {})


SHARED_AXES = {"shared_up": SHARED_UP_AXES, "shared_down": SHARED_DOWN_AXES, "shared_gate": SHARED_GATE_AXES}


PARAM_LAYOUTS = ("oxmoe", "maxtext", "transformer_engine")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of a layout: its shape, logical axes, and the initialiser
    it takes (``role``: ``"gate"``, ``"up"``, ``"down"`` or ``"shared"``)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    role: str


def layout_shapes(layout: str, config: MoEConfig, hidden: int, ffn: int) -> dict:
    """The parameters of ``layout`` (one of :data:`PARAM_LAYOUTS`) as a nested
    dict of names to :class:`ParamSpec`, as they sit under ``params`` (see the
    module docstring)."""
    if layout not in PARAM_LAYOUTS:
        raise ValueError(f"param_layout must be one of {PARAM_LAYOUTS}, got {layout!r}")
    e, h, f = config.num_experts, hidden, ffn
    gate = ParamSpec((h, e), GATE_AXES, "gate")
    down = ParamSpec((e, f, h), DOWN_AXES, "down")
    if layout == "oxmoe":
        up_shape, _ = expert_shapes(config, h, f)
        shared = {name: ParamSpec(shape, SHARED_AXES[name], "shared")
                  for name, shape in shared_shapes(config, h).items()}
        return {"gate": gate, "up": ParamSpec(up_shape, UP_AXES, "up"), "down": down, **shared}
    peer = {"maxtext": "MaxText's RoutedMoE", "transformer_engine": "TransformerEngine's _MoEBlock"}[layout]
    if not config.glu:
        raise ValueError(f"param_layout {layout!r} ({peer}) holds gated experts: activation must be 'swiglu' or "
                         f"'geglu', got {config.activation!r}")
    if layout == "transformer_engine":
        if config.shared_ffn is not None:
            raise ValueError("param_layout 'transformer_engine': TransformerEngine's _MoEBlock has no shared experts "
                             "(config.shared_ffn must be None)")
        return {"gate_kernel": gate, "wi": ParamSpec((e, h, 2 * f), UP_AXES, "up"), "wo": down}
    half = ParamSpec((e, h, f), UP_AXES, "up")
    routed = {"gate": {"kernel": gate}, "wi_0": half, "wi_1": half, "wo": down}
    if config.shared_ffn is None:
        return routed
    if config.shared_gate:
        raise ValueError("param_layout 'maxtext': MaxText's shared experts have no gate (config.shared_gate must be "
                         "False)")
    fs = config.shared_ffn
    shared_half = {"kernel": ParamSpec((h, fs), SHARED_UP_AXES, "shared")}
    return {"MoeBlock_0": routed,
            "shared_experts": {"wi_0": shared_half, "wi_1": shared_half,
                               "wo": {"kernel": ParamSpec((fs, h), SHARED_DOWN_AXES, "shared")}}}


def params_from_layout(layout: str, tree: Mapping, config: MoEConfig, expert_bias=None) -> MoEParams:
    """:class:`~oxmoe.moe.MoEParams` of a parameter tree in ``layout`` (names
    and shapes of :func:`layout_shapes`; the shapes are checked by the layer).
    MaxText's ``wi_0`` and ``wi_1`` are concatenated into the fused up weight
    (a copy)."""
    if layout == "oxmoe":
        return MoEParams(**tree, expert_bias=expert_bias)
    if layout == "transformer_engine":
        return MoEParams(gate=tree["gate_kernel"], up=tree["wi"], down=tree["wo"], expert_bias=expert_bias)
    if layout != "maxtext":
        raise ValueError(f"param_layout must be one of {PARAM_LAYOUTS}, got {layout!r}")

    def fused(group):
        return jnp.concatenate([group["wi_0"], group["wi_1"]], axis=-1)

    routed = tree["MoeBlock_0"] if "MoeBlock_0" in tree else tree
    shared = {}
    if "shared_experts" in tree:
        s = tree["shared_experts"]
        shared = dict(shared_up=jnp.concatenate([s["wi_0"]["kernel"], s["wi_1"]["kernel"]], axis=-1),
                      shared_down=s["wo"]["kernel"])
    return MoEParams(gate=routed["gate"]["kernel"], up=fused(routed), down=routed["wo"], expert_bias=expert_bias,
                     **shared)


class _ParamGroup(nn.Module):
    """The parameters of one level of a layout (sub-levels as submodules of their names)."""

    specs: Mapping
    inits: Mapping
    param_dtype: Any
    mesh: jax.sharding.Mesh | None

    @nn.compact
    def __call__(self):
        return create_params(self, self.specs, self.inits, self.param_dtype, self.mesh)


def create_params(module: nn.Module, specs: Mapping, inits: Mapping, param_dtype, mesh) -> dict:
    """``specs``' parameters (nested names to :class:`ParamSpec`) in ``module``'s scope."""
    values = {}
    for name, spec in specs.items():
        if isinstance(spec, ParamSpec):
            init = nn.with_logical_partitioning(inits[spec.role], spec.axes, mesh=mesh)
            values[name] = module.param(name, init, spec.shape, param_dtype)
        else:
            values[name] = _ParamGroup(spec, inits, param_dtype, mesh, name=name)()
    return values


def check_hidden(x, hidden: int | None) -> int:
    """The hidden size of ``x`` (its last dimension), checked against ``hidden`` when given."""
    if getattr(x, "ndim", 0) not in (2, 3):
        raise ValueError(f"x must be [tokens, hidden] or [batch, seq, hidden], got shape {getattr(x, 'shape', x)}")
    if hidden is not None and x.shape[-1] != hidden:
        raise ValueError(f"x's last dimension must be the layer's hidden size {hidden}, got shape {x.shape}")
    return x.shape[-1]


def call_moe(x, params: MoEParams, config: MoEConfig, *, expert_axis: str | None, data_axes: Sequence[str],
             weight_axes: Sequence[str],
             mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None,
             fp8_weights: QuantizedExpertWeights | None = None) -> tuple[jax.Array, MoEAux]:
    """Runs :func:`oxmoe.moe.moe` on global arrays: directly without mesh axes, else through
    :func:`oxmoe.moe.shard_map_moe` on ``mesh`` (``None``: the context mesh of ``jax.set_mesh``)."""
    data_axes = tuple(data_axes)
    if expert_axis is None and not data_axes:
        return _moe.moe(x, params, config, fp8_weights=fp8_weights)
    if mesh is None:
        # The abstract mesh, not jax.sharding.get_mesh(): the layer is usually traced under jit.
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(f"expert_axis={expert_axis!r} and data_axes={data_axes!r} name mesh axes, but the layer "
                             "has no mesh: pass mesh=... or call it under `with jax.set_mesh(mesh):`")
    return _moe.shard_map_moe(x, params, config, mesh=mesh, expert_axis=expert_axis, data_axes=data_axes,
                              weight_axes=tuple(weight_axes), fp8_weights=fp8_weights)


class MoEBlock(nn.Module, kw_only=True):
    """A Mixture-of-Experts feed-forward layer (Flax Linen); fields are keyword-only.

    ``block.apply(variables, x)`` returns ``(y, aux)`` as :func:`oxmoe.moe.moe`:
    ``x`` is ``[B, S, H]`` or ``[T, H]`` (global arrays; the block shards them
    itself when given mesh axes), ``y`` has ``x``'s shape and dtype
    ``config.dtype``, ``aux`` is an :class:`oxmoe.moe.MoEAux` whose losses the
    caller adds to its own. With ``config.use_expert_bias`` the variables must
    include the ``"moe_state"`` collection (see the module docstring).

    ``block.apply(variables, x, fp8_weights=q)``, with ``config.fp8`` and
    ``q = quantize_expert_weights(block, variables)`` (:func:`quantize_expert_weights`),
    computes with the expert weights ``q`` stands for instead of quantizing
    them in every call, as :func:`oxmoe.moe.moe`'s ``fp8_weights``: quantize once
    per optimizer step and pass ``q`` to each of its micro-batches. The weights'
    gradients go to ``variables["params"]`` as without it.

    Attributes:
      config: the routing and expert configuration.
      ffn: each expert's intermediate size F.
      hidden: the model's hidden size H; ``None`` takes it from ``x``.
      expert_axis: the mesh axis the experts are split over (expert parallelism),
        or ``None``.
      data_axes: further mesh axes the tokens are split over (data parallelism).
      weight_axes: those of ``data_axes`` that also split the expert weights'
        experts (FSDP: see :func:`oxmoe.moe.moe`); map ``"exp"`` to
        ``(expert_axis, *weight_axes)`` in the logical rules so the variables
        are made that way.
      mesh: the mesh of those axes; ``None``: the context mesh (``jax.set_mesh``).
      param_dtype: the parameters' dtype (cast to ``config.dtype`` for compute).
      gate_init, up_init, down_init: initialisers ``(key, shape, dtype)`` of the
        ``[H, E]``, ``[E, H, 2F]`` and ``[E, F, H]`` weights (default: LeCun
        normal, fan-in H, H and F).
      shared_init: the initialiser of the shared experts' ``[H, 2Fs]``,
        ``[Fs, H]`` and ``[H, 1]`` weights (default: LeCun normal, fan-in H, Fs, H).
      param_layout: the parameters' names and shapes: ``"oxmoe"`` (default),
        ``"maxtext"`` or ``"transformer_engine"``, so that a peer's checkpoint
        loads unchanged (see the module docstring; MaxText's ``wi_0``/``wi_1``
        cost a concatenation, a copy of the up weights, in every call).
        ``up_init`` initialises each of ``wi_0`` and ``wi_1``.
    """

    config: MoEConfig
    ffn: int
    hidden: int | None = None
    expert_axis: str | None = None
    data_axes: tuple[str, ...] = ()
    weight_axes: tuple[str, ...] = ()
    mesh: jax.sharding.Mesh | None = None
    param_dtype: Any = jnp.float32
    gate_init: Initializer = default_gate_init
    up_init: Initializer = default_expert_init
    down_init: Initializer = default_expert_init
    shared_init: Initializer = default_gate_init
    param_layout: str = "oxmoe"

    @nn.compact
    def __call__(self, x, fp8_weights: QuantizedExpertWeights | None = None) -> tuple[jax.Array, MoEAux]:
        config = self.config
        hidden = check_hidden(x, self.hidden)
        specs = layout_shapes(self.param_layout, config, hidden, self.ffn)
        inits = {"gate": self.gate_init, "up": self.up_init, "down": self.down_init, "shared": self.shared_init}
        tree = create_params(self, specs, inits, self.param_dtype, self.mesh)
        expert_bias = None
        if config.use_expert_bias:
            zeros = nn.with_logical_partitioning(jnp.zeros, EXPERT_BIAS_AXES, mesh=self.mesh)
            expert_bias = self.variable(STATE_COLLECTION, "expert_bias", zeros, (config.num_experts,),
                                        jnp.float32).value
        params = params_from_layout(self.param_layout, tree, config, expert_bias)
        return call_moe(x, params, config, expert_axis=self.expert_axis, data_axes=self.data_axes,
                        weight_axes=self.weight_axes, mesh=self.mesh, fp8_weights=fp8_weights)


def quantize_expert_weights(block: MoEBlock, variables: Mapping) -> QuantizedExpertWeights:
    """:func:`oxmoe.moe.quantize_expert_weights` of ``block``'s expert weights, for its
    ``fp8_weights`` (see :class:`MoEBlock`); quantize again after each update.

    Args:
      block: the :class:`MoEBlock`; its ``config.fp8`` must be set.
      variables: the block's own variables (as from ``block.init``, boxed or not);
        only ``params``' up and down weights are read, in ``block.param_layout``
        (MaxText's ``wi_0``/``wi_1`` concatenated, as in the block's call).
    """
    tree = nn.meta.unbox(variables["params"])
    return _moe.quantize_expert_weights(params_from_layout(block.param_layout, tree, block.config), block.config)


def update_expert_bias(variables: Mapping, tokens_per_expert, rate, *, path: Sequence[str] = ()) -> dict:
    """Returns ``variables`` with one block's expert bias moved by :func:`oxmoe.moe.update_expert_bias`.

    Args:
      variables: a model's variables (as from ``init``), holding the block's
        ``moe_state/.../expert_bias``; left unchanged.
      tokens_per_expert: ``[E]`` int32, ``aux.tokens_per_expert`` of that block's call.
      rate: the bias update rate (DeepSeek-V3's gamma).
      path: the block's module path inside the model, e.g. ``("layers_3", "moe")``;
        ``()`` when ``variables`` are the block's own.

    Returns:
      A new variables dict (plain dicts along the path) with ``expert_bias``
      replaced by ``expert_bias + rate * sign(mean(tokens) - tokens)``.
    """
    keys = (STATE_COLLECTION, *path, "expert_bias")

    def replace(tree, depth):
        if not isinstance(tree, Mapping) or keys[depth] not in tree:
            raise KeyError(f"the variables have no {'/'.join(keys)} (is config.use_expert_bias set, and is the "
                           f"block's path {tuple(path)!r}?)")
        child = tree[keys[depth]]
        if depth + 1 < len(keys):
            new = replace(child, depth + 1)
        else:
            # init's variables box the bias with its logical axes; keep the box, move the value.
            value = nn.meta.unbox(child)
            new = _moe.update_expert_bias(value, tokens_per_expert, rate)
            if isinstance(child, nn.meta.AxisMetadata):
                new = child.replace_boxed(new)
        return {**tree, keys[depth]: new}

    return replace(variables, 0)
