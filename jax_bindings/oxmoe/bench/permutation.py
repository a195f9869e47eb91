"""The permutation benchmark: oxmoe's dispatch, combine and sort_chunks against plain JAX.

Cases (T tokens, H hidden, E experts, top-k routing; bf16 tokens, float32 probs):

- ``<model> bf16 dispatch [align=128] fwd|bwd``: :func:`oxmoe.permutation.dispatch`
  of ``[T, H]`` tokens with a random top-k routing map (exactly k experts per
  token) and ``[T, E]`` probs, without and with ``align_size=128``; the backward
  takes d tokens ``[R, H]`` and d probs ``[R]`` to d tokens ``[T, H]`` and d probs
  ``[T, E]``;
- ``<model> bf16 combine [align=128] fwd|bwd``: :func:`oxmoe.permutation.combine`
  of ``[R, H]`` expert outputs (random, padding rows included) with ``[T, E]``
  merging probs; the backward takes d out ``[T, H]`` to d expert tokens ``[R, H]``
  and d merging probs ``[T, E]``;
- ``deepseek_v3 ep=8 bf16 sort_chunks fwd|bwd``: :func:`oxmoe.permutation.sort_chunks`
  as expert parallelism uses it after the all-to-all: one rank of 8 holds the
  ``T * k / 8`` rows its 8 source ranks sent, in 8 x 32 chunks (source-major,
  then its 32 local experts), and sorts them expert-major; the backward is the
  unsort (:func:`oxmoe.permutation.unsort_chunks` of the cotangent).

Models: DeepSeek-V3 (T=32768, H=7168, E=256, k=8) and Mixtral (T=32768, H=1024,
E=8, k=2). The smoke run takes T=256 and H=128.

Plain JAX is :mod:`oxmoe.reference.permutation`, the formulation a JAX user
writes (MaxText's ``permute`` / ``unpermute``), written independently of oxmoe: it
takes the routing as the top-k expert ids ``[T, k]`` and weights ``[T, k]`` that
``lax.top_k`` gives, flattens the ids, sorts them stably (``argsort``), gathers the token rows
(``x[sorted_token_ids]``); with ``align_size`` it computes each expert's padded
offset and scatters the sorted rows into a zero buffer. Its combine gathers the
rows back through the inverse permutation (computed by the dispatch, as oxmoe's
row id map is), and sums the ``k`` rows of a token weighted, in float32
(``einsum`` at HIGHEST precision, as MaxText does); its sort_chunks gathers rows
by indices computed from the chunk sizes. Backwards are ``jax.vjp`` of these.
Both produce the same layout (expert-major, tokens increasing within an
expert); each case compares them on every input set before timing: data
movement bit for bit, sums (combine, dispatch's d tokens) by relative error.

The byte floor of each case (each input read once, each output written once) is
documented at the case; ``N = T * k`` routed (token, expert) pairs, ``R`` rows
of dispatch's output (:func:`oxmoe.permutation.dispatched_rows`: ``N``, or ``N``
plus room for each expert's padding with ``align_size``), ``d`` = 2 bytes (bf16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import permutation as perm
from oxmoe import reference
from oxmoe.bench import timing
from oxmoe.bench.cases import Case, Family, Goals, Inputs, apply_vjp, apply_vjp_all, rel_err
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER, MIXTRAL_LAYER, LayerShape

#: Tokens per case in the full run (the models' step: DeepSeek-V3's, as many as Mixtral's), and in the
#: smoke run.
TOKENS, SMOKE_TOKENS = DEEPSEEK_V3_LAYER.tokens, 256
#: Hidden size of the smoke run (at most): DeepSeek-V3's align=128 dispatch has R=34560 rows at T=256.
SMOKE_HIDDEN = 128
#: The padding of the aligned cases (a grouped GEMM's tile).
ALIGN = 128
#: Expert parallelism of the sort_chunks cases: source ranks, and local experts per rank.
EP_RANKS = 8

#: Goals of the issue: at least 75% of the copy bandwidth ...
MIN_FRACTION_OF_COPY = 0.75
#: ... and at least this much faster than plain JAX (dispatch and combine).
MIN_SPEEDUP = 8.0
GOALS = Goals.fraction_of_copy(MIN_FRACTION_OF_COPY, MIN_SPEEDUP,
                               f">= {MIN_SPEEDUP:g}x faster than plain JAX (dispatch, combine)")

#: Largest ||oxmoe - plain|| / ||plain|| of a sum: bf16 values (plain JAX's d tokens of
#: dispatch are scatter-added in bf16), float32 values (dot products over H).
MAX_REL_ERR = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float32): 1e-4}


MODELS = (DEEPSEEK_V3_LAYER, MIXTRAL_LAYER)

DTYPE = jnp.dtype(jnp.bfloat16)
PROBS_DTYPE = jnp.dtype(jnp.float32)


# -- comparisons (on the device, one input set at a time) -----------------------

def _bits(x):
    """``x`` as unsigned integers of its width: equal bits, equal values (NaN, -0 included)."""
    return jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])


def _rows_differing(a, b):
    """How many rows of ``a`` and ``b`` differ in some bit."""
    differ = _bits(a) != _bits(b)
    return jnp.sum(jnp.any(differ.reshape(differ.shape[0], -1), axis=1))


def _count(x):
    return jnp.sum(x.astype(jnp.int32))


def _unrouted_nonzero(grad_tk_e, topk_ids):
    """Entries of a ``[T, E]`` gradient that are not zero outside the routed (t, e)."""
    routed = jnp.zeros(grad_tk_e.shape, bool).at[jnp.arange(topk_ids.shape[0])[:, None], topk_ids].set(True)
    return _count(~routed & (grad_tk_e != 0))


@jax.jit
def _compare_dispatch_fwd(ox, plain, topk_ids):
    tokens, probs, dest, counts, padded = plain
    t, k = topk_ids.shape
    row_map = ox.row_id_map
    source = jnp.full(row_map.source_tokens.shape, -1, jnp.int32).at[dest.reshape(-1)].set(
        jnp.repeat(jnp.arange(t, dtype=jnp.int32), k))
    counts_differing = (_count(ox.group_sizes != padded)
                        + _count(ox.tokens_per_expert != counts))
    if ox.pad_offsets is not None:
        pad_offsets = (jnp.cumsum(padded) - padded) - (jnp.cumsum(counts) - counts)
        counts_differing += _count(ox.pad_offsets != pad_offsets)
    return dict(
        tokens_rows_differing=_rows_differing(ox.tokens, tokens),
        probs_differing=_rows_differing(ox.probs, probs),
        row_id_map_differing=(_count(jnp.take_along_axis(row_map.dest_rows, topk_ids, axis=1) != dest)
                              + jnp.abs(_count(row_map.dest_rows >= 0) - t * k)
                              + _count(row_map.source_tokens != source)),
        counts_differing=counts_differing)


@jax.jit
def _compare_dispatch_bwd(ox, plain, topk_ids):
    (ox_tokens, ox_probs), (plain_tokens, plain_weights) = ox, plain
    return dict(
        grad_rel_err=rel_err(ox_tokens, plain_tokens),
        probs_grad_differing=(_rows_differing(jnp.take_along_axis(ox_probs, topk_ids, axis=1), plain_weights)
                              + _unrouted_nonzero(ox_probs, topk_ids)))


@jax.jit
def _compare_combine_fwd(ox, plain, context):
    del context
    return dict(out_rel_err=rel_err(ox, plain))


@jax.jit
def _compare_combine_bwd(ox, plain, topk_ids):
    (ox_tokens, ox_probs), (plain_tokens, plain_weights) = ox, plain
    return dict(
        grad_rel_err=rel_err(ox_tokens, plain_tokens),
        probs_grad_rel_err=rel_err(jnp.take_along_axis(ox_probs, topk_ids, axis=1), plain_weights),
        probs_grad_unrouted_nonzero=_unrouted_nonzero(ox_probs, topk_ids))


@jax.jit
def _compare_rows(ox, plain, context):
    del context
    return dict(rows_differing=_rows_differing(ox, plain))


# -- cases ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """One case's sizes: a model's experts and top-k at ``tokens`` x ``hidden``."""

    model: LayerShape
    tokens: int
    hidden: int
    align_size: int | None

    @property
    def num_routed(self) -> int:
        return self.tokens * self.model.topk

    @property
    def num_rows(self) -> int:
        return perm.dispatched_rows(self.num_routed, self.model.num_experts, self.align_size)

    def name(self, op: str, direction: str) -> str:
        align = "" if self.align_size is None else f" align={self.align_size}"
        return f"{self.model.name} bf16 {op}{align} {direction}"

    def info(self, op: str, direction: str) -> dict:
        m = self.model
        return dict(op=op, direction=direction, dtype=DTYPE.name, probs_dtype=PROBS_DTYPE.name,
                    tokens=self.tokens, hidden=self.hidden, num_experts=m.num_experts, topk=m.topk,
                    align_size=self.align_size, rows=self.num_rows, model=m.name)


def _routing(random: timing.RandomArrays, shape: Shape):
    """A random top-k routing: ``(topk_ids [T, k] int32 increasing, weights [T, k] f32 summing to 1,
    routing_map [T, E] bool, probs [T, E] f32: the weights at the routed entries, 0 elsewhere)``."""
    t, e, k = shape.tokens, shape.model.num_experts, shape.model.topk
    ids = random.distinct_choices(t, e, k)
    weights = np.asarray(random.probabilities((t, k), PROBS_DTYPE))
    routing_map = np.zeros((t, e), bool)
    probs = np.zeros((t, e), PROBS_DTYPE)
    np.put_along_axis(routing_map, ids, True, axis=1)
    np.put_along_axis(probs, ids, weights, axis=1)
    return tuple(jnp.asarray(x) for x in (ids, weights, routing_map, probs))


def _dispatch_fn(shape: Shape):
    def dispatch(tokens, routing_map, probs):
        return perm.dispatch(tokens, routing_map, probs=probs, topk=shape.model.topk, align_size=shape.align_size)
    return dispatch


def _plain_dispatch_fn(shape: Shape):
    def dispatch(tokens, topk_ids, weights):
        return reference.permutation.dispatch(tokens, topk_ids, weights, shape.model.num_experts, shape.align_size,
                                              shape.num_rows)
    return dispatch


# The untimed forwards that prepare a case's inputs: jitted once per shape (a new function
# per input set would compile again), their arrays passed as arguments, not closed over.

@functools.partial(jax.jit, static_argnames=("shape",))
def _ox_dispatch_values(tokens, probs, routing_map, *, shape: Shape):
    out = _dispatch_fn(shape)(tokens, routing_map, probs)
    return out.tokens, out.probs


@functools.partial(jax.jit, static_argnames=("shape",))
def _plain_dispatch_values(tokens, weights, topk_ids, *, shape: Shape):
    return _plain_dispatch_fn(shape)(tokens, topk_ids, weights)[:2]


#: Width of the tokens dispatched only for their row id map (the combine cases' input).
_MAP_ONLY_HIDDEN = 128


@functools.partial(jax.jit, static_argnames=("shape",))
def _row_id_map(routing_map, *, shape: Shape):
    """oxmoe's row id map of a routing, from dispatching narrow zero tokens (the rows are not used)."""
    tokens = jnp.zeros((shape.tokens, _MAP_ONLY_HIDDEN), DTYPE)
    return perm.dispatch(tokens, routing_map, topk=shape.model.topk, align_size=shape.align_size).row_id_map


