"""The oxmoe layer's training step at the benchmark's one-GPU layers (Mixtral, Qwen3-30B-A3B,
DeepSeek-V3 with its shared expert) and at issue 19's DeepSeek-V3 on one GPU (one rank of EP = 8:
32 experts), for comparing two builds of oxmoe run in turn.

Two losses: the benchmark's, linear in the layer's output, whose gradient does not wait for the
forward (XLA may then merge forward passes into the backward's), and a squared one, as a model's
loss is; median of 7 x 10 steps each. Run it once per build, alternating, e.g.

    for i in 1 2; do
      OXMOE_LIBRARY=old/liboxmoe.so PYTHONPATH=old/jax_bindings python3 bench/step_ab.py before_$i
      python3 bench/step_ab.py after_$i
    done

``--only NAME[,NAME...]`` times only the layers of those names (of ``LAYERS``).
With ``--dense`` it also times each layer's dense ceiling (the step's six expert GEMMs as
dense bf16 dots, as the benchmark's layer cases do) and prints the step's share of it: the
benchmark's figure without its plain-JAX layer, whose compilation at Qwen3-30B-A3B's 128
experts takes minutes.

Prints one line per measurement and a last ``JSON {...}`` line with the label, the build id
and every time in ms. Needs a GPU.
"""

import argparse
import json
import math
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe.bench import grouped_gemm as bench_gemm
from oxmoe.bench import moe as bench_moe
from oxmoe.bench import timing

import fp8_gemm

LAYERS = ("mixtral", "qwen3_30b_a3b", "deepseek_v3 1 device E=32", "deepseek_v3 shared")


def median_seconds(step, *args, calls: int = 10, samples: int = 7, sample_s: float | None = None) -> float:
    """The median over ``samples`` samples of a call's seconds, each sample ``calls`` calls
    dispatched back to back (with ``sample_s``, as many as last at least that long), after a
    warm-up call."""
    jax.block_until_ready(step(*args))
    if sample_s is not None:
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        calls = max(1, math.ceil(sample_s / (time.perf_counter() - start)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            out = step(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def main(label: str, with_dense: bool, names: tuple[str, ...] = LAYERS) -> None:
    ms = {}
    dense = bench_gemm.DenseTimes()
    known = fp8_gemm.layers_by_name(smoke=False)
    for layer in (known[name] for name in names):
        (x, params, w), = bench_moe._draw_sets(layer, bench_moe.Placement(None),
                                              (0, zlib.crc32(layer.name.encode())), 1)
        ox = bench_moe.oxmoe_layer(layer.config)

        def squared(x, params, w, ox=ox):
            y, aux = ox(x, params)
            return jnp.sum(jnp.square(y.astype(jnp.float32) * w.astype(jnp.float32))) + aux.load_balancing_loss

        for loss, step in (("linear", bench_moe.step(ox)), ("square", jax.value_and_grad(squared, argnums=(0, 1)))):
            ms[f"{layer.name} {loss}"] = median_seconds(jax.jit(step), x, params, w) * 1e3
            print(f"{label} {layer.name} {loss}: {ms[f'{layer.name} {loss}']:.3f} ms", flush=True)
        if with_dense:
            dense_s = sum(d.timing.median_s for d in bench_moe.dense_gemms(layer, timing.FULL, dense).values())
            ms[f"{layer.name} dense"] = dense_s * 1e3
            print(f"{label} {layer.name} dense ceiling: {dense_s * 1e3:.3f} ms, the linear step at "
                  f"{100 * dense_s * 1e3 / ms[f'{layer.name} linear']:.1f}% of it", flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "ms": ms}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label", help="names this run's lines (e.g. before_1)")
    parser.add_argument("--only", type=lambda names: tuple(names.split(",")), default=LAYERS,
                        help="comma-separated layer names (of LAYERS)")
    parser.add_argument("--dense", action="store_true", help="also each layer's dense ceiling")
    args = parser.parse_args()
    unknown = set(args.only) - set(LAYERS)
    if unknown:
        parser.error(f"--only: no layer {sorted(unknown)}; the layers are {LAYERS}")
    main(args.label, args.dense, args.only)
