"""What every benchmark family shares: a case, its check against plain JAX, running it.

A family (:mod:`oxmoe.bench.router`, :mod:`oxmoe.bench.permutation`) is a list
of :class:`Case` objects and its :class:`Goals`. :func:`run_case` runs one case:
it draws the case's input sets, checks that each timed function is what it
claims to be (its jaxpr calls the oxmoe primitive once per input set and holds
no excluded primitive), compares oxmoe's outputs with plain JAX's on every set
(a disagreement fails the case, which is then not timed), and times both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from oxmoe.bench import timing


@dataclasses.dataclass(frozen=True)
class Goals:
    """A family's goals: time within ``max_x_floor`` of the byte floor, and at least
    ``min_speedup`` times faster than plain JAX (for the cases with ``speedup_goal``)."""

    max_x_floor: float
    min_speedup: float
    floor_text: str
    """The floor goal in words, for the goals line."""
    speedup_text: str
    """The speedup goal in words, for the goals line."""
    floor_column: str
    """The table header of the floor goal's column."""

    @classmethod
    def fraction_of_copy(cls, min_fraction: float, min_speedup: float, speedup_text: str) -> Goals:
        """The goals of a kernel that moves bytes: at least ``min_fraction`` of the copy
        bandwidth (time within ``1 / min_fraction`` of the byte floor), and ``min_speedup``."""
        return cls(max_x_floor=1 / min_fraction, min_speedup=min_speedup,
                   floor_text=(f"time <= {1 / min_fraction:.3g}x byte floor "
                               f"(>= {100 * min_fraction:g}% of copy bandwidth)"),
                   speedup_text=speedup_text, floor_column=f">={100 * min_fraction:g}% copy")

    @property
    def speedup_column(self) -> str:
        return f">={self.min_speedup:g}x jax"

    def to_json(self) -> dict[str, Any]:
        return dict(max_x_floor=self.max_x_floor, min_fraction_of_copy=1 / self.max_x_floor,
                    min_speedup=self.min_speedup)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("oxmoe", "plain", "context"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class Inputs:
    """One input set of a case: the arguments of each implementation."""

    oxmoe: tuple
    plain: tuple
    context: Any = None
    """What the comparison needs besides the outputs (e.g. the forward's routing maps)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed op: oxmoe's and plain JAX's versions, their inputs, their check."""

    name: str
    bytes: int
    """The fewest bytes the op moves: each input read once, each output written once."""
    draw: Callable[[timing.RandomArrays], tuple]
    """One input set's arrays, fresh random data."""
    prepare: Callable[..., Inputs] | None
    """The arrays of :attr:`draw` -> each implementation's arguments (a backward's
    ``jax.vjp`` functions: its forward runs here, untimed); None: both take the arrays."""
    oxmoe: Callable
    plain: Callable
    compare: Callable[[Any, Any, Any], dict]
    """(oxmoe outputs, plain outputs, context) of one set -> named errors."""
    limits: dict[str, float]
    """The largest acceptable value of each error."""
    primitive: str
    """The oxmoe primitive the timed oxmoe function calls, once per input set."""
    excluded: tuple[str, ...] = ()
    """Primitives neither timed function may contain (a backward's forward)."""
    speedup_goal: bool = True
    """Whether the family's speedup goal over plain JAX applies."""
    jit_prepare: bool = True
    """Run :attr:`prepare` under ``jax.jit`` (one compiled call; the drawn arrays reach
    it at their dtype). False: eagerly, op by op, so that arguments it passes through
    (and ``jax.vjp`` residuals that are inputs) stay the drawn buffers instead of
    becoming copies: for cases whose input sets take gigabytes."""
    info: dict = dataclasses.field(default_factory=dict)


def apply_vjp(vjp, cotangent):
    """The first input's cotangent: a timed backward of one differentiable input."""
    return vjp(cotangent)[0]


def apply_vjp_all(vjp, cotangent):
    """Every input's cotangent: a timed backward of several differentiable inputs."""
    return vjp(cotangent)


def rel_err(actual, expected, rows=None):
    """``||actual - expected|| / ||expected||`` over all rows, or the rows where ``rows``."""
    actual, expected = actual.astype(jnp.float32), expected.astype(jnp.float32)
    if rows is not None:
        actual = jnp.where(rows[:, None], actual, 0.0)
        expected = jnp.where(rows[:, None], expected, 0.0)
    return jnp.linalg.norm(actual - expected) / jnp.maximum(jnp.linalg.norm(expected), 1e-30)


# -- running a case --------------------------------------------------------------

class CheckFailed(Exception):
    """oxmoe and plain JAX disagree, or a timed function is not what it claims to be."""


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: Case
    oxmoe: timing.Timing | None = None
    plain: timing.Timing | None = None
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    """The largest value of each comparison error over the input sets."""
    primitive_calls: int | None = None
    """How often the timed oxmoe jit calls ``case.primitive`` (checked: R)."""
    set_bytes: int | None = None
    """Device bytes one input set is counted to hold (see :func:`_set_bytes`)."""
    failure: str | None = None


def _check_timed_function(label: str, run, arg_sets, case: Case, calls_expected: int | None) -> int:
    """Checks the jaxpr of a timed jit: the op R times, no excluded primitive; returns the
    op's primitive count."""
    counts = timing.primitive_counts(run, arg_sets)
    if calls_expected is not None and counts[case.primitive] != calls_expected:
        raise CheckFailed(f"the timed {label} function calls {case.primitive} {counts[case.primitive]} "
                          f"times, expected {calls_expected} (one per input set)")
    found = sorted(p for p in case.excluded if counts[p])
    if found:
        raise CheckFailed(f"the timed {label} function contains {', '.join(found)}: "
                          "it would time more than the op")
    return counts[case.primitive]


def _worst_errors(case: Case, ox_outs, plain_outs, contexts) -> dict[str, float]:
    """The worst value of each comparison error over the input sets."""
    worst: dict[str, float] = {}
    for ox, plain, context in zip(ox_outs, plain_outs, contexts):
        for name, value in case.compare(ox, plain, context).items():
            value = float(value)
            if name not in worst or math.isnan(value) or value > worst[name]:  # NaN is the worst
                worst[name] = value
    return worst


def _check_limits(case: Case, errors: dict[str, float]) -> None:
    bad = [f"{name} = {value:.3g} (limit {case.limits[name]:.3g})"
           for name, value in errors.items() if not value <= case.limits[name]]
    if bad:
        raise CheckFailed("oxmoe and plain JAX disagree: " + "; ".join(bad))


def _buffer_key(x):
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - not a single-buffer array: count it by object
        return id(x)


def _set_bytes(case: Case, inputs: Inputs) -> int:
    """Device bytes one input set holds at the worst moment of :func:`run_case`.

    Its arrays (each buffer once: an argument both implementations take, or a ``jax.vjp``
    residual that is an input, counts once), plus twice the larger of the two
    implementations' outputs: the check holds oxmoe's and plain JAX's outputs of every
    set at once, and a timing sample dispatches a jit while the previous call's outputs
    may still exist. XLA's temporaries (one set at a time) are not counted.
    """
    buffers = {_buffer_key(x): x for x in jax.tree_util.tree_leaves(inputs) if hasattr(x, "dtype")}
    outputs = [timing.nbytes(jax.eval_shape(fn, *args))
               for fn, args in ((case.oxmoe, inputs.oxmoe), (case.plain, inputs.plain))]
    return timing.nbytes(list(buffers.values())) + 2 * max(outputs)


def run_case(case: Case, settings: timing.Settings, seed: int = 0) -> CaseResult:
    """Checks oxmoe against plain JAX on the case's input sets, then times both.

    The number of input sets R is :meth:`timing.Settings.num_sets` of the case's bytes,
    lowered (to 1 at least) so that R sets fit in ``settings.memory_bytes``.
    A failure (an exception, a disagreement) is returned in the result, not raised.
    """
    errors: dict[str, float] = {}
    primitive_calls = set_bytes = None
    try:
        # The drawn arrays exist at their dtype before anything uses them: drawn in the
        # same jit, XLA could skip the rounding to bf16 for the plain-JAX consumer (and
        # not for oxmoe's custom call), and the two would route different logits.
        if case.prepare is None:
            prepare = lambda *arrays: Inputs(arrays, arrays)  # noqa: E731
        else:
            prepare = jax.jit(case.prepare) if case.jit_prepare else case.prepare

        def input_set(n: int) -> Inputs:
            return prepare(*case.draw(timing.RandomArrays(seed, zlib.crc32(case.name.encode()), n)))

        inputs = [input_set(0)]
        set_bytes = _set_bytes(case, inputs[0])
        num_sets = min(settings.num_sets(case.bytes), max(1, settings.memory_bytes // set_bytes))
        inputs += [input_set(n) for n in range(1, num_sets)]
        ox_sets, plain_sets = [i.oxmoe for i in inputs], [i.plain for i in inputs]
        ox_run, plain_run = timing.rotated(case.oxmoe), timing.rotated(case.plain)
        primitive_calls = _check_timed_function("oxmoe", ox_run, ox_sets, case, num_sets)
        _check_timed_function("plain JAX", plain_run, plain_sets, case, None)
        errors = _worst_errors(case, ox_run(ox_sets), plain_run(plain_sets), [i.context for i in inputs])
        _check_limits(case, errors)
        del inputs
        ox_timing = timing.measure(ox_run, ox_sets, settings)
        plain_timing = timing.measure(plain_run, plain_sets, settings)
        return CaseResult(case, ox_timing, plain_timing, errors, primitive_calls, set_bytes)
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others' numbers
        return CaseResult(case, errors=errors, primitive_calls=primitive_calls, set_bytes=set_bytes,
                          failure=failure_text(e))


@dataclasses.dataclass(frozen=True)
class Family:
    """A benchmark family: its cases at full or smoke size, and its goals."""

    name: str
    goals: Goals | None
    """None for a family with its own :attr:`report`."""
    cases: Callable[[bool], list[Case]]
    """``smoke -> cases`` in the order they run."""
    sizes: Callable[[bool], str]
    """``smoke -> the sizes in words`` (e.g. ``T=65536``), for the table's heading."""
    report: Callable[[bool], Any] | None = None
    """A family whose cases are not timed against a byte floor and plain JAX (e.g.
    :mod:`oxmoe.bench.grouped_gemm`) runs them itself: ``smoke ->`` an :class:`OwnCasesReport`, with
    ``run(case, settings, log)`` and what ``__main__.FamilyReport`` has (``summaries``,
    ``failed``, ``heading()``, ``goals_line()``, ``table()``, ``to_json()``).
    None: :func:`run_case` runs each case, ``__main__`` prints the byte-floor table."""


#: The goals line of a smoke run: its sizes are too small for a goal to mean anything.
NOT_JUDGED = "not judged at smoke sizes"


def family_heading(family: Family, smoke: bool) -> str:
    """The line above a family's goals and table: its name and sizes."""
    return f"{family.name}: {family.sizes(smoke)}{' (smoke)' if smoke else ''}"


class OwnCasesReport:
    """Base of the report of a family that runs its own cases (:attr:`Family.report`).

    :meth:`run` runs a case with the subclass's ``run_case(case, settings, shared)``, keeps its
    ``summary(result)`` and logs its line; ``shared``, made by the subclass's ``new_shared()``,
    lives for the whole run (the GEMM families' dense timings, measured once per shape).
    Subclasses add ``goals_line()``, ``table()`` and ``to_json()``.
    """

    run_case: Callable
    summary: Callable
    new_shared: Callable

    def __init__(self, family: Family, smoke: bool):
        self.family, self.smoke, self.shared = family, smoke, self.new_shared()
        self.summaries: list = []

    def run(self, case, settings: timing.Settings, log: Callable[[str], None]) -> None:
        result = self.run_case(case, settings, self.shared)
        summary = self.summary(result, judge_goals=not self.smoke)
        self.summaries.append(summary)
        log(f"    FAILED: {result.failure}" if result.failure else summary.log_line())

    @property
    def failed(self) -> list:
        return [s.result for s in self.summaries if s.result.failure]

    def heading(self) -> str:
        return family_heading(self.family, self.smoke)


def error_text(error: BaseException, limit: int = 2000) -> str:
    """The error in one line, its start and end if long (an XLA error ends with its cause)."""
    lines = traceback.format_exception_only(type(error), error)
    text = " ".join(line.strip() for line in lines)
    return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"


def failure_text(error: BaseException) -> str:
    """How a case that stopped reads in its result: a failed check, or the error that stopped it."""
    return f"check failed: {error}" if isinstance(error, CheckFailed) else error_text(error)


def format_us(seconds: float) -> str:
    """Microseconds with about four significant digits."""
    us = seconds * 1e6
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 10_000 else f"{us:,.0f}"


def format_gbps(bytes_per_s: float) -> str:
    """GB/s with two decimals below 10, none above."""
    gb = bytes_per_s / 1e9
    return f"{gb:.2f}" if gb < 10 else f"{gb:.0f}"


def format_tflops(flops: int, seconds: float) -> str:
    value = flops / seconds / 1e12
    return f"{value:.3g}" if value < 1 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def text_table(rows: list[list[str]]) -> str:
    """``rows`` (the first one the header) as an aligned plain-text table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
