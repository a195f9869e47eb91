"""The layer's steps (route, dispatch, expert FFN, combine, and the shared
experts beside them), its custom VJP and :func:`moe` with :func:`shard_map_moe`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oxmoe import activation, fp8, grouped_gemm, permutation, router
from oxmoe.activation import gated
from oxmoe._checks import FLOAT_DTYPES, check_array
from oxmoe._pytree import pytree_dataclass
from oxmoe.moe.config import (Axes, MoEAux, MoEConfig, MoEParams, as_data_axes, as_weight_axes, check_weight_shards,
                              mesh_axes)
from oxmoe.moe.exchange import (Exchange, check_rows, dispatch_rows, exchange_method, exchange_tokens, gather_over,
                                rows_of)

_F32 = jnp.float32


def _sum_over(x, axes: tuple[str, ...]):
    return jax.lax.psum(x, axes) if axes else x


# -- route ---------------------------------------------------------------------------

@pytree_dataclass(("logits", "probs", "routing_map", "tokens_per_expert", "aux_tokens_per_expert",
                   "load_balancing_loss", "z_loss", "kept", "dropped_copies"))
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
    kept: jax.Array | None
    """``[T, E]`` bool: the chosen experts whose capacity holds this token's
    copy (``capacity_factor``); None without a capacity."""
    dropped_copies: jax.Array
    """int32 scalar: the copies past capacity, over every token shard."""

    def dispatched(self) -> tuple[jax.Array, jax.Array]:
        """``(routing_map, probs)`` of the copies that are computed: the chosen
        ones within capacity."""
        if self.kept is None:
            return self.routing_map, self.probs
        return self.kept, jnp.where(self.kept, self.probs, 0)


def _f32_dot(a, b):
    """A dense product accumulated in float32 (the router's and the shared
    experts'); float32 operands at full precision (XLA's default on a GPU
    would round them to TF32), as the grouped GEMMs do."""
    precision = jax.lax.Precision.HIGHEST if _F32 in (a.dtype, b.dtype) else None
    return jnp.dot(a, b, preferred_element_type=_F32, precision=precision)


def _bf16_parts(x):
    """float32 ``x [..., n]`` → bfloat16 ``[..., 3 n]``: three parts side by side
    whose sum is ``x`` exactly, each the next 8 of its 24 significand bits. A
    float32 operand split so against a bfloat16 one makes its product exact
    products summed in float32 on the tensor cores, where XLA's float32 product at
    full precision runs on the FMA units. The parts are cut by masking bits: a
    float32 → bfloat16 → float32 round trip is what XLA may fold away as excess
    precision."""
    parts = []
    for _ in range(3):
        head = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), _F32)
        parts.append(head.astype(jnp.bfloat16))
        x = x - head
    return jnp.concatenate(parts, axis=-1)


def _router_grads(tokens, gate, grad_logits):
    """``(grad_tokens, grad_gate)``, float32, of ``logits = tokens @ gate`` from the
    logits' float32 gradient. Against a bfloat16 router the gradient is split into
    :func:`_bf16_parts` (the same sums to float32 rounding, on the tensor cores)."""
    if gate.dtype != jnp.bfloat16:
        return _f32_dot(grad_logits, gate.T), _f32_dot(tokens.T, grad_logits)
    parts = _bf16_parts(grad_logits)
    grad_tokens = _f32_dot(parts, jnp.tile(gate.T, (3, 1)))
    grad_gate = _f32_dot(tokens.T, parts).reshape(len(gate), 3, -1).sum(1)
    return grad_tokens, grad_gate


def _aux_loss_config(config: MoEConfig, axes: Axes, tokens: int) -> router.AuxLossConfig:
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
    axes = mesh_axes(config, expert_axis, data_axes)
    return _route(tokens.astype(config.router_dtype), params, config, axes)


def _route(tokens, params: MoEParams, config: MoEConfig, axes: Axes) -> Routing:
    """:func:`route` of ``tokens`` in ``config.router_dtype``."""
    logits = _f32_dot(tokens, params.gate.astype(config.router_dtype))
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
    kept, dropped = None, jnp.zeros((), jnp.int32)
    if config.capacity_factor is not None:
        kept = _within_capacity(routing_map, config, axes)
        dropped = _sum_over((routing_map & ~kept).sum(dtype=jnp.int32), axes.token_axes)
    return Routing(logits, probs, routing_map, counts, aux_counts, loss, z_loss, kept, dropped)


def _within_capacity(routing_map, config: MoEConfig, axes: Axes):
    """``[T, E]`` bool: the chosen copies each expert has room for, in token
    order over the expert axis (its shards in order, then their tokens)."""
    capacity = config.expert_capacity(routing_map.shape[0] * axes.expert_shards)
    chosen = routing_map.astype(jnp.int32)
    position = jnp.cumsum(chosen, axis=0) - chosen  # this expert's copies before each token on this shard
    if axes.expert_shards > 1:
        every = jax.lax.all_gather(chosen.sum(0), axes.expert_axis)  # [n, E]
        position = position + (jnp.cumsum(every, axis=0) - every)[jax.lax.axis_index(axes.expert_axis)]
    return routing_map & (position < capacity)


def _route_bwd(logits, routing_map, aux_tokens_per_expert, grad_probs, aux: MoEAux, config: MoEConfig, axes: Axes):
    """The logits' gradient: through the top-k weights and both losses."""
    grad = router.topk_bwd(grad_probs, logits, routing_map, config.topk_config)
    if config.aux_loss_coeff:
        grad_scores = router.aux_loss_bwd(aux.load_balancing_loss, aux_tokens_per_expert,
                                          _aux_loss_config(config, axes, len(logits)),
                                          jax.ShapeDtypeStruct(logits.shape, _F32))
        grad_from_loss = router.aux_loss_scores_bwd(grad_scores, logits, config.score_function)
        grad = grad + grad_from_loss
    if config.z_loss_coeff:
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        scale = aux.z_loss * (2 * config.z_loss_coeff / (len(logits) * axes.token_shards))
        grad = grad + scale * lse * jax.nn.softmax(logits, axis=-1)
    return grad


# -- dispatch --------------------------------------------------------------------------

@pytree_dataclass(("rows", "tokens", "group_sizes", "row_id_map", "probs", "row_probs", "exchange"), ("ring",))
class ExpertInput:
    """The result of :func:`dispatch`: the rows the local experts compute on,
    and what :func:`combine` needs to bring their results back. (Named
    ``Dispatched`` before, like :class:`oxmoe.permutation.Dispatched`, which
    is another thing: the result of the local permutation.)"""

    rows: jax.Array | fp8.BlockQuantized
    """``[N, H]`` in ``config.dtype``: the local experts' rows, expert by
    expert, then zero rows: ``tokens`` permuted (with ``config.fp8``, their
    FP8 values and scales)."""
    tokens: jax.Array | fp8.BlockQuantized
    """``[T', H]`` in ``config.dtype``: what the local permutation took: this
    shard's tokens, the rows the exchange brought, or the ring's gathered tokens.
    With ``config.fp8``, quantized in 1 x 128 blocks before they left their
    shard: they travel and are permuted as FP8 values and scales, quantized once."""
    group_sizes: jax.Array
    """``[El]`` int32: the rows of each local expert."""
    row_id_map: permutation.RowIdMap
    """The local permutation (:func:`oxmoe.permutation.dispatch`) to undo."""
    probs: jax.Array
    """``[T', E']`` float32: the weights :func:`combine` applies, for the tokens
    and experts of ``row_id_map``."""
    row_probs: jax.Array
    """``[N]`` float32: each row's weight (``probs`` permuted), zero on padding rows."""
    exchange: Exchange | None
    """The exchange between expert shards; None without one."""
    ring: bool
    """Whether the tokens of the expert axis were gathered (``exchange="ring"``)."""