@functools.partial(jax.jit, static_argnames=("shape",))
def _plain_dest(topk_ids, *, shape: Shape):
    return reference.permutation.expert_major_layout(topk_ids, shape.model.num_experts, shape.align_size)[2]


@jax.jit
def _ox_combine(expert_tokens, probs, row_id_map):
    return perm.combine(expert_tokens, row_id_map, merging_probs=probs)


@jax.jit
def _plain_combine(expert_tokens, weights, dest):
    return reference.permutation.combine(expert_tokens, dest, weights)


@jax.jit
def _ox_sort_chunks(tokens, split_sizes, sorted_indices):
    return perm.sort_chunks(tokens, split_sizes, sorted_indices)


@jax.jit
def _plain_sort_chunks(tokens, split_sizes, sorted_indices):
    return reference.permutation.sort_chunks(tokens, split_sizes, sorted_indices)


def _dispatch_fwd_bytes(s: Shape) -> int:
    """Reads tokens ``T*H*d``, the routing map ``T*E`` (bool) and probs ``T*E*4``; writes every
    row of the output ``R*H*d`` (padding and unused rows too), its probs ``R*4``, the row id
    map (``dest_rows`` ``T*E*4``, ``source_tokens`` ``R*4``) and the counts (group_sizes,
    tokens_per_expert, and pad_offsets with align_size: ``E*4`` each)."""
    t, h, e, r, d = s.tokens, s.hidden, s.model.num_experts, s.num_rows, DTYPE.itemsize
    num_counts = 2 if s.align_size is None else 3
    return t * h * d + t * e + t * e * 4 + r * h * d + r * 4 + t * e * 4 + r * 4 + num_counts * e * 4


