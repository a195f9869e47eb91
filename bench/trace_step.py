"""Traces the MoE layer's training step on the GPUs (JAX's profiler, CUPTI) and summarises
where each GPU's time goes: busy and idle time, NCCL kernels, how much of them ran under
compute kernels (the overlap), the longest idle gaps with the kernels around them, and the
kernels that take the most time. Nsight Systems' summary, from the trace JAX writes (under
--out, with each step's optimized HLO and every kernel's time a step in kernels.json).

    PYTHONPATH=jax_bindings python3 bench/trace_step.py [--case "deepseek_v3 ep=2"]
        [--exchange all_to_all] [--token-chunks 2] [--steps 5] [--out trace-out] [--smoke]
        [--data-parallel] [--fp8]

The case is one of the benchmark's layers (oxmoe.bench.moe.LAYERS) or of bench/fp8_gemm.py's
("deepseek_v3 1 device E=32": one rank of DeepSeek-V3's EP = 8 on one GPU); an EP case is traced
over its devices, then the same per-device work on one device (E / devices experts). With
--data-parallel, that one-device layer is traced data-parallel over the EP case's devices
instead, its expert weights replicated, then sharded over the data axis (issue 17). With
--fp8, the one-device layer is traced again with ``MoEConfig.fp8 = BlockScaling()`` (issue 18),
and again given its expert weights quantized once outside the step (``fp8_weights=``, a
micro-batch's step under gradient accumulation), then so with the benchmark's two other options too
(square gradient blocks, rows aligned to 128).
Each step's untraced time comes with each busy GPU's median SM clock and power while it was
timed, and how often the power cap held the clock down: at the layers' shapes an H200 runs
these steps at its power limit, so two steps' times compare only with their clocks beside them.
"""

import argparse
import collections
import dataclasses
import functools
import gzip
import json
import pathlib
import zlib

import jax
import numpy as np
from jax.sharding import Mesh

from oxmoe import fp8, moe
from oxmoe.bench import moe as bench_moe
from oxmoe.bench import timing

import fp8_gemm

#: An idle stretch of a GPU at least this long is listed with its neighbours.
GAP_US = 50.0