def dispatch(tokens, routing: Routing, config: MoEConfig, *, expert_axis=None, data_axes=()) -> ExpertInput:
    """Moves each token's row to the shard and expert it is routed to.

    Args:
      tokens: ``[T, H]``, this shard's tokens (as given to :func:`route`).
      routing: :func:`route`'s result.
      config, expert_axis, data_axes: as for :func:`moe`.
    """
    axes = mesh_axes(config, expert_axis, data_axes)
    capacity = config.expert_capacity(len(tokens) * axes.expert_shards)
    return _dispatch(tokens.astype(config.dtype), *routing.dispatched(), config, axes, capacity)


def _dispatch(tokens, routing_map, probs, config: MoEConfig, axes: Axes, capacity: int | None,
              zero_unused_rows: bool = True) -> ExpertInput:
    """:func:`dispatch` of ``tokens`` (all of this shard's, or a chunk of them) with their
    ``routing_map`` and ``probs`` of the copies to compute; ``capacity``: the copies
    one expert takes from every token of the expert axis (None: no bound);
    ``zero_unused_rows``: see :func:`_zeroes_unused_rows`."""
    method, align = exchange_method(config, axes, *tokens.shape), config.align_size
    check_rows(config, axes, len(tokens), method, capacity)
    el = config.num_experts // axes.expert_shards
    exchange = None
    parts = _token_parts(tokens, config)
    if method == "ring":
        axis = axes.expert_axis
        assert axis is not None, "the ring needs an expert axis"
        first = jax.lax.axis_index(axis) * el
        local = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=el, axis=1)
        parts = gather_over(axis, *parts)
        routing_map, probs = (local(x) for x in gather_over(axis, routing_map, probs))
    elif method is not None:
        exchange, parts, weights = exchange_tokens(parts, routing_map, probs, config, axes, method, capacity)
        routing_map, probs = weights >= 0, jnp.maximum(weights, 0)
    # The last part (the rows, or the FP8 scales) is permuted by the dispatch, which makes the row map.
    local_rows = permutation.dispatch_fwd(parts[-1], routing_map, probs, num_rows=dispatch_rows(
        config, len(parts[-1]), el, capacity), align_size=align, zero_unused_rows=zero_unused_rows)
    assert local_rows.probs is not None  # given the weights, dispatch_fwd permutes them
    rows: jax.Array | fp8.BlockQuantized = local_rows.tokens
    if config.fp8 is not None:  # the dispatch permuted the scales; the values follow its map
        rows = fp8.BlockQuantized(rows_of(parts[0], local_rows.row_id_map), local_rows.tokens, fp8.ACTIVATION_BLOCK)
    return ExpertInput(rows, _from_parts(parts), local_rows.group_sizes, local_rows.row_id_map, probs,
                       local_rows.probs.astype(_F32), exchange, method == "ring")


def _token_parts(tokens, config: MoEConfig) -> tuple:
    """What of ``[T, H]`` rows travels and is permuted: the rows, or with ``config.fp8``
    their FP8 values and scales (1 x 128 blocks: half the bytes, quantized once)."""
    if config.fp8 is None:
        return (tokens,)
    q = fp8.quantize(tokens, fp8.ACTIVATION_BLOCK, power_of_two_scales=config.fp8.power_of_two_scales)
    return q.values, q.scales


def _from_parts(parts: tuple):
    """The rows :func:`_token_parts` cut up."""
    if len(parts) == 1:
        return parts[0]
    values, scales = parts
    return fp8.BlockQuantized(values, scales, fp8.ACTIVATION_BLOCK)


def _permuted(rows, row_map: permutation.RowIdMap, zero_unused_rows: bool = True):
    """``[T, H]`` rows (or their FP8 values and scales) → ``[R, H]``: each row's token's
    (``zero_unused_rows``: see :func:`_zeroes_unused_rows`)."""
    if isinstance(rows, fp8.BlockQuantized):
        return fp8.BlockQuantized(rows_of(rows.values, row_map), rows_of(rows.scales, row_map), rows.block)
    return rows_of(rows, row_map, zero_unused_rows=zero_unused_rows)


def _zeroes_unused_rows(config: MoEConfig, axes: Axes) -> bool:
    """Whether the layer's kernels zero the rows of its expert-row buffers that hold no
    routed copy (rows past the groups). With expert shards a buffer holds the most rows a
    shard's experts can take with no token dropped, about twice what they take: zeroing and
    reading the rest cost 1.0-4.5 ms of a 10-140 ms step on an H200 (bench/NOTES.md). Nothing
    in the layer reads them, so they are left unwritten, but with alignment padding (rows
    inside the groups that the weight gradients sum, which must be zero) or FP8 (whose
    quantization blocks of 128 rows span a group's end). On one shard a buffer holds the
    routed copies and nothing else."""
    return config.fp8 is not None or config.align_size is not None or axes.expert_shards == 1


# -- expert FFN --------------------------------------------------------------------------

@pytree_dataclass(("rows", "up_rows"))
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
    if gated(activation):
        gate, up = jnp.split(v, 2, axis=-1)
        act = jax.nn.silu(gate) if activation == "swiglu" else jax.nn.gelu(gate, approximate=True)
        return (act * up).astype(u.dtype)
    return (jax.nn.silu(v) if activation == "silu" else jax.nn.gelu(v, approximate=True)).astype(u.dtype)


def expert_ffn(dispatched: ExpertInput, params: MoEParams, config: MoEConfig) -> ExpertOutput:
    """Each local expert's FFN on its rows: one grouped GEMM over the fused
    gate+up weight with the activation (in its epilogue on Hopper,
    :func:`oxmoe.grouped_gemm.ragged_dot_activation`), one grouped GEMM over
    the down weight (with ``config.fp8``, FP8 products, and the activation in a
    pass of its own that quantizes its result, :func:`oxmoe.fp8.activation`).

    Args:
      dispatched: :func:`dispatch`'s result.
      params: :class:`MoEParams` whose ``up``/``down`` are the local experts.
      config: the layer's :class:`MoEConfig`.
    """
    return _expert_ffn(dispatched, _forward_weights(params, config), config)


