"""The grouped GEMM benchmark: oxmoe's ragged_dot against a dense GEMM and jax.lax.ragged_dot.

Cases (bf16 inputs and output, float32 accumulation), per shape ``M x K x N``
with ``G`` groups and per draw of the group sizes:

- ``<shape> <draw> fwd``: ``out = ragged_dot(lhs [M, K], rhs [G, K, N], gs)``;
- ``<shape> <draw> dlhs``: d lhs ``= ragged_dot(dout [M, N], rhs [G, K, N], gs,
  rhs_transposed=True)`` (``[M, K]``);
- ``<shape> <draw> drhs``: d rhs ``= transposed_ragged_dot(lhs [M, K], dout [M, N], gs)``
  (``[G, K, N]``);
- ``<shape> <draw> fwd [G,N,K]``: the forward with the weights stored ``[G, N, K]``
  (``rhs_transposed=True``: the kernel's other operand layout).

Shapes (an expert FFN's up or down projection after dispatch): Mixtral up
(65536 x 1024 x 4096, G=8), Qwen3-30B-A3B up (131072 x 2048 x 768, G=128),
DeepSeek-V3 on one rank of 8-way expert parallelism, up (32768 x 7168 x 2048,
G=32) and down (32768 x 2048 x 7168, G=32). Draws: ``a=4``, group sizes a
Dirichlet(alpha=4) split of ``M``; ``a=4 empty=10%``, 10% of the groups (at least
one) empty and the Dirichlet split over the others. Every non-empty group has at
least one row and the sizes sum to ``M`` (each input set draws its own).

Each case times three things on the same device in the same run, as TFLOP/s with
``FLOPs = 2 * M * K * N`` (every row is in a group):

- oxmoe's product (the call above, alone in its jit);
- a dense bf16 GEMM of the same FLOPs, ``jnp.dot``: fwd ``[M, K] x [K, N]``, dlhs
  ``[M, N] x [N, K]``, drhs ``[K, M] x [M, N]``; timed once per shape and product (the
  ``[G, N, K]`` forward's is the forward's). On a GPU XLA compiles it to cuBLAS, or to
  a Triton GEMM where its autotuner finds that faster (the JSON's ``dense.kernel`` says
  which; ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`` keeps cuBLAS);
- ``jax.lax.ragged_dot`` (``ragged_dot_general`` for ``[G, N, K]``); its dlhs and
  drhs are the backward products ``jax.vjp`` of ``ragged_dot`` applies (the
  transpose of ``ragged_dot_general`` in lhs or rhs, built with
  ``jax.linear_transpose``: the same jaxpr as the vjp's backward, without running
  the forward). It may run out of device memory; that is reported as ``OOM``,
  not as a failure. A slow one is timed with fewer samples (about
  :data:`RAGGED_DOT_BUDGET_S` seconds).

The goal: each oxmoe product at >= :data:`MIN_FRACTION_OF_DENSE` of the dense
GEMM's TFLOP/s. Before anything is timed, oxmoe's output on every input set is
compared with a plain-JAX reference: per group, the float32 product of the
float32-cast inputs at ``Precision.HIGHEST``. An element fails if
``|oxmoe - ref| > 2^-7 |ref| + 2 * L * 2^-24 * (|a| @ |b|)`` (one bf16 ulp of the
output, plus twice the worst-case float32 summation error over the ``L`` summed
products, which also covers the reference's own); the case fails if any element
does, or if ``||oxmoe - ref|| / ||ref|| > 1e-2``. A failed case is not timed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import grouped_gemm, reference
from oxmoe.bench import timing
from oxmoe.bench.cases import NOT_JUDGED, CheckFailed, Family, OwnCasesReport, error_text, failure_text, format_tflops, format_us, rel_err, text_table
from oxmoe.model_shapes import EXPERT_GEMMS, GemmShape

DTYPE = jnp.dtype(jnp.bfloat16)
#: The Dirichlet concentration of the group sizes, and the empty groups' share of the second draw.
ALPHA, EMPTY_FRACTION = 4.0, 0.1
#: The goal: oxmoe's TFLOP/s at least this fraction of the dense GEMM's.
MIN_FRACTION_OF_DENSE = 0.8
#: Largest ||oxmoe - ref|| / ||ref|| (bf16 output: about 2e-3 from its rounding alone).
MAX_REL_ERR = 1e-2
#: The elementwise bound: one ulp of the bf16 output (relative), float32's unit roundoff.
EPS_OUT, EPS_ACC = 2.0 ** -7, 2.0 ** -24
#: Device seconds jax.lax.ragged_dot's timing may take: a slower one gets fewer samples (3 at least).
RAGGED_DOT_BUDGET_S = 3.0

FWD_PRIMITIVE, BWD_PRIMITIVE = "oxmoe_ragged_dot", "oxmoe_transposed_ragged_dot"
JAX_PRIMITIVE, DENSE_PRIMITIVE = "ragged_dot_general", "dot_general"


SHAPES = EXPERT_GEMMS
#: The smoke run: the same groups, tiny M, K and N (multiples of 8, so that a GPU takes its
#: tensor-core path), the shapes' proportions roughly kept.
SMOKE_SHAPES = tuple(dataclasses.replace(shape, m=256, k=k, n=n)
                     for shape, (k, n) in zip(SHAPES, ((64, 128), (64, 24), (112, 32), (32, 112))))


@dataclasses.dataclass(frozen=True)
class Draw:
    """How the group sizes are drawn: a Dirichlet(``ALPHA``) split of ``M`` over the
    groups that are not empty."""

    name: str
    empty_fraction: float

    def num_empty(self, groups: int) -> int:
        return 0 if self.empty_fraction == 0 else max(1, round(self.empty_fraction * groups))

    def sizes(self, rng: np.random.Generator, m: int, groups: int) -> np.ndarray:
        """``[groups]`` int32 summing to ``m``: ``num_empty`` random groups get 0 rows,
        each other group 1 row plus its Dirichlet share of the rest (largest remainders
        rounded up, so that the sum is exact)."""
        sizes = np.zeros(groups, np.int64)
        full = np.sort(rng.permutation(groups)[self.num_empty(groups):])
        rest = m - len(full)
        share = rng.dirichlet(np.full(len(full), ALPHA)) * rest
        counts = np.floor(share).astype(np.int64)
        counts[np.argsort(counts - share)[:rest - counts.sum()]] += 1  # largest fractional parts
        sizes[full] = 1 + counts
        assert sizes.sum() == m
        return sizes.astype(np.int32)


DRAWS = (Draw(f"a={ALPHA:g}", 0.0), Draw(f"a={ALPHA:g} empty={100 * EMPTY_FRACTION:g}%", EMPTY_FRACTION))


# -- the timed functions ------------------------------------------------------------

def _oxmoe_fwd(lhs, rhs, group_sizes):
    return grouped_gemm.ragged_dot(lhs, rhs, group_sizes)


def _oxmoe_fwd_nk(lhs, rhs, group_sizes):
    return grouped_gemm.ragged_dot(lhs, rhs, group_sizes, rhs_transposed=True)


def _oxmoe_dlhs(dout, rhs, group_sizes):
    return grouped_gemm.ragged_dot(dout, rhs, group_sizes, rhs_transposed=True)


def _oxmoe_drhs(lhs, dout, group_sizes):
    return grouped_gemm.transposed_ragged_dot(lhs, dout, group_sizes)


def _jax_fwd(lhs, rhs, group_sizes):
    return reference.grouped_gemm.ragged_dot(lhs, rhs, group_sizes)


def _jax_fwd_nk(lhs, rhs, group_sizes):
    return reference.grouped_gemm.ragged_dot(lhs, rhs, group_sizes, rhs_transposed=True)


def _jax_dlhs(dout, rhs, group_sizes):
    """d lhs of ``jax.lax.ragged_dot(lhs, rhs, gs)``: what ``jax.vjp`` applies to ``dout``."""
    lhs = jax.ShapeDtypeStruct((dout.shape[0], rhs.shape[1]), dout.dtype)
    (grad,) = jax.linear_transpose(lambda x: reference.grouped_gemm.ragged_dot(x, rhs, group_sizes), lhs)(dout)
    return grad


def _jax_drhs(lhs, dout, group_sizes):
    """d rhs of ``jax.lax.ragged_dot(lhs, rhs, gs)``: what ``jax.vjp`` applies to ``dout``."""
    return reference.grouped_gemm.transposed_ragged_dot(lhs, dout, group_sizes)


def _dense(a, b):
    return jnp.dot(a, b)


# -- the reference check (one input set at a time) ----------------------------------
#
# Small cases (the smoke run) are checked on the host in float64 NumPy: nothing to compile.
# Larger ones on the device: each group's rows gathered into a zero-padded [G, rows, C]
# block, multiplied in float32 at Precision.HIGHEST (bf16 inputs: exact products).

#: Cases of up to this many FLOPs are checked on the host.
HOST_CHECK_MAX_FLOPS = 1 << 30


def _errors(xp, got, ref, magnitude, length, valid):
    """The check's two errors (``xp``: numpy or jax.numpy): elements past the bound (NaN
    counts), and the relative norm."""
    err = xp.abs(got - ref)
    bound = EPS_OUT * xp.abs(ref) + 2 * EPS_ACC * length * magnitude
    violations = xp.sum(xp.where(valid & ~(err <= bound), 1.0, 0.0))
    err_norm = xp.sqrt(xp.sum(xp.where(valid, err * err, 0.0)))
    ref_norm = xp.sqrt(xp.sum(xp.where(valid, ref * ref, 0.0)))
    return dict(bound_violations=violations, rel_err=err_norm / xp.maximum(ref_norm, 1e-30))


def _group_rows(x, group_sizes, rows: int):
    """``[G, rows, ...]`` float32: group g's rows of ``x``, zero past its size; and the
    ``[G, rows]`` mask of real rows."""
    starts = jnp.cumsum(group_sizes) - group_sizes
    r = jnp.arange(rows, dtype=jnp.int32)
    valid = r[None, :] < group_sizes[:, None]
    index = jnp.where(valid, starts[:, None] + r[None, :], 0)
    return jnp.where(valid[..., None], x[index].astype(jnp.float32), 0.0), valid


_HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("rows",))
def _check_rows_device(got, a, w, group_sizes, *, rows: int):
    """``got [M, D]`` against each group's rows of ``a [M, C]`` times ``w[g]`` (``[C, D]``)."""
    a_g, valid = _group_rows(a, group_sizes, rows)
    got_g, _ = _group_rows(got, group_sizes, rows)
    w = w.astype(jnp.float32)
    ref = jnp.einsum("grc,gcd->grd", a_g, w, precision=_HIGHEST)
    magnitude = jnp.einsum("grc,gcd->grd", jnp.abs(a_g), jnp.abs(w), precision=_HIGHEST)
    return _errors(jnp, got_g, ref, magnitude, a.shape[1], valid[..., None])


