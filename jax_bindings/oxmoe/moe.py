"""The MoE layer: route → dispatch → expert FFN → combine, as one custom VJP.

:func:`moe` is what a model calls. Inside ``jax.shard_map`` it runs with
expert parallelism (the experts split over ``expert_axis``) and data
parallelism (the tokens split over ``data_axes`` and ``expert_axis``); outside,
on one device. It is composed of four steps, each public and each returning a
small pytree:

- :func:`route` → :class:`Routing`: router logits, the top-k experts and
  weights of every token, the global token counts and the auxiliary losses;
- :func:`dispatch` → :class:`Dispatched`: the token rows grouped by local
  expert, after the exchange between expert shards;
- :func:`expert_ffn` → :class:`ExpertOutput`: the fused gate+up grouped GEMM,
  the activation and the down grouped GEMM;
- :func:`combine`: the rows back to their tokens, weighted and summed.

:func:`moe` wraps them in one ``custom_vjp`` whose backward runs the same
steps in reverse from saved residuals (:class:`Residuals`): the gradients
cross the same exchanges the activations did, in the other direction. Both
directions call the primitive level of :mod:`oxmoe.router` and
:mod:`oxmoe.permutation`, so :func:`route`, :func:`dispatch` and
:func:`combine` are not differentiable on their own: differentiate :func:`moe`.

Token exchange between expert shards (``MoEConfig.exchange``):

- ``"ragged_all_to_all"``: each shard sends each other shard exactly the rows
  of its experts (``jax.lax.ragged_all_to_all``), with sizes and offsets
  computed on the device from every shard's per-expert counts; not on a CPU
  mesh (refused when the layer is traced);
- ``"all_to_all"``: the same rows in fixed-size slots (``jax.lax.all_to_all``),
  which every platform has (XLA:CPU has no ragged collective);
- ``"auto"`` (default): ``"all_to_all"``, the faster of the two wherever it
  was measured: on two NVLink-connected H200s with jax 0.11.2, XLA's
  ragged_all_to_all moved the DeepSeek-V3 rows of a device at 2.6 GB/s, the
  dense all_to_all at 312 GB/s (``bench/profile_exchange.py``);
- ``"ring"``: no exchange of routed rows: every shard gathers all tokens of the
  expert axis, computes its own experts' share, and the partial outputs are
  summed and scattered back (a reduce-scatter).

Both exchanges receive into a buffer sized for the worst case (every token of
every shard routed to this shard's experts, plus alignment padding), so no
token is ever dropped and the result does not depend on the exchange.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import grouped_gemm, permutation, router
from oxmoe._checks import FLOAT_DTYPES, MAX_ROWS, check_array, check_bool, check_count, check_real
from oxmoe._primitive import _varying_axes

__all__ = ["MoEConfig", "MoEParams", "MoEAux", "Routing", "Dispatched", "ExpertOutput", "Exchange", "Residuals",
           "init_params", "moe", "shard_map_moe", "route", "dispatch", "expert_ffn", "combine",
           "update_expert_bias"]

ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu")
EXCHANGES = ("auto", "ragged_all_to_all", "all_to_all", "ring")
_F32 = jnp.float32


def _pytree(data: tuple[str, ...], meta: tuple[str, ...] = ()):
    """A frozen dataclass registered as a pytree with these data and static fields."""
    def register(cls):
        return jax.tree_util.register_dataclass(
            dataclasses.dataclass(frozen=True)(cls), data_fields=list(data), meta_fields=list(meta))
    return register


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
    ``"ragged_all_to_all"``, ``"all_to_all"`` or ``"ring"`` (see the module
    docstring).
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

    def __post_init__(self):
        check_count("num_experts", self.num_experts, 1)
        check_bool("use_expert_bias", self.use_expert_bias)
        check_bool("float32_gate_logits", self.float32_gate_logits)
        self.topk_config  # checks the routing options
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            check_real(name, getattr(self, name), low=0)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
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
        return self.activation in ("swiglu", "geglu")


@_pytree(("gate", "up", "down", "expert_bias"))
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


@_pytree(("load_balancing_loss", "z_loss", "tokens_per_expert"))
class MoEAux:
    """What :func:`moe` returns beside the output: the losses to add to the
    model's loss, and the load for logging. The same on every shard."""

    load_balancing_loss: jax.Array
    """float32 scalar, already times ``aux_loss_coeff`` (0 when that is 0)."""
    z_loss: jax.Array
    """float32 scalar, already times ``z_loss_coeff`` (0 when that is 0)."""
    tokens_per_expert: jax.Array
    """``[E]`` int32: the tokens routed to each expert, over every token shard."""