def union(intervals):
    """Sorted disjoint ``(start, end)`` intervals covering ``intervals``."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a, b) -> float:
    """The length of the intersection of two unions."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def gpu_kernels(trace: dict) -> dict[str, list[dict]]:
    """The trace's complete events of each GPU (by process name), sorted by start."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {pid: name for pid, name in names.items() if "GPU" in name or "gpu" in name}
    events = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in gpus and e.get("dur", 0) > 0:
            events[gpus[e["pid"]]].append(e)
    return {name: sorted(evs, key=lambda e: e["ts"]) for name, evs in sorted(events.items())}


def summarise(label: str, trace: dict, steps: int, out: pathlib.Path) -> None:
    """Prints the summary, and writes every kernel's time and count a step, per GPU, to
    ``out/kernels.json`` (to compare two traces kernel by kernel)."""
    print(f"\n== {label}: per step (mean of {steps}), us ==")
    kernels = gpu_kernels(trace)
    per_kernel = {}
    if not kernels:
        print("no GPU events; the trace's processes:", sorted({e["args"]["name"] for e in trace["traceEvents"]
                                                              if e.get("name") == "process_name"}))
    for gpu, events in kernels.items():
        is_nccl = [("nccl" in e["name"].lower()) for e in events]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events]
        busy = union(spans)
        nccl = union([s for s, n in zip(spans, is_nccl) if n])
        compute = union([s for s, n in zip(spans, is_nccl) if not n])
        wall = busy[-1][1] - busy[0][0]
        print(f"{gpu}: span {wall / steps:.0f}, busy {length(busy) / steps:.0f}, idle {(wall - length(busy)) / steps:.0f}, "
              f"compute {length(compute) / steps:.0f}, nccl {length(nccl) / steps:.0f}, "
              f"nccl under compute {intersection(nccl, compute) / steps:.0f}")
        gaps = []
        for (_, end), (start, _) in zip(busy, busy[1:]):
            if start - end >= GAP_US:
                before = max((e for e in events if e["ts"] + e["dur"] <= end + 1e-3), key=lambda e: e["ts"] + e["dur"])
                after = min((e for e in events if e["ts"] >= start - 1e-3), key=lambda e: e["ts"])
                gaps.append((start - end, before["name"], after["name"]))
        print(f"  idle gaps >= {GAP_US:g} us: {len(gaps) / steps:.1f} a step, {sum(g for g, _, _ in gaps) / steps:.0f} us")
        for gap, before, after in sorted(gaps, reverse=True)[:8]:
            print(f"    {gap:8.0f}  after {before[:70]}  before {after[:70]}")
        totals = collections.Counter()
        counts = collections.Counter()
        for e in events:
            totals[e["name"]] += e["dur"]
            counts[e["name"]] += 1
        per_kernel[gpu] = {name: (total / steps, counts[name] / steps) for name, total in totals.most_common()}
        print("  kernels by time:")
        for name, total in totals.most_common(25):
            print(f"    {total / steps:9.0f}  x{counts[name] / steps:<5g} {name[:110]}")
    (out / "kernels.json").write_text(json.dumps({"label": label, "us_and_count_per_step": per_kernel}))


def traced(fn, args, steps: int, out: pathlib.Path) -> dict:
    """The trace of ``steps`` calls of ``fn``; the step's optimized HLO goes to ``out/step.hlo.txt``
    (to find what a fusion named in the summary does)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.hlo.txt").write_text(fn.lower(*args).compile().as_text())
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(out)):
        for _ in range(steps):
            result = fn(*args)
        jax.block_until_ready(result)
    (path,) = sorted(out.glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)[-1:]
    with gzip.open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="deepseek_v3 ep=2")
    parser.add_argument("--exchange", default="auto")
    parser.add_argument("--token-chunks", type=int, default=1, help="MoEConfig.token_chunks of the EP step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("trace-out"))
    parser.add_argument("--smoke", action="store_true", help="the smoke run's layers (tiny sizes)")
    parser.add_argument("--data-parallel", action="store_true",
                        help="the EP case's one-device layer data-parallel, weights replicated and sharded")
    parser.add_argument("--fp8", action="store_true", help="the one-device layer with FP8 expert GEMMs too")
    args = parser.parse_args()
    # The benchmark's layers and the FP8 benchmark's (DeepSeek-V3 on one GPU: one rank of EP = 8).
    layers = fp8_gemm.layers_by_name(args.smoke)
    if args.case not in layers:
        parser.error(f"--case must be one of {', '.join(repr(name) for name in layers)}")
    layer = layers[args.case]
    layer = dataclasses.replace(layer, config=dataclasses.replace(layer.config, exchange=args.exchange,
                                                                  token_chunks=args.token_chunks))
    seed = (0, zlib.crc32(layer.name.encode()))
    runs = []
    if args.data_parallel:
        mesh = Mesh(np.array(jax.devices()[:layer.devices]), (bench_moe.DATA_AXIS,))
        single = layer.one_device()
        for weight_axes in ((), (bench_moe.DATA_AXIS,)):
            (sets,) = bench_moe.data_parallel_sets(single, mesh, weight_axes, seed, 1)
            runs.append((f"{single.name} {bench_moe.DATA_AXIS}={layer.devices}, weight_axes {weight_axes}",
                         jax.jit(bench_moe.data_parallel_step(single, mesh, weight_axes)), sets))
    elif layer.devices > 1:
        mesh = Mesh(np.array(jax.devices()[:layer.devices]), (bench_moe.EXPERT_AXIS,))
        (sets,) = bench_moe._draw_sets(layer, bench_moe.Placement(mesh), seed, 1)
        runs.append((f"{layer.name}, exchange {args.exchange!r}, token_chunks {args.token_chunks}",
                     jax.jit(bench_moe.step(bench_moe.oxmoe_ep_layer(layer.config, mesh))), sets))
        layer = layer.one_device()
    if not args.data_parallel:
        (sets,) = bench_moe._draw_sets(layer, bench_moe.Placement(None), seed, 1)
        runs.append((layer.name, jax.jit(bench_moe.step(bench_moe.oxmoe_layer(layer.config))), sets))
        if args.fp8:
            config = dataclasses.replace(layer.config, fp8=fp8.BlockScaling())
            runs.append((f"{layer.name}, fp8", jax.jit(bench_moe.step(bench_moe.oxmoe_layer(config))), sets))
            x, params, w = sets
            # All three of the FP8 benchmark's options: the fastest step it times.
            all_three = dataclasses.replace(layer.config, align_size=fp8_gemm.ALIGNED_ROWS,
                                            fp8=fp8.BlockScaling(square_gradient_blocks=True))
            for label, once in (("weights quantized once", config),
                                (f"128x128 gradients, align {fp8_gemm.ALIGNED_ROWS}, weights quantized once", all_three)):
                quantized = jax.jit(functools.partial(moe.quantize_expert_weights, config=once))(params)
                runs.append((f"{layer.name}, fp8, {label}", jax.jit(fp8_gemm.quantized_once_step(once)),
                             (x, params, w, quantized)))
    for n, (label, fn, fn_args) in enumerate(runs):
        clocks = timing.ClockSampler()
        timing_ = timing.measure(timing.rotated(fn), [fn_args], bench_moe.step_settings(timing.FULL), clocks)
        print(f"{label}: step {timing_.median_s * 1e6:.0f} us (median, untraced, steps back to back)")
        if clocks.result:
            print(f"  while timed: {clocks.describe()}")
        summarise(label, traced(fn, fn_args, args.steps, args.out / str(n)), args.steps, args.out / str(n))


if __name__ == "__main__":
    main()