def _dispatch_bwd_bytes(s: Shape) -> int:
    """Reads the ``N`` routed rows of d tokens ``N*H*d`` and of d probs ``N*4`` (padding rows are
    never read) and ``dest_rows`` ``T*E*4``; writes d tokens ``T*H*d`` and d probs ``T*E*4``."""
    t, h, e, n, d = s.tokens, s.hidden, s.model.num_experts, s.num_routed, DTYPE.itemsize
    return n * h * d + n * 4 + t * e * 4 + t * h * d + t * e * 4


def _combine_fwd_bytes(s: Shape) -> int:
    """Reads the ``N`` rows of expert tokens the routing refers to ``N*H*d`` (padding rows are
    never read), merging probs ``T*E*4`` and ``dest_rows`` ``T*E*4`` (``source_tokens`` is not
    needed); writes out ``T*H*d``."""
    t, h, e, n, d = s.tokens, s.hidden, s.model.num_experts, s.num_routed, DTYPE.itemsize
    return n * h * d + t * e * 4 + t * e * 4 + t * h * d


def _combine_bwd_bytes(s: Shape) -> int:
    """Reads d out ``T*H*d``, the ``N`` referred rows of expert tokens ``N*H*d`` (for d merging
    probs), merging probs ``T*E*4`` and ``dest_rows`` ``T*E*4``; writes every row of d expert
    tokens ``R*H*d`` (zero on padding rows) and d merging probs ``T*E*4``."""
    t, h, e, n, r, d = s.tokens, s.hidden, s.model.num_experts, s.num_routed, s.num_rows, DTYPE.itemsize
    return t * h * d + n * h * d + t * e * 4 + t * e * 4 + r * h * d + t * e * 4