def init_params(key, config: MoEConfig, hidden: int, ffn: int, dtype=jnp.float32) -> MoEParams:
    """Random parameters of the whole layer (all experts): normal with variance
    ``1 / fan_in`` per matrix, and a zero expert bias when the config uses one.

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
    return MoEParams(
        gate=(jax.random.normal(k_gate, (h, e), _F32) / math.sqrt(h)).astype(dtype),
        up=(jax.random.normal(k_up, (e, h, up_width), _F32) / math.sqrt(h)).astype(dtype),
        down=(jax.random.normal(k_down, (e, f, h), _F32) / math.sqrt(f)).astype(dtype),
        expert_bias=jnp.zeros((e,), _F32) if config.use_expert_bias else None)


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
class _Axes:
    """The shard_map axes of one call, with their sizes (static)."""

    expert_axis: str | None
    data_axes: tuple[str, ...]
    expert_shards: int
    token_shards: int

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self.data_axes + ((self.expert_axis,) if self.expert_axis else ())


def _axis_size(name, what: str) -> int:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a mesh axis name (str), got {name!r}")
    try:
        return jax.lax.axis_size(name)
    except NameError:
        raise ValueError(f"{what} {name!r} is not an axis of the enclosing jax.shard_map (call moe inside "
                         "shard_map with that axis, or use shard_map_moe)") from None


def _data_axes(expert_axis, data_axes) -> tuple[str, ...]:
    """``data_axes`` as a tuple; each mesh axis may split the tokens once."""
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if expert_axis in data_axes:
        raise ValueError(f"expert_axis {expert_axis!r} is also in data_axes {data_axes}")
    if len(set(data_axes)) != len(data_axes):
        raise ValueError(f"data_axes {data_axes} names an axis twice")
    return data_axes


def _axes(config: MoEConfig, expert_axis, data_axes) -> _Axes:
    data_axes = _data_axes(expert_axis, data_axes)
    sizes = [_axis_size(a, "data_axes entry") for a in data_axes]
    expert_shards = 1 if expert_axis is None else _axis_size(expert_axis, "expert_axis")
    if config.num_experts % expert_shards:
        raise ValueError(f"num_experts ({config.num_experts}) must divide by the size of expert_axis "
                         f"{expert_axis!r} ({expert_shards})")
    return _Axes(expert_axis, data_axes, expert_shards, math.prod(sizes) * expert_shards)


def _sum_over(x, axes: tuple[str, ...]):
    return jax.lax.psum(x, axes) if axes else x


# -- route ---------------------------------------------------------------------------

@_pytree(("logits", "probs", "routing_map", "tokens_per_expert", "aux_tokens_per_expert",
          "load_balancing_loss", "z_loss"))
class Routing:
    """The result of :func:`route` for this shard's ``T`` tokens."""

    logits: jax.Array
    """``[T, E]`` float32 router logits."""
    probs: jax.Array
    """``[T, E]`` float32 routing weights, zero off the chosen experts."""
    routing_map: jax.Array
    """``[T, E]`` bool: the chosen experts."""
    tokens_per_expert: jax.Array
    """``[E]`` int32, counted over every token shard."""
    aux_tokens_per_expert: jax.Array | None
    """``[E]`` int32: the load-balancing loss's counts (plain top-k of its scores,
    over every token shard); None without that loss."""
    load_balancing_loss: jax.Array
    """float32 scalar, times ``aux_loss_coeff``."""
    z_loss: jax.Array
    """float32 scalar, times ``z_loss_coeff``."""


def _router_dot(a, b):
    """The router's products in float32, at full precision on every backend
    (XLA's default on a GPU would round float32 operands to TF32)."""
    return jnp.dot(a, b, preferred_element_type=_F32, precision=jax.lax.Precision.HIGHEST)


def _aux_loss_config(config: MoEConfig, axes: _Axes, tokens: int) -> router.AuxLossConfig:
    return router.AuxLossConfig(total_num_tokens=tokens * axes.token_shards, topk=config.topk,
                                coeff=config.aux_loss_coeff)


def route(tokens, params: MoEParams, config: MoEConfig, *, expert_axis=None, data_axes=()) -> Routing:
    """Chooses each token's experts and computes the auxiliary losses.

    Args:
      tokens: ``[T, H]``, this shard's tokens.
      params: the layer's :class:`MoEParams` (``gate`` and ``expert_bias`` are used).
      config: the layer's :class:`MoEConfig`.
      expert_axis, data_axes: as for :func:`moe`: the counts and losses are
        taken over every token shard.
    """
    axes = _axes(config, expert_axis, data_axes)
    return _route(tokens.astype(config.router_dtype), params, config, axes)


