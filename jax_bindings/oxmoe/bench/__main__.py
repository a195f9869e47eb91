"""Runs oxmoe's benchmarks on the default JAX device: tables, every number and a chart.

    python -m oxmoe.bench [--smoke] [--out DIR] [--only NAME ...] [--list]

Measures, in one run on one device: the copy bandwidth (the ceiling), then per
case of each family (router, permutation, activation) oxmoe's time and plain JAX's, per
case of the grouped GEMM family oxmoe's TFLOP/s, a dense GEMM's and
jax.lax.ragged_dot's, and per case of the MoE layer family (moe_layer) a training
step's TFLOP/s, the dense GEMMs' and the plain-JAX layer's (its expert-parallel
case runs over 4 devices when JAX has them: on a machine without a GPU, the benchmark
splits the CPU into 4 virtual devices, as the training job does, unless XLA_FLAGS sets
--xla_force_host_platform_device_count).
Progress goes to stderr: a log line per step, and on a terminal a live bar of the
cases done under them. The run writes every number to DIR/results.json and a chart
to DIR/chart.png (DIR: ./oxmoe-bench unless --out): per case oxmoe's and the
plain-JAX baseline's speed as a fraction of the ceiling measured in the same run
(copy bandwidth; dense GEMM of the same FLOPs), with each family's goal. The chart
needs matplotlib, the bar rich: pip install 'oxmoe[tools]'.
The results tables are the last thing on stdout, one per family, each after its
goals line. The exit status is 1 if any case failed (an error, or oxmoe
disagreeing with plain JAX or with the reference); a missed goal is a result, not
a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import sys

import jax
import jaxlib

import oxmoe
from oxmoe.bench import cases as bench_cases
from oxmoe.bench import activation, chart, grouped_gemm, moe, permutation, router, timing
from oxmoe._progress import Progress

#: The benchmark families, in the order they run.
FAMILIES = (router.FAMILY, permutation.FAMILY, activation.FAMILY, grouped_gemm.FAMILY, moe.FAMILY)
#: What a run writes to its --out folder.
RESULTS_FILE, CHART_FILE = "results.json", "chart.png"


def _mb(num_bytes: int) -> str:
    mb = num_bytes / 1e6
    return f"{mb:.3f}" if mb < 1 else f"{mb:.2f}" if mb < 100 else f"{mb:.0f}"


def _mark(met: bool | None) -> str:
    return "-" if met is None else "ok" if met else "MISS"


class Summary:
    """The derived numbers of one case: bandwidth, floor, speedup, goals."""

    def __init__(self, family: bench_cases.Family, result: bench_cases.CaseResult, copy: timing.CopyCeiling,
                 judge_goals: bool = True):
        case, goals = result.case, family.goals
        self.family = family
        self.result = result
        self.floor_s = case.bytes / copy.bytes_per_s
        ox, plain = result.oxmoe, result.plain
        self.bytes_per_s = case.bytes / ox.median_s if ox else None
        self.fraction_of_copy = self.bytes_per_s / copy.bytes_per_s if ox else None
        self.x_floor = ox.median_s / self.floor_s if ox else None
        self.speedup = plain.median_s / ox.median_s if ox and plain else None
        self.floor_met = self.x_floor <= goals.max_x_floor if ox and judge_goals else None
        self.speedup_met = (self.speedup >= goals.min_speedup
                            if ox and plain and case.speedup_goal and judge_goals else None)

    def row(self) -> list[str]:
        r, case = self.result, self.result.case
        if r.failure:
            return [case.name, "FAILED", _mb(case.bytes)] + [""] * 7
        return [case.name, bench_cases.format_us(r.oxmoe.median_s), _mb(case.bytes),
                bench_cases.format_gbps(self.bytes_per_s),
                f"{100 * self.fraction_of_copy:.0f}%", f"{self.x_floor:.2f}x", bench_cases.format_us(r.plain.median_s),
                f"{self.speedup:.1f}x", _mark(self.floor_met), _mark(self.speedup_met)]

    def log_line(self) -> str:
        r = self.result
        return (f"    oxmoe {bench_cases.format_us(r.oxmoe.median_s)} us ({self.x_floor:.2f}x floor), "
                f"plain JAX {bench_cases.format_us(r.plain.median_s)} us, R={r.oxmoe.num_sets}, "
                f"{r.oxmoe.calls_per_sample} call(s) x {len(r.oxmoe.samples_s)} samples"
                + (f", {_mb(r.set_bytes)} MB per set" if r.set_bytes else ""))

    def to_json(self) -> dict:
        r, case = self.result, self.result.case
        return dict(
            name=case.name, family=self.family.name, **case.info, bytes=case.bytes,
            floor_us=self.floor_s * 1e6,
            oxmoe=r.oxmoe.to_json() if r.oxmoe else None,
            plain_jax=r.plain.to_json() if r.plain else None,
            gb_per_s=self.bytes_per_s / 1e9 if self.bytes_per_s else None,
            fraction_of_copy=self.fraction_of_copy, x_floor=self.x_floor, speedup=self.speedup,
            goals=dict(floor=self.floor_met, speedup=self.speedup_met),
            check=dict(passed=r.failure is None, errors=r.errors, limits=case.limits,
                       primitive=case.primitive, primitive_calls=r.primitive_calls,
                       excluded_primitives=list(case.excluded)),
            device_bytes_per_set=r.set_bytes,
            failure=r.failure)


def _header(goals: bench_cases.Goals) -> list[str]:
    return ["case", "oxmoe us", "MB", "GB/s", "% copy", "x floor", "plain us", "speedup",
            goals.floor_column, goals.speedup_column]


class FamilyReport:
    """One family's summaries: its goals line and its table."""

    def __init__(self, family: bench_cases.Family, smoke: bool, summaries: list[Summary]):
        self.family, self.smoke, self.summaries = family, smoke, summaries
        self.failed = [s.result for s in summaries if s.result.failure]
        self.floor = [s.floor_met for s in summaries if s.floor_met is not None]
        self.speedup = [s.speedup_met for s in summaries if s.speedup_met is not None]

    def heading(self) -> str:
        return bench_cases.family_heading(self.family, self.smoke)

    def goals_line(self) -> str:
        goals = self.family.goals
        if self.smoke:
            return (f"{self.family.name} goals {bench_cases.NOT_JUDGED} ({goals.floor_text}; {goals.speedup_text}); "
                    f"failed cases {len(self.failed)}")
        return (f"{self.family.name} goals met: {goals.floor_text} {sum(self.floor)}/{len(self.floor)}; "
                f"{goals.speedup_text} {sum(self.speedup)}/{len(self.speedup)}; failed cases {len(self.failed)}")

    def table(self) -> str:
        return bench_cases.text_table([_header(self.family.goals)] + [s.row() for s in self.summaries])

    def to_json(self) -> dict:
        return dict(sizes=self.family.sizes(self.smoke), goals=self.family.goals.to_json(),
                    goals_met=dict(floor=[sum(self.floor), len(self.floor)],
                                   speedup=[sum(self.speedup), len(self.speedup)]),
                    failed=[r.case.name for r in self.failed],
                    cases=[s.result.case.name for s in self.summaries])


