"""`python -m oxmoe.bench --smoke` runs every case of every family (router, permutation,
grouped_gemm), finds oxmoe in agreement with plain JAX (grouped_gemm: with the float32
reference) on each, times it and its baselines, writes every number to its JSON report and
prints one table per family.

The benchmark runs in a subprocess, as CI and a user run it: from this checkout's
`jax_bindings` (the benchmark is not part of an installed package), with the native
library this test process loaded, on the default device (on a CPU machine one host
device, not the eight that conftest.py sets up for the sharding tests; on a GPU
machine the GPU).
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oxmoe
from oxmoe import _library
from oxmoe.bench import grouped_gemm as bench_gemm
from oxmoe.bench import timing

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
}


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "jax_bindings"), env.get("PYTHONPATH")) if p)
    env["OXMOE_LIBRARY"] = str(_library.library_path().resolve())
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    # On a GPU machine this test process may hold most of the GPU's memory already.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return subprocess.run([sys.executable, "-m", "oxmoe.bench", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def run_smoke(json_path: pathlib.Path) -> subprocess.CompletedProcess:
    return run_bench("--smoke", "--json", str(json_path))


def test_smoke_run_checks_and_times_every_case(tmp_path):
    json_path = tmp_path / "bench.json"
    result = run_smoke(json_path)
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")

    report = json.loads(json_path.read_text())
    assert report["smoke"] is True
    assert report["oxmoe_build_id"] == oxmoe.build_id()
    assert report["jax_version"] == jax.__version__
    assert report["device"] and report["date"]
    assert report["copy"]["gb_per_s"] > 0 and report["copy"]["bytes"] > 0

    assert list(report["families"]) == [*EXPECTED_CASES, "grouped_gemm"]
    for family, expected in EXPECTED_CASES.items():
        entry = report["families"][family]
        assert sorted(entry["cases"]) == sorted(expected), family
        assert entry["failed"] == []
        assert entry["goals"]["max_x_floor"] > 0 and entry["goals"]["min_speedup"] > 0
        assert entry["goals_met"]["floor"][1] == len(expected)
    assert [case["name"] for case in report["cases"]] == [
        name for entry in report["families"].values() for name in entry["cases"]]

    for case in report["cases"]:
        name, family = case["name"], case["family"]
        if family == "grouped_gemm":  # check_grouped_gemm_cases
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
        assert case["device_bytes_per_set"] > 0, name

    # The results tables are the last thing on stdout, one per family after a blank line:
    # its heading, its goals line, the table's header and rule, one row per case.
    blocks = result.stdout.rstrip().split("\n\n")[-len(report["families"]):]
    for block, (family, entry) in zip(blocks, report["families"].items()):
        lines = block.splitlines()
        assert lines[0].startswith(f"{family}: "), lines[0]
        assert lines[1].startswith(f"{family} goals met: "), lines[1]
        assert lines[2].split()[:3] == ["case", "oxmoe", "us"]
        assert [line.split("  ")[0].strip() for line in lines[4:]] == entry["cases"]

    check_grouped_gemm_cases(report)


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
    assert entry["goals_met"]["dense"] == [sum(case["goals"]["dense"] for case in cases), len(GEMM_CASES)]

    for case in cases:
        name, check = case["name"], case["check"]
        assert case["failure"] is None, f"{name}: {case['failure']}"
        assert check["passed"], name
        assert check["primitive"] == ("oxmoe_ragged_dot_bwd" if case["product"] == "drhs" else "oxmoe_ragged_dot_fwd")
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
        assert case["goals"]["dense"] == (case["ratio_to_dense"] >= 0.8), name
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


#: A small shape whose cases the in-process tests run on the default device.
SMALL = bench_gemm.Shape("small", m=200, k=48, n=40, groups=6)


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