def _route(tokens, params: MoEParams, config: MoEConfig, axes: _Axes) -> Routing:
    """:func:`route` of ``tokens`` in ``config.router_dtype``."""
    logits = _router_dot(tokens, params.gate.astype(config.router_dtype))
    bias = params.expert_bias if config.use_expert_bias else None
    probs, routing_map = router.topk_fwd(logits, bias, config.topk_config)
    counts = routing_map.sum(0, dtype=jnp.int32)
    zero = jnp.zeros((), _F32)
    aux_counts, loss, z_loss = None, zero, zero
    if config.aux_loss_coeff:
        aux_map, scores = router.aux_loss_scores_fwd(logits, config.topk, config.score_function)
        counts, aux_counts = _sum_over((counts, aux_map.sum(0, dtype=jnp.int32)), axes.token_axes)
        loss = router.aux_loss_fwd(scores, aux_counts, _aux_loss_config(config, axes, len(tokens)))
    else:
        counts = _sum_over(counts, axes.token_axes)
    if config.z_loss_coeff:
        lse = jax.nn.logsumexp(logits, axis=-1)
        z_loss = config.z_loss_coeff / (len(tokens) * axes.token_shards) * jnp.sum(lse * lse)
    loss, z_loss = _sum_over((loss, z_loss), axes.token_axes)
    return Routing(logits, probs, routing_map, counts, aux_counts, loss, z_loss)


def _route_bwd(routing: Routing, grad_probs, aux: MoEAux, config: MoEConfig, axes: _Axes):
    """The logits' gradient: through the top-k weights and both losses."""
    logits = routing.logits
    grad = router.topk_bwd(grad_probs, logits, routing.routing_map, config.topk_config)
    if config.aux_loss_coeff:
        grad_scores = router.aux_loss_bwd(aux.load_balancing_loss, routing.aux_tokens_per_expert,
                                          _aux_loss_config(config, axes, len(logits)),
                                          jax.ShapeDtypeStruct(logits.shape, _F32))
        grad_from_loss = router.aux_loss_scores_bwd(grad_scores, logits, config.score_function)
        grad = grad + grad_from_loss
    if config.z_loss_coeff:
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        scale = aux.z_loss * (2 * config.z_loss_coeff / (len(logits) * axes.token_shards))
        grad = grad + scale * lse * jax.nn.softmax(logits, axis=-1)
    return grad


# -- the exchange between expert shards ---------------------------------------------

@_pytree(("send_sizes", "send_offsets", "recv_sizes", "return_offsets", "chunk_sizes", "group_sizes"),
         ("axis", "shards", "capacity", "method"))