@functools.partial(jax.jit, static_argnames=("rows",))
def _check_groups_device(got, a, b, group_sizes, *, rows: int):
    """``got [G, K, N]`` against each group's ``a_gᵀ b_g`` (zero for an empty group)."""
    a_g, _ = _group_rows(a, group_sizes, rows)
    b_g, _ = _group_rows(b, group_sizes, rows)
    ref = jnp.einsum("grk,grn->gkn", a_g, b_g, precision=_HIGHEST)
    magnitude = jnp.einsum("grk,grn->gkn", jnp.abs(a_g), jnp.abs(b_g), precision=_HIGHEST)
    length = jnp.maximum(group_sizes, 0)[:, None, None]
    return _errors(jnp, got.astype(jnp.float32), ref, magnitude, length, jnp.ones(got.shape, bool))


def _padded_rows(sizes: np.ndarray, mean: float) -> int:
    """The rows of a group in the device check: the largest group, or twice the mean if
    more, rounded up to a power of two (so that cases share the check's compilation)."""
    return 1 << (max(1, math.ceil(2 * mean), int(sizes.max())) - 1).bit_length()


def _host(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _check_rows_host(got, a, w, sizes: np.ndarray):
    got, a, w = _host(got), _host(a), _host(w)
    ref, magnitude = np.zeros(got.shape), np.zeros(got.shape)
    ends = np.cumsum(sizes)
    for g, (start, end) in enumerate(zip(ends - sizes, ends)):
        ref[start:end] = a[start:end] @ w[g]
        magnitude[start:end] = np.abs(a[start:end]) @ np.abs(w[g])
    valid = (np.arange(got.shape[0]) < ends[-1])[:, None]  # every row (the sizes sum to M)
    return _errors(np, got, ref, magnitude, a.shape[1], valid)


def _check_groups_host(got, a, b, sizes: np.ndarray):
    got, a, b = _host(got), _host(a), _host(b)
    ref, magnitude = np.zeros(got.shape), np.zeros(got.shape)
    ends = np.cumsum(sizes)
    for g, (start, end) in enumerate(zip(ends - sizes, ends)):
        ref[g] = a[start:end].T @ b[start:end]
        magnitude[g] = np.abs(a[start:end]).T @ np.abs(b[start:end])
    return _errors(np, got, ref, magnitude, sizes[:, None, None], np.ones(got.shape, bool))


_rel_err = jax.jit(rel_err)
_swap_last = jax.jit(lambda x: jnp.swapaxes(x, -1, -2))


def compare(got, expected, on_host: bool) -> float:
    """``||got - expected|| / ||expected||`` (jax.lax.ragged_dot's output against oxmoe's)."""
    if on_host:
        got, expected = _host(got), _host(expected)
        return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))
    return float(_rel_err(got, expected))


