"""The MoE layer benchmark: a training step of oxmoe.moe against the same layer in plain JAX.

A step is ``jax.value_and_grad`` of ``sum(y * w) + load_balancing_loss + z_loss`` with
respect to the tokens ``x`` and every parameter, jitted (bf16 tokens and weights, SwiGLU
experts, ``aux_loss_coeff`` :data:`AUX_LOSS_COEFF`, ``z_loss_coeff`` :data:`Z_LOSS_COEFF`).
Cases:

- ``mixtral fwd+bwd``: T=32768 tokens, H=1024, F=4096, 8 experts, top-2 softmax;
- ``qwen3_30b_a3b fwd+bwd``: T=16384, H=2048, F=768, 128 experts, top-8 softmax;
- ``deepseek_v3 ep=2 fwd+bwd``, ``deepseek_v3 ep=4 fwd+bwd``: expert parallelism over 2
  and 4 devices (each listed as skipped when JAX has fewer): 8192 tokens per device,
  H=7168, F=2048, 256 experts (128 or 64 per device),
  top-8 of sigmoid scores in the best 4 of 8 groups, scaling 2.5, expert bias;
  :func:`oxmoe.moe.shard_map_moe` with ``expert_axis``, exchange ``"auto"`` (and the others
  in the breakdown);
- ``qwen3_30b_a3b ep=2 fwd+bwd``: Qwen3's layer (16384 tokens per device) over 2 devices;
- ``mixtral_8x7b ep=2 fwd+bwd``: Mixtral 8x7B's own sizes over 2 devices: 32768 tokens per
  device, H=4096, F=14336, 8 experts (4 per device), top-2 softmax;
- ``deepseek_v3 shared fwd+bwd``: DeepSeek-V3's layer on one device (all 256 experts,
  8192 tokens) with its one shared expert (``MoEConfig(shared_ffn=2048)``, no gate), whose
  two dense GEMMs count in the FLOPs and the dense ceiling like the experts'.

FLOPs of a step are those of its expert GEMMs on one device: 3 x the forward's (forward,
d lhs, d rhs), forward ``= 2 T k H (2F) + 2 T k F H`` (with expert parallelism T is a
device's tokens: its experts multiply ``T k`` rows on average). The router's GEMM, the
activation and the permutations are not counted. Each case times, on the default device:

- oxmoe's step (:func:`oxmoe.moe.moe`; the EP case: :func:`oxmoe.moe.shard_map_moe`);
- the dense ceiling: the step's six expert GEMMs (forward, d lhs and d rhs of the up and
  the down projection) as dense bf16 ``jnp.dot`` of the same shapes, each timed as the
  grouped GEMM family times its dense GEMMs (:class:`oxmoe.bench.grouped_gemm.DenseTimes`);
  dense TFLOP/s = the step's FLOPs / the sum of the six times;
- one device: the step of :func:`oxmoe.reference.moe.moe`, the layer in plain JAX as
  MaxText writes it (``jax.lax.top_k`` routing, the token copies sorted by expert with ``argsort``,
  ``jax.lax.ragged_dot`` for the fused ``[E, H, 2F]`` up and the ``[E, F, H]`` down
  projection, unsorted with ``argsort`` and weight-summed), differentiated by JAX. If it
  runs out of device memory that is reported as ``OOM``, not as a failure; a slow one is
  timed with fewer samples (about :data:`PLAIN_BUDGET_S` seconds);
- one device: the bytes each layer's VJP keeps for the backward (:func:`saved_bytes`)
  beside a dense SwiGLU MLP's of the same activated parameters (its input and its up
  projection, ``T (H + k 2F)``), and each step's peak device memory
  (:func:`peak_device_bytes`);
- the EP case: where a step's time goes, per device:

  - the step with exchange ``"auto"`` (the case's time; the layer's default), named with
    the exchange it chose (:func:`oxmoe.moe.exchange.exchange_method`: the fewer bytes of
    :func:`oxmoe.moe.exchange.cost_model`, the ring on a tie), and the step with each
    exchange the platform runs: ``"all_to_all"``, ``"ring"`` and, off a CPU,
    ``"ragged_all_to_all"``; each with its bytes sent per device by the cost model (which
    models the first two) and its peak device memory by XLA's memory analysis of the
    compiled step (:func:`peak_device_bytes`; none where the platform gives none); then the
    steps of ``"all_to_all"`` and ``"ring"`` with each ``token_chunks`` of
    :data:`TOKEN_CHUNKS` (the same bytes; one chunk's exchange may overlap another's GEMMs);
  - the forward alone, and the routing (gate GEMM and :func:`oxmoe.router.topk`) alone;
  - one exchange of the (token, shard) rows alone, by the layer's own
    :class:`oxmoe.moe.Exchange`, under a balanced load: each device sends
    ``round(T * shards_per_token)`` rows of ``H`` (:func:`exchange_blocks`), shared as
    equally as rows allow among all devices (itself included), in one
    ``jax.lax.all_to_all`` of ``devices`` slots of the smallest of the layer's slot sizes
    that holds the largest share (:func:`exchange_slot`; ``devices x slot x H x 2``
    bytes); a step has four (dispatch and combine, and their transposes) where ``"auto"``
    exchanges by all_to_all; off a CPU the same rows by ``jax.lax.ragged_all_to_all`` too;
  - the step and forward of the same layer on one device with as many experts as a device
    owns (no exchange; not checked again: its semantics are the EP layer's);
  - DeepSeek-V3's cases only: that one-device layer data-parallel over the same devices
    (each its own tokens and every one of those experts), its expert weights replicated and
    sharded over the data axis (``weight_axes``: gathered for the step, their gradients
    reduce-scattered), each step with its peak device memory; then :data:`DEEP_LAYERS` such
    layers in sequence, where XLA may gather one layer's weights under another's GEMMs
    (:func:`weight_sharding_parts`). An EP mesh of those devices has no data axis left to
    shard the weights over.

  Each piece runs alone, with only its own arrays alive. In results.json each part of
  ``breakdown`` has, besides its timing, ``per_step``, ``exchange`` (a step's),
  ``cost_model_bytes_per_step``, ``peak_bytes_per_device`` and ``wire_bytes`` (the
  all_to_all exchange's), None where they do not apply; ``auto_exchange`` is what
  ``"auto"`` chose; ``device_rows`` the routed copies each device's experts took in the
  timed input set (the step waits for the busiest; the one-device step has exactly
  ``T k``).

The goal: each single-device step at >= :data:`MIN_FRACTION_OF_DENSE` of the dense
ceiling's TFLOP/s (about :data:`MIN_SPEEDUP` x the plain-JAX layer, which the goals line
counts too). The EP case reports its share of the dense ceiling without a goal: its step
includes the exchanges.

Before anything is timed, oxmoe's step is checked against
:func:`oxmoe.reference.moe.moe`'s: ``y``, the load-balancing and z-losses, the tokens per expert and the gradients of ``x`` and every parameter
(:func:`compare`; a disagreement past :func:`limits_of` fails the case, which is then not
timed). One device: on every input set at full size, or, if plain JAX fails there (out of
memory, as XLA's dense lowering of jax.lax.ragged_dot may at Qwen3's 128 experts), at a
small sample of fresh tokens (:func:`sample_tokens`). The EP case: at such a sample, against
:func:`oxmoe.reference.moe.moe` on one device with all the experts. The timed functions' jaxprs
are checked too: oxmoe's step holds oxmoe's grouped GEMMs and no ``ragged_dot_general``;
plain JAX's holds ``ragged_dot_general`` and no oxmoe primitive.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oxmoe import moe, permutation, reference, router
from oxmoe.bench import grouped_gemm, timing
from oxmoe.bench.cases import NOT_JUDGED, CheckFailed, Family, OwnCasesReport, failure_text, format_tflops, format_us, rel_err, text_table
from oxmoe.bench.grouped_gemm import OOM, DenseTimes
from oxmoe.model_shapes import (DEEPSEEK_V3_LAYER, MIXTRAL_8X7B_LAYER, MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER, GemmShape,
                                LayerShape)
from oxmoe.moe.config import Axes
from oxmoe.moe.exchange import cost_model, exchange_method, lays_out_in_slots, shards_per_token, slot_sizes

DTYPE = jnp.dtype(jnp.bfloat16)
F32 = jnp.float32
AUX_LOSS_COEFF, Z_LOSS_COEFF = 1e-2, 1e-3
#: The goal: oxmoe's step at least this fraction of the dense ceiling's TFLOP/s ...
MIN_FRACTION_OF_DENSE = 0.6
#: ... which is about this many times the plain-JAX layer's (counted, not a column).
MIN_SPEEDUP = 5.0
#: The check's sample, where it takes one (split over the devices of an EP case): at most
#: this many tokens, and few enough that the ``[E, rows, max(H, 2F)]`` bf16 operand XLA's GPU
#: lowering of jax.lax.ragged_dot materializes (the rows masked once per expert) stays within
#: this many bytes (e.g. 144 tokens at DeepSeek-V3's 256 experts of width 7168).
CHECK_TOKENS, CHECK_EXPANSION_BYTES = 2048, 4 << 30
#: Largest ||oxmoe - plain JAX|| / ||plain JAX|| of y and of each gradient: two bf16 layers
#: whose float32 sums run in different orders (each rounding to bf16 is 2^-9 relative).
MAX_REL_ERR = 2e-2
#: Largest relative difference of the load-balancing loss and of the z-loss: float32 sums of
#: positive terms. (The step's loss, ``sum(y * w)`` plus those, is not compared: its terms
#: cancel, so its relative error says nothing that y's does not.)
MAX_AUX_LOSS_REL_ERR = 1e-3
#: Largest share of the routed token copies counted at another expert: near-ties of float32
#: logits that two GEMMs summed in different orders (about one token in 10^5 at these sizes).
MAX_ROUTING_MISMATCH = 1e-3
#: Device seconds the plain-JAX layer's timing may take: a slower one gets fewer samples.
PLAIN_BUDGET_S = grouped_gemm.RAGGED_DOT_BUDGET_S
#: The mesh axis of the EP case, and how many exchanges of the (token, shard) rows a step has
#: (dispatch and combine in the forward, their transposes in the backward).
EXPERT_AXIS, EXCHANGES_PER_STEP = "expert", 4
#: The mesh axis of :func:`weight_sharding_parts`.
DATA_AXIS = "data"

#: The random stream of the check's tokens (input set ``n`` draws from stream ``n``).
CHECK_SET = 1 << 16

JAX_PRIMITIVE = "ragged_dot_general"
OXMOE_PRIMITIVES = ("oxmoe_ragged_dot", "oxmoe_transposed_ragged_dot")


def _config(model: LayerShape, shared_ffn: int | None = None) -> moe.MoEConfig:
    return moe.MoEConfig(**model.router.moe_kwargs(), aux_loss_coeff=AUX_LOSS_COEFF, z_loss_coeff=Z_LOSS_COEFF,
                         activation="swiglu", dtype=DTYPE, shared_ffn=shared_ffn)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One MoE layer: a device's tokens, the sizes, the routing, the devices it is split over."""

    name: str
    tokens: int
    """Tokens per device."""
    hidden: int
    ffn: int
    config: moe.MoEConfig
    devices: int = 1
    """Devices of expert parallelism (each owns ``num_experts / devices`` experts)."""
    compare_weight_sharding: bool = False
    """The EP case times :func:`weight_sharding_parts` too."""

    @property
    def local_experts(self) -> int:
        return self.config.num_experts // self.devices

    @property
    def up_width(self) -> int:
        return 2 * self.ffn if self.config.glu else self.ffn

    @property
    def rows(self) -> int:
        """The token copies a device's experts multiply (on average, with expert parallelism)."""
        return self.tokens * self.config.topk

    @property
    def shared_up_width(self) -> int:
        """The shared experts' fused up width (0 without them)."""
        fs = self.config.shared_ffn or 0
        return 2 * fs if self.config.glu else fs

    @property
    def flops(self) -> int:
        """The expert GEMMs of a step on one device (the shared experts' too): forward, d lhs and
        d rhs of up and down."""
        shared = 2 * self.tokens * self.hidden * (self.shared_up_width + (self.config.shared_ffn or 0))
        return 3 * (2 * self.rows * self.hidden * self.up_width + 2 * self.rows * self.ffn * self.hidden + shared)

    def gemms(self) -> tuple[GemmShape, ...]:
        """The up and down projections of a device as grouped GEMMs (for the dense ceiling), then
        the shared experts' as one group each."""
        e, fs = self.local_experts, self.config.shared_ffn
        routed = (GemmShape(f"{self.name} up", m=self.rows, k=self.hidden, n=self.up_width, groups=e),
                  GemmShape(f"{self.name} down", m=self.rows, k=self.ffn, n=self.hidden, groups=e))
        if fs is None:
            return routed
        return routed + (GemmShape(f"{self.name} shared_up", m=self.tokens, k=self.hidden, n=self.shared_up_width,
                                   groups=1),
                         GemmShape(f"{self.name} shared_down", m=self.tokens, k=fs, n=self.hidden, groups=1))

    def param_bytes(self) -> int:
        """A device's parameters at their dtypes."""
        h, e = self.hidden, self.config.num_experts
        bias = 4 * e if self.config.use_expert_bias else 0
        shared = h * (self.shared_up_width + (self.config.shared_ffn or 0))
        return DTYPE.itemsize * (h * e + self.local_experts * (h * self.up_width + self.ffn * h) + shared) + bias

    def one_device(self) -> Layer:
        """A device's share of an expert-parallel layer on one device: its tokens, as many
        experts as it owns, no exchange (group-limited routing kept where still valid)."""
        c, e = self.config, self.local_experts
        changes = {}
        if c.num_groups is not None and (e % c.num_groups or c.topk > c.group_topk * (e // c.num_groups)):
            changes = dict(num_groups=None, group_topk=None)
        config = dataclasses.replace(c, num_experts=e, **changes)
        return Layer(f"{self.name.split()[0]} 1 device E={e}", self.tokens, self.hidden, self.ffn, config)

    def describe(self) -> str:
        c = self.config
        routing = c.score_function + (f" (best {c.group_topk} of {c.num_groups} groups)" if c.num_groups else "")
        routing += f" x{c.scaling_factor:g}" if c.scaling_factor is not None else ""
        routing += " +bias" if c.use_expert_bias else ""
        routing += f" +shared Fs={c.shared_ffn}" if c.shared_ffn else ""
        tokens = f"T={self.tokens}" + (" per device" if self.devices > 1 else "")
        return f"{tokens} H={self.hidden} F={self.ffn} E={c.num_experts} k={c.topk} {routing}"

    def info(self) -> dict:
        c = self.config
        return dict(model=self.name, tokens_per_device=self.tokens, hidden=self.hidden, ffn=self.ffn,
                    num_experts=c.num_experts, topk=c.topk, score_function=c.score_function,
                    num_groups=c.num_groups, group_topk=c.group_topk, scaling_factor=c.scaling_factor,
                    use_expert_bias=c.use_expert_bias, activation=c.activation, dtype=DTYPE.name,
                    aux_loss_coeff=c.aux_loss_coeff, z_loss_coeff=c.z_loss_coeff, devices=self.devices,
                    exchange=c.exchange if self.devices > 1 else None, rows_per_device=self.rows,
                    shared_ffn=c.shared_ffn)


def _layer(model: LayerShape, *, devices: int = 1, shared_ffn: int | None = None,
           compare_weight_sharding: bool = False, **sizes) -> Layer:
    """``model``'s layer on ``devices`` devices of expert parallelism, at its sizes or at those of
    ``sizes`` (``tokens``, ``hidden``, ``ffn``) where given, with shared experts of width
    ``shared_ffn`` if given."""
    sizes = {**dict(tokens=model.tokens, hidden=model.hidden, ffn=model.ffn), **sizes}
    name = model.name + (f" ep={devices}" if devices > 1 else "") + (" shared" if shared_ffn else "")
    return Layer(name, **sizes, config=_config(model, shared_ffn), devices=devices,
                 compare_weight_sharding=compare_weight_sharding)


#: Tokens per device of the expert-parallel DeepSeek-V3 cases.
EP_TOKENS = 8192
LAYERS = (
    _layer(MIXTRAL_LAYER),
    _layer(QWEN3_30B_A3B_LAYER),
    _layer(DEEPSEEK_V3_LAYER, devices=2, tokens=EP_TOKENS, compare_weight_sharding=True),
    _layer(QWEN3_30B_A3B_LAYER, devices=2),
    _layer(MIXTRAL_8X7B_LAYER, devices=2),
    _layer(DEEPSEEK_V3_LAYER, devices=4, tokens=EP_TOKENS, compare_weight_sharding=True),
    _layer(DEEPSEEK_V3_LAYER, tokens=EP_TOKENS, shared_ffn=DEEPSEEK_V3_LAYER.ffn),  # n_shared_experts=1
)
#: The smoke run: the same routing (experts, top-k, groups), tiny T, H and F (multiples of 8).
SMOKE_LAYERS = (
    _layer(MIXTRAL_LAYER, tokens=256, hidden=64, ffn=128),
    _layer(QWEN3_30B_A3B_LAYER, tokens=64, hidden=64, ffn=32),
    _layer(DEEPSEEK_V3_LAYER, devices=4, tokens=64, hidden=64, ffn=32, compare_weight_sharding=True),
)


# -- the steps ------------------------------------------------------------------------

def _loss(layer: Callable):
    """``(x, params, w) -> (sum(y * w) + both losses, (y, aux))`` of ``layer(x, params) -> (y, aux)``."""
    def loss(x, params, w):
        y, aux = layer(x, params)
        total = jnp.sum(y.astype(F32) * w.astype(F32)) + aux.load_balancing_loss + aux.z_loss
        return total, (y, aux)
    return loss


def step(layer: Callable) -> Callable:
    """``(x, params, w) -> ((loss, (y, aux)), (dx, dparams))``: the timed training step (y and
    aux go on to the next layer and the logs; the check compares all of it)."""
    return jax.value_and_grad(_loss(layer), argnums=(0, 1), has_aux=True)


def forward(layer: Callable) -> Callable:
    """``(x, params, w) -> y``: the layer's forward alone."""
    return lambda x, params, w: layer(x, params)[0]


def oxmoe_layer(config: moe.MoEConfig) -> Callable:
    return lambda x, params: moe.moe(x, params, config)


def oxmoe_ep_layer(config: moe.MoEConfig, mesh: Mesh) -> Callable:
    return lambda x, params: moe.shard_map_moe(x, params, config, mesh=mesh, expert_axis=EXPERT_AXIS)


def plain_layer(config: moe.MoEConfig) -> Callable:
    return lambda x, params: reference.moe.moe(x, params, config)


def ep_routing(config: moe.MoEConfig, mesh: Mesh) -> Callable:
    """``(x, params, w) -> (probs, routing_map)``: each device's gate GEMM and top-k."""
    def route(x, gate, expert_bias):
        logits = jnp.dot(x.astype(DTYPE), gate.astype(DTYPE), preferred_element_type=F32)
        return router.topk(logits, config.topk, expert_bias=expert_bias, score_function=config.score_function,
                           use_pre_softmax=config.use_pre_softmax, num_groups=config.num_groups,
                           group_topk=config.group_topk, scaling_factor=config.scaling_factor)

    routed = jax.shard_map(route, mesh=mesh, in_specs=(P(EXPERT_AXIS), P(), P()), out_specs=P(EXPERT_AXIS))
    return lambda x, params, w: routed(x, params.gate, params.expert_bias)


def device_rows(layer: Layer, mesh: Mesh, args: tuple) -> list[int]:
    """The routed copies each device's experts take from the step's inputs ``args``."""
    _, routing_map = jax.jit(ep_routing(layer.config, mesh))(*args)
    per_expert = np.asarray(jnp.sum(routing_map, axis=0, dtype=jnp.int32))
    return per_expert.reshape(layer.devices, -1).sum(axis=1).tolist()


def exchange_blocks(layer: Layer) -> tuple[int, ...]:
    """The (token, shard) rows a device sends each device under a balanced load of uniformly
    random routing: ``round(T * shards_per_token)`` in all, shared as equally as rows allow."""
    n = layer.devices
    total = round(layer.tokens * shards_per_token(layer.config, n))
    return tuple(total // n + (j < total % n) for j in range(n))


def exchange_slot(layer: Layer) -> int:
    """The all_to_all's slot rows, as the layer chooses them: the smallest of its slot sizes
    that holds the largest block."""
    largest = max(exchange_blocks(layer))
    return next(size for size in _slot_sizes(layer) if size >= largest)


def _slot_sizes(layer: Layer) -> tuple[int, ...]:
    return slot_sizes(layer.tokens, layer.devices, layer.config)


def exchange_wire_bytes(layer: Layer) -> int:
    """The bytes of one all_to_all a device takes part in: ``devices`` slots of
    :func:`exchange_slot` rows of ``H``."""
    return layer.devices * exchange_slot(layer) * layer.hidden * DTYPE.itemsize


def exchange_name(layer: Layer, method: str) -> str:
    rows = f"{sum(exchange_blocks(layer))} x {layer.hidden} {DTYPE.name} (token, shard) rows"
    if method == "all_to_all":
        return (f"all_to_all exchange: {rows} in {layer.devices} x {exchange_slot(layer)} slots, "
                f"{exchange_wire_bytes(layer)} bytes")
    return f"ragged_all_to_all exchange: {rows}"


def exchange_args(layer: Layer, place: Placement, seed: tuple, num_sets: int, method: str) -> list[tuple]:
    """The input sets of :func:`ep_exchange`: each device's rows, the blocks' sizes and the
    slot's index in the slot sizes (arguments, not constants, so that XLA plans the
    exchange at run time as it does in the layer)."""
    replicated = NamedSharding(place.mesh, P())
    sizes = jax.device_put(np.asarray(exchange_blocks(layer), np.int32), replicated)
    choice = jax.device_put(np.int32(_slot_sizes(layer).index(exchange_slot(layer))), replicated)
    in_slots = lays_out_in_slots(method, _slot_sizes(layer))
    rows = layer.devices * exchange_slot(layer) if in_slots else sum(exchange_blocks(layer))
    return [(place.split((*seed, n, 6), (rows, layer.hidden), DTYPE), sizes, choice) for n in range(num_sets)]


def ep_exchange(layer: Layer, mesh: Mesh, method: str) -> Callable:
    """``(rows, sizes, slot_choice) -> received``: one exchange of each device's (token, shard)
    rows, ``sizes[j]`` of them to device ``j`` (the same on every device), by the layer's
    own :class:`oxmoe.moe.Exchange`, into its receive buffer of ``devices`` slots of ``T``
    rows."""
    n, tokens = layer.devices, layer.tokens

    def local(rows, sizes, slot_choice):
        me = jax.lax.axis_index(EXPERT_AXIS)
        exchange = moe.Exchange(
            # to_experts reads neither the token map nor the return offsets: stand-ins of their types.
            token_rows=permutation.RowIdMap(dest_rows=jnp.full((tokens, n), -1, jnp.int32),
                                            source_tokens=jnp.full((rows.shape[0],), -1, jnp.int32)),
            send_sizes=sizes, recv_sizes=jnp.full((n,), sizes[me]), return_offsets=jnp.zeros((n,), jnp.int32),
            slot_choice=slot_choice, axis=EXPERT_AXIS, shards=n, slot_rows=_slot_sizes(layer), method=method)
        (received,) = exchange.to_experts(rows)
        return received

    return jax.shard_map(local, mesh=mesh, in_specs=(P(EXPERT_AXIS), P(), P()), out_specs=P(EXPERT_AXIS))


def auto_exchange(layer: Layer, mesh: Mesh) -> str:
    """The exchange ``"auto"`` resolves to, asked of the layer's own choice."""
    axes = Axes(expert_axis=EXPERT_AXIS, data_axes=(), expert_shards=layer.devices, token_shards=layer.devices)
    with jax.set_mesh(mesh):  # the choice reads the mesh's platform
        return exchange_method(layer.config, axes, layer.tokens, layer.hidden)


def peak_device_bytes(fn: Callable, args: tuple) -> int | None:
    """A device's peak memory in ``jit(fn)(*args)`` by XLA's memory analysis of the compiled
    program: its temporaries, arguments and outputs, less the outputs that alias arguments
    (None where the platform gives no analysis)."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    if stats is None:
        return None
    return (stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes)


def saved_bytes(layer: Callable, args: tuple) -> int:
    """The bytes a layer's VJP keeps for its backward beyond its arguments: the residuals
    JAX saves of ``layer(x, params)``'s forward (the list :func:`jax.ad_checkpoint.
    print_saved_residuals` prints; the arguments, which the step holds anyway, left out)."""
    from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints, as data

    x, params, _ = args
    residuals = saved_residuals(lambda x, params: layer(x, params)[0], x, params)
    return sum(math.prod(aval.shape) * aval.dtype.itemsize for aval, where in residuals
               if not where.startswith("from the argument"))


def argument_device_bytes(args: tuple) -> int:
    """The bytes of ``args`` one device holds (the first's shards)."""
    device = jax.tree.leaves(args)[0].sharding.mesh.devices.flat[0]
    return sum(shard.data.nbytes for a in jax.tree.leaves(args) for shard in a.addressable_shards
               if shard.device == device)


# -- inputs -------------------------------------------------------------------------

class Placement:
    """Where a case's arrays live: the default device, or split over a mesh's first axis
    (tokens and experts on their first dimension, the gate and the expert bias replicated)."""

    def __init__(self, mesh: Mesh | None):
        self.mesh = mesh

    def split(self, seed: tuple, local_shape, dtype, scale: float = 1.0) -> jax.Array:
        """Standard normal values times ``scale``; with a mesh ``[devices * local_shape[0], ...]``,
        each device's block drawn on that device (nothing whole ever exists on one device)."""
        if self.mesh is None:
            return timing.RandomArrays(*seed).normal(local_shape, dtype, scale)
        blocks = []
        for i, device in enumerate(self.mesh.devices.flat):
            with jax.default_device(device):
                blocks.append(timing.RandomArrays(*seed, i).normal(local_shape, dtype, scale))
        shape = (len(blocks) * local_shape[0], *local_shape[1:])
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(self.mesh, P(self.mesh.axis_names[0])),
                                                        blocks)

    def replicated(self, seed: tuple, shape, dtype, scale: float = 1.0) -> jax.Array:
        x = timing.RandomArrays(*seed).normal(shape, dtype, scale)
        return x if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, P()))


#: The expert bias's scale: one update of DeepSeek-V3's bias (its speed gamma). A trained bias
#: balances the experts' loads; a random one of 0.1 (sigmoid scores differ by about that much)
#: made the busiest expert take 11x the mean and, at DeepSeek-V3 EP = 2, one device 1.27x the
#: mean rows, so the EP step no longer did the one-device step's work.
EXPERT_BIAS_SCALE = 1e-3


def draw_params(layer: Layer, place: Placement, seed: tuple) -> moe.MoEParams:
    """Weights that keep the activations near unit scale (logits, u and y about N(0, 1)) and
    the experts' loads near balanced (:data:`EXPERT_BIAS_SCALE`)."""
    h, f, e, c = layer.hidden, layer.ffn, layer.local_experts, layer.config
    bias = place.replicated((*seed, 3), (c.num_experts,), F32, EXPERT_BIAS_SCALE) if c.use_expert_bias else None
    return moe.MoEParams(gate=place.replicated((*seed, 0), (h, c.num_experts), DTYPE, h ** -0.5),
                         up=place.split((*seed, 1), (e, h, layer.up_width), DTYPE, h ** -0.5),
                         down=place.split((*seed, 2), (e, f, h), DTYPE, f ** -0.5),
                         expert_bias=bias, **draw_shared_params(layer, place, seed))


def draw_shared_params(layer: Layer, place: Placement, seed: tuple) -> dict:
    """The shared experts' weights (whole on every device), at the experts' scale; none without them."""
    h, fs = layer.hidden, layer.config.shared_ffn
    if fs is None:
        return {}
    return dict(shared_up=place.replicated((*seed, 6), (h, layer.shared_up_width), DTYPE, h ** -0.5),
                shared_down=place.replicated((*seed, 7), (fs, h), DTYPE, fs ** -0.5))


def draw_tokens(layer: Layer, place: Placement, seed: tuple, tokens: int) -> tuple[jax.Array, jax.Array]:
    """``(x, w)``: ``tokens`` per device, and the weights of the loss ``sum(y * w)``."""
    return (place.split((*seed, 4), (tokens, layer.hidden), DTYPE),
            place.split((*seed, 5), (tokens, layer.hidden), DTYPE))


# -- the check ----------------------------------------------------------------------

def _scalar_rel_err(actual, expected):
    return jnp.abs(actual - expected) / jnp.maximum(jnp.abs(expected), 1e-30)


@jax.jit
def compare(ox, plain) -> dict:
    """The errors of oxmoe's :func:`step` outputs against plain JAX's (limits: :func:`limits_of`)."""
    (_, (ox_y, ox_aux)), (ox_dx, ox_dp) = ox
    (_, (y, aux)), (dx, dp) = plain
    errors = dict(load_balancing_loss_rel_err=_scalar_rel_err(ox_aux.load_balancing_loss, aux.load_balancing_loss),
                  z_loss_rel_err=_scalar_rel_err(ox_aux.z_loss, aux.z_loss),
                  routing_mismatch=(jnp.abs(ox_aux.tokens_per_expert - aux.tokens_per_expert).sum()
                                    / jnp.maximum(2 * aux.tokens_per_expert.sum(), 1)).astype(F32),
                  y_rel_err=rel_err(ox_y, y), dx_rel_err=rel_err(ox_dx, dx),
                  dgate_rel_err=rel_err(ox_dp.gate, dp.gate), dup_rel_err=rel_err(ox_dp.up, dp.up),
                  ddown_rel_err=rel_err(ox_dp.down, dp.down))
    if dp.shared_up is not None:
        errors.update(dshared_up_rel_err=rel_err(ox_dp.shared_up, dp.shared_up),
                      dshared_down_rel_err=rel_err(ox_dp.shared_down, dp.shared_down))
    if dp.expert_bias is not None:
        errors["dexpert_bias_max_abs"] = jnp.max(jnp.abs(ox_dp.expert_bias.astype(F32)))
    return errors


def worst_errors(layer: Layer, pairs) -> dict[str, float]:
    """The worst value of each error of :func:`compare` over ``(oxmoe, plain JAX)`` output
    pairs; raises :class:`CheckFailed` if one is past :func:`limits_of`."""
    worst: dict[str, float] = {}
    for ox, plain in pairs:
        for name, value in compare(ox, plain).items():
            value = float(value)
            if name not in worst or math.isnan(value) or value > worst[name]:  # NaN is the worst
                worst[name] = value
    limits = limits_of(layer)
    bad = [f"{name} = {value:.3g} (limit {limits[name]:.3g})" for name, value in worst.items()
           if not value <= limits[name]]
    if bad:
        raise CheckFailed(f"oxmoe and plain JAX disagree ({layer.name}): " + "; ".join(bad))
    return worst


def sample_tokens(layer: Layer) -> int:
    """A device's tokens in the check's sample (see :data:`CHECK_EXPANSION_BYTES`)."""
    c = layer.config
    expansion = c.num_experts * c.topk * max(layer.hidden, layer.up_width) * DTYPE.itemsize  # per token
    return max(1, min(CHECK_TOKENS, CHECK_EXPANSION_BYTES // expansion, layer.tokens * layer.devices)
               // layer.devices)


def check_at_sample(ox_layer: Callable, layer: Layer, place: Placement, params: moe.MoEParams, seed: tuple):
    """oxmoe's step against :func:`oxmoe.reference.moe.moe`'s on one device, at a sample of
    fresh tokens (:func:`sample_tokens` per device) with ``params``: ``(sample tokens, errors)``."""
    tokens = sample_tokens(layer)
    x, w = draw_tokens(layer, place, (*seed, CHECK_SET), tokens)
    ox = jax.jit(step(ox_layer))(x, params, w)
    if place.mesh is None:
        plain = jax.jit(step(plain_layer(layer.config)))(x, params, w)
    else:  # every expert on the first device, then each result where oxmoe's is
        whole = jax.device_put((x, params, w), place.mesh.devices.flat[0])
        del x, w
        plain = jax.jit(step(plain_layer(layer.config)))(*whole)
        del whole
        plain = jax.device_put(plain, jax.tree.map(lambda a: a.sharding, ox))
    return tokens * layer.devices, worst_errors(layer, [(ox, plain)])


def limits_of(layer: Layer) -> dict[str, float]:
    """The largest acceptable value of each error of :func:`compare`."""
    limits = dict(load_balancing_loss_rel_err=MAX_AUX_LOSS_REL_ERR, z_loss_rel_err=MAX_AUX_LOSS_REL_ERR,
                  routing_mismatch=MAX_ROUTING_MISMATCH)
    limits.update({f"{name}_rel_err": MAX_REL_ERR for name in ("y", "dx", "dgate", "dup", "ddown")})
    if layer.config.shared_ffn is not None:
        limits.update(dshared_up_rel_err=MAX_REL_ERR, dshared_down_rel_err=MAX_REL_ERR)
    if layer.config.use_expert_bias:
        limits["dexpert_bias_max_abs"] = 0.0
    return limits


def _count_primitives(label: str, run, arg_sets, wanted: tuple[str, ...], unwanted: tuple[str, ...]) -> dict:
    """Checks a timed jit's jaxpr: each of ``wanted`` at least once per input set, nothing of
    ``unwanted`` (a prefix); returns the counts of ``wanted`` per input set."""
    counts = timing.primitive_counts(run, arg_sets)
    missing = [p for p in wanted if counts[p] < len(arg_sets)]
    if missing:
        raise CheckFailed(f"the timed {label} step calls {', '.join(missing)} fewer than once per input set")
    found = sorted(p for p in counts if any(p.startswith(u) for u in unwanted))
    if found:
        raise CheckFailed(f"the timed {label} step contains {', '.join(found)}")
    return {p: counts[p] / len(arg_sets) for p in wanted}


# -- running a case -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One layer's training step."""

    layer: Layer

    @property
    def name(self) -> str:
        return f"{self.layer.name} fwd+bwd"

    @property
    def flops(self) -> int:
        return self.layer.flops

    @property
    def limits(self) -> dict[str, float]:
        return limits_of(self.layer)

    def info(self) -> dict:
        return self.layer.info()


@dataclasses.dataclass(frozen=True)
class Part:
    """One row of the EP case's breakdown: a timed piece and how often a step has it."""

    name: str
    timing: timing.Timing
    per_step: int | None
    """None: not a piece of the EP step (another exchange's step or exchange, the one-device layer)."""
    exchange: str | None = None
    """A step's ``MoEConfig.exchange``; None for the other parts."""
    cost_model_bytes: float | None = None
    """A step's bytes sent per device by :func:`oxmoe.moe.exchange.cost_model` (it models
    ``"ring"`` and ``"all_to_all"`` only)."""
    peak_bytes: int | None = None
    """A step's peak device memory (:func:`peak_device_bytes`; None where XLA gives none)."""
    wire_bytes: int | None = None
    """An all_to_all exchange's bytes (:func:`exchange_wire_bytes`)."""
    argument_bytes: int | None = None
    """The step's arguments on one device (:func:`weight_sharding_parts`' steps only)."""

    def to_json(self) -> dict:
        return dict(part=self.name, per_step=self.per_step, **self.timing.to_json(), exchange=self.exchange,
                    cost_model_bytes_per_step=self.cost_model_bytes, peak_bytes_per_device=self.peak_bytes,
                    wire_bytes=self.wire_bytes, argument_bytes_per_device=self.argument_bytes)


@dataclasses.dataclass
class LayerResult:
    case: LayerCase
    oxmoe: timing.Timing | None = None
    plain: timing.Timing | str | None = None
    """The plain-JAX layer's timing, ``"OOM"``, or None (not run: EP, or an error: :attr:`plain_error`)."""
    plain_error: str | None = None
    dense: dict[str, grouped_gemm.Dense] = dataclasses.field(default_factory=dict)
    """The dense GEMMs of the ceiling, by ``"<up|down> <product>"``."""
    check_tokens: int | None = None
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    primitives: dict[str, float] = dataclasses.field(default_factory=dict)
    """oxmoe's grouped GEMM primitives per step in the timed jaxpr."""
    set_bytes: int | None = None
    memory: dict[str, int | None] = dataclasses.field(default_factory=dict)
    """One device: the bytes each layer's VJP keeps (``oxmoe_saved``, ``plain_saved``;
    :func:`saved_bytes`), a dense SwiGLU MLP's of the same activated parameters, the
    shared experts' included (``dense_mlp_saved``: its input and up projection), and
    each step's peak
    (``oxmoe_peak``, ``plain_peak``; :func:`peak_device_bytes`)."""
    breakdown: list[Part] = dataclasses.field(default_factory=list)
    auto_exchange: str | None = None
    """The exchange ``"auto"`` chose (EP)."""
    device_rows: list[int] | None = None
    """EP: the routed (token, expert) copies each device's experts took in the timed input
    set (:func:`device_rows`); the step waits for the device with the most."""
    skipped: str | None = None
    failure: str | None = None

    @property
    def dense_s(self) -> float | None:
        return sum(d.timing.median_s for d in self.dense.values()) if self.dense else None


def _num_sets(settings: timing.Settings, layer: Layer) -> tuple[int, int]:
    """``(R, device bytes of one input set)``: its x, w and parameters, and twice a step's
    outputs (the check holds oxmoe's and plain JAX's of every set at once)."""
    tokens = layer.tokens * layer.hidden * DTYPE.itemsize
    inputs = 2 * tokens + layer.param_bytes()
    outputs = 2 * tokens + layer.param_bytes()  # y, d x, d params
    set_bytes = inputs + 2 * outputs
    return min(settings.num_sets(inputs + outputs), max(1, settings.memory_bytes // set_bytes)), set_bytes


def _draw_sets(layer: Layer, place: Placement, seed: tuple, num_sets: int) -> list[tuple]:
    """``num_sets`` input sets ``(x, params, w)``, each drawn from its own stream."""
    sets = []
    for n in range(num_sets):
        x, w = draw_tokens(layer, place, (*seed, n), layer.tokens)
        sets.append((x, draw_params(layer, place, (*seed, n)), w))
    return sets


def dense_gemms(layer: Layer, settings: timing.Settings, dense: DenseTimes,
                seed: int = 0) -> dict[str, grouped_gemm.Dense]:
    """The dense GEMMs of ``layer``'s ceiling (forward, d lhs and d rhs of each of
    :meth:`Layer.gemms`, timed once per run by ``dense``), by ``"<up|down|...> <product>"``."""
    return {f"{shape.name.split()[-1]} {product}": dense.get(shape, product, settings, seed)
            for shape in layer.gemms() for product in ("fwd", "dlhs", "drhs")}


def _time_plain(run, arg_sets, settings: timing.Settings) -> tuple[timing.Timing | str | None, str | None]:
    """The plain-JAX layer's timing within :data:`PLAIN_BUDGET_S`, or ``OOM`` / None and its error."""
    try:
        return grouped_gemm.measure_within(run, arg_sets, settings, PLAIN_BUDGET_S), None
    except Exception as e:  # noqa: BLE001 - the baseline's failure is a result, not the case's
        return grouped_gemm.baseline_failure(e)


def run_one_device(case: LayerCase, settings: timing.Settings, dense: DenseTimes, seed: int = 0) -> LayerResult:
    """Checks oxmoe's step against plain JAX's on every input set (at a sample of fresh tokens
    if plain JAX fails at full size), then times both and the dense GEMMs. A failure is
    returned in the result, not raised."""
    result = LayerResult(case)
    layer, place = case.layer, Placement(None)
    base = (seed, zlib.crc32(case.name.encode()))
    try:
        num_sets, result.set_bytes = _num_sets(settings, layer)
        arg_sets = _draw_sets(layer, place, base, num_sets)
        ox_run = timing.rotated(step(oxmoe_layer(layer.config)))
        plain_run = timing.rotated(step(plain_layer(layer.config)))
        result.primitives = _count_primitives("oxmoe", ox_run, arg_sets, OXMOE_PRIMITIVES, (JAX_PRIMITIVE,))
        _count_primitives("plain JAX", plain_run, arg_sets, (JAX_PRIMITIVE,), ("oxmoe_",))

        try:
            plain_outs = jax.block_until_ready(plain_run(arg_sets))
        except Exception as e:  # noqa: BLE001 - see grouped_gemm.baseline_failure
            result.plain, result.plain_error = grouped_gemm.baseline_failure(e)
            plain_outs = None
        ox_outs = ox_run(arg_sets)
        if plain_outs is None:
            del ox_outs
            result.check_tokens, result.errors = check_at_sample(
                oxmoe_layer(layer.config), layer, place, arg_sets[0][1], base)
        else:
            result.check_tokens, result.errors = layer.tokens, worst_errors(layer, zip(ox_outs, plain_outs))
            del ox_outs, plain_outs

        result.oxmoe = timing.measure(ox_run, arg_sets, settings)
        if result.plain_error is None:
            result.plain, result.plain_error = _time_plain(plain_run, arg_sets, settings)
        result.memory = layer_memory(layer, arg_sets[0], plain_fails=result.plain_error is not None)
        del arg_sets
        result.dense = dense_gemms(layer, settings, dense, seed)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others' numbers
        result.failure = failure_text(e)
    return result


def run_expert_parallel(case: LayerCase, settings: timing.Settings, dense: DenseTimes,
                        seed: int = 0) -> LayerResult:
    """The EP case, skipped without enough devices: checked at a sample against plain JAX on one
    device with every expert, then its step timed with the breakdown. The pieces are timed one
    after another, each with only its own arrays alive."""
    result = LayerResult(case)
    layer = case.layer
    devices = jax.devices()
    if len(devices) < layer.devices:
        result.skipped = f"needs {layer.devices} devices, JAX has {len(devices)}"
        return result
    mesh = Mesh(np.array(devices[:layer.devices]), (EXPERT_AXIS,))
    place = Placement(mesh)
    base = (seed, zlib.crc32(case.name.encode()))
    ep = oxmoe_ep_layer(layer.config, mesh)
    ragged = [] if devices[0].platform == "cpu" else ["ragged_all_to_all"]  # XLA:CPU has none
    try:
        num_sets, result.set_bytes = _num_sets(settings, layer)
        arg_sets = _draw_sets(layer, place, base, num_sets)
        result.check_tokens, result.errors = check_at_sample(ep, layer, place, arg_sets[0][1], base)
        step_run = timing.rotated(step(ep))
        result.primitives = _count_primitives("oxmoe", step_run, arg_sets, OXMOE_PRIMITIVES, (JAX_PRIMITIVE,))
        result.oxmoe = timing.measure(step_run, arg_sets, settings)
        result.device_rows = device_rows(layer, mesh, arg_sets[0])
        result.auto_exchange = auto_exchange(layer, mesh)
        costs = cost_model(layer.config, layer.devices, layer.tokens, layer.hidden)
        parts = [Part(f"step (fwd+bwd), exchange 'auto' = {result.auto_exchange!r}", result.oxmoe, 1, "auto",
                      costs[result.auto_exchange], peak_device_bytes(step(ep), arg_sets[0]))]
        for method in ["all_to_all", "ring", *ragged]:
            method_step = step(oxmoe_ep_layer(dataclasses.replace(layer.config, exchange=method), mesh))
            # ragged_all_to_all's step has taken 20x the others': fewer samples where it is slow.
            parts.append(Part(f"step (fwd+bwd), exchange {method!r}",
                              grouped_gemm.measure_within(timing.rotated(method_step), arg_sets, settings,
                                                          PLAIN_BUDGET_S),
                              None, method, costs.get(method), peak_device_bytes(method_step, arg_sets[0])))
        for chunks in TOKEN_CHUNKS:
            for method in ["all_to_all", "ring"]:
                config = dataclasses.replace(layer.config, exchange=method, token_chunks=chunks)
                chunked_step = step(oxmoe_ep_layer(config, mesh))
                parts.append(Part(f"step (fwd+bwd), exchange {method!r}, token_chunks={chunks}",
                                  timing.measure(timing.rotated(chunked_step), arg_sets, settings), None, method,
                                  costs[method], peak_device_bytes(chunked_step, arg_sets[0])))
        parts += [Part("forward", timing.measure(timing.rotated(forward(ep)), arg_sets, settings), 1),
                  Part("routing forward (gate GEMM, oxmoe.router.topk)",
                       timing.measure(timing.rotated(ep_routing(layer.config, mesh)), arg_sets, settings), 1)]
        del arg_sets

        for method in ["all_to_all", *ragged]:
            exchange_sets = exchange_args(layer, place, base, num_sets, method)
            # Four a step where "auto" exchanges by it (by ragged_all_to_all it never does).
            per_step = EXCHANGES_PER_STEP if method == result.auto_exchange else None
            exchange = grouped_gemm.measure_within(timing.rotated(ep_exchange(layer, mesh, method)), exchange_sets,
                                                   settings, PLAIN_BUDGET_S)
            wire_bytes = exchange_wire_bytes(layer) if method == "all_to_all" else None
            parts.append(Part(exchange_name(layer, method), exchange, per_step, wire_bytes=wire_bytes))
            del exchange_sets

        # Its semantics are the EP layer's (checked above) on fewer experts: not checked again.
        single = layer.one_device()
        arg_sets = _draw_sets(single, Placement(None), (seed, zlib.crc32(single.name.encode())),
                              _num_sets(settings, single)[0])
        ox = oxmoe_layer(single.config)
        e = single.config.num_experts
        parts += [Part(f"1 device, E={e}: step (fwd+bwd)", timing.measure(timing.rotated(step(ox)), arg_sets, settings),
                       None),
                  Part(f"1 device, E={e}: forward", timing.measure(timing.rotated(forward(ox)), arg_sets, settings),
                       None)]
        del arg_sets
        if layer.compare_weight_sharding:
            parts += weight_sharding_parts(layer, settings, seed)
        result.breakdown = parts
        result.dense = dense_gemms(layer, settings, dense, seed)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others' numbers
        result.failure = failure_text(e)
    return result


#: The token chunks (``MoEConfig.token_chunks``) the EP case's steps are also timed with, each
#: exchange's: each chunk's exchange may run under another chunk's expert GEMMs.
TOKEN_CHUNKS = (2, 4)

def layer_memory(layer: Layer, args: tuple, plain_fails: bool) -> dict[str, int | None]:
    """:attr:`LayerResult.memory` of a one-device layer (the plain-JAX layer's peak not
    compiled where its step failed)."""
    config, tokens = layer.config, layer.tokens
    dense = tokens * (layer.hidden + config.topk * layer.up_width + layer.shared_up_width) * DTYPE.itemsize
    return dict(oxmoe_saved=saved_bytes(oxmoe_layer(config), args), plain_saved=saved_bytes(plain_layer(config), args),
                dense_mlp_saved=dense, oxmoe_peak=peak_device_bytes(step(oxmoe_layer(config)), args),
                plain_peak=None if plain_fails else peak_device_bytes(step(plain_layer(config)), args))


#: The layers of the deeper data-parallel step: enough for XLA to gather one layer's sharded
#: weights while another computes, which a one-layer step cannot show.
DEEP_LAYERS = 2


def data_parallel_step(single: Layer, mesh: Mesh, weight_axes: tuple[str, ...]) -> Callable:
    """The :func:`step` of one-device layers in sequence (as many as the parameters given),
    data-parallel over ``mesh``'s :data:`DATA_AXIS`, their expert weights sharded over
    ``weight_axes`` (none: replicated); the layers' losses summed."""
    def layers(x, params: tuple[moe.MoEParams, ...]):
        auxes = []
        for layer_params in params:
            x, aux = moe.shard_map_moe(x, layer_params, single.config, mesh=mesh, data_axes=(DATA_AXIS,),
                                       weight_axes=weight_axes)
            auxes.append(aux)
        return x, dataclasses.replace(auxes[-1], load_balancing_loss=sum(a.load_balancing_loss for a in auxes),
                                      z_loss=sum(a.z_loss for a in auxes))
    return step(layers)


def data_parallel_sets(single: Layer, mesh: Mesh, weight_axes: tuple[str, ...], seed: tuple, num_sets: int,
                       num_layers: int = 1) -> list[tuple]:
    """Input sets of :func:`data_parallel_step`: each device's own tokens, and each layer's
    parameters replicated but for the expert weights' experts, split over ``weight_axes``."""
    experts = moe.expert_weights_spec(weight_axes=weight_axes)
    arg_sets = []
    for n in range(num_sets):
        x, w = draw_tokens(single, Placement(mesh), (*seed, n), single.tokens)
        params = []
        for i in range(num_layers):
            drawn = draw_params(single, Placement(None), (*seed, n, i))
            specs = dataclasses.replace(jax.tree.map(lambda _: P(), drawn), up=experts, down=experts)
            params.append(jax.device_put(drawn, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)))
        arg_sets.append((x, tuple(params), w))
    return arg_sets


def weight_sharding_parts(layer: Layer, settings: timing.Settings, seed: int = 0) -> list[Part]:
    """The steps of :meth:`Layer.one_device`'s layer data-parallel over ``layer.devices``
    devices (each its own tokens and every one of those experts), expert weights replicated,
    then sharded over the data axis (``weight_axes``), each with its peak device memory and
    the bytes of its arguments on a device (the expert weights' share, besides x and w); then
    :data:`DEEP_LAYERS` such layers in sequence, replicated and sharded."""
    single = layer.one_device()
    mesh = Mesh(np.array(jax.devices()[:layer.devices]), (DATA_AXIS,))
    base = (seed, zlib.crc32(f"{single.name} {DATA_AXIS}={layer.devices}".encode()))
    parts = []
    for num_layers in (1, DEEP_LAYERS):
        deep = f", {num_layers} layers" if num_layers > 1 else ""
        name = f"{DATA_AXIS}={layer.devices}, E={single.config.num_experts} on each device{deep}, expert weights"
        num_sets = max(1, _num_sets(settings, single)[0] // num_layers)
        for weight_axes in ((), (DATA_AXIS,)):
            arg_sets = data_parallel_sets(single, mesh, weight_axes, base, num_sets, num_layers)
            run = data_parallel_step(single, mesh, weight_axes)
            label = f"sharded over {DATA_AXIS!r}" if weight_axes else "replicated"
            parts.append(Part(f"{name} {label}: step (fwd+bwd)",
                              timing.measure(timing.rotated(run), arg_sets, settings), None,
                              peak_bytes=peak_device_bytes(run, arg_sets[0]),
                              argument_bytes=argument_device_bytes(arg_sets[0])))
            del arg_sets
    return parts


#: A sample of a layer's step lasts at least this long: several steps dispatched back to back,
#: as a training loop runs them. With one call a sample (a 10 ms step under ``timing.FULL``'s
#: 10 ms) the sample also timed the host launching the program on every device and waiting
#: for it: the Qwen3 EP = 2 step over two H200s took 10.64 ms a call, 9.57 ms a step back to
#: back (bench/trace_step.py), while the one-GPU step's 7.9 ms got two calls a sample.
STEP_SAMPLE_S = 0.1


def step_settings(settings: timing.Settings) -> timing.Settings:
    """``settings`` with samples of at least :data:`STEP_SAMPLE_S` (the smoke run's single
    call a sample stays)."""
    if not settings.min_sample_s:
        return settings
    return dataclasses.replace(settings, min_sample_s=max(settings.min_sample_s, STEP_SAMPLE_S))


def run_case(case: LayerCase, settings: timing.Settings, dense: DenseTimes, seed: int = 0) -> LayerResult:
    run = run_expert_parallel if case.layer.devices > 1 else run_one_device
    return run(case, step_settings(settings), dense, seed)


# -- the report ---------------------------------------------------------------------



def _megabytes(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.3g}"


class Summary:
    """The derived numbers of one case: TFLOP/s, the ratios, the goal."""

    def __init__(self, result: LayerResult, judge_goals: bool = True):
        self.result = result
        case, ox, plain = result.case, result.oxmoe, result.plain
        timed = result.failure is None and ox is not None and result.dense_s is not None
        self.tflops = case.flops / ox.median_s / 1e12 if timed else None
        self.dense_tflops = case.flops / result.dense_s / 1e12 if timed else None
        self.ratio = self.tflops / self.dense_tflops if timed else None
        one_device = case.layer.devices == 1
        self.goal_met = self.ratio >= MIN_FRACTION_OF_DENSE if timed and one_device and judge_goals else None
        plain_timed = timed and isinstance(plain, timing.Timing)
        self.plain_tflops = case.flops / plain.median_s / 1e12 if plain_timed else None
        self.speedup = plain.median_s / ox.median_s if plain_timed else None
        self.max_rel_err = max((v for k, v in result.errors.items() if k.startswith("d") and k.endswith("rel_err")
                                or k == "y_rel_err"), default=None)

    def plain_cell(self) -> str:
        plain = self.result.plain
        if isinstance(plain, timing.Timing):
            return format_us(plain.median_s)
        return plain or ("-" if self.result.case.layer.devices > 1 else "error")

    def row(self) -> list[str]:
        r = self.result
        if r.skipped:
            return [r.case.name, "skipped"] + [""] * 7
        if r.failure:
            return [r.case.name, "FAILED"] + [""] * 7
        return [r.case.name, format_us(r.oxmoe.median_s), format_tflops(r.case.flops, r.oxmoe.median_s),
                format_tflops(r.case.flops, r.dense_s), f"{100 * self.ratio:.0f}%",
                "-" if self.goal_met is None else "ok" if self.goal_met else "MISS", self.plain_cell(),
                f"{self.speedup:.1f}x" if self.speedup is not None else "-", f"{self.max_rel_err:.1e}"]

    def breakdown_table(self) -> str:
        """The EP case's parts, per device, against its step."""
        r = self.result
        step_s = r.oxmoe.median_s
        rows = [["part (per device)", "us", "x step", "% of step", "peak MB", "cost model MB"]]
        for part in r.breakdown:
            t = part.timing.median_s
            rows.append([part.name, format_us(t), "-" if part.per_step is None else str(part.per_step),
                         f"{100 * t * (part.per_step or 1) / step_s:.0f}%", _megabytes(part.peak_bytes),
                         _megabytes(part.cost_model_bytes)])
        return text_table(rows)

    def log_line(self) -> str:
        r = self.result
        if r.skipped:
            return f"    skipped: {r.skipped}"
        plain = r.plain
        if isinstance(plain, timing.Timing):
            plain_text = (f"plain JAX {format_us(plain.median_s)} us ({format_tflops(r.case.flops, plain.median_s)} TFLOP/s, "
                          f"{len(plain.samples_s)} samples), ")
        elif r.plain_error:
            plain_text = f"plain JAX {self.plain_cell()}: {r.plain_error[:300]}, "
        else:
            plain_text = ""
        return (f"    oxmoe {format_us(r.oxmoe.median_s)} us ({format_tflops(r.case.flops, r.oxmoe.median_s)} TFLOP/s, "
                f"{100 * self.ratio:.0f}% of dense {format_tflops(r.case.flops, r.dense_s)}), {plain_text}"
                f"check at {r.check_tokens} tokens: max rel err {self.max_rel_err:.1e}, "
                f"R={r.oxmoe.num_sets}, {r.oxmoe.calls_per_sample} call(s) x {len(r.oxmoe.samples_s)} samples, "
                f"{r.set_bytes / 1e6:.1f} MB per set{self._rows_text()}{self._memory_text()}")

    def _memory_text(self) -> str:
        m = self.result.memory
        if not m:
            return ""
        return (f"; kept for the backward: oxmoe {_megabytes(m['oxmoe_saved'])} MB, plain JAX "
                f"{_megabytes(m['plain_saved'])} MB, a dense SwiGLU MLP {_megabytes(m['dense_mlp_saved'])} MB; "
                f"peak: oxmoe {_megabytes(m['oxmoe_peak'])} MB, plain JAX {_megabytes(m['plain_peak'])} MB")

    def _rows_text(self) -> str:
        rows = self.result.device_rows
        if not rows:
            return ""
        return f", routed copies per device {'/'.join(map(str, rows))} (max / mean {max(rows) * len(rows) / sum(rows):.3f})"

    def to_json(self) -> dict:
        r, case = self.result, self.result.case
        plain_json = r.plain.to_json() if isinstance(r.plain, timing.Timing) else r.plain
        return dict(
            name=case.name, family=FAMILY_NAME, **case.info(), flops=case.flops,
            oxmoe=r.oxmoe.to_json() if r.oxmoe else None, tflops=self.tflops,
            dense=dict(median_us=r.dense_s * 1e6,
                       products={name: dict(**d.timing.to_json(), kernel=d.kernel) for name, d in r.dense.items()})
            if r.dense else None,
            dense_tflops=self.dense_tflops, ratio_to_dense=self.ratio, goals=dict(dense=self.goal_met),
            plain_jax=plain_json, plain_jax_tflops=self.plain_tflops, plain_jax_error=r.plain_error,
            speedup=self.speedup,
            check=dict(passed=r.failure is None and r.skipped is None, tokens=r.check_tokens, errors=r.errors,
                       limits=case.limits, primitives_per_step=r.primitives),
            memory=r.memory or None,
            breakdown=[p.to_json() for p in r.breakdown], auto_exchange=r.auto_exchange, device_rows=r.device_rows,
            device_bytes_per_set=r.set_bytes, skipped=r.skipped, failure=r.failure)


_HEADER = ["case", "oxmoe us", "TFLOP/s", "dense TFLOP/s", "% dense", f">={100 * MIN_FRACTION_OF_DENSE:g}% dense",
           "plain JAX us", "x plain JAX", "max rel err"]


class Report(OwnCasesReport):
    """The family's runner and results: one :class:`Summary` per case, its goals line and
    tables (what :mod:`oxmoe.bench.__main__` prints and writes)."""

    run_case = staticmethod(run_case)
    summary = Summary
    new_shared = DenseTimes

    def _count(self, keep) -> list[Summary]:
        return [s for s in self.summaries if not s.result.failure and not s.result.skipped and keep(s)]

    def goals_line(self) -> str:
        goals = [s.goal_met for s in self._count(lambda s: s.goal_met is not None)]
        timed = self._count(lambda s: s.speedup is not None)
        oom = self._count(lambda s: s.result.plain == OOM)
        errors = self._count(lambda s: s.result.plain is None and s.result.plain_error is not None)
        skipped = [s.result.case.name for s in self.summaries if s.result.skipped]
        if self.smoke:
            return (f"{self.family.name} goals {NOT_JUDGED} (>= {100 * MIN_FRACTION_OF_DENSE:g}% of the dense bf16 "
                    f"GEMMs' TFLOP/s, >= {MIN_SPEEDUP:g}x the plain-JAX layer); plain-JAX layer (OOM {len(oom)}, "
                    f"error {len(errors)}); skipped {len(skipped)}{' (' + ', '.join(skipped) + ')' if skipped else ''}; "
                    f"failed cases {len(self.failed)}")
        return (f"{self.family.name} goals met: >= {100 * MIN_FRACTION_OF_DENSE:g}% of the dense bf16 GEMMs' "
                f"TFLOP/s {sum(goals)}/{len(goals)}; >= {MIN_SPEEDUP:g}x the plain-JAX layer "
                f"{sum(s.speedup >= MIN_SPEEDUP for s in timed)}/{len(timed)} (OOM {len(oom)}, error {len(errors)}); "
                f"skipped {len(skipped)}{' (' + ', '.join(skipped) + ')' if skipped else ''}; "
                f"failed cases {len(self.failed)}")

    def table(self) -> str:
        """The cases' table, then each EP case's breakdown (no blank line: one block per family)."""
        lines = [text_table([_HEADER] + [s.row() for s in self.summaries])]
        for s in self.summaries:
            if s.result.breakdown:
                lines += [f"{s.result.case.name}: where a step's time goes", s.breakdown_table()]
        return "\n".join(lines)

    def to_json(self) -> dict:
        goals = [s.goal_met for s in self._count(lambda s: s.goal_met is not None)]
        return dict(sizes=self.family.sizes(self.smoke),
                    goals=dict(min_fraction_of_dense=MIN_FRACTION_OF_DENSE, min_speedup=MIN_SPEEDUP),
                    goals_met=dict(dense=[sum(goals), len(goals)]),
                    plain_jax_oom=[s.result.case.name for s in self._count(lambda s: s.result.plain == OOM)],
                    skipped=[s.result.case.name for s in self.summaries if s.result.skipped],
                    failed=[r.case.name for r in self.failed],
                    cases=[s.result.case.name for s in self.summaries])


def _sizes(smoke: bool) -> str:
    layers = SMOKE_LAYERS if smoke else LAYERS
    return ("; ".join(f"{layer.name} {layer.describe()}" for layer in layers)
            + "; bf16, SwiGLU, a step = value_and_grad of sum(y * w) + losses")


FAMILY_NAME = "moe_layer"
FAMILY = Family(name=FAMILY_NAME, goals=None,
                cases=lambda smoke: [LayerCase(layer) for layer in (SMOKE_LAYERS if smoke else LAYERS)],
                sizes=_sizes, report=lambda smoke: Report(FAMILY, smoke))