class Exchange:
    """How this shard's dispatched rows travel to the shards that own their
    experts, and back. Made on the device by :func:`dispatch`.

    Rows for shard ``j`` are the contiguous block of its experts in the
    expert-major dispatch layout. They land in ``j``'s receive buffer in slot
    ``me`` of ``shards`` slots of ``capacity`` rows each, where a local chunk
    sort groups them by local expert.
    """

    send_sizes: jax.Array
    """``[n]`` int32: rows this shard sends to each shard."""
    send_offsets: jax.Array
    """``[n]`` int32: where those rows start in the dispatched rows."""
    recv_sizes: jax.Array
    """``[n]`` int32: rows this shard receives from each shard."""
    return_offsets: jax.Array
    """``[n]`` int32: where this shard's block starts in each shard's dispatched rows."""
    chunk_sizes: jax.Array
    """``[n * (El + 1)]`` int32: per slot, the rows of each local expert, then the unused rest."""
    group_sizes: jax.Array
    """``[El]`` int32: the received rows of each local expert (the grouped GEMM's sizes)."""
    axis: str
    """The ``shard_map`` axis the experts are split over."""
    shards: int
    """``n``, the size of that axis."""
    capacity: int
    """The rows of one slot: the most one shard can send another."""
    method: str
    """``"all_to_all"`` or ``"ragged_all_to_all"``: the collective that moves the rows."""

    @property
    def local_experts(self) -> int:
        """``El``, the experts this shard owns."""
        return self.group_sizes.shape[0]

    def _sorted_chunks(self):
        """Chunk order by local expert, then by source slot; the unused rests last."""
        n, el = self.shards, self.local_experts
        order = [s * (el + 1) + e for e in range(el) for s in range(n)] + [s * (el + 1) + el for s in range(n)]
        return jnp.asarray(order, jnp.int32)

    def to_experts(self, rows):
        """``[R, H]`` dispatched rows → ``[n * capacity, H]`` rows of this shard's
        experts, grouped by local expert, then zero rows."""
        received = self._transfer(rows, back=False)
        return permutation.permute_chunks(received, self.chunk_sizes, self._sorted_chunks(), inverse=False)

    def from_experts(self, rows, num_rows: int):
        """The inverse of :meth:`to_experts`: ``[n * capacity, H]`` → ``[num_rows, H]``."""
        slots = permutation.permute_chunks(rows, self.chunk_sizes, self._sorted_chunks(), inverse=True)
        return self._transfer(slots, back=True, num_rows=num_rows)

    def _transfer(self, rows, *, back: bool, num_rows: int | None = None):
        transfer = self._ragged if self.method == "ragged_all_to_all" else self._slotted
        return transfer(rows, back=back, num_rows=num_rows)

    def _ragged(self, rows, *, back: bool, num_rows):
        me = jax.lax.axis_index(self.axis)
        if not back:
            out = jnp.zeros((self.shards * self.capacity, rows.shape[1]), rows.dtype)
            offsets = jnp.full((self.shards,), me * self.capacity, jnp.int32)
            args = (self.send_offsets, self.send_sizes, offsets, self.recv_sizes)
        else:
            out = jnp.zeros((num_rows, rows.shape[1]), rows.dtype)
            slots = jnp.arange(self.shards, dtype=jnp.int32) * self.capacity
            args = (slots, self.recv_sizes, self.return_offsets, self.send_sizes)
        # The receive buffer starts as zeros that vary like the rows sent into it.
        axes = tuple(_varying_axes(jax.typeof(rows)))
        out = jax.lax.pcast(out, axes, to="varying") if axes else out
        return jax.lax.ragged_all_to_all(rows, out, *args, axis_name=self.axis)

    def _slotted(self, rows, *, back: bool, num_rows):
        n, cap, h = self.shards, self.capacity, rows.shape[1]
        if not back:
            index = self.send_offsets[:, None] + jnp.arange(cap, dtype=jnp.int32)
            valid = jnp.arange(cap) < self.send_sizes[:, None]
            slots = jnp.where(valid[..., None], rows[jnp.clip(index, 0, rows.shape[0] - 1)], 0)
            return jax.lax.all_to_all(slots, self.axis, 0, 0).reshape(n * cap, h)
        returned = jax.lax.all_to_all(rows.reshape(n, cap, h), self.axis, 0, 0).reshape(n * cap, h)
        row = jnp.arange(num_rows, dtype=jnp.int32)
        ends = jnp.cumsum(self.send_sizes)
        shard = jnp.minimum(jnp.searchsorted(ends, row, side="right"), n - 1).astype(jnp.int32)
        index = shard * cap + row - self.send_offsets[shard]
        return jnp.where((row < ends[-1])[:, None], returned[jnp.clip(index, 0, n * cap - 1)], 0)


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def _plan_exchange(tokens_per_expert, config: MoEConfig, axes: _Axes, num_tokens: int, method: str) -> Exchange:
    n, e = axes.expert_shards, config.num_experts
    el = e // n
    me = jax.lax.axis_index(axes.expert_axis)
    # blocks[s, j, l]: rows shard s sends to shard j for j's local expert l.
    blocks = jax.lax.all_gather(tokens_per_expert, axes.expert_axis).reshape(n, n, el)
    per_pair = blocks.sum(-1)
    mine = blocks[:, me, :]
    capacity = _dispatch_rows(config, num_tokens, el)  # all of a shard's tokens sent to one shard's experts
    chunks = jnp.concatenate([mine, capacity - mine.sum(-1, keepdims=True)], axis=1).reshape(-1)
    return Exchange(
        send_sizes=per_pair[me], send_offsets=_exclusive_cumsum(per_pair[me]), recv_sizes=per_pair[:, me],
        return_offsets=_exclusive_cumsum(per_pair, axis=1)[:, me], chunk_sizes=chunks.astype(jnp.int32),
        group_sizes=mine.sum(0), axis=axes.expert_axis, shards=n, capacity=capacity, method=method)


def _dispatch_rows(config: MoEConfig, num_tokens: int, num_experts: int) -> int:
    """The rows of a dispatch of ``num_tokens`` tokens to ``num_experts`` of the
    experts: each token reaches at most ``min(topk, num_experts)`` of them, each
    expert's block padded to ``align_size``. With a shard's ``El`` experts, the
    most rows one shard can send another."""
    return permutation.padded_rows(num_tokens * min(config.topk, num_experts), num_experts, config.align_size)


def _check_rows(config: MoEConfig, axes: _Axes, num_tokens: int, method: str | None) -> None:
    """The layer's largest buffer of rows (which holds at least as many as the
    others) must fit int32 row indices."""
    n, el = axes.expert_shards, config.num_experts // axes.expert_shards
    if method is None:
        what, rows = "the dispatch", _dispatch_rows(config, num_tokens, el)
    elif method == "ring":
        what, rows = (f"the dispatch of the expert axis's {n * num_tokens} gathered tokens",
                      _dispatch_rows(config, n * num_tokens, el))
    else:
        capacity = _dispatch_rows(config, num_tokens, el)
        what, rows = f"the exchange's receive buffer ({n} slots of {capacity} rows)", n * capacity
    if rows > MAX_ROWS:
        raise ValueError(f"{what} would hold {rows} rows, more than 2**31 - 1 (row indices are int32): {num_tokens} "
                         f"tokens per shard, topk={config.topk}, {el} experts per shard, align_size={config.align_size}")