def dispatch_fwd_case(s: Shape) -> Case:
    def draw(random):
        ids, weights, routing_map, probs = _routing(random, s)
        return random.normal((s.tokens, s.hidden), DTYPE), ids, weights, routing_map, probs

    def prepare(tokens, ids, weights, routing_map, probs):
        return Inputs((tokens, routing_map, probs), (tokens, ids, weights), context=ids)

    return Case(
        name=s.name("dispatch", "fwd"), bytes=_dispatch_fwd_bytes(s),
        draw=draw, prepare=prepare, jit_prepare=False,
        oxmoe=_dispatch_fn(s), plain=_plain_dispatch_fn(s),
        compare=_compare_dispatch_fwd,
        limits=dict(tokens_rows_differing=0, probs_differing=0, row_id_map_differing=0, counts_differing=0),
        primitive="oxmoe_dispatch_fwd",
        info=s.info("dispatch", "fwd"))


def dispatch_bwd_case(s: Shape) -> Case:
    def draw(random):
        ids, weights, routing_map, probs = _routing(random, s)
        return (random.normal((s.tokens, s.hidden), DTYPE), ids, weights, routing_map, probs,
                random.normal((s.num_rows, s.hidden), DTYPE), random.normal((s.num_rows,), PROBS_DTYPE))

    def prepare(tokens, ids, weights, routing_map, probs, grad_tokens, grad_probs):
        _, ox_vjp = jax.vjp(lambda x, p: _ox_dispatch_values(x, p, routing_map, shape=s), tokens, probs)
        _, plain_vjp = jax.vjp(lambda x, w: _plain_dispatch_values(x, w, ids, shape=s), tokens, weights)
        grads = (grad_tokens, grad_probs)
        return Inputs((ox_vjp, grads), (plain_vjp, grads), context=ids)

    return Case(
        name=s.name("dispatch", "bwd"), bytes=_dispatch_bwd_bytes(s),
        draw=draw, prepare=prepare, jit_prepare=False,
        oxmoe=apply_vjp_all, plain=apply_vjp_all,
        compare=_compare_dispatch_bwd,
        limits=dict(grad_rel_err=MAX_REL_ERR[DTYPE], probs_grad_differing=0),
        # The backward of dispatch is a combine of d tokens (and a gather of d probs).
        primitive="oxmoe_combine_fwd", excluded=("oxmoe_dispatch_fwd", "sort"),
        info=s.info("dispatch", "bwd"))


