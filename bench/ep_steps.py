"""The expert-parallel layer's training step against the same per-device work on one device
(issue 16's goals), without the full benchmark's breakdown: for each of the benchmark's EP = 2
layers (DeepSeek-V3, Qwen3-30B-A3B, Mixtral 8x7B), the step of ``oxmoe.moe.shard_map_moe`` over
two devices with each exchange and token-chunk count of ``VARIANTS``, and the step of one
device's share (E / 2 experts, its tokens, no exchange) on one device.

    PYTHONPATH=jax_bindings python3 bench/ep_steps.py [--only deepseek_v3,qwen3_30b_a3b]
        [--variants auto,all_to_all:2] [--budget-s 540] [--smoke]

A variant is ``EXCHANGE[:CHUNKS]``. Each step is timed as a training loop runs it: samples of
at least ``SAMPLE_S`` seconds of steps dispatched back to back, the median of ``SAMPLES``. The
EP step waits for the busier device, so each case also prints the routed copies each device's
experts take (``device_rows``). Parts not started within ``--budget-s`` are listed as skipped.
The layers' semantics are checked by tests/test_moe_gpu.py, not here.

Prints one line per step and a last ``JSON {...}`` line with every time in ms.
"""

import argparse
import dataclasses
import json
import time
import zlib

import jax
import numpy as np
from jax.sharding import Mesh

import oxmoe
from oxmoe.bench import moe as bench_moe

from step_ab import median_seconds

CASES = ("deepseek_v3", "qwen3_30b_a3b", "mixtral_8x7b")
VARIANTS = ("auto", "all_to_all", "ring", "all_to_all:2", "ring:2", "all_to_all:4")
SAMPLE_S, SAMPLES = 0.1, 9


def parse_variant(text: str) -> tuple[str, int]:
    exchange, _, chunks = text.partition(":")
    return exchange, int(chunks or 1)


def main(names, variants, budget_s: float, smoke: bool) -> None:
    began = time.perf_counter()
    layers = {layer.name.split()[0]: layer for layer in (bench_moe.SMOKE_LAYERS if smoke else bench_moe.LAYERS)
              if layer.devices == (4 if smoke else 2)}
    ms, skipped = {}, []

    def timed(key: str, run, args) -> None:
        if time.perf_counter() - began > budget_s:
            skipped.append(key)
            print(f"{key}: skipped (past the {budget_s:g} s budget)", flush=True)
            return
        start = time.perf_counter()
        ms[key] = median_seconds(jax.jit(run), *args, samples=SAMPLES, sample_s=SAMPLE_S) * 1e3
        print(f"{key}: {ms[key]:.3f} ms ({time.perf_counter() - start:.0f} s with compilation)", flush=True)

    for name in (n for n in names if n in layers):  # the smoke run has DeepSeek-V3's alone
        layer = layers[name]
        mesh = Mesh(np.array(jax.devices()[:layer.devices]), (bench_moe.EXPERT_AXIS,))
        (args,) = bench_moe._draw_sets(layer, bench_moe.Placement(mesh), (0, zlib.crc32(layer.name.encode())), 1)
        rows = bench_moe.device_rows(layer, mesh, args)
        print(f"{layer.name}: {layer.describe()}; auto = {bench_moe.auto_exchange(layer, mesh)!r}; "
              f"routed copies per device {rows} (max / mean {max(rows) / np.mean(rows):.3f})", flush=True)
        for variant in variants:
            exchange, chunks = parse_variant(variant)
            config = dataclasses.replace(layer.config, exchange=exchange, token_chunks=chunks)
            timed(f"{layer.name} {variant}", bench_moe.step(bench_moe.oxmoe_ep_layer(config, mesh)), args)
        del args
        single = layer.one_device()
        (args,) = bench_moe._draw_sets(single, bench_moe.Placement(None), (0, zlib.crc32(single.name.encode())), 1)
        timed(f"{layer.name} one device", bench_moe.step(bench_moe.oxmoe_layer(single.config)), args)
        del args
        one = ms.get(f"{layer.name} one device")
        if one:
            ratios = ", ".join(f"{v} {ms[f'{layer.name} {v}'] / one:.3f}x" for v in variants
                               if f"{layer.name} {v}" in ms)
            print(f"{layer.name} against one device ({one:.3f} ms): {ratios}", flush=True)
    print("JSON", json.dumps({"build": oxmoe.build_id(), "device": str(jax.devices()[0].device_kind),
                              "ms": ms, "skipped": skipped}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=lambda names: tuple(names.split(",")), default=CASES,
                        help=f"comma-separated layers (of {CASES})")
    parser.add_argument("--variants", type=lambda names: tuple(names.split(",")), default=VARIANTS,
                        help="comma-separated EXCHANGE[:CHUNKS]")
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no part after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="the smoke run's EP layer (tiny sizes, 4 devices)")
    args = parser.parse_args()
    unknown = set(args.only) - set(CASES)
    if unknown:
        parser.error(f"--only: no layer {sorted(unknown)}; the layers are {CASES}")
    main(args.only, args.variants, args.budget_s, args.smoke)