# -- dispatch --------------------------------------------------------------------------

@_pytree(("rows", "group_sizes", "row_id_map", "probs", "exchange"), ("ring",))
class Dispatched:
    """The result of :func:`dispatch`: the rows the local experts compute on."""

    rows: jax.Array
    """``[N, H]`` in ``config.dtype``: the local experts' rows, expert by
    expert, then zero rows."""
    group_sizes: jax.Array
    """``[El]`` int32: the rows of each local expert."""
    row_id_map: permutation.RowIdMap
    """The local permutation (:func:`oxmoe.permutation.dispatch`) to undo."""
    probs: jax.Array
    """``[T', E']`` float32: the weights :func:`combine` applies, for the tokens
    and experts of ``row_id_map``."""
    exchange: Exchange | None
    """The exchange between expert shards; None without one."""
    ring: bool
    """Whether the tokens of the expert axis were gathered (``exchange="ring"``)."""


def _method(config: MoEConfig, axes: _Axes) -> str | None:
    if axes.expert_shards == 1:
        return None
    # Inside shard_map the mesh is abstract, but it knows its devices' platform.
    device = jax.sharding.get_abstract_mesh().abstract_device
    if config.exchange == "ragged_all_to_all" and getattr(device, "platform", None) == "cpu":
        raise ValueError("exchange 'ragged_all_to_all' is not implemented on CPU (XLA:CPU has no ragged all-to-all; "
                         "the layer would fail when it runs): use exchange 'auto', 'all_to_all' or 'ring' on a CPU mesh")
    return "all_to_all" if config.exchange == "auto" else config.exchange


def dispatch(tokens, routing: Routing, config: MoEConfig, *, expert_axis=None, data_axes=()) -> Dispatched:
    """Moves each token's row to the shard and expert it is routed to.

    Args:
      tokens: ``[T, H]``, this shard's tokens (as given to :func:`route`).
      routing: :func:`route`'s result.
      config, expert_axis, data_axes: as for :func:`moe`.
    """
    axes = _axes(config, expert_axis, data_axes)
    return _dispatch(tokens.astype(config.dtype), routing, config, axes)


def _dispatch(tokens, routing: Routing, config: MoEConfig, axes: _Axes) -> Dispatched:
    method, align = _method(config, axes), config.align_size
    _check_rows(config, axes, len(tokens), method)
    if method == "ring":
        n, el = axes.expert_shards, config.num_experts // axes.expert_shards
        first = jax.lax.axis_index(axes.expert_axis) * el
        gather = functools.partial(jax.lax.all_gather, axis_name=axes.expert_axis, tiled=True)
        local = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=el, axis=1)
        tokens, routing_map, probs = gather(tokens), local(gather(routing.routing_map)), local(gather(routing.probs))
        local_rows = permutation.dispatch_fwd(tokens, routing_map, None,
                                              num_rows=_dispatch_rows(config, len(tokens), el), align_size=align)
        return Dispatched(local_rows.tokens, local_rows.tokens_per_expert, local_rows.row_id_map, probs, None, True)
    local_rows = permutation.dispatch_fwd(tokens, routing.routing_map, None,
                                          num_rows=_dispatch_rows(config, len(tokens), config.num_experts),
                                          align_size=align)
    if method is None:
        return Dispatched(local_rows.tokens, local_rows.tokens_per_expert, local_rows.row_id_map, routing.probs,
                          None, False)
    exchange = _plan_exchange(local_rows.tokens_per_expert, config, axes, len(tokens), method)
    return Dispatched(exchange.to_experts(local_rows.tokens), exchange.group_sizes, local_rows.row_id_map,
                      routing.probs, exchange, False)


# -- expert FFN --------------------------------------------------------------------------

@_pytree(("rows", "up_rows"))
class ExpertOutput:
    """The result of :func:`expert_ffn`."""

    rows: jax.Array
    """``[N, H]``: each dispatched row through its expert."""
    up_rows: jax.Array
    """``[N, 2F]`` or ``[N, F]``: the up projection before the activation (kept
    for the backward)."""


def _activate(u, activation: str):
    """The activation in float32, rounded to ``u``'s dtype."""
    v = u.astype(_F32)
    if activation in ("swiglu", "geglu"):
        gate, up = jnp.split(v, 2, axis=-1)
        act = jax.nn.silu(gate) if activation == "swiglu" else jax.nn.gelu(gate, approximate=True)
        return (act * up).astype(u.dtype)
    return (jax.nn.silu(v) if activation == "silu" else jax.nn.gelu(v, approximate=True)).astype(u.dtype)