def _combine_inputs(random: timing.RandomArrays, s: Shape):
    ids, weights, routing_map, probs = _routing(random, s)
    return random.normal((s.num_rows, s.hidden), DTYPE), ids, weights, routing_map, probs


def combine_fwd_case(s: Shape) -> Case:
    def prepare(expert_tokens, ids, weights, routing_map, probs):
        return Inputs((expert_tokens, _row_id_map(routing_map, shape=s), probs),
                      (expert_tokens, _plain_dest(ids, shape=s), weights))

    return Case(
        name=s.name("combine", "fwd"), bytes=_combine_fwd_bytes(s),
        draw=lambda random: _combine_inputs(random, s), prepare=prepare, jit_prepare=False,
        oxmoe=lambda et, row_id_map, probs: perm.combine(et, row_id_map, merging_probs=probs),
        plain=reference.permutation.combine,
        compare=_compare_combine_fwd, limits=dict(out_rel_err=MAX_REL_ERR[DTYPE]),
        primitive="oxmoe_combine_fwd", excluded=("oxmoe_dispatch_fwd",),
        info=s.info("combine", "fwd"))


def combine_bwd_case(s: Shape) -> Case:
    def draw(random):
        return *_combine_inputs(random, s), random.normal((s.tokens, s.hidden), DTYPE)

    def prepare(expert_tokens, ids, weights, routing_map, probs, grad_out):
        row_id_map, dest = _row_id_map(routing_map, shape=s), _plain_dest(ids, shape=s)
        _, ox_vjp = jax.vjp(lambda et, p: _ox_combine(et, p, row_id_map), expert_tokens, probs)
        _, plain_vjp = jax.vjp(lambda et, w: _plain_combine(et, w, dest), expert_tokens, weights)
        return Inputs((ox_vjp, grad_out), (plain_vjp, grad_out), context=ids)

    return Case(
        name=s.name("combine", "bwd"), bytes=_combine_bwd_bytes(s),
        draw=draw, prepare=prepare, jit_prepare=False,
        oxmoe=apply_vjp_all, plain=apply_vjp_all,
        compare=_compare_combine_bwd,
        limits=dict(grad_rel_err=MAX_REL_ERR[DTYPE], probs_grad_rel_err=MAX_REL_ERR[PROBS_DTYPE],
                    probs_grad_unrouted_nonzero=0),
        primitive="oxmoe_combine_bwd", excluded=("oxmoe_combine_fwd", "oxmoe_dispatch_fwd"),
        info=s.info("combine", "bwd"))


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """sort_chunks after an expert-parallel all-to-all: ``rows`` rows of ``hidden`` in
    ``EP_RANKS`` x ``local_experts`` chunks, source-major; sorted expert-major."""

    model: LayerShape
    rows: int
    hidden: int

    @property
    def local_experts(self) -> int:
        return self.model.num_experts // EP_RANKS

    @property
    def num_chunks(self) -> int:
        return EP_RANKS * self.local_experts

    def name(self, direction: str) -> str:
        return f"{self.model.name} ep={EP_RANKS} bf16 sort_chunks {direction}"

    def info(self, direction: str) -> dict:
        return dict(op="sort_chunks", direction=direction, dtype=DTYPE.name, rows=self.rows,
                    hidden=self.hidden, chunks=self.num_chunks, ep_ranks=EP_RANKS,
                    local_experts=self.local_experts, model=self.model.name)

    def sorted_indices(self) -> np.ndarray:
        """Chunk ``src * L + e`` (source rank ``src``, local expert ``e``) to position ``e * 8 + src``."""
        return np.arange(self.num_chunks, dtype=np.int32).reshape(EP_RANKS, self.local_experts).T.reshape(-1)