# -- the products -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Product:
    """One grouped product: its operands, oxmoe's call, jax.lax.ragged_dot's, its dense GEMM."""

    name: str
    """The case name's last part."""
    operands: Callable[[GemmShape], tuple[tuple[int, ...], tuple[int, ...]]]
    """The shapes of the two arrays it multiplies (group sizes come third)."""
    output: Callable[[GemmShape], tuple[int, ...]]
    oxmoe: Callable
    jax: Callable
    primitive: str
    oxmoe_call: str
    jax_call: str
    transposed: bool
    """Whether oxmoe reads rhs transposed (``rhs_transposed=True``)."""
    dense: str
    """The dense GEMM of the same FLOPs: a key of :data:`DENSE`."""
    layout: str
    """How rhs (the weights) is stored."""

    def check(self, got, a, b, group_sizes, sizes: np.ndarray, on_host: bool) -> dict:
        """oxmoe's output ``got`` of one input set ``(a, b, group_sizes)`` (``sizes`` on the
        host) against the reference: the errors of :data:`LIMITS`."""
        rows = _padded_rows(sizes, a.shape[0] / len(sizes))
        if self.primitive == BWD_PRIMITIVE:
            if on_host:
                return _check_groups_host(got, a, b, sizes)
            return _check_groups_device(got, a, b, group_sizes, rows=rows)
        w = _swap_last(b) if self.transposed else b  # [G, C, D] (a copy, untimed)
        if on_host:
            return _check_rows_host(got, a, w, sizes)
        return _check_rows_device(got, a, w, group_sizes, rows=rows)