def expert_ffn(dispatched: Dispatched, params: MoEParams, config: MoEConfig) -> ExpertOutput:
    """Each local expert's FFN on its rows: one grouped GEMM over the fused
    gate+up weight, the activation, one grouped GEMM over the down weight.

    Args:
      dispatched: :func:`dispatch`'s result.
      params: :class:`MoEParams` whose ``up``/``down`` are the local experts.
      config: the layer's :class:`MoEConfig`.
    """
    sizes = dispatched.group_sizes
    up = grouped_gemm.ragged_dot(dispatched.rows, params.up.astype(config.dtype), sizes)
    rows = grouped_gemm.ragged_dot(_activate(up, config.activation), params.down.astype(config.dtype), sizes)
    return ExpertOutput(rows, up)


def _expert_ffn_bwd(grad_rows, dispatched: Dispatched, out: ExpertOutput, params: MoEParams, config: MoEConfig):
    """Gradients of the expert rows, the up and the down weights."""
    sizes, groups = dispatched.group_sizes, dispatched.group_sizes.shape[0]
    hidden, activation_vjp = jax.vjp(functools.partial(_activate, activation=config.activation), out.up_rows)
    grad_hidden = grouped_gemm.ragged_dot(grad_rows, params.down.astype(config.dtype), sizes, rhs_transposed=True)
    grad_down = grouped_gemm.transposed_ragged_dot(hidden, grad_rows, sizes, num_groups=groups,
                                                   preferred_element_type=_weight_grad_dtype(params.down, config))
    (grad_up_rows,) = activation_vjp(grad_hidden)
    grad_in = grouped_gemm.ragged_dot(grad_up_rows, params.up.astype(config.dtype), sizes, rhs_transposed=True)
    grad_up = grouped_gemm.transposed_ragged_dot(dispatched.rows, grad_up_rows, sizes, num_groups=groups,
                                                 preferred_element_type=_weight_grad_dtype(params.up, config))
    return grad_in, grad_up, grad_down


def _weight_grad_dtype(weight, config: MoEConfig):
    """The kernels accumulate in float32 and write the weight's own dtype when
    they can: a float32 copy of a large bfloat16 gradient, then cast, would
    move three times its bytes."""
    return weight.dtype if weight.dtype in (jnp.dtype(_F32), config.dtype) else _F32


# -- combine -----------------------------------------------------------------------------

def combine(out: ExpertOutput, dispatched: Dispatched, config: MoEConfig, *, expert_axis=None,
            data_axes=()) -> jax.Array:
    """Brings the expert rows back to this shard's tokens: ``[T, H]``, each
    token's rows weighted by its routing weights and summed (in float32).

    Args:
      out: :func:`expert_ffn`'s result.
      dispatched: the :func:`dispatch` it came from.
      config, expert_axis, data_axes: as for :func:`moe`.
    """
    axes = _axes(config, expert_axis, data_axes)
    return _combine(_returned_rows(out, dispatched), dispatched, axes)


def _returned_rows(out: ExpertOutput, dispatched: Dispatched):
    """The expert rows in this shard's dispatch layout (after the way back)."""
    if dispatched.exchange is None:
        return out.rows
    return dispatched.exchange.from_experts(out.rows, dispatched.row_id_map.source_tokens.shape[0])


def _combine(returned, dispatched: Dispatched, axes: _Axes):
    y = permutation.combine_fwd(returned, dispatched.row_id_map, dispatched.probs)
    if dispatched.ring:
        y = jax.lax.psum_scatter(y, axes.expert_axis, scatter_dimension=0, tiled=True)
    return y


# -- the layer -------------------------------------------------------------------------

@_pytree(("tokens", "params", "routing", "dispatched", "expert_output", "returned"), ("x_shape", "x_dtype"))
class Residuals:
    """What the forward pass keeps for the backward."""

    tokens: jax.Array
    """``[T, H]`` in ``config.router_dtype``: the router's input."""
    params: MoEParams
    routing: Routing
    dispatched: Dispatched
    expert_output: ExpertOutput
    returned: jax.Array
    """``[R, H]``: the expert rows in this shard's own dispatch layout, the ones
    the weights multiplied (not the rows of the experts this shard computed)."""
    x_shape: tuple[int, ...]
    """The layer input's shape, to give its gradient."""
    x_dtype: Any
    """The layer input's dtype, to give its gradient."""