def _forward_weights(params: MoEParams, config: MoEConfig) -> tuple:
    """``(up, down)`` as the forward's products take them, the first of
    :func:`_expert_weights` without the backward's layout nor the gather: in ``config.dtype``, or with
    ``config.fp8`` each weight's transpose quantized in 128 x 128 blocks."""
    if config.fp8 is None:
        return params.up.astype(config.dtype), params.down.astype(config.dtype)
    quantize = functools.partial(fp8.quantize, block=fp8.WEIGHT_BLOCK, transpose=True,
                                 power_of_two_scales=config.fp8.power_of_two_scales)
    return quantize(params.up), quantize(params.down)


@pytree_dataclass(("up", "down", "transposed_up", "transposed_down"), ("recipe",))
class QuantizedExpertWeights:
    """The experts' ``up`` and ``down`` weights quantized in 128 x 128 blocks, in both
    layouts the FP8 layer's products take: :func:`quantize_expert_weights`'s result, which
    :func:`moe` takes as ``fp8_weights`` so that several calls (a step's micro-batches)
    share one quantization."""

    up: fp8.BlockQuantized
    """``[El, H, 2F]`` (``[El, H, F]`` ungated): the backward's d lhs products read it transposed."""
    down: fp8.BlockQuantized
    """``[El, F, H]``, as ``up``."""
    transposed_up: fp8.BlockQuantized
    """``[El, 2F, H]``: the forward's up projection (both operands K-major, the form Hopper's
    tensor cores multiply in FP8). The same values and scales as ``up``, each block where the
    transpose puts it."""
    transposed_down: fp8.BlockQuantized
    """``[El, H, F]``, as ``transposed_up``."""
    recipe: fp8.BlockScaling
    """The recipe they were quantized with (``MoEConfig.fp8``)."""

    @property
    def forward(self) -> tuple[fp8.BlockQuantized, fp8.BlockQuantized]:
        """``(up, down)`` as the forward's products take them."""
        return self.transposed_up, self.transposed_down

    @property
    def backward(self) -> tuple[fp8.BlockQuantized, fp8.BlockQuantized]:
        """``(up, down)`` as the backward's products take them."""
        return self.up, self.down