def _sort_bytes(s: ChunkShape) -> int:
    """Reads the rows ``N*H*d`` and split_sizes, sorted_indices ``C*4`` each; writes ``N*H*d``.
    The chunks' sizes (random, uniform over the chunks) add up to ``N``: no zero tail."""
    return 2 * s.rows * s.hidden * DTYPE.itemsize + 2 * s.num_chunks * 4


def _sort_draw(s: ChunkShape):
    def draw(random):
        return (random.normal((s.rows, s.hidden), DTYPE), jnp.asarray(random.counts(s.rows, s.num_chunks)),
                jnp.asarray(s.sorted_indices()))
    return draw


def sort_fwd_case(s: ChunkShape) -> Case:
    return Case(
        name=s.name("fwd"), bytes=_sort_bytes(s), draw=_sort_draw(s), prepare=None,
        oxmoe=perm.sort_chunks, plain=reference.permutation.sort_chunks,
        compare=_compare_rows, limits=dict(rows_differing=0),
        primitive="oxmoe_sort_chunks",
        # Plain JAX's sort_chunks is one gather: no kernel is 8x faster than that.
        speedup_goal=False,
        info=s.info("fwd"))


def sort_bwd_case(s: ChunkShape) -> Case:
    def draw(random):
        return *_sort_draw(s)(random), random.normal((s.rows, s.hidden), DTYPE)

    def prepare(tokens, split_sizes, sorted_indices, grad_out):
        _, ox_vjp = jax.vjp(lambda x: _ox_sort_chunks(x, split_sizes, sorted_indices), tokens)
        _, plain_vjp = jax.vjp(lambda x: _plain_sort_chunks(x, split_sizes, sorted_indices), tokens)
        return Inputs((ox_vjp, grad_out), (plain_vjp, grad_out))

    return Case(
        name=s.name("bwd"), bytes=_sort_bytes(s), draw=draw, prepare=prepare, jit_prepare=False,
        oxmoe=apply_vjp, plain=apply_vjp,
        compare=_compare_rows, limits=dict(rows_differing=0),
        # The backward is the unsort: the same primitive (inverse=True), once.
        primitive="oxmoe_sort_chunks", excluded=("sort",),
        speedup_goal=False,
        info=s.info("bwd"))


def cases(tokens: int, max_hidden: int | None = None) -> list[Case]:
    """Every permutation case at ``tokens`` tokens (hidden sizes capped at ``max_hidden``)."""
    out = []
    for model in MODELS:
        hidden = model.hidden if max_hidden is None else min(model.hidden, max_hidden)
        for align_size in (None, ALIGN):
            s = Shape(model, tokens, hidden, align_size)
            out += [dispatch_fwd_case(s), dispatch_bwd_case(s), combine_fwd_case(s), combine_bwd_case(s)]
    model = DEEPSEEK_V3_LAYER
    chunks = ChunkShape(model, rows=tokens * model.topk // EP_RANKS,
                        hidden=model.hidden if max_hidden is None else min(model.hidden, max_hidden))
    return out + [sort_fwd_case(chunks), sort_bwd_case(chunks)]


FAMILY = Family(name="permutation", goals=GOALS,
                cases=lambda smoke: cases(SMOKE_TOKENS, SMOKE_HIDDEN) if smoke else cases(TOKENS),
                sizes=lambda smoke: f"T={SMOKE_TOKENS}, H<={SMOKE_HIDDEN}" if smoke else f"T={TOKENS}")