PRODUCTS = (
    Product("fwd", operands=lambda s: ((s.m, s.k), (s.groups, s.k, s.n)), output=lambda s: (s.m, s.n),
            oxmoe=_oxmoe_fwd, jax=_jax_fwd, primitive=FWD_PRIMITIVE, oxmoe_call="ragged_dot(lhs, rhs, gs)",
            jax_call="jax.lax.ragged_dot(lhs, rhs, gs)", transposed=False, dense="fwd", layout="[G,K,N]"),
    Product("dlhs", operands=lambda s: ((s.m, s.n), (s.groups, s.k, s.n)), output=lambda s: (s.m, s.k),
            oxmoe=_oxmoe_dlhs, jax=_jax_dlhs, primitive=FWD_PRIMITIVE,
            oxmoe_call="ragged_dot(dout, rhs, gs, rhs_transposed=True)",
            jax_call="jax.vjp of jax.lax.ragged_dot, d lhs", transposed=True, dense="dlhs", layout="[G,K,N]"),
    Product("drhs", operands=lambda s: ((s.m, s.k), (s.m, s.n)), output=lambda s: (s.groups, s.k, s.n),
            oxmoe=_oxmoe_drhs, jax=_jax_drhs, primitive=BWD_PRIMITIVE,
            oxmoe_call="transposed_ragged_dot(lhs, dout, gs)",
            jax_call="jax.vjp of jax.lax.ragged_dot, d rhs", transposed=False, dense="drhs", layout="[G,K,N]"),
    Product("fwd [G,N,K]", operands=lambda s: ((s.m, s.k), (s.groups, s.n, s.k)), output=lambda s: (s.m, s.n),
            oxmoe=_oxmoe_fwd_nk, jax=_jax_fwd_nk, primitive=FWD_PRIMITIVE,
            oxmoe_call="ragged_dot(lhs, rhs, gs, rhs_transposed=True)",
            jax_call="jax.lax.ragged_dot_general(lhs, rhs, gs), rhs contracting dim 2", transposed=True,
            dense="fwd", layout="[G,N,K]"),
)

#: The dense GEMMs: ``(a, b)`` shapes of ``jnp.dot(a, b)``, by product.
DENSE = {
    "fwd": lambda s: ((s.m, s.k), (s.k, s.n)),
    "dlhs": lambda s: ((s.m, s.n), (s.n, s.k)),
    "drhs": lambda s: ((s.k, s.m), (s.m, s.n)),
}