def quantize_expert_weights(params: MoEParams, config: MoEConfig) -> QuantizedExpertWeights:
    """``params.up`` and ``params.down`` quantized as the FP8 layer (``config.fp8``) quantizes
    them in each call, for :func:`moe`'s ``fp8_weights``: one quantization for several calls.

    With gradient accumulation, each of a step's micro-batches runs the layer on the same
    weights, and without ``fp8_weights`` each call quantizes them again both ways (on an H200,
    0.6 ms of a 7.4 ms Qwen3-30B-A3B FP8 step, 1.5 ms of 24 ms at DeepSeek-V3 on one GPU).
    Quantize them once per optimizer step instead, as TransformerEngine keeps its FP8 weight
    casts across micro-batches, and pass the result to every call of that step; quantize
    again after each update: the layer computes with the weights these stand for, not with
    ``params.up`` and ``params.down``. Not differentiated: the weights' gradients reach
    ``params`` through :func:`moe`.

    Args:
      params: :class:`MoEParams`; only ``up`` and ``down`` are read. Inside ``shard_map``,
        this shard's, as :func:`moe` takes them (with ``weight_axes``, the shard's part:
        :func:`moe` gathers the quantized weights as it gathers the weights).
      config: the layer's :class:`MoEConfig`; ``config.fp8`` must be set.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be an oxmoe.moe.MoEConfig, got {type(config).__name__}")
    if config.fp8 is None:
        raise ValueError("quantize_expert_weights needs config.fp8 (an oxmoe.fp8.BlockScaling recipe); "
                         "without it the layer's products take the weights as they are")
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be an oxmoe.moe.MoEParams, got {type(params).__name__}")
    for name in ("up", "down"):
        weight = getattr(params, name)
        check_array(f"params.{name}", weight)
        if weight.ndim != 3 or weight.dtype not in FLOAT_DTYPES:
            raise ValueError(f"params.{name} must be a float32, bfloat16 or float16 [experts, rows, columns] array, "
                             f"got {weight.dtype}{list(weight.shape)}")
        if weight.shape[1] % 128 or weight.shape[2] % 128:
            raise ValueError(f"config.fp8 quantizes params.{name} in 128 x 128 blocks: its last two dimensions must "
                             f"be multiples of 128, got {list(weight.shape)}")
    quantize = functools.partial(fp8.quantize_with_transpose, block=fp8.WEIGHT_BLOCK,
                                 power_of_two_scales=config.fp8.power_of_two_scales)
    (up, transposed_up), (down, transposed_down) = quantize(params.up), quantize(params.down)
    return QuantizedExpertWeights(up, down, transposed_up, transposed_down, config.fp8)


def _expert_weights(params: MoEParams, config: MoEConfig, axes: Axes,
                    fp8_weights: QuantizedExpertWeights | None = None) -> tuple[tuple, tuple]:
    """``(forward, backward)``: all of this expert shard's ``up`` and ``down`` (gathered over
    ``weight_axes``) as the forward's products take them and as the backward's do. In
    ``config.dtype``, the same arrays for both; with ``config.fp8``
    :func:`quantize_expert_weights`'s two layouts (``fp8_weights`` where given), quantized
    per expert, so before they are gathered: the gather moves FP8 bytes."""
    if config.fp8 is None:
        weights = _forward_weights(_gather_weights(params, axes), config)
        return weights, weights
    quantized = quantize_expert_weights(params, config) if fp8_weights is None else fp8_weights
    if axes.weight_axes:
        leaves, tree = jax.tree.flatten(quantized)
        quantized = jax.tree.unflatten(tree, gather_over(axes.weight_axes, *leaves))
    return quantized.forward, quantized.backward


def _expert_product(rows, weight, sizes, config: MoEConfig, *, rhs_transposed: bool = False,
                    zero_unused_rows: bool = True):
    """``rows`` of each group times its expert's ``weight`` (``weight[g]ᵀ`` with
    ``rhs_transposed``), in ``config.dtype``; with ``config.fp8`` the FP8 product of
    the rows quantized per row in 1 x 128 blocks (or as they came, quantized).
    ``zero_unused_rows``: see :func:`_zeroes_unused_rows`."""
    if config.fp8 is None:
        return grouped_gemm.ragged_dot(rows, weight, sizes, rhs_transposed=rhs_transposed,
                                       zero_unused_rows=zero_unused_rows)
    if not isinstance(rows, fp8.BlockQuantized):
        rows = fp8.quantize(rows, fp8.ACTIVATION_BLOCK, power_of_two_scales=config.fp8.power_of_two_scales)
    return fp8.ragged_dot(rows, weight, sizes, rhs_transposed=rhs_transposed, preferred_element_type=config.dtype)


def _expert_ffn(dispatched: ExpertInput, weights: tuple, config: MoEConfig,
                zero_unused_rows: bool = True) -> ExpertOutput:
    """:func:`expert_ffn` with the forward's weights of :func:`_expert_weights`
    (``zero_unused_rows``: see :func:`_zeroes_unused_rows`)."""
    up_weight, down_weight = weights
    sizes = dispatched.group_sizes
    if config.fp8 is None:
        up, hidden = grouped_gemm.ragged_dot_activation(dispatched.rows, up_weight, sizes, config.activation,
                                                        zero_unused_rows=zero_unused_rows)
        return ExpertOutput(_expert_product(hidden, down_weight, sizes, config, zero_unused_rows=zero_unused_rows),
                            up)
    # FP8: the weights come transposed (both operands K-major); the activation is a pass of its
    # own, which quantizes its result for the down projection.
    up = _expert_product(dispatched.rows, up_weight, sizes, config, rhs_transposed=True)
    quantized_hidden = fp8.activation(up, config.activation, power_of_two_scales=config.fp8.power_of_two_scales)
    return ExpertOutput(_expert_product(quantized_hidden, down_weight, sizes, config, rhs_transposed=True), up)


def _expert_ffn_bwd(grad_out_rows, kept: ExpertResiduals, weights: tuple, config: MoEConfig,
                    zero_unused_rows: bool = True):
    """From each row's output gradient before its routing weight (``grad_out_rows``),
    ``(grad_in, weighted_hidden, grad_up_rows, grad_row_probs)``: the gradient of the
    dispatched rows, the activation's output times each row's weight and the up
    projection's gradient (what the weight gradients, :func:`_expert_weight_grads`,
    take besides the rows; with ``config.fp8`` both as those products take them,
    quantized transposed in 128 x 1 blocks, the gradient in ``config.fp8.gradient_block``
    ones), and each row's weight's gradient, ``<row
    output, its gradient> = <hidden, its gradient times downᵀ>``: from values the
    backward computes anyway, so the forward keeps neither the rows nor their outputs
    (as SonicMoE does). The last three, and the d lhs product's operand, from one pass
    over the rows: :func:`oxmoe.activation.activation_bwd`, or with ``config.fp8``
    :func:`oxmoe.fp8.activation_bwd`, which quantizes them in the same pass (one
    pass where there were three: the activation's backward and two quantizations).
    ``weights``: the backward's of :func:`_expert_weights`; ``zero_unused_rows``: see
    :func:`_zeroes_unused_rows`."""
    up_weight, down_weight = weights
    grad_hidden = _expert_product(grad_out_rows, down_weight, kept.group_sizes, config, rhs_transposed=True,
                                  zero_unused_rows=zero_unused_rows)
    lhs_rows: jax.Array | fp8.BlockQuantized
    weight_grad_rows: jax.Array | fp8.BlockQuantized
    weighted_hidden: jax.Array | fp8.BlockQuantized
    if config.fp8 is None:
        lhs_rows, weighted_hidden, grad_row_probs = activation.activation_bwd(
            grad_hidden, kept.up_rows, kept.row_probs, config.activation,
            group_sizes=None if zero_unused_rows else kept.group_sizes)
        weight_grad_rows = lhs_rows
    else:
        # The d lhs product's operand and both weight gradients' rows, quantized in the same pass.
        lhs_rows, weight_grad_rows, weighted_hidden, grad_row_probs = fp8.activation_bwd(
            grad_hidden, kept.up_rows, kept.row_probs, config.activation,
            power_of_two_scales=config.fp8.power_of_two_scales, grad_transposed_block=config.fp8.gradient_block)
    grad_in = _expert_product(lhs_rows, up_weight, kept.group_sizes, config, rhs_transposed=True,
                              zero_unused_rows=zero_unused_rows)
    return grad_in, weighted_hidden, weight_grad_rows, grad_row_probs


def _expert_weight_grads(kept: tuple[ExpertResiduals, ...], weighted_hidden: list, grad_out_rows: list,
                         grad_up_rows: list, params: MoEParams, config: MoEConfig, zero_unused_rows: bool = True):
    """``(grad_up, grad_down)`` of the local experts over every chunk's rows: one
    weight-gradient product per weight, its rows kept in their chunks' buffers
    (with ``config.fp8``, each quantized in 128 x 1 blocks, one scale per 128 rows
    (the output gradients in ``config.fp8.gradient_block`` blocks)
    of a column, and transposed: each column's rows contiguous, as the FP8 product
    takes them; ``weighted_hidden`` and ``grad_up_rows`` come so from
    :func:`_expert_ffn_bwd`). The
    dispatched rows are permuted again from their tokens (with ``config.fp8``, read
    from them through the dispatch's map by the requantization: on an H200 that kept
    the forward's copy of the rows out of the step's memory, 411 MB of 2,234 at
    DeepSeek-V3's one-GPU shape, which XLA had kept for the backward)."""
    sizes = jnp.stack([chunk.group_sizes for chunk in kept])  # [C, El]
    groups = sizes.shape[1]
    down_operands: tuple = (weighted_hidden, grad_out_rows)
    product: Callable = grouped_gemm.transposed_ragged_dot
    if config.fp8 is None:
        up_operands: tuple = ([_permuted(chunk.tokens, chunk.row_id_map, zero_unused_rows) for chunk in kept],
                              grad_up_rows)
    else:
        # Rows that travelled quantized per row (the tokens, the output gradient) are quantized
        # again per 128 rows (DeepSeek-V3's way), read as their FP8 values and scales: no 16-bit
        # copy of them, and the same values as quantizing one. The dispatched rows are read
        # from their tokens through the dispatch's map, with no copy of them either.
        requantize = functools.partial(fp8.requantize, dtype=config.dtype, transpose=True,
                                       power_of_two_scales=config.fp8.power_of_two_scales)

        def dispatched_rows(chunk: ExpertResiduals):
            assert isinstance(chunk.tokens, fp8.BlockQuantized)  # kept as they travelled (_token_parts)
            return requantize(chunk.tokens, fp8.ACTIVATION_BLOCK, source_rows=chunk.row_id_map.source_tokens)
        # The weighted hidden and the up projection's gradient come so from _expert_ffn_bwd.
        down_operands = (weighted_hidden, [requantize(rows, config.fp8.gradient_block) for rows in grad_out_rows])
        up_operands = ([dispatched_rows(chunk) for chunk in kept], grad_up_rows)
        product = fp8.transposed_ragged_dot
    grad_down = product(*down_operands, sizes, num_groups=groups,
                        preferred_element_type=_weight_grad_dtype(params.down, config))
    grad_up = product(*up_operands, sizes, num_groups=groups,
                      preferred_element_type=_weight_grad_dtype(params.up, config))
    return grad_up, grad_down


def _weight_grad_dtype(weight, config: MoEConfig):
    """The kernels accumulate in float32 and write the weight's own dtype when
    they can: a float32 copy of a large bfloat16 gradient, then cast, would
    move three times its bytes."""
    return weight.dtype if weight.dtype in (jnp.dtype(_F32), config.dtype) else _F32


# -- shared experts ----------------------------------------------------------------------

@pytree_dataclass(("tokens", "up_rows", "rows", "gate"))
class SharedOutput:
    """The result of :func:`shared_expert_ffn` on this shard's ``T`` tokens
    (what the backward needs of it)."""

    tokens: jax.Array
    """``[T, H]`` in ``config.dtype``: the MLP's input."""
    up_rows: jax.Array
    """``[T, 2Fs]`` or ``[T, Fs]``: the up projection before the activation."""
    rows: jax.Array | None
    """``[T, H]`` in ``config.dtype``: the MLP's output, before the gate (None in the
    layer's :class:`Residuals` without the gate, whose gradient alone reads it)."""
    gate: jax.Array | None
    """``[T, 1]`` float32: ``sigmoid(tokens @ shared_gate)`` with ``config.shared_gate``, else None."""

    def added_to(self, y):
        """``y + gate * rows`` summed in float32, rounded to ``y``'s dtype."""
        rows = self.rows.astype(_F32)
        return (y.astype(_F32) + (rows if self.gate is None else self.gate * rows)).astype(y.dtype)


def _shared_weights(params: MoEParams, config: MoEConfig):
    """``(shared_up, shared_down, shared_gate or None)``; a config without
    ``shared_ffn`` has none."""
    if config.shared_ffn is None or params.shared_up is None or params.shared_down is None:
        raise ValueError("the shared experts need config.shared_ffn and params.shared_up and shared_down")
    return params.shared_up, params.shared_down, params.shared_gate if config.shared_gate else None


def shared_expert_ffn(tokens, params: MoEParams, config: MoEConfig) -> SharedOutput:
    """The shared experts' dense MLP on ``tokens`` ``[T, H]`` (cast to
    ``config.dtype``), rounded like the routed experts: after the up product,
    the activation and the down product; the optional gate in float32.
    Add it to the routed output with :meth:`SharedOutput.added_to`."""
    dtype = config.dtype
    up, down, gate_weight = _shared_weights(params, config)
    tokens = tokens.astype(dtype)
    up_rows = _f32_dot(tokens, up.astype(dtype)).astype(dtype)
    rows = _f32_dot(_activate(up_rows, config.activation), down.astype(dtype)).astype(dtype)
    gate = None
    if gate_weight is not None:
        gate = jax.nn.sigmoid(_f32_dot(tokens, gate_weight.astype(dtype)))
    return SharedOutput(tokens, up_rows, rows, gate)


def _shared_expert_ffn_bwd(grad_y, shared: SharedOutput, params: MoEParams, config: MoEConfig):
    """``(grad_tokens, grad_up, grad_down, grad_gate)`` of this shard's tokens
    (float32; the weights' not yet summed over the shards) for ``grad_y`` ``[T, H]``."""
    dtype = config.dtype
    up, down, gate_weight = _shared_weights(params, config)
    down, up = down.astype(dtype), up.astype(dtype)
    grad_rows, grad_x, grad_gate = grad_y.astype(dtype), 0, None
    if shared.gate is not None and gate_weight is not None and shared.rows is not None:  # rows are kept with a gate
        g, grad_f32 = shared.gate, grad_y.astype(_F32)
        grad_logit = jnp.sum(grad_f32 * shared.rows.astype(_F32), axis=-1, keepdims=True) * g * (1 - g)
        grad_rows = (grad_f32 * g).astype(dtype)
        grad_gate = _f32_dot(shared.tokens.astype(_F32).T, grad_logit)
        grad_x = _f32_dot(grad_logit, gate_weight.astype(dtype).astype(_F32).T)
    # Every row weighs 1: the weighted hidden activation is the hidden activation.
    grad_hidden = _f32_dot(grad_rows, down.T).astype(dtype)
    grad_up_rows, hidden, _ = activation.activation_bwd(
        grad_hidden, shared.up_rows, jnp.ones(grad_hidden.shape[:1], _F32), config.activation)
    grad_down = _f32_dot(hidden.T, grad_rows)
    grad_x = grad_x + _f32_dot(grad_up_rows, up.T)
    grad_up = _f32_dot(shared.tokens.T, grad_up_rows)
    return grad_x, grad_up, grad_down, grad_gate


# -- combine -----------------------------------------------------------------------------

def combine(out: ExpertOutput, dispatched: ExpertInput, config: MoEConfig, *, expert_axis=None,
            data_axes=()) -> jax.Array:
    """Brings the expert rows back to this shard's tokens: ``[T, H]``, each
    token's rows weighted by its routing weights and summed (in float32).

    Args:
      out: :func:`expert_ffn`'s result.
      dispatched: the :func:`dispatch` it came from.
      config, expert_axis, data_axes: as for :func:`moe`.
    """
    axes = mesh_axes(config, expert_axis, data_axes)
    return _combine(out.rows, dispatched, axes)


def _combine(rows, dispatched: ExpertInput, axes: Axes):
    """With an exchange, each received token's rows are summed where they
    were computed and the sums go back, one row per (token, shard)."""
    y = permutation.combine_fwd(rows, dispatched.row_id_map, dispatched.probs)
    if dispatched.exchange is not None:
        y = dispatched.exchange.gather_tokens(y)
    if dispatched.ring:
        y = jax.lax.psum_scatter(y, axes.expert_axis, scatter_dimension=0, tiled=True)
    return y


# -- the layer -------------------------------------------------------------------------

@pytree_dataclass(("tokens", "group_sizes", "row_id_map", "row_probs", "exchange", "up_rows"), ("ring",))
class ExpertResiduals:
    """What the layer's backward keeps of one token chunk's trip through the
    experts. Neither the dispatched rows nor their outputs (``N`` rows of ``H``
    each): the backward permutes ``tokens`` again for the up weight's gradient,
    and takes each row's weight's gradient as ``<hidden, its gradient times
    downᵀ>``, from values it computes anyway (SonicMoE's way)."""

    tokens: jax.Array | fp8.BlockQuantized
    """:attr:`ExpertInput.tokens`."""
    group_sizes: jax.Array
    """:attr:`ExpertInput.group_sizes`."""
    row_id_map: permutation.RowIdMap
    """:attr:`ExpertInput.row_id_map`."""
    row_probs: jax.Array
    """:attr:`ExpertInput.row_probs`."""
    exchange: Exchange | None
    """:attr:`ExpertInput.exchange`."""
    up_rows: jax.Array
    """:attr:`ExpertOutput.up_rows`."""
    ring: bool
    """:attr:`ExpertInput.ring`."""

    @classmethod
    def of(cls, dispatched: ExpertInput, out: ExpertOutput) -> ExpertResiduals:
        """What the backward keeps of ``dispatched`` and ``out``."""
        return cls(dispatched.tokens, dispatched.group_sizes, dispatched.row_id_map, dispatched.row_probs,
                   dispatched.exchange, out.up_rows, dispatched.ring)


@pytree_dataclass(("tokens", "params", "routing_map", "aux_tokens_per_expert", "chunks", "fp8_weights", "shared"),
                  ("x_shape", "x_dtype"))
class Residuals:
    """What the forward pass keeps for the backward: the router's input and
    choices (the logits are computed again), each token chunk's
    :class:`ExpertResiduals`, the FP8 weights, the shared experts' values."""

    tokens: jax.Array
    """``[T, H]`` in ``config.router_dtype``: the router's input."""
    params: MoEParams
    routing_map: jax.Array
    """:attr:`Routing.routing_map`."""
    aux_tokens_per_expert: jax.Array | None
    """:attr:`Routing.aux_tokens_per_expert`."""
    chunks: tuple[ExpertResiduals, ...]
    """Each token chunk's (one without ``MoEConfig.token_chunks``)."""
    fp8_weights: tuple[fp8.BlockQuantized, fp8.BlockQuantized] | None
    """With ``MoEConfig.fp8``: ``(up, down)`` as the forward quantized them, in their
    own layout (the backward's products take them so; the forward's took them
    transposed, quantized from the same read); else None."""
    x_shape: tuple[int, ...]
    """The layer input's shape, to give its gradient."""
    x_dtype: Any
    """The layer input's dtype, to give its gradient."""
    shared: SharedOutput | None = None
    """The shared experts' result; None without them."""


def _check_params(params, config: MoEConfig, axes: Axes, hidden: int) -> None:
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be an oxmoe.moe.MoEParams, got {type(params).__name__}")
    e, el = config.num_experts, config.num_experts // axes.expert_shards
    for name in ("gate", "up", "down"):
        check_array(f"params.{name}", getattr(params, name))
        if getattr(params, name).dtype not in FLOAT_DTYPES:
            raise TypeError(f"params.{name} must be float32, bfloat16 or float16, got {getattr(params, name).dtype}")
    if params.gate.shape != (hidden, e) and _params_hidden(params) not in (None, hidden):
        raise ValueError(f"x's hidden size (its last dimension) is {hidden}, but params are for hidden "
                         f"{_params_hidden(params)} (params.gate {list(params.gate.shape)}, params.down "
                         f"{list(params.down.shape)})")
    if params.gate.shape != (hidden, e):
        raise ValueError(f"params.gate must have shape [hidden, num_experts] = [{hidden}, {e}], "
                         f"got {list(params.gate.shape)}")
    check_weight_shards(el, axes.weight_shards, axes.weight_axes)
    held = el // axes.weight_shards
    sizes = [f"num_experts {e}"] + [f"{name} size {n}" for name, n in (("expert_axis", axes.expert_shards),
                                                                      ("weight_axes", axes.weight_shards)) if n > 1]
    where = f" ({' / '.join(sizes)})" if held != e else ""
    up, down = params.up.shape, params.down.shape
    if len(down) != 3 or down[0] != held or down[2] != hidden:
        raise ValueError(f"params.down must have shape [local experts, ffn, hidden] = [{held}{where}, F, {hidden}], "
                         f"got {list(down)}")
    f = down[1]
    if config.fp8 is not None and (hidden % 128 or f % 128):
        raise ValueError(f"config.fp8 needs the hidden size and the experts' ffn to be multiples of 128 (one scale "
                         f"per 128 of each), got hidden {hidden} and ffn {f}")
    width, form = (2 * f, "2 * ffn (gate and up halves)") if config.glu else (f, "ffn")
    if up != (held, hidden, width):
        raise ValueError(f"params.up must have shape [local experts, hidden, {form}] = [{held}{where}, {hidden}, "
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
    _check_shared_params(params, config, hidden)


def _check_shared_params(params: MoEParams, config: MoEConfig, hidden: int) -> None:
    fs = config.shared_ffn
    width, form = (2 * (fs or 0), "2 * shared_ffn (gate and up halves)") if config.glu else (fs, "shared_ffn")
    expected = {"shared_up": ((hidden, width), f"[hidden, {form}] = [{hidden}, {width}] for activation "
                              f"{config.activation!r}"),
                "shared_down": ((fs, hidden), f"[shared_ffn, hidden] = [{fs}, {hidden}]"),
                "shared_gate": ((hidden, 1), f"[hidden, 1] = [{hidden}, 1]")}
    for name, (shape, form) in expected.items():
        wanted = config.shared_gate if name == "shared_gate" else fs is not None
        given = getattr(params, name)
        option = "config.shared_gate is True" if name == "shared_gate" else f"config.shared_ffn is {fs}"
        if wanted and given is None:
            raise ValueError(f"{option} but params.{name} is None (init_params creates it)")
        if not wanted:
            if given is not None:
                off = "config.shared_gate is False" if name == "shared_gate" else "config.shared_ffn is None"
                raise ValueError(f"params.{name} is given but {off}")
            continue
        check_array(f"params.{name}", given)
        if given.dtype not in FLOAT_DTYPES:
            raise TypeError(f"params.{name} must be float32, bfloat16 or float16, got {given.dtype}")
        if given.shape != shape:
            raise ValueError(f"params.{name} must have shape {form} (whole on every shard), got {list(given.shape)}")


def _params_hidden(params: MoEParams) -> int | None:
    """The hidden size the params agree on (gate's rows, down's last
    dimension), or None where they disagree among themselves."""
    gate, down = params.gate.shape, params.down.shape
    if len(gate) == 2 and len(down) == 3 and gate[0] == down[2]:
        return gate[0]
    return None


def moe(x, params: MoEParams, config: MoEConfig, *, expert_axis: str | None = None,
        data_axes: tuple[str, ...] = (), weight_axes: tuple[str, ...] = (),
        fp8_weights: QuantizedExpertWeights | None = None) -> tuple[jax.Array, MoEAux]:
    """The MoE layer, forward and (by its custom VJP) backward.

    Args:
      x: ``[B, S, H]`` or ``[T, H]`` float tokens (inside ``shard_map``, this
        shard's).
      params: :class:`MoEParams`; inside ``shard_map`` with ``expert_axis``,
        ``up``/``down`` hold this shard's ``E / size(expert_axis)`` experts
        (shard ``i`` owns experts ``[i * El, (i + 1) * El)``); ``gate``,
        ``expert_bias`` and the shared experts' ``shared_*`` are whole
        (replicated).
      config: :class:`MoEConfig`.
      expert_axis: the ``shard_map`` axis the experts are split over; the
        tokens are split over it too. None: every expert is local.
      data_axes: further ``shard_map`` axes the tokens are split over (data
        parallelism); the expert weights are replicated over them, except
        over ``weight_axes``.
      weight_axes: those of ``data_axes`` that also split ``up`` and ``down``
        (FSDP): each shard of ``expert_axis`` splits its ``El`` experts over
        them, in mesh order (``up [El / D, H, 2F]``, ``down [El / D, F, H]``,
        ``D`` the product of their sizes, which must divide ``El``). The layer
        all-gathers its experts' weights for the step (again in the backward;
        with ``config.fp8``, quantized first and gathered once, as FP8 bytes)
        and reduce-scatters their gradients over them. The experts, not the
        hidden dimension, are split so that both collectives move whole
        contiguous blocks (a split hidden dimension costs a transpose of the
        weights and of their gradients each way).
      fp8_weights: with ``config.fp8``, ``up`` and ``down`` already quantized
        (:func:`quantize_expert_weights` of ``params``, this shard's as
        ``params`` are; with ``weight_axes`` gathered as the weights would be,
        in FP8): the products take them instead of quantizing ``params.up``
        and ``params.down`` again, so that a step's micro-batches share one
        quantization. The layer's values are those of the weights they stand
        for; the weights' gradients go to ``params`` as without them. None
        (default): quantized in the call.

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
        hint = ""
        if isinstance(config, jax.core.Tracer):
            hint = ("; a transformation traced it: make config static, e.g. jax.jit(moe, static_argnames="
                    "'config') or jax.jit(functools.partial(moe, config=config))")
        raise TypeError(f"config must be an oxmoe.moe.MoEConfig, got {type(config).__name__}{hint}")
    axes = mesh_axes(config, expert_axis, data_axes, weight_axes)
    _check_params(params, config, axes, x.shape[-1])
    _check_fp8_weights(fp8_weights, params, config)
    return _layer(config, axes, x, params, fp8_weights)


def _check_fp8_weights(fp8_weights, params: MoEParams, config: MoEConfig) -> None:
    if fp8_weights is None:
        return
    if config.fp8 is None:
        raise ValueError("fp8_weights are given but config.fp8 is None: the layer's products would not read them")
    if not isinstance(fp8_weights, QuantizedExpertWeights):
        raise TypeError(f"fp8_weights must be an oxmoe.moe.QuantizedExpertWeights (quantize_expert_weights' result), "
                        f"got {type(fp8_weights).__name__}")
    # Of the recipe, only the scales' rounding decides the weights' quantization.
    if fp8_weights.recipe.power_of_two_scales != config.fp8.power_of_two_scales:
        raise ValueError(f"fp8_weights were quantized with {fp8_weights.recipe}, but config.fp8 is {config.fp8}: "
                         "their scales are not rounded as its are (power_of_two_scales)")
    expected = jax.eval_shape(functools.partial(quantize_expert_weights, config=config), params)
    for name in ("up", "down", "transposed_up", "transposed_down"):
        for part in ("values", "scales"):
            want, got = getattr(getattr(expected, name), part), getattr(getattr(fp8_weights, name), part)
            if (want.shape, want.dtype) != (tuple(got.shape), got.dtype):
                raise ValueError(f"fp8_weights.{name}.{part} must be {want.dtype}{list(want.shape)}, as "
                                 f"quantize_expert_weights(params, config) gives for these params, got "
                                 f"{got.dtype}{list(got.shape)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layer(config: MoEConfig, axes: Axes, x, params: MoEParams, fp8_weights: QuantizedExpertWeights | None):
    return _layer_fwd(config, axes, x, params, fp8_weights)[0]


def _layer_fwd(config: MoEConfig, axes: Axes, x, params: MoEParams, fp8_weights: QuantizedExpertWeights | None):
    flat = x.reshape(-1, x.shape[-1])
    # The router's input: without float32_gate_logits, the same cast as the dispatched tokens'.
    router_tokens = flat.astype(config.router_dtype)
    routing = _route(router_tokens, params, config, axes)
    routing_map, probs = routing.dispatched()
    tokens = flat.astype(config.dtype)
    capacity = config.expert_capacity(len(flat) * axes.expert_shards)
    forward_weights, backward_weights = _expert_weights(params, config, axes, fp8_weights)
    # The shared experts need only this shard's tokens: nothing ties them to the exchange.
    shared = shared_expert_ffn(flat, params, config) if config.shared_ffn is not None else None
    # Each chunk's tokens travel, meet their experts and come back on their own, so that one
    # chunk's exchange may run while another's expert GEMMs do.
    dispatched, outputs, ys = [], [], []
    zero_unused_rows = _zeroes_unused_rows(config, axes)
    for rows in _token_chunks(len(flat), config, axes):
        d = _dispatch(tokens[rows], routing_map[rows], probs[rows], config, axes, capacity, zero_unused_rows)
        out = _expert_ffn(d, forward_weights, config, zero_unused_rows)
        dispatched.append(d)
        outputs.append(out)
        ys.append(_combine(out.rows, d, axes))
    y = jnp.concatenate(ys).astype(config.dtype)
    if shared is not None:
        y = shared.added_to(y)
    aux = MoEAux(routing.load_balancing_loss, routing.z_loss, routing.tokens_per_expert, routing.dropped_copies)
    kept_weights = backward_weights if config.fp8 is not None else None
    kept = tuple(ExpertResiduals.of(d, out) for d, out in zip(dispatched, outputs))
    if shared is not None and shared.gate is None:
        shared = dataclasses.replace(shared, rows=None)
    return (y.reshape(x.shape), aux), Residuals(router_tokens, params, routing.routing_map,
                                                routing.aux_tokens_per_expert, kept, kept_weights, x.shape, x.dtype,
                                                shared)


def _token_chunks(tokens: int, config: MoEConfig, axes: Axes) -> list[slice]:
    """The rows of this shard's token chunks: ``config.token_chunks`` of them (at
    most one per token) with an exchange between expert shards, else one."""
    chunks = min(config.token_chunks, tokens) if axes.expert_shards > 1 else 1
    bounds = [tokens * c // chunks for c in range(chunks + 1)]
    return [slice(start, stop) for start, stop in zip(bounds[:-1], bounds[1:])]


def _layer_bwd(config: MoEConfig, axes: Axes, res: Residuals, cotangents):
    grad_y, grad_aux = cotangents
    params = res.params
    # The FP8 weights are the forward's; others are cast (and gathered) again rather than kept.
    weights = res.fp8_weights or _expert_weights(params, config, axes)[1]
    grad_y = grad_y.reshape(-1, grad_y.shape[-1]).astype(config.dtype)
    shared_grads = None
    if res.shared is not None:  # independent of the exchange below
        shared_grads = _shared_expert_ffn_bwd(grad_y, res.shared, params, config)
    # Each chunk's output gradient travels to its experts and its tokens' gradient back on its
    # own, as in the forward; the weight gradients sum every chunk's rows in one product each.
    chunks = _token_chunks(len(grad_y), config, axes)
    # On one expert shard (one chunk, nothing exchanged) the rows are summed into the tokens'
    # gradient after the router's backward: the router's float32 gradient starts each token's sum,
    # rounded once to the layer's dtype, where a separate pass would add the two (-50 us a step at
    # DeepSeek-V3 on one GPU). Not with shared experts: their float32 gradient would be added to
    # the router's in a pass of its own, which costs more than it saves (bench/NOTES.md).
    local = axes.expert_shards == 1 and res.shared is None and jnp.dtype(res.x_dtype) == jnp.dtype(config.dtype)
    local_rows = None
    zero_unused_rows = _zeroes_unused_rows(config, axes)
    grad_tokens, grad_probs, hidden, grad_rows, grad_up_rows = [], [], [], [], []
    for rows, d in zip(chunks, res.chunks):
        # The output's gradient travels as the tokens did (with FP8, quantized once before it leaves).
        g = _token_parts(grad_y[rows], config)
        if d.ring and axes.expert_axis is not None:
            g = gather_over(axes.expert_axis, *g)
        if d.exchange is not None:
            g = d.exchange.scatter_tokens(*g)
        grad_out_rows = _permuted(_from_parts(g), d.row_id_map, zero_unused_rows)  # each row's token's, unweighted
        grad_in, chunk_hidden, chunk_grad_up_rows, grad_row_probs = _expert_ffn_bwd(grad_out_rows, d, weights, config,
                                                                                    zero_unused_rows)
        chunk_grad_probs = permutation.dispatch_probs_bwd(grad_row_probs, d.row_id_map)
        if local:
            local_rows = grad_in
        else:
            chunk_grad_tokens = permutation.combine_fwd(grad_in, d.row_id_map)
            if d.exchange is not None:
                chunk_grad_tokens, chunk_grad_probs = d.exchange.gather_tokens(chunk_grad_tokens, chunk_grad_probs)
            if d.ring:
                chunk_grad_tokens = jax.lax.psum_scatter(chunk_grad_tokens, axes.expert_axis, scatter_dimension=0,
                                                         tiled=True)
                chunk_grad_probs = _scatter_expert_columns(chunk_grad_probs, config, axes)
            grad_tokens.append(chunk_grad_tokens)
        grad_probs.append(chunk_grad_probs)
        hidden.append(chunk_hidden)
        grad_rows.append(grad_out_rows)
        grad_up_rows.append(chunk_grad_up_rows)
    grad_up, grad_down = _expert_weight_grads(res.chunks, hidden, grad_rows, grad_up_rows, params, config,
                                              zero_unused_rows)
    gate = params.gate.astype(config.router_dtype)
    logits = _f32_dot(res.tokens, gate)  # as the forward computed them: cheaper than keeping [T, E] float32
    grad_logits = _route_bwd(logits, res.routing_map, res.aux_tokens_per_expert, jnp.concatenate(grad_probs),
                             grad_aux, config, axes)
    grad_x, grad_gate = _router_grads(res.tokens, gate, grad_logits)
    shared = {}
    if shared_grads is not None:
        grad_shared_x, *shared_weights = shared_grads
        grad_x = grad_x + grad_shared_x
        shared_weights = _sum_over(shared_weights, axes.token_axes)  # replicated: every token shard's share
        shared = {name: None if g is None else g.astype(getattr(params, name).dtype)
                  for name, g in zip(("shared_up", "shared_down", "shared_gate"), shared_weights)}
    if local:
        grad_x = permutation.combine_fwd(local_rows, res.chunks[0].row_id_map, addend=grad_x)
    else:
        grad_x = jnp.concatenate(grad_tokens).astype(_F32) + grad_x
    grad_gate = _sum_over(grad_gate, axes.token_axes)
    grad_up, grad_down = _reduce_weight_grads(grad_up, grad_down, axes)
    bias = None if params.expert_bias is None else jnp.zeros_like(params.expert_bias)
    grads = MoEParams(grad_gate.astype(params.gate.dtype), grad_up.astype(params.up.dtype),
                      grad_down.astype(params.down.dtype), bias, **shared)
    # The quantized weights, if given, are not differentiated (quantize_expert_weights).
    return grad_x.reshape(res.x_shape).astype(res.x_dtype), grads, None


def _gather_weights(params: MoEParams, axes: Axes) -> MoEParams:
    """``params`` with all of this expert shard's ``up`` and ``down`` (gathered
    over ``weight_axes``)."""
    if not axes.weight_axes:
        return params
    up, down = gather_over(axes.weight_axes, params.up, params.down)
    return dataclasses.replace(params, up=up, down=down)


def _reduce_weight_grads(grad_up, grad_down, axes: Axes):
    """The whole weights' gradients summed over the data axes, each shard
    keeping its experts' of ``weight_axes``."""
    replicated = tuple(a for a in axes.data_axes if a not in axes.weight_axes)
    grad_up, grad_down = _sum_over((grad_up, grad_down), replicated)
    if axes.weight_axes:
        scatter = functools.partial(jax.lax.psum_scatter, axis_name=axes.weight_axes, scatter_dimension=0,
                                    tiled=True)
        grad_up, grad_down = scatter(grad_up), scatter(grad_down)
    return grad_up, grad_down


def _scatter_expert_columns(grad_probs, config: MoEConfig, axes: Axes):
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
                  data_axes: tuple[str, ...] = (), weight_axes: tuple[str, ...] = (),
                  fp8_weights: QuantizedExpertWeights | None = None) -> tuple[jax.Array, MoEAux]:
    """:func:`moe` on whole (global) arrays, under ``jax.shard_map`` over ``mesh``.

    ``x``'s first dimension is split over ``(*data_axes, expert_axis)``, the
    expert weights' first (and ``fp8_weights``' arrays') over ``(expert_axis, *weight_axes)``; ``gate``,
    ``expert_bias`` and the shared experts' weights are replicated. Returns ``y`` split like ``x`` and a replicated
    :class:`MoEAux`.

    Args:
      x, params, config: as for :func:`moe`, with every expert's weights.
      fp8_weights: as for :func:`moe`, :func:`quantize_expert_weights` of every
        expert's weights.
      mesh: the mesh (default: the context mesh, ``jax.set_mesh``).
      expert_axis, data_axes, weight_axes: mesh axis names, as for :func:`moe`.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    data_axes = as_data_axes(expert_axis, data_axes)
    weight_axes = as_weight_axes(data_axes, weight_axes)
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
    expert_shards = 1 if expert_axis is None else mesh.shape[expert_axis]
    if config.num_experts % expert_shards:
        raise ValueError(f"num_experts ({config.num_experts}) must divide by the size of expert_axis "
                         f"{expert_axis!r} ({expert_shards})")
    check_weight_shards(config.num_experts // expert_shards, math.prod(mesh.shape[a] for a in weight_axes),
                        weight_axes)
    P = jax.sharding.PartitionSpec
    split_tokens = P(token_axes or None)
    experts = expert_weights_spec(expert_axis, weight_axes)
    whole = {name: None if getattr(params, name) is None else P()
             for name in ("expert_bias", "shared_up", "shared_down", "shared_gate")}
    # Pytrees of PartitionSpecs in the structure of the params and of the aux (a JAX idiom the
    # dataclasses' field types do not describe).
    param_specs = MoEParams(P(), experts, experts, **whole)  # type: ignore[arg-type]
    fp8_specs = jax.tree.map(lambda _: experts, fp8_weights)
    if jax.sharding.AxisType.Explicit in mesh.axis_types:
        # shard_map takes arrays of an explicit-axes mesh as they are sharded.
        place = functools.partial(_reshard, mesh=mesh)
        x, params = place(x, split_tokens), jax.tree.map(place, params, param_specs)
        fp8_weights = jax.tree.map(place, fp8_weights, fp8_specs)

    def layer(x, params, fp8_weights):
        return moe(x, params, config, expert_axis=expert_axis, data_axes=data_axes, weight_axes=weight_axes,
                   fp8_weights=fp8_weights)
    return jax.shard_map(layer, mesh=mesh, in_specs=(split_tokens, param_specs, fp8_specs),
                         out_specs=(split_tokens, MoEAux(P(), P(), P(), P())))(  # type: ignore[arg-type]
        x, params, fp8_weights)


def expert_weights_spec(expert_axis: str | None = None, weight_axes: tuple[str, ...] = ()):
    """The ``PartitionSpec`` of ``up`` and ``down`` that :func:`shard_map_moe` takes: their
    experts split over ``expert_axis``, then each shard's over ``weight_axes``."""
    return jax.sharding.PartitionSpec(tuple(a for a in (expert_axis, *weight_axes) if a is not None) or None)


def _reshard(x, spec, *, mesh):
    target = jax.sharding.NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec
    return jax.sharding.reshard(x, target)