def _check_params(params, config: MoEConfig, axes: _Axes, hidden: int) -> None:
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be an oxmoe.moe.MoEParams, got {type(params).__name__}")
    e, el = config.num_experts, config.num_experts // axes.expert_shards
    for name in ("gate", "up", "down"):
        check_array(f"params.{name}", getattr(params, name))
        if getattr(params, name).dtype not in FLOAT_DTYPES:
            raise TypeError(f"params.{name} must be float32, bfloat16 or float16, got {getattr(params, name).dtype}")
    if params.gate.shape != (hidden, e):
        raise ValueError(f"params.gate must have shape [hidden, num_experts] = [{hidden}, {e}], "
                         f"got {list(params.gate.shape)}")
    where = f" (num_experts {e} / expert_axis size {axes.expert_shards})" if axes.expert_shards > 1 else ""
    up, down = params.up.shape, params.down.shape
    if len(down) != 3 or down[0] != el or down[2] != hidden:
        raise ValueError(f"params.down must have shape [local experts, ffn, hidden] = [{el}{where}, F, {hidden}], "
                         f"got {list(down)}")
    f = down[1]
    width, form = (2 * f, "2 * ffn (gate and up halves)") if config.glu else (f, "ffn")
    if up != (el, hidden, width):
        raise ValueError(f"params.up must have shape [local experts, hidden, {form}] = [{el}{where}, {hidden}, "
                         f"{width}] for activation {config.activation!r} and ffn = {f}, got {list(up)}")
    if config.use_expert_bias:
        bias = params.expert_bias
        if bias is None:
            raise ValueError("config.use_expert_bias is True but params.expert_bias is None")
        check_array("params.expert_bias", bias)
        if bias.shape != (e,) or bias.dtype != _F32:
            raise ValueError(f"params.expert_bias must be float32 [num_experts] = [{e}], "
                             f"got {bias.dtype}{list(bias.shape)}")
    elif params.expert_bias is not None:
        raise ValueError("params.expert_bias is given but config.use_expert_bias is False")


