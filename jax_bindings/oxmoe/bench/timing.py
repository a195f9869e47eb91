"""Timing device work from JAX: many calls of one op per jit, the copy ceiling.

The router's kernels take 10-100 us while a jitted call costs 20-50 us of
Python dispatch and synchronisation, so timing one op per call measures the
host. Instead:

- :func:`rotated` builds one jit that applies the op to ``R`` different input
  sets in sequence (fenced by optimization barriers, so XLA neither fuses nor
  overlaps the ``R`` calls) and returns every output (nothing is dead code).
  ``R`` sets that together exceed the L2 cache (:meth:`Settings.num_sets`)
  make each call read its inputs from device memory, as it would in a model.
- :func:`measure` times that jit: a sample dispatches it back to back until at
  least ``min_sample_s`` has passed and blocks once at the end, so dispatch
  overlaps the device work of the previous call; the reported time per op is
  the median sample over ``R``.
- :func:`copy_ceiling` measures the device-to-device copy bandwidth in the same
  process: the ceiling that byte counts are compared against.
- :class:`ClockSampler` records each NVIDIA GPU's SM clock and board power while
  :func:`measure` times (``nvidia-smi`` every 50 ms): an H200 runs the layer's
  training steps at its 700 W limit, its clock lowered by the power cap, so a step's
  time follows its energy, and an A/B of two steps says which ran at which clock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class Settings:
    """How hard to time: sample counts, the size of a sample, the input sets."""

    repeats: int
    """Timed samples per op; the median is reported."""
    warmup: int
    """Untimed calls after the first (compilation) call."""
    min_sample_s: float
    """A sample repeats the call until it has lasted at least this long."""
    working_set_bytes: int
    """The input sets of one jit together move at least this many bytes (several
    times the L2 cache), within ``min_sets``..``max_sets``."""
    min_sets: int
    max_sets: int
    copy_bytes: int
    """Size of the array the copy ceiling copies (read once, written once)."""
    memory_bytes: int
    """Device memory the input sets of one case may hold together (their arrays and both
    implementations' outputs): a case whose sets are large gets fewer than ``min_sets``
    (at least one). XLA's temporaries and the copy ceiling's array come on top."""

    def num_sets(self, bytes_per_call: int) -> int:
        """How many input sets one timed jit rotates through."""
        wanted = math.ceil(self.working_set_bytes / max(bytes_per_call, 1))
        return max(self.min_sets, min(self.max_sets, wanted))


#: For a GPU: an H200 has a 60 MB L2, so the R sets of a jit move >= 512 MB (R = 4..64);
#: the sets of a case hold at most 30 GiB (a DeepSeek-V3 dispatch writes 4.2 GB a call:
#: R = 3 of them, with oxmoe's and plain JAX's outputs), so that with XLA's temporaries
#: a run stays within about 40 GB of device memory.
FULL = Settings(repeats=30, warmup=3, min_sample_s=10e-3, working_set_bytes=512 << 20,
                min_sets=4, max_sets=64, copy_bytes=1 << 30, memory_bytes=30 << 30)
#: For CI on a small CPU: runs every code path once or twice, in seconds.
SMOKE = Settings(repeats=3, warmup=1, min_sample_s=0.0, working_set_bytes=0,
                 min_sets=2, max_sets=2, copy_bytes=8 << 20, memory_bytes=4 << 30)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per op call: the median sample, and the spread of the samples."""

    median_s: float
    min_s: float
    max_s: float
    num_sets: int
    """R, the op calls in one jit call."""
    calls_per_sample: int
    """Jit calls dispatched back to back in one sample."""
    samples_s: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return dict(median_us=self.median_s * 1e6, min_us=self.min_s * 1e6, max_us=self.max_s * 1e6,
                    num_sets=self.num_sets, calls_per_sample=self.calls_per_sample,
                    samples_us=[s * 1e6 for s in self.samples_s])


def nbytes(*trees) -> int:
    """Bytes of every array (or ShapeDtypeStruct) in ``trees`` at its dtype (bool = 1 byte)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(trees))


#: Arrays of up to this many elements are drawn on the host (nothing to compile:
#: what a small CPU run wants), larger ones on the device (fast: what a GPU run wants).
HOST_DRAW_MAX_ELEMENTS = 1 << 22


@functools.partial(jax.jit, static_argnums=(1, 2))
def _device_normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1,))
def _softmax_rows(x, dtype):
    return jax.nn.softmax(x, axis=-1).astype(dtype)


class RandomArrays:
    """Fresh random arrays on the default device, reproducible from a seed.

    Each call draws from its own stream (the seed and the call's number), so
    the arrays of one input set are independent of each other.
    """

    def __init__(self, *seed: int):
        self._seed = tuple(seed)
        self._calls = 0

    def _stream(self) -> tuple[int, ...]:
        self._calls += 1
        return (*self._seed, self._calls)

    def normal(self, shape, dtype, scale: float = 1.0) -> jax.Array:
        """Standard normal values times ``scale``, drawn in float32 and rounded to ``dtype``."""
        shape, stream = tuple(shape), self._stream()
        if math.prod(shape) <= HOST_DRAW_MAX_ELEMENTS:
            x = np.random.default_rng(stream).standard_normal(shape, np.float32)
            return jnp.asarray((x * np.float32(scale)).astype(dtype))
        key = jax.random.key(stream[0])
        for part in stream[1:]:
            key = jax.random.fold_in(key, part)
        x = _device_normal(key, shape, jnp.dtype(dtype))
        return x if scale == 1.0 else (x * scale).astype(dtype)

    def probabilities(self, shape, dtype) -> jax.Array:
        """Rows that sum to 1: the softmax of normal logits, rounded to ``dtype``."""
        x = self.normal(shape, jnp.float32)
        if x.size <= HOST_DRAW_MAX_ELEMENTS:
            x = np.asarray(x)
            p = np.exp(x - x.max(-1, keepdims=True))
            return jnp.asarray((p / p.sum(-1, keepdims=True)).astype(dtype))
        return _softmax_rows(x, jnp.dtype(dtype))

    def integers(self, low: int, high: int, shape, dtype=jnp.int32) -> jax.Array:
        """Uniform integers in ``[low, high)`` (drawn on the host)."""
        rng = np.random.default_rng(self._stream())
        return jnp.asarray(rng.integers(low, high, shape).astype(dtype))

    def distinct_choices(self, rows: int, high: int, k: int) -> np.ndarray:
        """``[rows, k]`` int32 on the host: each row ``k`` distinct uniform integers of
        ``[0, high)``, increasing (e.g. a random top-k routing's expert ids)."""
        rng = np.random.default_rng(self._stream())
        chosen = np.argpartition(rng.random((rows, high), np.float32), k - 1, axis=1)[:, :k]
        return np.sort(chosen, axis=1).astype(np.int32)

    def counts(self, total: int, bins: int) -> np.ndarray:
        """``[bins]`` int32 on the host: ``total`` items thrown uniformly into ``bins`` bins."""
        rng = np.random.default_rng(self._stream())
        return rng.multinomial(total, np.full(bins, 1.0 / bins)).astype(np.int32)


def rotated(fn: Callable) -> Callable:
    """``jit(arg_sets -> [fn(*args) for args in arg_sets])``, the calls strictly in sequence.

    ``arg_sets`` is a sequence of argument tuples (pytrees of arrays, e.g. a
    ``jax.vjp`` function and its cotangent). Each call's arguments pass through
    an optimization barrier together with the previous call's outputs, so call
    ``i + 1`` cannot start before call ``i`` has finished and no fusion spans two
    calls: the jit's time is the sum of ``R`` standalone op times.
    """

    def run(arg_sets):
        outs = []
        for args in arg_sets:
            if outs:
                outs[-1], args = jax.lax.optimization_barrier((outs[-1], tuple(args)))
            outs.append(fn(*args))
        return outs

    return jax.jit(run)


def measure(run: Callable, arg_sets: Sequence, settings: Settings, clocks: ClockSampler | None = None) -> Timing:
    """Times ``run(arg_sets)`` (a :func:`rotated` jit); returns seconds per op call.

    The first call (compilation, and oxmoe's kernel compilation at first use)
    and ``settings.warmup`` more are not timed. ``clocks`` samples the GPUs'
    clocks and power over the timed samples only.
    """
    num_sets = len(arg_sets)
    for _ in range(1 + settings.warmup):
        jax.block_until_ready(run(arg_sets))
    start = time.perf_counter()
    jax.block_until_ready(run(arg_sets))
    per_call = time.perf_counter() - start
    calls = max(1, min(1000, math.ceil(settings.min_sample_s / max(per_call, 1e-9))))

    samples = []
    with clocks if clocks is not None else contextlib.nullcontext():
        for _ in range(settings.repeats):
            start = time.perf_counter()
            for _ in range(calls):
                out = run(arg_sets)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - start) / (calls * num_sets))
            del out
    return Timing(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples),
                  num_sets=num_sets, calls_per_sample=calls, samples_s=tuple(samples))


