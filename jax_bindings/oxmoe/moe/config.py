"""The MoE layer's configuration and parameters, what it returns beside its
output, and the mesh axes of a call as the layer sees them."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import router
from oxmoe.activation import _check_activation, gated
from oxmoe._checks import FLOAT_DTYPES, MAX_ROWS, check_array, check_bool, check_count, check_real
from oxmoe._pytree import pytree_dataclass
from oxmoe.fp8 import BlockScaling
from oxmoe.grouped_gemm import MAX_CHUNKS

EXCHANGES = ("auto", "ragged_all_to_all", "all_to_all", "ring")
_F32 = jnp.float32


# -- configuration and parameters ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """What the layer computes. Checked on construction: every real-valued
    option must be finite, every flag a bool.

    Routing (see :func:`oxmoe.router.topk`): ``num_experts``, ``topk``,
    ``score_function`` (``"softmax"`` or ``"sigmoid"``), ``use_pre_softmax``,
    ``num_groups`` with ``group_topk`` (group-limited routing), and
    ``scaling_factor`` for the weights; ``use_expert_bias`` (sigmoid only): a
    ``[E]`` bias in the params steers the choice of experts, not the weights
    (auxiliary-loss-free balancing; see :func:`update_expert_bias`).

    Losses: ``aux_loss_coeff`` scales the switch load-balancing loss and
    ``z_loss_coeff`` the router z-loss ``mean_t logsumexp(logits_t)²``; each is
    0 by default, and then not computed.

    Experts: ``activation`` is ``"swiglu"`` (default), ``"geglu"`` (gated,
    with a fused ``[E, H, 2F]`` up weight whose first half is the gate) or
    ``"gelu"``/``"silu"`` (``[E, H, F]``); GELU is the tanh approximation.
    ``align_size`` pads each expert's rows to a multiple of it (for kernels
    that want aligned groups; oxmoe's do not need it). Row indices are
    int32: ``align_size`` and the rows of every padded buffer of the layer
    are at most ``2**31 - 1`` (the buffers are checked when the layer is
    traced). ``dtype`` is the
    compute dtype of the token rows and expert weights (products accumulate in
    float32; the router's logits are float32).

    ``float32_gate_logits`` (MaxText's option of that name; default False):
    the router's product takes the layer's input (before its cast to
    ``dtype``) and the gate weight in float32, not rounded to ``dtype``. With a
    bfloat16 ``dtype`` the rounded product chooses other experts than a float32
    router for a few tokens in a thousand; with this option the choices are
    the float32 router's. The gradients reach the input and the gate in their
    own dtypes either way.

    ``exchange``: how tokens travel between expert shards: ``"auto"``,
    ``"ragged_all_to_all"``, ``"all_to_all"`` or ``"ring"`` (see
    :mod:`oxmoe.moe`).

    ``fp8`` (default None: the experts' GEMMs in ``dtype``): an
    :class:`oxmoe.fp8.BlockScaling` recipe makes the experts' three GEMMs of the
    forward and four of the backward block-scaled FP8 products
    (:func:`oxmoe.fp8.ragged_dot`, :func:`oxmoe.fp8.transposed_ragged_dot`): the
    tokens quantized per row in 1 x 128 blocks once, before they leave their
    shard (they cross the exchange and the permutation as FP8 values and
    scales, as the output's gradient does in the backward), the activation's
    output likewise, the expert weights in 128 x 128 blocks (once a call, kept
    for the backward: half the bytes of bfloat16 weights; or once for several
    calls, :func:`oxmoe.moe.quantize_expert_weights`), the weight
    gradients' operands in 128 x 1 blocks; each product's result rounded to
    ``dtype``. The router, the
    activation, the combine and the shared experts are not quantized, and the
    master weights are untouched. The hidden and the experts' FFN sizes must be
    multiples of 128; the row buffers are padded to multiples of 128. With
    ``align_size=128`` as well, each expert's rows are whole 128-row blocks, as
    DeepSeek-V3 lays them out: no 128 x 1 block of the weight gradients' operands
    holds two experts' rows, so the weight-gradient products have no block to
    take twice, and the training step measured 3-5% faster on an H200 at
    DeepSeek-V3 on one GPU and 0-4% at Qwen3-30B-A3B (three runs each,
    ``bench/NOTES.md``). The weight gradients then round differently (their
    blocks are other rows); the output and the input's gradient are the same.

    ``token_chunks`` (MaxText's ``num_moe_token_chunks``; default 1, at most
    :data:`oxmoe.grouped_gemm.MAX_CHUNKS`): with expert shards, each shard's
    tokens are split into this many chunks (at most one per token) that
    travel to their experts, are computed and come back each on its own,
    forward and backward, so that XLA can run one chunk's exchange while
    another chunk's expert GEMMs run; the weight gradients take every chunk's
    rows in one product. The result does not depend on it. Each chunk's
    grouped GEMMs see ``1 / token_chunks`` of the rows per expert, which costs
    where few rows per expert make them read-bound on the weights; an
    exchange chosen on the device among slot sizes (:class:`Exchange`) sits
    in a conditional, which nothing outside it overlaps: the overlap wants
    the ring or one static slot size. With ``capacity_factor`` each chunk's
    buffers are sized for the whole capacity. Without expert shards there
    is no exchange to hide, and the tokens are not split. On two NVLink H200s
    chunks made every EP = 2 step slower (DeepSeek-V3 by 15% at 2 chunks: its
    128 experts a GPU read their weights again per chunk): they pay only
    where a GPU holds few experts or the exchange is slow (across nodes).

    ``capacity_factor`` (MaxText's meaning; default None: no token is ever
    dropped): each expert takes at most ``ceil(capacity_factor * T k / E)``
    token copies, ``T`` the tokens of the expert axis (every token without
    one): its room relative to a balanced load. The copies past it are
    dropped in token order (the expert axis's shards in order, then each
    shard's tokens), counted in :attr:`MoEAux.dropped_copies`, add nothing to
    the output and get no gradient; the layer's row buffers shrink to that
    room. Dropping depends on the expert axis's size, not on the data axes
    (each data shard drops on its own).

    Shared experts (DeepSeek-V3, Qwen2-MoE, MaxText's ``shared_experts``):
    ``shared_ffn`` (default None: none) is the width ``Fs`` of one dense MLP
    that every token goes through, its output added to the routed experts'.
    ``n`` shared experts of width ``F`` are one of width ``Fs = n F``
    (MaxText: ``shared_experts * moe_mlp_dim``; Qwen2-MoE:
    ``shared_expert_intermediate_size``; DeepSeek-V3: ``n_shared_experts *
    moe_intermediate_size`` = 2048). It has the experts' ``activation`` and
    rounding (a fused ``[H, 2Fs]`` up weight when gated, ``[Fs, H]`` down;
    :attr:`MoEParams.shared_up`). ``shared_gate`` (Qwen2-MoE's
    ``shared_expert_gate``; default False) scales its output per token by
    ``sigmoid(x @ shared_gate)``, a ``[H, 1]`` weight. The output is
    ``y = routed + g * shared`` summed in float32 and rounded to ``dtype``
    (``g = 1`` without the gate). Its weights are replicated on every shard
    (not split by ``expert_axis`` or ``weight_axes``) and it computes the
    shard's own tokens, independent of the exchange of routed tokens, which
    it can overlap.
    """

    num_experts: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    use_expert_bias: bool = False
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    activation: str = "swiglu"
    align_size: int | None = None
    dtype: Any = jnp.bfloat16
    exchange: str = "auto"
    float32_gate_logits: bool = False
    capacity_factor: float | None = None
    shared_ffn: int | None = None
    shared_gate: bool = False
    token_chunks: int = 1
    fp8: BlockScaling | None = None

    def __post_init__(self):
        check_count("num_experts", self.num_experts, 1)
        check_bool("use_expert_bias", self.use_expert_bias)
        check_bool("float32_gate_logits", self.float32_gate_logits)
        self.topk_config  # checks the routing options
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            check_real(name, getattr(self, name), low=0)
        _check_activation(self.activation)
        if self.align_size is not None:
            check_count("align_size", self.align_size, 1, MAX_ROWS, " (row indices are int32)")
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        check_count("token_chunks", self.token_chunks, 1, MAX_CHUNKS,
                    " (the weight gradients take every chunk's rows in one product)")
        if self.fp8 is not None and not isinstance(self.fp8, BlockScaling):
            raise TypeError(f"fp8 must be None or an oxmoe.fp8.BlockScaling recipe, got {self.fp8!r}")
        if self.capacity_factor is not None:
            check_real("capacity_factor", self.capacity_factor, low=0)
            if self.capacity_factor == 0:
                raise ValueError("capacity_factor must be positive (None: no capacity, no drops), got 0")
        check_bool("shared_gate", self.shared_gate)
        if self.shared_ffn is not None:
            check_count("shared_ffn", self.shared_ffn, 1)
        elif self.shared_gate:
            raise ValueError("shared_gate needs shared experts: set shared_ffn (their width) too")

    def expert_capacity(self, tokens: int) -> int | None:
        """The token copies one expert takes from ``tokens`` tokens (those of the
        expert axis) with ``capacity_factor``; None without it."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.topk / self.num_experts))

    @property
    def topk_config(self) -> router.TopkConfig:
        """The routing options as :func:`oxmoe.router.topk` checks them."""
        return router.topk_config(self.num_experts, self.topk, score_function=self.score_function,
                                  use_pre_softmax=self.use_pre_softmax, num_groups=self.num_groups,
                                  group_topk=self.group_topk, scaling_factor=self.scaling_factor,
                                  use_expert_bias=self.use_expert_bias)

    @property
    def router_dtype(self) -> np.dtype:
        """The dtype the router's product takes the tokens and the gate weight in:
        float32 with ``float32_gate_logits``, else ``dtype``."""
        return jnp.dtype(_F32) if self.float32_gate_logits else self.dtype

    @property
    def glu(self) -> bool:
        """Whether the activation is gated (the up weight holds gate and up halves)."""
        return gated(self.activation)


@pytree_dataclass(("gate", "up", "down", "expert_bias", "shared_up", "shared_down", "shared_gate"))
class MoEParams:
    """The layer's parameters (any float dtype; cast to ``MoEConfig.dtype`` to compute,
    the gate to ``MoEConfig.router_dtype``).

    Inside ``shard_map``, ``up`` and ``down`` hold this shard's experts
    (``E / expert shards`` of them); ``gate`` and ``expert_bias`` are whole.
    """

    gate: jax.Array
    """``[H, E]``: the router weight, ``logits = x @ gate``."""
    up: jax.Array
    """``[E, H, 2F]`` gate and up projections fused (gated activations: ``[..., :F]``
    is the gate half), or ``[E, H, F]``."""
    down: jax.Array
    """``[E, F, H]``: the down projection."""
    expert_bias: jax.Array | None = None
    """``[E]`` float32 with ``use_expert_bias``, else None. Its gradient is zero."""
    shared_up: jax.Array | None = None
    """``[H, 2Fs]`` (gated activations; ``[:, :Fs]`` is the gate half) or
    ``[H, Fs]``: the shared experts' up projection, ``Fs`` =
    ``MoEConfig.shared_ffn``; None without shared experts. Whole on every shard."""
    shared_down: jax.Array | None = None
    """``[Fs, H]``: the shared experts' down projection; None without them."""
    shared_gate: jax.Array | None = None
    """``[H, 1]``: the shared experts' sigmoid gate weight with
    ``MoEConfig.shared_gate``, else None."""


@pytree_dataclass(("load_balancing_loss", "z_loss", "tokens_per_expert", "dropped_copies"))
class MoEAux:
    """What :func:`moe` returns beside the output: the losses to add to the
    model's loss, and the load for logging. The same on every shard."""

    load_balancing_loss: jax.Array
    """float32 scalar, already times ``aux_loss_coeff`` (0 when that is 0)."""
    z_loss: jax.Array
    """float32 scalar, already times ``z_loss_coeff`` (0 when that is 0)."""
    tokens_per_expert: jax.Array
    """``[E]`` int32: the tokens routed to each expert, over every token shard
    (before any capacity drop)."""
    dropped_copies: jax.Array
    """int32 scalar: the token copies dropped past ``capacity_factor``, over
    every token shard (0 without it)."""


def init_params(key, config: MoEConfig, hidden: int, ffn: int, dtype=jnp.float32) -> MoEParams:
    """Random parameters of the whole layer (all experts, and the shared
    experts of ``config.shared_ffn``): normal with variance ``1 / fan_in`` per
    matrix, and a zero expert bias when the config uses one.

    Args:
      key: a JAX random key.
      config: the layer's :class:`MoEConfig`.
      hidden: ``H``, the model's width.
      ffn: ``F``, each expert's hidden width.
      dtype: the parameters' dtype.
    """
    h, f = check_count("hidden", hidden, 1), check_count("ffn", ffn, 1)
    e = config.num_experts
    k_gate, k_up, k_down = jax.random.split(key, 3)
    up_width = 2 * f if config.glu else f

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, _F32) / math.sqrt(fan_in)).astype(dtype)

    shared = {}
    if config.shared_ffn is not None:
        fs = config.shared_ffn
        # Their own keys, so that the routed experts' weights do not change with shared_ffn.
        k_up_s, k_down_s, k_gate_s = jax.random.split(jax.random.fold_in(key, 3), 3)
        shared = dict(shared_up=normal(k_up_s, (h, 2 * fs if config.glu else fs), h),
                      shared_down=normal(k_down_s, (fs, h), fs),
                      shared_gate=normal(k_gate_s, (h, 1), h) if config.shared_gate else None)
    return MoEParams(
        gate=normal(k_gate, (h, e), h), up=normal(k_up, (e, h, up_width), h), down=normal(k_down, (e, f, h), f),
        expert_bias=jnp.zeros((e,), _F32) if config.use_expert_bias else None, **shared)


def update_expert_bias(expert_bias, tokens_per_expert, rate):
    """Auxiliary-loss-free balancing (DeepSeek-V3): raises the bias of the
    experts that got fewer tokens than the mean and lowers the others'.

    Returns ``expert_bias + rate * sign(mean(tokens_per_expert) - tokens_per_expert)``
    as float32. Call it between steps with :attr:`MoEAux.tokens_per_expert`;
    ``rate`` may be a traced scalar (a schedule); a Python or NumPy number
    must be finite.
    """
    if isinstance(rate, numbers.Real):  # a traced (or device) rate is the caller's to keep finite
        check_real("rate", rate)
    check_array("expert_bias", expert_bias)
    check_array("tokens_per_expert", tokens_per_expert)
    if expert_bias.ndim != 1 or tokens_per_expert.shape != expert_bias.shape:
        raise ValueError(f"expert_bias and tokens_per_expert must both have shape [num_experts], got "
                         f"{tuple(expert_bias.shape)} and {tuple(tokens_per_expert.shape)}")
    counts = tokens_per_expert.astype(_F32)
    return expert_bias.astype(_F32) + jnp.asarray(rate, _F32) * jnp.sign(counts.mean() - counts)


# -- the mesh as the layer sees it -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Axes:
    """The shard_map axes of one call, with their sizes (static)."""

    expert_axis: str | None
    data_axes: tuple[str, ...]
    expert_shards: int
    token_shards: int
    weight_axes: tuple[str, ...] = ()
    """The data axes that also split the expert weights (their experts)."""
    weight_shards: int = 1
    """The product of their sizes."""

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every axis the tokens are split over."""
        return self.data_axes + ((self.expert_axis,) if self.expert_axis else ())


def _axis_size(name, what: str) -> int:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a mesh axis name (str), got {name!r}")
    try:
        return jax.lax.axis_size(name)
    except NameError:
        raise ValueError(f"{what} {name!r} is not an axis of the enclosing jax.shard_map (call moe inside "
                         "shard_map with that axis, or use shard_map_moe)") from None


def as_data_axes(expert_axis, data_axes) -> tuple[str, ...]:
    """``data_axes`` as a tuple; each mesh axis may split the tokens once."""
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if expert_axis in data_axes:
        raise ValueError(f"expert_axis {expert_axis!r} is also in data_axes {data_axes}")
    if len(set(data_axes)) != len(data_axes):
        raise ValueError(f"data_axes {data_axes} names an axis twice")
    return data_axes


def as_weight_axes(data_axes: tuple[str, ...], weight_axes) -> tuple[str, ...]:
    """``weight_axes`` as a tuple, each one of ``data_axes``, in their order."""
    weight_axes = (weight_axes,) if isinstance(weight_axes, str) else tuple(weight_axes)
    stray = [a for a in weight_axes if a not in data_axes]
    if stray:
        raise ValueError(f"weight_axes {weight_axes} must be data axes (data_axes {data_axes}); {stray} are not")
    if len(set(weight_axes)) != len(weight_axes):
        raise ValueError(f"weight_axes {weight_axes} names an axis twice")
    return tuple(a for a in data_axes if a in weight_axes)


def check_weight_shards(experts_per_shard: int, weight_shards: int, weight_axes: tuple[str, ...]) -> None:
    """``weight_axes`` split each expert shard's experts: their shards must divide them."""
    if experts_per_shard % weight_shards:
        raise ValueError(f"the {experts_per_shard} experts of a shard of expert_axis must divide by the "
                         f"{weight_shards} shards of weight_axes {weight_axes}")


def mesh_axes(config: MoEConfig, expert_axis, data_axes, weight_axes=()) -> Axes:
    """The axes of a call, checked: each an axis of the enclosing ``shard_map``,
    the experts split evenly over ``expert_axis``, ``weight_axes`` among the
    data axes."""
    data_axes = as_data_axes(expert_axis, data_axes)
    weight_axes = as_weight_axes(data_axes, weight_axes)
    sizes = [_axis_size(a, "data_axes entry") for a in data_axes]
    expert_shards = 1 if expert_axis is None else _axis_size(expert_axis, "expert_axis")
    if config.num_experts % expert_shards:
        raise ValueError(f"num_experts ({config.num_experts}) must divide by the size of expert_axis "
                         f"{expert_axis!r} ({expert_shards})")
    weight_shards = math.prod(size for a, size in zip(data_axes, sizes) if a in weight_axes)
    return Axes(expert_axis, data_axes, expert_shards, math.prod(sizes) * expert_shards, weight_axes, weight_shards)