def moe(x, params: MoEParams, config: MoEConfig, *, expert_axis: str | None = None,
        data_axes: tuple[str, ...] = ()) -> tuple[jax.Array, MoEAux]:
    """The MoE layer, forward and (by its custom VJP) backward.

    Args:
      x: ``[B, S, H]`` or ``[T, H]`` float tokens (inside ``shard_map``, this
        shard's).
      params: :class:`MoEParams`; inside ``shard_map`` with ``expert_axis``,
        ``up``/``down`` hold this shard's ``E / size(expert_axis)`` experts
        (shard ``i`` owns experts ``[i * El, (i + 1) * El)``); ``gate`` and
        ``expert_bias`` are whole (replicated).
      config: :class:`MoEConfig`.
      expert_axis: the ``shard_map`` axis the experts are split over; the
        tokens are split over it too. None: every expert is local.
      data_axes: further ``shard_map`` axes the tokens are split over (data
        parallelism); the expert weights are replicated over them.

    Returns:
      ``(y, aux)``: ``y`` has ``x``'s shape in ``config.dtype``; ``aux`` is
      :class:`MoEAux`, the same on every shard. Gradients of replicated
      parameters are summed over the shards that share them.
    """
    check_array("x", x)
    if x.ndim not in (2, 3) or x.shape[-1] < 1 or math.prod(x.shape[:-1]) < 1:
        raise ValueError(f"x must have shape [batch, seq, hidden] or [tokens, hidden] with at least one token, "
                         f"got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be an oxmoe.moe.MoEConfig, got {type(config).__name__}")
    axes = _axes(config, expert_axis, data_axes)
    _check_params(params, config, axes, x.shape[-1])
    return _layer(config, axes, x, params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layer(config: MoEConfig, axes: _Axes, x, params: MoEParams):
    return _layer_fwd(config, axes, x, params)[0]


def _layer_fwd(config: MoEConfig, axes: _Axes, x, params: MoEParams):
    flat = x.reshape(-1, x.shape[-1])
    # The router's input: without float32_gate_logits, the same cast as the dispatched tokens'.
    router_tokens = flat.astype(config.router_dtype)
    routing = _route(router_tokens, params, config, axes)
    dispatched = _dispatch(flat.astype(config.dtype), routing, config, axes)
    out = expert_ffn(dispatched, params, config)
    returned = _returned_rows(out, dispatched)
    y = _combine(returned, dispatched, axes).reshape(x.shape)
    aux = MoEAux(routing.load_balancing_loss, routing.z_loss, routing.tokens_per_expert)
    return (y, aux), Residuals(router_tokens, params, routing, dispatched, out, returned, x.shape, x.dtype)


def _layer_bwd(config: MoEConfig, axes: _Axes, res: Residuals, cotangents):
    grad_y, grad_aux = cotangents
    d, params = res.dispatched, res.params
    grad_y = grad_y.reshape(-1, grad_y.shape[-1]).astype(config.dtype)
    if d.ring:
        grad_y = jax.lax.all_gather(grad_y, axes.expert_axis, tiled=True)
    # combine: the rows' gradient in this shard's layout; the weights' from the returned rows.
    grad_returned, grad_probs = permutation.combine_bwd(grad_y, res.returned, d.row_id_map, d.probs)
    grad_rows = d.exchange.to_experts(grad_returned) if d.exchange else grad_returned
    grad_in, grad_up, grad_down = _expert_ffn_bwd(grad_rows, d, res.expert_output, params, config)
    if d.exchange:
        grad_in = d.exchange.from_experts(grad_in, len(grad_returned))
    grad_tokens, _ = permutation.dispatch_bwd(grad_in, d.row_id_map)
    if d.ring:
        grad_tokens = jax.lax.psum_scatter(grad_tokens, axes.expert_axis, scatter_dimension=0, tiled=True)
        grad_probs = _scatter_expert_columns(grad_probs, config, axes)
    grad_logits = _route_bwd(res.routing, grad_probs, grad_aux, config, axes)
    gate = params.gate.astype(config.router_dtype)
    grad_x = grad_tokens.astype(_F32) + _router_dot(grad_logits, gate.T)
    grad_gate = _sum_over(_router_dot(res.tokens.T, grad_logits), axes.token_axes)
    grad_up, grad_down = _sum_over((grad_up, grad_down), axes.data_axes)
    bias = None if params.expert_bias is None else jnp.zeros_like(params.expert_bias)
    grads = MoEParams(grad_gate.astype(params.gate.dtype), grad_up.astype(params.up.dtype),
                      grad_down.astype(params.down.dtype), bias)
    return grad_x.reshape(res.x_shape).astype(res.x_dtype), grads


def _scatter_expert_columns(grad_probs, config: MoEConfig, axes: _Axes):
    """Ring: this shard's ``[T_all, El]`` weight gradients → ``[T, E]`` for its own
    tokens, every shard's columns summed into place."""
    el = config.num_experts // axes.expert_shards
    first = jax.lax.axis_index(axes.expert_axis) * el
    full = jnp.zeros((grad_probs.shape[0], config.num_experts), grad_probs.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, grad_probs, first, axis=1)
    return jax.lax.psum_scatter(full, axes.expert_axis, scatter_dimension=0, tiled=True)


_layer.defvjp(_layer_fwd, _layer_bwd)


# -- the layer under its own shard_map ------------------------------------------------------

def shard_map_moe(x, params: MoEParams, config: MoEConfig, *, mesh=None, expert_axis: str | None = None,
                  data_axes: tuple[str, ...] = ()) -> tuple[jax.Array, MoEAux]:
    """:func:`moe` on whole (global) arrays, under ``jax.shard_map`` over ``mesh``.

    ``x``'s first dimension is split over ``(*data_axes, expert_axis)``, the
    expert weights' first over ``expert_axis``; ``gate`` and ``expert_bias``
    are replicated. Returns ``y`` split like ``x`` and a replicated
    :class:`MoEAux`.

    Args:
      x, params, config: as for :func:`moe`, with every expert's weights.
      mesh: the mesh (default: the context mesh, ``jax.set_mesh``).
      expert_axis, data_axes: mesh axis names.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    data_axes = _data_axes(expert_axis, data_axes)
    token_axes = data_axes + ((expert_axis,) if expert_axis is not None else ())
    for axis in token_axes:
        if axis not in mesh.axis_names:
            raise ValueError(f"{axis!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)})")
    check_array("x", x)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in token_axes)
    if x.ndim < 2 or x.shape[0] % shards:
        raise ValueError(f"x's first dimension ({x.shape[0] if x.ndim else x}) must divide by the {shards} token "
                         f"shards of the mesh axes ({sizes})")
    if expert_axis is not None and config.num_experts % mesh.shape[expert_axis]:
        raise ValueError(f"num_experts ({config.num_experts}) must divide by the size of expert_axis "
                         f"{expert_axis!r} ({mesh.shape[expert_axis]})")
    P = jax.sharding.PartitionSpec
    split_tokens, split_experts = P(token_axes or None), P(expert_axis)
    param_specs = MoEParams(P(), split_experts, split_experts, None if params.expert_bias is None else P())
    if jax.sharding.AxisType.Explicit in mesh.axis_types:
        # shard_map takes arrays of an explicit-axes mesh as they are sharded.
        place = functools.partial(_reshard, mesh=mesh)
        x, params = place(x, split_tokens), jax.tree.map(place, params, param_specs)
    layer = functools.partial(moe, config=config, expert_axis=expert_axis, data_axes=data_axes)
    return jax.shard_map(layer, mesh=mesh, in_specs=(split_tokens, param_specs),
                         out_specs=(split_tokens, MoEAux(P(), P(), P())))(x, params)


def _reshard(x, spec, *, mesh):
    target = jax.sharding.NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec
    return jax.sharding.reshard(x, target)