def _copy_line(copy: timing.CopyCeiling) -> str:
    gbps, t = bench_cases.format_gbps, copy.timing
    return (f"copy ceiling: {_mb(copy.bytes)} MB read + written in {bench_cases.format_us(t.median_s)} us = "
            f"{gbps(copy.bytes_per_s)} GB/s (median of {len(t.samples_s)}, "
            f"{gbps(copy.bytes / t.max_s)}..{gbps(copy.bytes / t.min_s)})")


def _describe_device(device) -> str:
    return f"{device.device_kind} ({device.platform})"


def _peak_bytes(device) -> int | None:
    """The most device memory in use at once so far in this process (None: not reported,
    e.g. on CPU)."""
    try:
        return (device.memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None


#: The XLA flag that sets the CPU's device count; where the user gives it, the benchmark keeps it.
HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _virtual_cpu_devices() -> None:
    """On the CPU, as many virtual devices as the largest expert-parallel case uses, as the
    training job does: only the CPU backend reads this, before any backend starts (a GPU run
    times the GPU; the other cases use the first device)."""
    if HOST_DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", max(layer.devices for layer in moe.LAYERS + moe.SMOKE_LAYERS))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxmoe.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (" + "; ".join(f"{f.name}: {f.sizes(True)}" for f in FAMILIES)
                        + ") and few repetitions: checks that it runs")
    parser.add_argument("--out", type=pathlib.Path, metavar="DIR", default=pathlib.Path("oxmoe-bench"),
                        help=f"write every number to DIR/{RESULTS_FILE} and the chart to DIR/{CHART_FILE} "
                             "(default: %(default)s)")
    parser.add_argument("--only", action="append", metavar="NAME", default=[],
                        help="run the cases whose name (or family) contains NAME (repeatable), "
                             "e.g. 'deepseek', 'topk bwd', 'permutation', 'grouped_gemm', 'moe_layer'")
    parser.add_argument("--list", action="store_true", help="list the case names and exit")
    args = parser.parse_args(argv)
    _virtual_cpu_devices()

    settings = timing.SMOKE if args.smoke else timing.FULL
    selected = []  # (family, its cases)
    for family in FAMILIES:
        cases = family.cases(args.smoke)
        if args.only:
            cases = [c for c in cases if any(name in c.name or name == family.name for name in args.only)]
        if cases:
            selected.append((family, cases))
    if not selected:
        parser.error(f"no case name contains any of {args.only}; see --list")
    if args.list:
        print("\n".join(c.name for _, cases in selected for c in cases))
        return 0

    total = sum(len(cases) for _, cases in selected)
    try:
        chart.matplotlib_figure()  # missing: fail now, not after the measurements
        progress = Progress(total, "cases")
    except ImportError as e:
        sys.exit(f"python -m oxmoe.bench: {e}")

    device = jax.devices()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    environment = (f"oxmoe {oxmoe.build_id()} on {_describe_device(device)}, jax {jax.__version__}"
                   f"{', smoke' if args.smoke else ''}, {started:%Y-%m-%d %H:%M} UTC")
    with progress:
        log = progress.log
        log(f"oxmoe benchmark: {environment}")

        progress.running("copy ceiling")
        log(f"[copy] {settings.copy_bytes >> 20} MiB float32 x * 2 ...")
        copy = timing.copy_ceiling(settings)
        copy_line = _copy_line(copy)
        log("    " + copy_line)

        reports = []
        n = 0
        for family, cases in selected:
            log(f"{family.name} ({family.sizes(args.smoke)}): {len(cases)} cases")
            own = family.report(args.smoke) if family.report is not None else None
            summaries = []
            for case in cases:
                n += 1
                progress.running(case.name)
                log(f"[{n}/{total}] {case.name} ...")
                if own is not None:  # a family with its own runner, progress lines and table
                    own.run(case, settings, log)
                else:
                    result = bench_cases.run_case(case, settings)
                    summary = Summary(family, result, copy, judge_goals=not args.smoke)
                    summaries.append(summary)
                    log(f"    FAILED: {result.failure}" if result.failure else summary.log_line())
                peak = _peak_bytes(device)
                if peak is not None:
                    log(f"    peak device memory so far {peak / 1e9:.1f} GB")
                progress.advance()
            reports.append(own if own is not None else FamilyReport(family, args.smoke, summaries))

        report = dict(
            benchmark="oxmoe", device=device.device_kind, platform=device.platform,
            jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
            oxmoe_build_id=oxmoe.build_id(), date=started.isoformat(), smoke=args.smoke,
            settings=dataclasses.asdict(settings), copy=copy.to_json(), device_peak_bytes=_peak_bytes(device),
            families={r.family.name: r.to_json() for r in reports},
            cases=[s.to_json() for r in reports for s in r.summaries])
        args.out.mkdir(parents=True, exist_ok=True)
        results_path, chart_path = args.out / RESULTS_FILE, args.out / CHART_FILE
        results_path.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {results_path}")
        progress.running("chart")
        chart.write_chart(report, chart_path)
        log(f"wrote {chart_path}")

    print(f"oxmoe benchmark: {environment}")
    print(copy_line)
    for r in reports:
        print()
        print(r.heading())
        for failed in r.failed:
            print(f"FAILED {failed.case.name}: {failed.failure[:400]}")
        print(r.goals_line())
        print(r.table())
    return 1 if any(r.failed for r in reports) else 0


def run_from_command_line() -> int:
    """``main()``, quiet when stdout's reader stops early (``python -m oxmoe.bench --list | head``)."""
    try:
        status = main()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # Python's recipe: point stdout at /dev/null so that the flush at exit raises nothing either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(run_from_command_line())