#: One jit per timed function (a case's input sets differ from another's in values only, so
#: the draws of a shape share its compilations).
_rotated = functools.cache(timing.rotated)


def _nbytes(*shapes) -> int:
    return sum(math.prod(shape) for shape in shapes) * DTYPE.itemsize


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One grouped product at one shape and one draw of the group sizes."""

    shape: GemmShape
    draw: Draw
    product: Product

    @property
    def name(self) -> str:
        return f"{self.shape.name} {self.draw.name} {self.product.name}"

    @property
    def flops(self) -> int:
        return 2 * self.shape.m * self.shape.k * self.shape.n

    @property
    def bytes(self) -> int:
        """Each operand read once, the output written once (bf16; group sizes not counted)."""
        return _nbytes(*self.product.operands(self.shape), self.product.output(self.shape))

    def info(self) -> dict:
        s, p = self.shape, self.product
        return dict(op="transposed_ragged_dot" if p.primitive == BWD_PRIMITIVE else "ragged_dot",
                    product=p.name, layout=p.layout, dtype=DTYPE.name, m=s.m, k=s.k, n=s.n, groups=s.groups,
                    model=s.name, draw=self.draw.name, alpha=ALPHA, empty_groups=self.draw.num_empty(s.groups),
                    oxmoe_call=p.oxmoe_call, jax_call=p.jax_call,
                    dense_call="jnp.dot({} x {})".format(*(list(x) for x in DENSE[p.dense](s))))

    def draw_set(self, seed: int, n: int):
        """Input set ``n``: ``(a, b, group sizes)`` on the device, the sizes also on the host."""
        crc = zlib.crc32(self.name.encode())
        sizes = self.draw.sizes(np.random.default_rng((seed, crc, n, 0)), self.shape.m, self.shape.groups)
        random = timing.RandomArrays(seed, crc, n)
        a_shape, b_shape = self.product.operands(self.shape)
        return (random.normal(a_shape, DTYPE), random.normal(b_shape, DTYPE), jnp.asarray(sizes)), sizes


def cases(shapes) -> list[GemmCase]:
    return [GemmCase(shape, draw, product) for shape in shapes for draw in DRAWS for product in PRODUCTS]


# -- running a case -----------------------------------------------------------------

def is_out_of_memory(error: BaseException) -> bool:
    """Whether XLA ran out of device memory (at compilation or at run time)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _num_sets(settings: timing.Settings, bytes_per_call: int, set_bytes: int) -> int:
    """R as :func:`oxmoe.bench.cases.run_case` takes it: for the L2 cache, within the memory cap."""
    return min(settings.num_sets(bytes_per_call), max(1, settings.memory_bytes // set_bytes))


def _check_calls(label: str, run, arg_sets, primitive: str, expected: int, excluded=()) -> int:
    """Checks that a timed jit calls ``primitive`` once per input set and nothing in ``excluded``."""
    counts = timing.primitive_counts(run, arg_sets)
    if counts[primitive] != expected:
        raise CheckFailed(f"the timed {label} function calls {primitive} {counts[primitive]} times, "
                          f"expected {expected} (one per input set)")
    found = sorted(p for p in excluded if counts[p])
    if found:
        raise CheckFailed(f"the timed {label} function contains {', '.join(found)}")
    return counts[primitive]


def measure_within(run, arg_sets, settings: timing.Settings, budget_s: float) -> timing.Timing:
    """:func:`timing.measure` of a jit that has run once, with fewer samples (3 at least, no
    warm-up beyond the first call) when ``settings`` would take more than ``budget_s`` seconds."""
    start = time.perf_counter()
    jax.block_until_ready(run(arg_sets))
    per_call = time.perf_counter() - start
    if (settings.warmup + 2 + settings.repeats) * per_call > budget_s:
        settings = dataclasses.replace(settings, warmup=0,
                                       repeats=max(3, min(settings.repeats, int(budget_s / per_call) - 2)))
    return timing.measure(run, arg_sets, settings)


OOM = "OOM"


def baseline_failure(error: BaseException) -> tuple[str | None, str]:
    """jax.lax.ragged_dot's error as ``(result, text)``: ``"OOM"`` when it ran out of
    device memory, else None (an error). Neither fails the case."""
    return (OOM if is_out_of_memory(error) else None), error_text(error)


def time_baseline(run, arg_sets, settings: timing.Settings) -> tuple[timing.Timing | str | None, str | None]:
    """Times jax.lax.ragged_dot's jit, which has run once (within :data:`RAGGED_DOT_BUDGET_S`):
    ``(Timing, None)``, or :func:`baseline_failure` of its error."""
    try:
        return measure_within(run, arg_sets, settings, RAGGED_DOT_BUDGET_S), None
    except Exception as e:  # noqa: BLE001 - the baseline's failure is a result, not the case's
        return baseline_failure(e)


@dataclasses.dataclass
class GemmResult:
    case: GemmCase
    oxmoe: timing.Timing | None = None
    dense: Dense | None = None
    jax: timing.Timing | str | None = None
    """jax.lax.ragged_dot's timing, ``"OOM"``, or None (not run, or an error: :attr:`jax_error`)."""
    jax_error: str | None = None
    jax_rel_err: float | None = None
    """Worst ``||jax.lax.ragged_dot - oxmoe|| / ||oxmoe||`` over the input sets (information only)."""
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    primitive_calls: int | None = None
    set_bytes: int | None = None
    group_sizes: list[str] = dataclasses.field(default_factory=list)
    """Each input set's group sizes, space-separated."""
    failure: str | None = None


LIMITS = dict(bound_violations=0, rel_err=MAX_REL_ERR)


def _worst(errors: dict[str, float], new: dict) -> None:
    for name, value in new.items():
        value = float(value)
        if name not in errors or math.isnan(value) or value > errors[name]:
            errors[name] = value


@dataclasses.dataclass(frozen=True)
class Dense:
    """The dense GEMM of a shape and product: its timing, the bytes of one input set, and
    which GEMM XLA compiled it to (``cublas``, ``triton`` or, e.g. on a CPU, ``other``)."""

    timing: timing.Timing
    set_bytes: int
    kernel: str


def _gemm_kind(hlo: str) -> str:
    kinds = [name for name, marker in (("cublas", "__cublas"), ("triton", "__triton")) if marker in hlo]
    return "+".join(kinds) or "other"


class DenseTimes:
    """The dense GEMMs of a run, each timed once (per shape and product) on its own input sets."""

    def __init__(self):
        self._done: dict[tuple[GemmShape, str], Dense] = {}

    def get(self, shape: GemmShape, key: str, settings: timing.Settings, seed: int = 0) -> Dense:
        if (shape, key) not in self._done:
            a_shape, b_shape = DENSE[key](shape)
            set_bytes = _nbytes(a_shape, b_shape) + 2 * _nbytes((a_shape[0], b_shape[1]))
            num_sets = _num_sets(settings, _nbytes(a_shape, b_shape, (a_shape[0], b_shape[1])), set_bytes)
            stream = zlib.crc32(f"dense {shape} {key}".encode())
            sets = []
            for n in range(num_sets):
                random = timing.RandomArrays(seed, stream, n)
                sets.append((random.normal(a_shape, DTYPE), random.normal(b_shape, DTYPE)))
            run = _rotated(_dense)
            _check_calls("dense", run, sets, DENSE_PRIMITIVE, num_sets)
            compiled = run.lower(sets).compile()
            self._done[shape, key] = Dense(timing.measure(compiled, sets, settings), set_bytes,
                                           _gemm_kind(compiled.as_text()))
        return self._done[shape, key]


def run_case(case: GemmCase, settings: timing.Settings, dense: DenseTimes, seed: int = 0) -> GemmResult:
    """Checks oxmoe against the reference on every input set, then times oxmoe,
    jax.lax.ragged_dot and the dense GEMM. A failure is returned in the result, not raised."""
    result = GemmResult(case)
    p = case.product
    try:
        first, first_sizes = case.draw_set(seed, 0)
        out_bytes = _nbytes(p.output(case.shape))
        # The two operands (group sizes aside) and two outputs: the check holds oxmoe's and
        # jax.lax.ragged_dot's outputs of every set at once.
        result.set_bytes = _nbytes(*p.operands(case.shape)) + 2 * out_bytes
        num_sets = _num_sets(settings, case.bytes, result.set_bytes)
        drawn = [(first, first_sizes)] + [case.draw_set(seed, n) for n in range(1, num_sets)]
        arg_sets = [args for args, _ in drawn]
        result.group_sizes = [" ".join(map(str, sizes)) for _, sizes in drawn]

        ox_run, jax_run = _rotated(p.oxmoe), _rotated(p.jax)
        other = BWD_PRIMITIVE if p.primitive == FWD_PRIMITIVE else FWD_PRIMITIVE
        result.primitive_calls = _check_calls("oxmoe", ox_run, arg_sets, p.primitive, num_sets, (other,))
        _check_calls("jax.lax.ragged_dot", jax_run, arg_sets, JAX_PRIMITIVE, num_sets)

        ox_outs = ox_run(arg_sets)
        on_host = case.flops <= HOST_CHECK_MAX_FLOPS
        for out, (args, sizes) in zip(ox_outs, drawn):
            _worst(result.errors, p.check(out, *args, sizes, on_host))
        bad = [f"{name} = {value:.3g} (limit {LIMITS[name]:.3g})"
               for name, value in result.errors.items() if not value <= LIMITS[name]]
        if bad:
            raise CheckFailed("oxmoe disagrees with the float32 reference: " + "; ".join(bad))

        # jax.lax.ragged_dot's outputs next to oxmoe's (information: it is a baseline, not checked).
        try:
            jax_outs = jax_run(arg_sets)
            result.jax_rel_err = max(compare(out, ox, on_host) for out, ox in zip(jax_outs, ox_outs))
            del jax_outs
        except Exception as e:  # noqa: BLE001 - see baseline_failure
            result.jax, result.jax_error = baseline_failure(e)
        del ox_outs

        result.oxmoe = timing.measure(ox_run, arg_sets, settings)
        if result.jax_error is None:
            result.jax, result.jax_error = time_baseline(jax_run, arg_sets, settings)
        del arg_sets, drawn, first
        result.dense = dense.get(case.shape, p.dense, settings, seed)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others' numbers
        result.failure = failure_text(e)
    return result


# -- the report ---------------------------------------------------------------------

class Summary:
    """The derived numbers of one case: TFLOP/s, the ratios, the goal."""

    def __init__(self, result: GemmResult, judge_goals: bool = True):
        self.result = result
        case, ox, jx = result.case, result.oxmoe, result.jax
        dense = result.dense.timing if result.dense else None
        timed = result.failure is None and ox is not None
        self.tflops = case.flops / ox.median_s / 1e12 if timed else None
        self.dense_tflops = case.flops / dense.median_s / 1e12 if timed and dense else None
        self.ratio = self.tflops / self.dense_tflops if self.dense_tflops else None
        self.goal_met = self.ratio >= MIN_FRACTION_OF_DENSE if self.ratio is not None and judge_goals else None
        jax_timed = timed and isinstance(jx, timing.Timing)
        self.jax_tflops = case.flops / jx.median_s / 1e12 if jax_timed else jx if timed else None
        self.jax_ratio = jx.median_s / ox.median_s if jax_timed else None

    def jax_cell(self) -> str:
        r = self.result
        if isinstance(r.jax, timing.Timing):
            return format_tflops(r.case.flops, r.jax.median_s)
        return r.jax or "error"

    def row(self) -> list[str]:
        r = self.result
        if r.failure:
            return [r.case.name, "FAILED"] + [""] * 6
        return [r.case.name, format_us(r.oxmoe.median_s), format_tflops(r.case.flops, r.oxmoe.median_s),
                format_tflops(r.case.flops, r.dense.timing.median_s), f"{100 * self.ratio:.0f}%",
                "-" if self.goal_met is None else "ok" if self.goal_met else "MISS", self.jax_cell(),
                f"{self.jax_ratio:.1f}x" if self.jax_ratio is not None else "-"]

    def log_line(self) -> str:
        r = self.result
        jax_text = (f"jax.lax.ragged_dot {format_us(r.jax.median_s)} us ({self.jax_cell()} TFLOP/s, "
                    f"{len(r.jax.samples_s)} samples)" if isinstance(r.jax, timing.Timing)
                    else f"jax.lax.ragged_dot {self.jax_cell()}"
                    + (f": {r.jax_error[:300]}" if r.jax_error else ""))
        return (f"    oxmoe {format_us(r.oxmoe.median_s)} us ({format_tflops(r.case.flops, r.oxmoe.median_s)} TFLOP/s, "
                f"{100 * self.ratio:.0f}% of dense {format_tflops(r.case.flops, r.dense.timing.median_s)}), {jax_text}, "
                f"R={r.oxmoe.num_sets}, {r.oxmoe.calls_per_sample} call(s) x {len(r.oxmoe.samples_s)} samples, "
                f"{r.set_bytes / 1e6:.1f} MB per set")

    def to_json(self) -> dict:
        r, case = self.result, self.result.case
        jax_json = r.jax.to_json() if isinstance(r.jax, timing.Timing) else r.jax
        return dict(
            name=case.name, family=FAMILY_NAME, **case.info(), flops=case.flops, bytes=case.bytes,
            oxmoe=r.oxmoe.to_json() if r.oxmoe else None, tflops=self.tflops,
            dense=dict(**r.dense.timing.to_json(), kernel=r.dense.kernel) if r.dense else None,
            dense_tflops=self.dense_tflops,
            ratio_to_dense=self.ratio, goals=dict(dense=self.goal_met),
            ragged_dot=jax_json, ragged_dot_tflops=self.jax_tflops, ragged_dot_error=r.jax_error,
            ratio_to_ragged_dot=self.jax_ratio,
            check=dict(passed=r.failure is None, errors=r.errors, limits=LIMITS, primitive=case.product.primitive,
                       primitive_calls=r.primitive_calls, ragged_dot_rel_err_to_oxmoe=r.jax_rel_err),
            group_sizes=r.group_sizes, device_bytes_per_set=r.set_bytes,
            dense_device_bytes_per_set=r.dense.set_bytes if r.dense else None,
            failure=r.failure)


_HEADER = ["case", "oxmoe us", "TFLOP/s", "dense TFLOP/s", "% dense", f">={100 * MIN_FRACTION_OF_DENSE:g}% dense",
           "ragged_dot TFLOP/s", "x ragged_dot"]


class Report(OwnCasesReport):
    """The family's runner and results: one :class:`Summary` per case run, its goals line
    and table (what :mod:`oxmoe.bench.__main__` prints and writes)."""

    run_case = staticmethod(run_case)
    summary = Summary
    new_shared = DenseTimes

    def _goals(self) -> list[bool]:
        return [s.goal_met for s in self.summaries if s.goal_met is not None]

    def _jax(self, outcome) -> list[Summary]:
        return [s for s in self.summaries if not s.result.failure and outcome(s)]

    def goals_line(self) -> str:
        goals = self._goals()
        faster = self._jax(lambda s: s.jax_ratio is not None and s.jax_ratio > 1)
        timed = self._jax(lambda s: s.jax_ratio is not None)
        oom = self._jax(lambda s: s.result.jax == OOM)
        errors = self._jax(lambda s: s.result.jax is None)
        if self.smoke:
            return (f"{self.family.name} goals {NOT_JUDGED} (>= {100 * MIN_FRACTION_OF_DENSE:g}% of a dense bf16 "
                    f"GEMM's TFLOP/s); jax.lax.ragged_dot (OOM {len(oom)}, error {len(errors)}); "
                    f"failed cases {len(self.failed)}")
        return (f"{self.family.name} goals met: >= {100 * MIN_FRACTION_OF_DENSE:g}% of a dense bf16 GEMM's TFLOP/s "
                f"{sum(goals)}/{len(goals)}; faster than jax.lax.ragged_dot {len(faster)}/{len(timed)} "
                f"(OOM {len(oom)}, error {len(errors)}); failed cases {len(self.failed)}")

    def table(self) -> str:
        return text_table([_HEADER] + [s.row() for s in self.summaries])

    def to_json(self) -> dict:
        goals = self._goals()
        return dict(sizes=self.family.sizes(self.smoke),
                    goals=dict(min_fraction_of_dense=MIN_FRACTION_OF_DENSE),
                    goals_met=dict(dense=[sum(goals), len(goals)]),
                    ragged_dot_oom=[s.result.case.name for s in self._jax(lambda s: s.result.jax == OOM)],
                    failed=[r.case.name for r in self.failed],
                    cases=[s.result.case.name for s in self.summaries])


def _sizes(smoke: bool) -> str:
    shapes = SMOKE_SHAPES if smoke else SHAPES
    return (", ".join(f"{s.m}x{s.k}x{s.n}/{s.groups}" for s in shapes)
            + f" (MxKxN/G), bf16, group sizes Dirichlet(alpha={ALPHA:g})")


FAMILY_NAME = "grouped_gemm"
FAMILY = Family(name=FAMILY_NAME, goals=None,
                cases=lambda smoke: cases(SMOKE_SHAPES if smoke else SHAPES),
                sizes=_sizes, report=lambda smoke: Report(FAMILY, smoke))
