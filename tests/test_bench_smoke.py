"""`python -m oxmoe.bench --smoke` runs every case of every family (router, permutation),
finds oxmoe in agreement with plain JAX on each, times both, writes every number to its
JSON report and prints one table per family.

The benchmark runs in a subprocess, as CI and a user run it: from this checkout's
`jax_bindings` (the benchmark is not part of an installed package), with the native
library this test process loaded, on the default device (on a CPU machine one host
device, not the eight that conftest.py sets up for the sharding tests; on a GPU
machine the GPU).
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax

import oxmoe
from oxmoe import _library

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
#: The oxmoe primitive each family's timed functions call (a backward may call another op's).
PRIMITIVES = {
    "router": {"oxmoe_topk_fwd", "oxmoe_topk_bwd", "oxmoe_aux_loss_scores_fwd", "oxmoe_aux_loss_scores_bwd",
               "oxmoe_aux_loss_fwd", "oxmoe_aux_loss_bwd"},
    "permutation": {"oxmoe_dispatch_fwd", "oxmoe_combine_fwd", "oxmoe_combine_bwd", "oxmoe_sort_chunks"},
}


def run_smoke(json_path: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "jax_bindings"), env.get("PYTHONPATH")) if p)
    env["OXMOE_LIBRARY"] = str(_library.library_path().resolve())
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    # On a GPU machine this test process may hold most of the GPU's memory already.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return subprocess.run([sys.executable, "-m", "oxmoe.bench", "--smoke", "--json", str(json_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


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

    assert list(report["families"]) == list(EXPECTED_CASES)
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
    blocks = result.stdout.rstrip().split("\n\n")[-len(EXPECTED_CASES):]
    for block, (family, entry) in zip(blocks, report["families"].items()):
        lines = block.splitlines()
        assert lines[0].startswith(f"{family}: "), lines[0]
        assert lines[1].startswith(f"{family} goals met: "), lines[1]
        assert lines[2].split()[:3] == ["case", "oxmoe", "us"]
        assert [line.split("  ")[0].strip() for line in lines[4:]] == entry["cases"]