#: ``clocks_event_reasons.active``'s bit for the software power cap (nvidia-smi).
POWER_CAP_REASON = 0x4


@dataclasses.dataclass(frozen=True)
class GpuClocks:
    """One GPU's SM clock and board power over a measurement (medians of nvidia-smi's samples)."""

    index: int
    sm_mhz: float
    max_sm_mhz: float
    power_w: float
    power_limit_w: float
    power_capped: float
    """The share of the samples whose clock the software power cap held down."""
    samples: int

    def describe(self) -> str:
        return (f"GPU {self.index}: SM clock {self.sm_mhz:.0f} of {self.max_sm_mhz:.0f} MHz, {self.power_w:.0f} of "
                f"{self.power_limit_w:.0f} W, power-capped in {self.power_capped:.0%} of {self.samples} samples")


def gpu_clocks(limits: str, samples: str) -> list[GpuClocks]:
    """Each GPU's :class:`GpuClocks` from nvidia-smi's CSV (no header, no units): ``limits``
    rows ``index, clocks.max.sm, power.limit``; ``samples`` rows ``index, clocks.sm,
    power.draw, clocks_event_reasons.active`` (the reasons in hex). Rows that do not parse
    (a GPU's "[N/A]") are left out."""
    def rows(text: str, width: int) -> list[list[str]]:
        return [fields for line in text.splitlines() if len(fields := [f.strip() for f in line.split(",")]) == width]

    maxima = {}
    for index, max_mhz, limit_w in rows(limits, 3):
        try:
            maxima[int(index)] = (float(max_mhz), float(limit_w))
        except ValueError:
            continue
    taken = collections.defaultdict(list)
    for index, mhz, watts, reasons in rows(samples, 4):
        try:
            taken[int(index)].append((float(mhz), float(watts), int(reasons, 16) & POWER_CAP_REASON != 0))
        except ValueError:
            continue
    return [GpuClocks(index=index, sm_mhz=statistics.median(m for m, _, _ in got),
                      max_sm_mhz=maxima[index][0], power_w=statistics.median(w for _, w, _ in got),
                      power_limit_w=maxima[index][1], power_capped=sum(c for _, _, c in got) / len(got),
                      samples=len(got))
            for index, got in sorted(taken.items()) if index in maxima]


