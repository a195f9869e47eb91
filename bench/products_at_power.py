"""The expert products timed alone, back to back for ~2 s, with each GPU's SM clock and power
sampled (``oxmoe.bench.timing.ClockSampler``): DeepSeek-V3's up projection on one GPU (65,536
rows, K 7,168, N 4,096, 32 equal groups) in bf16 (``oxmoe.ragged_dot``) and FP8
(``oxmoe.fp8.ragged_dot``), and XLA's dense bf16 ``jnp.dot`` of the same FLOPs. Whether each ran
at the power limit, and at what clock, says what its TFLOP/s can be compared with.

    PYTHONPATH=jax_bindings python3 bench/products_at_power.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import fp8
from oxmoe.bench import timing

ROWS, K, N, GROUPS = 65536, 7168, 4096, 32
#: 150 samples of >= 10 ms: about 2 s timed, ~40 clock samples.
SETTINGS = dataclasses.replace(timing.FULL, repeats=150)


def main() -> None:
    print(oxmoe.build_id())
    sizes = jnp.full((GROUPS,), ROWS // GROUPS, jnp.int32)
    bf16_sets, fp8_sets, dense_sets = [], [], []
    for s in range(4):  # 4 input sets: each call reads its operands from device memory
        x = jax.random.normal(jax.random.key(s), (ROWS, K), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(100 + s), (GROUPS, N, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
        bf16_sets.append((x, jnp.swapaxes(w, 1, 2)))
        fp8_sets.append((fp8.quantize(x), fp8.quantize(w, fp8.WEIGHT_BLOCK)))
        dense_sets.append((x, w[0].T))
    runs = {
        "bf16 oxmoe.ragged_dot": (lambda x, w: oxmoe.ragged_dot(x, w, sizes), bf16_sets),
        "fp8 oxmoe.fp8.ragged_dot": (lambda x, w: fp8.ragged_dot(x, w, sizes, rhs_transposed=True), fp8_sets),
        "dense bf16 jnp.dot": (jnp.dot, dense_sets),
    }
    flops = 2 * ROWS * K * N
    for name, (fn, sets) in runs.items():
        clocks = timing.ClockSampler()
        t = timing.measure(timing.rotated(fn), sets, SETTINGS, clocks)
        print(f"{name:26s} {t.median_s * 1e6:8.0f} us  {flops / t.median_s / 1e12:6.0f} TFLOP/s  "
              f"{clocks.describe() or '(no nvidia-smi: no clocks)'}", flush=True)


if __name__ == "__main__":
    main()
