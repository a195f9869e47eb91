"""What capturing oxmoe's calls in CUDA graphs does, on one GPU (issue 19, item 5).

oxmoe's CUDA handlers are command-buffer compatible, so XLA records them into its
command buffers (CUDA graphs) with its own kernels. This runs each measurement in a
fresh process twice, alternating, in two modes:

- ``graphs``: XLA's defaults (oxmoe's calls captured with XLA's kernels);
- ``launched``: ``XLA_FLAGS=--xla_gpu_enable_command_buffer=-CUSTOM_CALL``: XLA's own
  kernels still captured, oxmoe's calls launched one at a time, as they were before
  the handlers were compatible (which also splits XLA's graphs around them).

Measured: the default training job (``python -m oxmoe.train``, its tokens/s after
the first step), and cases of ``python -m oxmoe.bench`` (median times): the router
and the dispatch at Mixtral's 8 experts, bound by launch cost, and the Mixtral layer step.

    python3 bench/command_buffers.py --out DIR [--train-runs 3] [--bench-runs 2] [--steps 500]

Writes DIR/command_buffers.json and prints one table. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

MODES = {"graphs": "", "launched": "--xla_gpu_enable_command_buffer=-CUSTOM_CALL"}
BENCH_CASES = ("mixtral bf16 topk fwd", "mixtral bf16 topk bwd", "mixtral bf16 scores fwd", "mixtral bf16 scores bwd",
               "aux_loss E=256 bf16 fwd", "mixtral bf16 dispatch fwd", "mixtral fwd+bwd")


def _run(mode: str, args: list[str]) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), MODES[mode]) if f)
    subprocess.run([sys.executable, "-m", *args], env=env, check=True, stdout=subprocess.DEVNULL)


def train_tokens_per_s(mode: str, steps: int, scratch: pathlib.Path) -> float:
    out = scratch / f"train-{mode}"
    _run(mode, ["oxmoe.train", "--steps", str(steps), "--eval-every", str(10 * steps), "--out", str(out)])
    return json.loads((out / "summary.json").read_text())["training"]["tokens_per_second"]


def bench_medians_us(mode: str, scratch: pathlib.Path) -> dict[str, float]:
    out = scratch / f"bench-{mode}"
    _run(mode, ["oxmoe.bench", "--out", str(out), *(a for name in BENCH_CASES for a in ("--only", name))])
    results = json.loads((out / "results.json").read_text())
    return {c["name"]: c["oxmoe"]["median_us"] for c in results["cases"] if c.get("oxmoe")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--train-runs", type=int, default=3, help="runs of the training job in each mode")
    parser.add_argument("--bench-runs", type=int, default=2, help="runs of the benchmark's cases in each mode")
    parser.add_argument("--steps", type=int, default=500, help="the training job's steps")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    runs = {mode: {"train_tokens_per_s": [], "bench_us": []} for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(max(args.train_runs, args.bench_runs)):
            for mode in (list(MODES) if run % 2 == 0 else list(reversed(MODES))):
                print(f"run {run + 1}, {mode}", file=sys.stderr, flush=True)
                if run < args.train_runs:
                    runs[mode]["train_tokens_per_s"].append(train_tokens_per_s(mode, args.steps, pathlib.Path(scratch)))
                if run < args.bench_runs:
                    runs[mode]["bench_us"].append(bench_medians_us(mode, pathlib.Path(scratch)))
    (args.out / "command_buffers.json").write_text(json.dumps({"modes": MODES, "steps": args.steps, "runs": runs}, indent=1))

    print("| measurement | graphs | launched | speedup in graphs |")
    print("| --- | --- | --- | --- |")
    train = {mode: runs[mode]["train_tokens_per_s"] for mode in MODES}
    print(f"| training job, tokens/s (runs) | {', '.join(f'{t:,.0f}' for t in train['graphs'])} | "
          f"{', '.join(f'{t:,.0f}' for t in train['launched'])} | "
          f"{statistics.median(train['graphs']) / statistics.median(train['launched']):.2f}x |")
    for name in BENCH_CASES:
        times = {mode: [run[name] for run in runs[mode]["bench_us"] if name in run] for mode in MODES}
        if not all(times.values()):
            print(f"| {name} | failed | | |")
            continue
        print(f"| {name}, us | {', '.join(f'{t:,.1f}' for t in times['graphs'])} | "
              f"{', '.join(f'{t:,.1f}' for t in times['launched'])} | "
              f"{statistics.median(times['launched']) / statistics.median(times['graphs']):.2f}x |")


if __name__ == "__main__":
    main()