class ClockSampler:
    """Samples every NVIDIA GPU's SM clock, power and clock-event reasons every 50 ms
    (``nvidia-smi``, in a subprocess) while its ``with`` block runs. ``result`` is then one
    :class:`GpuClocks` a GPU, or empty where ``nvidia-smi`` is not installed (a CPU machine)."""

    INTERVAL_MS = 50

    def __init__(self) -> None:
        self.result: list[GpuClocks] = []
        self._smi = shutil.which("nvidia-smi")
        self._process: subprocess.Popen | None = None
        self._limits = ""

    def __enter__(self) -> ClockSampler:
        if self._smi is not None:
            self._limits = subprocess.run([self._smi, "--query-gpu=index,clocks.max.sm,power.limit",
                                           "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            self._process = subprocess.Popen(
                [self._smi, "--query-gpu=index,clocks.sm,power.draw,clocks_event_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", str(self.INTERVAL_MS)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *_) -> None:
        if self._process is None:
            return
        self._process.terminate()
        samples, _ = self._process.communicate()
        self.result = gpu_clocks(self._limits, samples)

    def describe(self) -> str:
        """A clause a GPU (those that drew power above a third of their limit, the busy ones;
        all where none did), or "" without samples."""
        busy = [c for c in self.result if c.power_w > c.power_limit_w / 3] or self.result
        return "; ".join(c.describe() for c in busy)


@dataclasses.dataclass(frozen=True)
class CopyCeiling:
    """The device-to-device copy: ``bytes`` read plus written per call."""

    bytes: int
    timing: Timing

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.timing.median_s

    def to_json(self) -> dict[str, Any]:
        return dict(bytes=self.bytes, gb_per_s=self.bytes_per_s / 1e9, **self.timing.to_json())


def copy_ceiling(settings: Settings) -> CopyCeiling:
    """Measures the copy bandwidth with a jitted ``x * 2`` over ``settings.copy_bytes`` of float32.

    The result is a new array that is returned, so XLA must read every input
    element and write every output element once: ``2 * copy_bytes`` per call.
    """
    x = RandomArrays(0).normal((settings.copy_bytes // 4,), jnp.float32)
    timing = measure(rotated(lambda x: x * 2), [(x,)], settings)
    return CopyCeiling(bytes=2 * nbytes(x), timing=timing)


def primitive_counts(fn: Callable, *args) -> collections.Counter:
    """How often each primitive occurs in ``fn``'s jaxpr, nested jaxprs included.

    Used to show that a timed function contains what it claims to time (e.g. a
    backward without its forward).
    """
    counts: collections.Counter = collections.Counter()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts
