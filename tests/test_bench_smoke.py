"""`python -m oxmoe.bench --smoke` runs every case of every family (router, permutation,
activation, grouped_gemm, moe_layer), finds oxmoe in agreement with plain JAX (grouped_gemm: with the
float32 reference) on each, times it and its baselines, writes every number (results.json) and a
chart of each case against the device's ceiling (chart.png) to its output folder, and prints
one table per family.

The benchmark runs in a subprocess, as CI and a user run it: from this checkout's
`jax_bindings` (the benchmark is not part of an installed package), with the native
library this test process loaded, on the default device (on a CPU machine the four virtual
devices the benchmark makes itself, not the eight that conftest.py sets up for the sharding
tests, so the moe_layer family's expert-parallel case runs there too; on a GPU machine the
GPU).
"""

import dataclasses
import io
import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oxmoe
from oxmoe import _library
from oxmoe.bench import __main__ as bench_main
from oxmoe.bench import chart
from oxmoe.bench import grouped_gemm as bench_gemm
from oxmoe.bench import moe as bench_moe
from oxmoe.bench import timing
from oxmoe.model_shapes import GemmShape

ROOT = pathlib.Path(__file__).resolve().parent.parent

MODELS = ("deepseek_v3", "qwen3_moe", "mixtral")
EXPECTED_CASES = {
    "router": (
        [f"{model} bf16 {op} {direction}" for model in MODELS for op in ("topk", "scores")
         for direction in ("fwd", "bwd")]
        + ["deepseek_v3 f32 topk fwd", "deepseek_v3 f32 topk bwd"]
        + [f"aux_loss E={e} {dtype} {direction}" for e in (256, 1024, 2048) for dtype in ("bf16", "f32")
           for direction in ("fwd", "bwd")]),
    "permutation": (
        [f"{model} bf16 {op}{align} {direction}" for model in ("deepseek_v3", "mixtral")
         for align in ("", " align=128") for op in ("dispatch", "combine") for direction in ("fwd", "bwd")]
        + ["deepseek_v3 ep=8 bf16 sort_chunks fwd", "deepseek_v3 ep=8 bf16 sort_chunks bwd"]),
    "activation": [f"{model} bf16 swiglu {op}" for model in ("mixtral", "qwen3_30b_a3b", "deepseek_v3")
                   for op in ("bwd", "bwd fp8", "fwd fp8")],
}
#: The grouped GEMM family's cases: per shape and draw of the group sizes, the forward, both
#: backward products and the forward with [G, N, K] weights.
GEMM_SHAPES = {"mixtral up": 8, "qwen3_30b_a3b up": 128, "deepseek_v3 ep=8 up": 32, "deepseek_v3 ep=8 down": 32}
GEMM_PRODUCTS = ("fwd", "dlhs", "drhs", "fwd [G,N,K]")
GEMM_CASES = [f"{shape} {draw} {product}" for shape in GEMM_SHAPES for draw in ("a=4", "a=4 empty=10%")
              for product in GEMM_PRODUCTS]
#: The oxmoe primitive each family's timed functions call (a backward may call another op's).
PRIMITIVES = {
    "router": {"oxmoe_topk_fwd", "oxmoe_topk_bwd", "oxmoe_aux_loss_scores_fwd", "oxmoe_aux_loss_scores_bwd",
               "oxmoe_aux_loss_fwd", "oxmoe_aux_loss_bwd"},
    "permutation": {"oxmoe_dispatch_fwd", "oxmoe_combine_fwd", "oxmoe_combine_bwd", "oxmoe_sort_chunks"},
    "activation": {"oxmoe_activation_bwd", "oxmoe_fp8_activation_bwd", "oxmoe_fp8_activation"},
}


def run_bench(*args: str, host_devices: int | None = None) -> subprocess.CompletedProcess:
    """The benchmark in a subprocess; ``host_devices``: on that many CPU devices, the CPU the
    default backend even on a GPU machine (default: the benchmark's own choice)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "jax_bindings"), env.get("PYTHONPATH")) if p)
    env["OXMOE_LIBRARY"] = str(_library.library_path().resolve())
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    if host_devices is not None:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={host_devices}"
        env["JAX_PLATFORMS"] = "cpu"
    # On a GPU machine this test process may hold most of the GPU's memory already.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return subprocess.run([sys.executable, "-m", "oxmoe.bench", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def read_report(result: subprocess.CompletedProcess, out: pathlib.Path) -> dict:
    """The results.json of a benchmark run that succeeded."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")
    return json.loads((out / "results.json").read_text())


@dataclasses.dataclass(frozen=True)
class SmokeRun:
    result: subprocess.CompletedProcess
    out: pathlib.Path
    """The --out folder."""
    report: dict


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> SmokeRun:
    """The whole smoke run, once for the tests that read it; --out a folder not yet there."""
    out = tmp_path_factory.mktemp("bench") / "runs" / "smoke"
    result = run_bench("--smoke", "--out", str(out))
    return SmokeRun(result, out, read_report(result, out))


def test_smoke_run_checks_and_times_every_case(smoke_run):
    result, report = smoke_run.result, smoke_run.report
    assert report["smoke"] is True
    assert report["oxmoe_build_id"] == oxmoe.build_id()
    assert report["jax_version"] == jax.__version__
    assert report["device"] and report["date"]
    assert report["copy"]["gb_per_s"] > 0 and report["copy"]["bytes"] > 0

    assert list(report["families"]) == [*EXPECTED_CASES, "grouped_gemm", "moe_layer"]
    for family, expected in EXPECTED_CASES.items():
        entry = report["families"][family]
        assert sorted(entry["cases"]) == sorted(expected), family
        assert entry["failed"] == []
        assert entry["goals"]["max_x_floor"] > 0 and entry["goals"]["min_speedup"] > 0
        # Smoke sizes are too small for the goals to mean anything: none is judged.
        assert entry["goals_met"] == {"floor": [0, 0], "speedup": [0, 0]}, family
    assert [case["name"] for case in report["cases"]] == [
        name for entry in report["families"].values() for name in entry["cases"]]

    for case in report["cases"]:
        name, family = case["name"], case["family"]
        if family in ("grouped_gemm", "moe_layer"):  # check_grouped_gemm_cases, check_moe_layer_cases
            continue
        assert name in EXPECTED_CASES[family], name
        assert case["failure"] is None, f"{name}: {case['failure']}"
        check = case["check"]
        assert check["passed"], name
        assert check["primitive"] in PRIMITIVES[family], name
        assert set(check["errors"]) == set(check["limits"]), name
        for error, value in check["errors"].items():
            assert 0 <= value <= check["limits"][error], f"{name}: {error} = {value}"
        num_sets = case["oxmoe"]["num_sets"]
        assert check["primitive_calls"] == num_sets, name
        for impl in ("oxmoe", "plain_jax"):
            timing = case[impl]
            assert 0 < timing["min_us"] <= timing["median_us"] <= timing["max_us"], f"{name} {impl}: {timing}"
            assert timing["num_sets"] == num_sets >= 1
        assert case["bytes"] > 0 and case["floor_us"] > 0 and case["gb_per_s"] > 0, name
        assert case["x_floor"] > 0 and case["speedup"] > 0, name
        assert case["goals"] == {"floor": None, "speedup": None}, name
        assert case["device_bytes_per_set"] > 0, name

    # The results tables are the last thing on stdout, one per family after a blank line:
    # its heading, its goals line, the table's header and rule, one row per case.
    blocks = result.stdout.rstrip().split("\n\n")[-len(report["families"]):]
    for block, (family, entry) in zip(blocks, report["families"].items()):
        lines = block.splitlines()
        assert lines[0].startswith(f"{family}: "), lines[0]
        assert lines[1].startswith(f"{family} goals not judged at smoke sizes ("), lines[1]
        assert " met" not in lines[1] and "MISS" not in block and " ok " not in block, block
        assert lines[2].split()[:3] == ["case", "oxmoe", "us"]
        rows = lines[4:4 + len(entry["cases"])]
        assert [line.split("  ")[0].strip() for line in rows] == entry["cases"]
        if family != "moe_layer":  # whose expert-parallel case's breakdown follows its table
            assert len(lines) == 4 + len(entry["cases"])

    check_grouped_gemm_cases(report)
    check_moe_layer_cases(report, blocks[-1], MOE_LAYER_CASES)
    if report["platform"] == "cpu":  # the benchmark's own 4 virtual CPU devices: the EP case runs too
        assert report["families"]["moe_layer"]["skipped"] == []

    # stderr is not a terminal here: plain log lines (no live bar), one per case in order,
    # and last the paths of what the run wrote.
    log = result.stderr.splitlines()
    assert "\x1b" not in result.stderr
    names = [case["name"] for case in report["cases"]]
    assert [line for line in log if re.match(r"\[\d+/\d+\] ", line)] == [
        f"[{n}/{len(names)}] {name} ..." for n, name in enumerate(names, 1)]
    assert log[-2:] == [f"wrote {smoke_run.out / 'results.json'}", f"wrote {smoke_run.out / 'chart.png'}"]


#: The goals of the issue, as fractions of each family's ceiling (router: within 2x the byte floor).
GOALS = {"router": 0.5, "permutation": 0.75, "activation": 0.75, "grouped_gemm": 0.8, "moe_layer": 0.6}


def _expected_chart_rows(report: dict) -> list[tuple]:
    """(family, case, oxmoe, baseline, goal) from a report's raw numbers: GB/s over the copy's
    GB/s, or TFLOP/s over the dense GEMMs' TFLOP/s; None where nothing was timed."""
    copy_gbps = report["copy"]["bytes"] / report["copy"]["median_us"] / 1e3
    rows = []
    for case in report["cases"]:
        family = case["family"]
        baseline = case["ragged_dot" if family == "grouped_gemm" else "plain_jax"]
        timings = [case["oxmoe"], baseline if isinstance(baseline, dict) else None]
        if family in ("router", "permutation", "activation"):
            fractions = [t and case["bytes"] / t["median_us"] / 1e3 / copy_gbps for t in timings]
        elif case["oxmoe"] is None:
            fractions = [None, None]
        else:
            dense_tflops = case["flops"] / case["dense"]["median_us"] / 1e6
            fractions = [t and case["flops"] / t["median_us"] / 1e6 / dense_tflops for t in timings]
        rows.append((family, case["name"], *fractions, GOALS[family]))
    return rows


def test_smoke_run_charts_each_case_against_its_ceiling(smoke_run):
    """chart.png: per case oxmoe's and the baseline's speed over the ceiling of the same run, the
    numbers of chart_rows; a PNG of the figure's size at its dpi, with room for every case."""
    report = smoke_run.report
    rows = chart.chart_rows(report)
    expected = _expected_chart_rows(report)
    assert [(row.family, row.case, row.goal) for row in rows] == [(f, c, goal) for f, c, _, _, goal in expected]
    for row, (_, _, *fractions, _) in zip(rows, expected):
        for got, want in zip((row.oxmoe_fraction, row.plain_fraction), fractions):
            assert got == (None if want is None else pytest.approx(want, rel=1e-9)), row.case
    assert all(row.oxmoe_fraction > 0 for row in rows if row.case != MOE_EP_CASE)

    png = (smoke_run.out / "chart.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    width_in, height_in = chart.figure_size(rows)
    assert abs(width - width_in * chart.DPI) < 1 and abs(height - height_in * chart.DPI) < 1
    assert height / len(rows) >= 36  # pixels per case's two bars: legible


def test_without_matplotlib_the_error_names_the_extra(monkeypatch, tmp_path):
    """No chart without matplotlib, and no run: the benchmark stops before it measures."""
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'oxmoe\[tools\]'"):
        chart.write_chart({}, tmp_path / "chart.png")
    with pytest.raises(SystemExit, match=r"matplotlib: pip install 'oxmoe\[tools\]'"):
        bench_main.main(["--smoke", "--only", "aux_loss", "--out", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_live_bar_under_the_log_lines(monkeypatch, tmp_path):
    """On a terminal the log lines print above a live bar of the cases done; the run writes to
    ./oxmoe-bench by default."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "160")  # the terminal's width: room for the bar and the case's name
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    name = "aux_loss E=256 bf16 fwd"
    assert bench_main.main(["--smoke", "--only", name]) == 0

    report = json.loads((tmp_path / "oxmoe-bench" / "results.json").read_text())
    assert [case["name"] for case in report["cases"]] == [name]
    assert (tmp_path / "oxmoe-bench" / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    screen = terminal.getvalue()
    assert "\x1b[" in screen  # drawn with escape codes
    lines = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).strip() for line in re.split(r"[\r\n]+", screen)]
    logged = [f"[1/1] {name} ...", "wrote oxmoe-bench/results.json", "wrote oxmoe-bench/chart.png"]
    assert [line for line in lines if line in logged] == logged
    bars = [line for line in lines if re.search(r"\d/1 cases", line)]  # cases done, elapsed, what runs
    assert any(re.search(rf"0/1 cases \d:\d\d:\d\d left \S+ {re.escape(name)}$", line) for line in bars), bars
    assert re.search(r"1/1 cases \d:\d\d:\d\d left \S+ done$", bars[-1]), bars[-1]


def _sizes(case: dict) -> list[np.ndarray]:
    return [np.array(sizes.split(), int) for sizes in case["group_sizes"]]


def check_grouped_gemm_cases(report: dict) -> None:
    """Every grouped GEMM case of a smoke run's report: oxmoe checked against the float32
    reference on every input set, timed next to the dense GEMM and jax.lax.ragged_dot;
    TFLOP/s and ratios consistent."""
    entry = report["families"]["grouped_gemm"]
    assert entry["cases"] == GEMM_CASES
    assert entry["failed"] == [] and entry["ragged_dot_oom"] == []
    assert entry["goals"] == {"min_fraction_of_dense": 0.8}
    cases = [case for case in report["cases"] if case["family"] == "grouped_gemm"]
    assert [case["name"] for case in cases] == GEMM_CASES
    assert entry["goals_met"]["dense"] == [0, 0]  # smoke sizes: no goal judged

    for case in cases:
        name, check = case["name"], case["check"]
        assert case["failure"] is None, f"{name}: {case['failure']}"
        assert check["passed"], name
        assert check["primitive"] == ("oxmoe_transposed_ragged_dot" if case["product"] == "drhs" else "oxmoe_ragged_dot")
        assert set(check["errors"]) == set(check["limits"]) == {"bound_violations", "rel_err"}, name
        assert check["errors"]["bound_violations"] == 0, name
        assert 0 < check["errors"]["rel_err"] <= check["limits"]["rel_err"], name
        # The two bf16 roundings of float32 sums (on a CPU the same sums, so often equal).
        assert 0 <= check["ragged_dot_rel_err_to_oxmoe"] < 2e-2, name

        flops = 2 * case["m"] * case["k"] * case["n"]
        assert case["flops"] == flops and case["groups"] == GEMM_SHAPES[case["model"]], name
        num_sets = case["oxmoe"]["num_sets"]
        assert check["primitive_calls"] == num_sets >= 1, name
        timings = {impl: case[impl] for impl in ("oxmoe", "dense", "ragged_dot")}
        for impl, t in timings.items():
            assert isinstance(t, dict), f"{name} {impl}: {t}"  # a smoke size never runs out of memory
            assert 0 < t["min_us"] <= t["median_us"] <= t["max_us"], f"{name} {impl}: {t}"
        assert timings["ragged_dot"]["num_sets"] == num_sets, name
        tflops = {impl: flops / (t["median_us"] * 1e-6) / 1e12 for impl, t in timings.items()}
        assert case["tflops"] == pytest.approx(tflops["oxmoe"]), name
        assert case["dense_tflops"] == pytest.approx(tflops["dense"]), name
        assert case["ragged_dot_tflops"] == pytest.approx(tflops["ragged_dot"]), name
        assert case["ratio_to_dense"] == pytest.approx(tflops["oxmoe"] / tflops["dense"]), name
        assert case["goals"]["dense"] is None, name
        assert case["ratio_to_ragged_dot"] == pytest.approx(tflops["oxmoe"] / tflops["ragged_dot"]), name
        assert case["device_bytes_per_set"] > 0 and case["dense_device_bytes_per_set"] > 0, name

        sizes = _sizes(case)
        assert len(sizes) == num_sets, name
        empty = max(1, round(0.1 * case["groups"])) if "empty=10%" in name else 0
        assert case["empty_groups"] == empty, name
        for s in sizes:
            assert len(s) == case["groups"] and s.sum() == case["m"], name
            assert (s == 0).sum() == empty and (s >= 0).all(), name


def test_only_grouped_gemm_lists_its_cases():
    result = run_bench("--only", "grouped_gemm", "--list")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines() == GEMM_CASES


def test_list_into_a_reader_that_stops_early_exits_quietly():
    # `python -m oxmoe.bench --list | head -1`: the reader is gone before the list is written.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "jax_bindings"),
                                                                   os.environ.get("PYTHONPATH")) if p),
               OXMOE_LIBRARY=str(_library.library_path().resolve()))
    bench = subprocess.Popen([sys.executable, "-m", "oxmoe.bench", "--list"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    bench.stdout.close()
    stderr = bench.stderr.read().decode()
    assert bench.wait(timeout=300) == 0, stderr
    assert stderr == "", stderr


#: A small shape whose cases the in-process tests run on the default device.
SMALL = GemmShape("small", m=200, k=48, n=40, groups=6)


@pytest.mark.parametrize("product", bench_gemm.PRODUCTS, ids=lambda p: p.name)
def test_grouped_gemm_check_catches_wrong_outputs(product):
    """The check passes oxmoe's output on the host (float64) and on the device (float32 padded
    groups), and fails an output one element of which is off by 4 bf16 ulps, or NaN, or, for
    d rhs, an empty group's block that is not zero."""
    case = bench_gemm.GemmCase(SMALL, bench_gemm.DRAWS[1], product)
    (a, b, group_sizes), sizes = case.draw_set(0, 0)
    assert (sizes == 0).sum() == 1 and sizes.sum() == SMALL.m
    out = product.oxmoe(a, b, group_sizes)

    def errors(got):
        host = product.check(got, a, b, group_sizes, sizes, on_host=True)
        device = product.check(got, a, b, group_sizes, sizes, on_host=False)
        return {k: float(v) for k, v in host.items()}, {k: float(v) for k, v in device.items()}

    for found in errors(out):
        assert found["bound_violations"] == 0 and 1e-4 < found["rel_err"] < 5e-3, found
    largest = np.unravel_index(np.argmax(np.abs(np.asarray(out, np.float32))), out.shape)
    wrong = [out.at[largest].multiply(1 + 4 * 2.0 ** -7), out.at[largest].set(jnp.nan)]
    if product.name == "drhs":
        wrong.append(out.at[int(np.argmax(sizes == 0)), 0, 0].set(1e-3))
    for got in wrong:
        for found in errors(got):
            assert not found["bound_violations"] <= bench_gemm.LIMITS["bound_violations"], found


def _raises_out_of_memory(x):
    raise MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 68719476736 bytes.")


def _ragged_dot_out_of_memory(lhs, rhs, group_sizes):
    """jax.lax.ragged_dot that fails at run time as XLA does when it runs out of device memory."""
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    zero = jax.pure_callback(_raises_out_of_memory, jax.ShapeDtypeStruct((), out.dtype), out[0, 0])
    return out + zero


def test_ragged_dot_out_of_memory_is_reported_not_failed():
    product = dataclasses.replace(bench_gemm.PRODUCTS[0], jax=_ragged_dot_out_of_memory)
    report = bench_gemm.Report(bench_gemm.FAMILY, smoke=True)
    logged = []
    report.run(bench_gemm.GemmCase(SMALL, bench_gemm.DRAWS[0], product), timing.SMOKE, logged.append)
    (summary,) = report.summaries
    assert report.failed == [] and summary.result.jax == "OOM", summary.result.jax_error
    assert "RESOURCE_EXHAUSTED" in summary.result.jax_error and "jax.lax.ragged_dot OOM" in logged[0]
    row = summary.row()
    assert row[6:] == ["OOM", "-"] and row[1] != "FAILED"
    case = summary.to_json()
    assert case["ragged_dot"] == case["ragged_dot_tflops"] == "OOM" and case["tflops"] > 0
    assert case["dense_tflops"] > 0 and case["ratio_to_ragged_dot"] is None
    assert report.to_json()["ragged_dot_oom"] == [case["name"]]
    assert "(OOM 1, error 0)" in report.goals_line()


# -- the moe_layer family --------------------------------------------------------------

MOE_LAYER_CASES = ["mixtral fwd+bwd", "qwen3_30b_a3b fwd+bwd", "deepseek_v3 ep=4 fwd+bwd"]
MOE_EP_CASE = "deepseek_v3 ep=4 fwd+bwd"
#: What the moe_layer check compares: both losses, the routing, y and every gradient.
MOE_LAYER_ERRORS = {"load_balancing_loss_rel_err", "z_loss_rel_err", "routing_mismatch",
                    "y_rel_err", "dx_rel_err", "dgate_rel_err", "dup_rel_err", "ddown_rel_err"}
#: The smoke EP layer: 64 tokens per device of H=64 on 4 devices, 64 experts each (two of
#: DeepSeek-V3's 8 groups), top-8 in the best 4 groups: a token reaches
#: 4 * (1 - C(6, 4) / C(8, 4)) = 3.14 devices, so a device sends round(64 * 3.14) = 201
#: (token, shard) rows, at most 51 to one device; the layer's only slot size is T = 64 (the
#: ladder's next size rounds up to it), so an all_to_all moves 4 x 64 rows of 64 bf16 = 32768
#: bytes, the rows the ring's gather moves: "auto" takes the ring.
EP_LAYER = bench_moe.SMOKE_LAYERS[2]
EP_EXCHANGE_ROWS, EP_SLOT, EP_WIRE_BYTES = 201, 64, 4 * 64 * 64 * 2
#: The expert-parallel case's breakdown: the step with exchange "auto" (the ring: the
#: all_to_all's one slot holds every token) and with each exchange the platform runs,
#: all_to_all's and the ring's with the tokens in 2 and in 4 chunks, then the forward, the
#: routing, one all_to_all exchange (none a step: "auto" takes the ring), off a CPU the
#: ragged_all_to_all exchange beside it, the layer on one device, and that layer data-parallel
#: over the 4 devices with its expert weights replicated and sharded, alone and two in
#: sequence; each with how many a step has.
_EP_STEPS = [("step (fwd+bwd), exchange 'auto' = 'ring'", 1), ("step (fwd+bwd), exchange 'all_to_all'", None),
             ("step (fwd+bwd), exchange 'ring'", None)]
_EP_CHUNKED = [(f"step (fwd+bwd), exchange {method!r}, token_chunks={chunks}", None)
               for chunks in (2, 4) for method in ("all_to_all", "ring")]
_EP_PIECES = [("forward", 1), ("routing forward (gate GEMM, oxmoe.router.topk)", 1),
              (f"all_to_all exchange: {EP_EXCHANGE_ROWS} x 64 bfloat16 (token, shard) rows in 4 x {EP_SLOT} slots, "
               f"{EP_WIRE_BYTES} bytes", None)]
_EP_ONE_DEVICE = [("1 device, E=64: step (fwd+bwd)", None), ("1 device, E=64: forward", None),
                  ("data=4, E=64 on each device, expert weights replicated: step (fwd+bwd)", None),
                  ("data=4, E=64 on each device, expert weights sharded over 'data': step (fwd+bwd)", None),
                  ("data=4, E=64 on each device, 2 layers, expert weights replicated: step (fwd+bwd)", None),
                  ("data=4, E=64 on each device, 2 layers, expert weights sharded over 'data': step (fwd+bwd)",
                   None)]
MOE_EP_PARTS = {
    "cpu": _EP_STEPS + _EP_CHUNKED + _EP_PIECES + _EP_ONE_DEVICE,
    "gpu": _EP_STEPS + [("step (fwd+bwd), exchange 'ragged_all_to_all'", None)] + _EP_CHUNKED + _EP_PIECES
    + [(f"ragged_all_to_all exchange: {EP_EXCHANGE_ROWS} x 64 bfloat16 (token, shard) rows", None)]
    + _EP_ONE_DEVICE}


def check_weight_sharding(parts: list[dict]) -> None:
    """Sharding the expert weights over the 4 data devices keeps 1/4 of them on a device; the
    step's peak saves 3/4 of them, less what it gathers at once (up's whole [E, H, 2F] at most).
    With two layers, twice the weights are saved."""
    single = EP_LAYER.one_device()
    experts = 2 * single.local_experts * single.hidden * (single.up_width + single.ffn)  # bf16 up and down
    up = 2 * single.local_experts * single.hidden * single.up_width
    for layers, (replicated, sharded) in ((1, parts[-4:-2]), (2, parts[-2:])):
        saved = layers * 3 * experts // 4
        assert replicated["argument_bytes_per_device"] - sharded["argument_bytes_per_device"] == saved, layers
        assert sharded["peak_bytes_per_device"] <= replicated["peak_bytes_per_device"] - saved + up, layers
    assert all(p["argument_bytes_per_device"] is None for p in parts[:-4])


def check_ep_exchanges(parts: list[dict], platform: str) -> None:
    """Every exchange's step was timed, with the cost model's bytes of the two it models and a
    peak memory that holds at least the step's arguments; "auto" is the ring (the all_to_all's
    one slot holds every token, though the model counts fewer bytes for it); the all_to_all
    exchange moves the bytes of its slots."""
    costs = bench_moe.moe.exchange.cost_model(EP_LAYER.config, 4, EP_LAYER.tokens, EP_LAYER.hidden)
    assert costs["all_to_all"] < costs["ring"]
    assert bench_moe.moe.exchange.sends_every_token(EP_LAYER.config, 4, EP_LAYER.tokens)
    steps = {p["exchange"]: p for p in parts if p["exchange"] is not None and "token_chunks" not in p["part"]}
    assert sorted(steps) == sorted(["auto", "all_to_all", "ring"] + (["ragged_all_to_all"] if platform == "gpu" else []))
    chunked = [p for p in parts if "token_chunks" in p["part"]]
    arguments = 2 * EP_LAYER.tokens * EP_LAYER.hidden * 2 + EP_LAYER.param_bytes()  # x, w and the parameters
    for method, part in [*steps.items(), *((p["exchange"], p) for p in chunked)]:
        assert 0 < part["min_us"] <= part["median_us"] <= part["max_us"], method
        assert part["cost_model_bytes_per_step"] == costs.get("ring" if method == "auto" else method), method
        # XLA:CPU gives a memory analysis; a platform without one reports None.
        peak = part["peak_bytes_per_device"]
        assert (peak is None and platform != "cpu") or peak >= arguments, (method, peak, arguments)
    assert steps["auto"]["peak_bytes_per_device"] == steps["ring"]["peak_bytes_per_device"]
    wire = [p["wire_bytes"] for p in parts]
    assert wire == [EP_WIRE_BYTES if p["part"].startswith("all_to_all exchange") else None for p in parts]
    assert EP_EXCHANGE_ROWS == round(EP_LAYER.tokens * bench_moe.moe.exchange.shards_per_token(EP_LAYER.config, 4))
    assert bench_moe.moe.exchange.slot_sizes(EP_LAYER.tokens, 4, EP_LAYER.config) == (EP_SLOT,)


def _expert_flops(case: dict) -> int:
    rows, h, f = case["tokens_per_device"] * case["topk"], case["hidden"], case["ffn"]
    return 3 * (2 * rows * h * 2 * f + 2 * rows * f * h)


def check_moe_layer_cases(report: dict, block: str, names: list[str]) -> None:
    """The moe_layer cases ``names`` of a smoke run's report and printed block: each one run
    is checked against the plain-JAX layer (every error measured and within a bf16 limit),
    timed next to its dense GEMMs (and on one device the plain-JAX layer), its TFLOP/s and
    ratios consistent; the expert-parallel one is skipped without 4 devices."""
    entry = report["families"]["moe_layer"]
    assert entry["cases"] == names
    assert entry["failed"] == [] and entry["plain_jax_oom"] == []
    assert entry["goals"] == {"min_fraction_of_dense": 0.6, "min_speedup": 5.0}
    cases = [case for case in report["cases"] if case["family"] == "moe_layer"]
    assert [case["name"] for case in cases] == names
    assert entry["skipped"] == [case["name"] for case in cases if case["skipped"]]
    assert entry["goals_met"]["dense"] == [0, 0]  # smoke sizes: no goal judged

    lines = block.splitlines()
    assert lines[1].startswith("moe_layer goals not judged at smoke sizes (>= 60% of the dense bf16 GEMMs' "
                               "TFLOP/s, >= 5x the plain-JAX layer)"), lines[1]
    assert lines[2].split("  ")[:1] == ["case"] and ">=60% dense" in lines[2] and "x plain JAX" in lines[2]
    rows = dict(zip(names, lines[4:4 + len(names)]))

    for case in cases:
        name, check, cells = case["name"], case["check"], rows[case["name"]].split()
        assert case["failure"] is None, f"{name}: {case['failure']}"
        if case["skipped"]:
            assert name == MOE_EP_CASE and case["skipped"].startswith("needs 4 devices"), case["skipped"]
            assert case["oxmoe"] is None and cells[-1] == "skipped"
            continue
        assert check["passed"], name
        expected = MOE_LAYER_ERRORS | ({"dexpert_bias_max_abs"} if case["use_expert_bias"] else set())
        assert set(check["errors"]) == set(check["limits"]) == expected, name
        for error, value in check["errors"].items():
            assert 0 <= value <= check["limits"][error] <= 2e-2, f"{name}: {error} = {value}"
        if case["use_expert_bias"]:
            assert check["limits"]["dexpert_bias_max_abs"] == 0
        # Single device: every token of every input set (plain JAX ran at full size); EP: a sample.
        tokens = case["tokens_per_device"] * case["devices"] if case["devices"] == 1 else 256
        assert check["tokens"] == tokens, name
        assert check["primitives_per_step"]["oxmoe_ragged_dot"] >= 1, name
        assert check["primitives_per_step"]["oxmoe_transposed_ragged_dot"] >= 1, name

        assert case["flops"] == _expert_flops(case), name
        ox, dense = case["oxmoe"], case["dense"]
        assert 0 < ox["min_us"] <= ox["median_us"] <= ox["max_us"], name
        assert sorted(dense["products"]) == sorted(f"{p} {d}" for p in ("up", "down") for d in ("fwd", "dlhs", "drhs"))
        assert dense["median_us"] == pytest.approx(sum(t["median_us"] for t in dense["products"].values()))
        assert case["tflops"] == pytest.approx(case["flops"] / (ox["median_us"] * 1e-6) / 1e12), name
        assert case["dense_tflops"] == pytest.approx(case["flops"] / (dense["median_us"] * 1e-6) / 1e12), name
        assert case["ratio_to_dense"] == pytest.approx(case["tflops"] / case["dense_tflops"]), name
        assert f"{100 * case['ratio_to_dense']:.0f}%" in cells, (name, cells)
        assert case["device_bytes_per_set"] > 0, name

        if case["devices"] == 1:
            plain = case["plain_jax"]
            assert isinstance(plain, dict), f"{name}: {plain}"  # a smoke size never runs out of memory
            assert 0 < plain["min_us"] <= plain["median_us"] <= plain["max_us"], name
            assert case["speedup"] == pytest.approx(plain["median_us"] / ox["median_us"]), name
            assert case["goals"]["dense"] is None, name
            assert cells[-4] == "-", (name, cells)
            assert case["breakdown"] == [] and case["device_rows"] is None, name
            # The layer keeps its up projection and the routing's bookkeeping, about the dense MLP's
            # input and up projection, and less than the plain-JAX layer, which keeps its sorted rows too.
            memory = case["memory"]
            bookkeeping = case["tokens_per_device"] * (case["num_experts"] * 5 + case["topk"] * 8) + 4096
            assert memory["oxmoe_saved"] <= memory["dense_mlp_saved"] + bookkeeping, (name, memory)
            assert memory["oxmoe_saved"] < memory["plain_saved"], (name, memory)
            assert memory["oxmoe_peak"] > memory["oxmoe_saved"] and memory["plain_peak"] > 0, (name, memory)
        else:
            assert case["plain_jax"] is None and case["speedup"] is None and case["goals"]["dense"] is None, name
            parts = case["breakdown"]
            expected_parts = [part for part, _ in MOE_EP_PARTS[report["platform"]]]
            assert [p["part"] for p in parts] == expected_parts, name
            assert [p["per_step"] for p in parts] == [n for _, n in MOE_EP_PARTS[report["platform"]]], name
            assert parts[0]["median_us"] == ox["median_us"], name
            assert case["auto_exchange"] == "ring", name
            # Every token's k copies, counted at the device of its expert.
            rows = case["device_rows"]
            assert len(rows) == EP_LAYER.devices and sum(rows) == EP_LAYER.devices * EP_LAYER.rows, (name, rows)
            check_ep_exchanges(parts, report["platform"])
            check_weight_sharding(parts)
            for part in parts:
                assert 0 < part["min_us"] <= part["median_us"] <= part["max_us"], (name, part)
            breakdown = lines[4 + len(names):]
            assert breakdown[0] == f"{name}: where a step's time goes"
            assert breakdown[1].split()[:3] == ["part", "(per", "device)"]
            assert breakdown[1].split()[-5:] == ["peak", "MB", "cost", "model", "MB"]
            assert [line.split("  ")[0] for line in breakdown[3:]] == expected_parts


def test_moe_layer_expert_parallel_case_on_four_devices(tmp_path):
    """With 8 host devices the expert-parallel case runs (over the first 4, exchange "auto":
    the ring): checked against plain JAX on one device, timed with its breakdown."""
    result = run_bench("--smoke", "--only", MOE_EP_CASE, "--out", str(tmp_path), host_devices=8)
    report = read_report(result, tmp_path)
    assert list(report["families"]) == ["moe_layer"]
    check_moe_layer_cases(report, result.stdout.rstrip().split("\n\n")[-1], [MOE_EP_CASE])


def test_only_moe_layer_lists_its_cases():
    result = run_bench("--only", "moe_layer", "--list")
    assert result.returncode == 0, result.stderr[-4000:]
    # The full run's cases: expert parallelism over 2 devices at three models' sizes and over 4
    # (the smoke run has the latter), and DeepSeek-V3 on one device with its shared expert.
    assert result.stdout.splitlines() == MOE_LAYER_CASES[:2] + [
        "deepseek_v3 ep=2 fwd+bwd", "qwen3_30b_a3b ep=2 fwd+bwd", "mixtral_8x7b ep=2 fwd+bwd", MOE_EP_CASE,
        "deepseek_v3 shared fwd+bwd"]


def _step_outputs(rng: np.random.Generator, tokens=64, hidden=16, ffn=8, experts=4, topk=2):
    """Outputs of a step of the expert-parallel smoke layer's kind, ``((loss, (y, aux)), (dx, dparams))``,
    random, with ``tokens * topk`` copies routed."""
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    counts = rng.multinomial(tokens * topk - experts, np.full(experts, 1 / experts)) + 1
    aux = bench_moe.moe.MoEAux(load_balancing_loss=jnp.float32(0.31), z_loss=jnp.float32(0.02),
                               tokens_per_expert=jnp.asarray(counts, jnp.int32), dropped_copies=jnp.int32(0))
    grads = bench_moe.moe.MoEParams(gate=normal(hidden, experts), up=normal(experts, hidden, 2 * ffn),
                                    down=normal(experts, ffn, hidden), expert_bias=jnp.zeros(experts, jnp.float32))
    return (jnp.float32(12.5), (normal(tokens, hidden), aux)), (normal(tokens, hidden), grads)


def _one_ulp_off(x):
    """``x`` with about half its elements one bf16 ulp away (a different float32 summation order)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    flip = jax.random.bernoulli(jax.random.key(1), 0.5, x.shape).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits ^ flip, jnp.bfloat16)


def _wrong(what: str):
    """A step output that a broken layer could produce, from a right one."""
    def y(out, f):
        (loss, (y, aux)), grads = out
        return (loss, (f(y), aux)), grads

    def aux(out, **changes):
        (loss, (y, aux)), grads = out
        return (loss, (y, dataclasses.replace(aux, **changes))), grads

    def grad(out, name, f):
        (value, (dx, dparams)) = out
        return value, (dx, dataclasses.replace(dparams, **{name: f(getattr(dparams, name))}))

    return {
        "y 5% too large": lambda out: y(out, lambda v: v * 1.05),
        "one token's y zero": lambda out: y(out, lambda v: v.at[3].set(0)),
        "z-loss 1% off": lambda out: aux(out, z_loss=out[0][1][1].z_loss * 1.01),
        "load-balancing loss missing": lambda out: aux(out, load_balancing_loss=jnp.float32(0)),
        "one copy routed elsewhere": lambda out: aux(
            out, tokens_per_expert=out[0][1][1].tokens_per_expert.at[0].add(1).at[1].add(-1)),
        "d up NaN at one element": lambda out: grad(out, "up", lambda g: g.at[1, 2, 3].set(jnp.nan)),
        "d gate 10% off": lambda out: grad(out, "gate", lambda g: g * 0.9),
        "d expert bias not zero": lambda out: grad(out, "expert_bias", lambda g: g.at[0].set(1e-3)),
    }[what]


MOE_WRONG_OUTPUTS = ["y 5% too large", "one token's y zero", "z-loss 1% off", "load-balancing loss missing",
                     "one copy routed elsewhere", "d up NaN at one element", "d gate 10% off",
                     "d expert bias not zero"]


@pytest.mark.parametrize("wrong", MOE_WRONG_OUTPUTS)
def test_moe_layer_check_catches_wrong_outputs(rng, wrong):
    """The moe_layer check passes outputs that differ from plain JAX's by bf16 rounding (one ulp
    in about half the elements) and fails each kind of wrong output."""
    layer = bench_moe.SMOKE_LAYERS[2]  # sigmoid routing with an expert bias: every error applies
    plain = _step_outputs(rng)
    rounded = jax.tree.map(lambda x: _one_ulp_off(x) if x.dtype == jnp.bfloat16 else x, plain)
    errors = bench_moe.worst_errors(layer, [(rounded, plain)])
    assert set(errors) == set(bench_moe.limits_of(layer)) == MOE_LAYER_ERRORS | {"dexpert_bias_max_abs"}
    assert 1e-3 < errors["y_rel_err"] < 1e-2, errors
    with pytest.raises(bench_moe.CheckFailed, match="oxmoe and plain JAX disagree"):
        bench_moe.worst_errors(layer, [(rounded, plain), (_wrong(wrong)(rounded), plain)])


def test_moe_layer_plain_jax_out_of_memory_is_reported_not_failed(monkeypatch):
    """When the plain-JAX layer runs out of memory at full size, the case reports OOM and checks
    oxmoe against it at a smaller sample of tokens instead."""
    layer = bench_moe.SMOKE_LAYERS[0]
    sample = layer.tokens // 4
    monkeypatch.setattr(bench_moe, "CHECK_TOKENS", sample)
    plain_layer = bench_moe.plain_layer

    def out_of_memory_past_the_sample(config):
        def run(x, params):
            y, aux = plain_layer(config)(x, params)
            if x.shape[0] > sample:  # fails at run time as XLA does
                y = y + jax.pure_callback(_raises_out_of_memory, jax.ShapeDtypeStruct((), y.dtype),
                                          jax.lax.stop_gradient(y[0, 0]))
            return y, aux
        return run

    monkeypatch.setattr(bench_moe, "plain_layer", out_of_memory_past_the_sample)
    report = bench_moe.Report(bench_moe.FAMILY, smoke=True)
    logged = []
    report.run(bench_moe.LayerCase(layer), timing.SMOKE, logged.append)
    (summary,) = report.summaries
    assert report.failed == [] and summary.result.plain == "OOM", summary.result.plain_error
    assert "RESOURCE_EXHAUSTED" in summary.result.plain_error and "plain JAX OOM" in logged[0]
    assert summary.result.check_tokens == sample and summary.result.errors["y_rel_err"] <= 2e-2
    row = summary.row()
    assert row[1] != "FAILED" and row[6:8] == ["OOM", "-"]
    case = summary.to_json()
    assert case["plain_jax"] == "OOM" and case["speedup"] is None and case["tflops"] > 0
    assert case["check"]["passed"] and case["check"]["tokens"] == sample
    assert report.to_json()["plain_jax_oom"] == [case["name"]]
    assert "(OOM 1, error 0)" in report.goals_line()
