"""Times oxmoe.fp8.quantize on the device against its copy bandwidth (issue 18's goal: at
least 75%), at the operands of the FP8 expert GEMMs:

- activations, one scale per token per 128 channels: the dispatched rows of a layer step
  (T k rows of H), at Qwen3-30B-A3B's and DeepSeek-V3's one-GPU sizes;
- the same rows quantized per 128 tokens per channel (the weight gradient's operand);
- one GPU's expert weights (E_local experts of ``[H, 2F]``) in 128 x 128 blocks.

Bytes are the fewest the op moves: the bf16 input read once, the e4m3 values (1 byte) and
float32 scales written once.

    PYTHONPATH=jax_bindings python3 bench/fp8_quantize.py [--smoke]
"""

import argparse
import math

import jax
import jax.numpy as jnp

from oxmoe import fp8
from oxmoe.bench import timing

#: (name, shape, block): rows of Qwen3 (T 16384, k 8, H 2048, F 768, 128 experts) and of
#: DeepSeek-V3 on one GPU (T 8192, k 8, H 7168, F 2048, 32 experts).
CASES = (
    ("qwen3 dispatched rows [T k, H]", (16384 * 8, 2048), fp8.ACTIVATION_BLOCK),
    ("qwen3 dispatched rows, weight-gradient blocks", (16384 * 8, 2048), fp8.TRANSPOSED_ACTIVATION_BLOCK),
    ("qwen3 expert up weights [E, H, 2F]", (128, 2048, 2 * 768), fp8.WEIGHT_BLOCK),
    ("deepseek_v3 dispatched rows [T k, H]", (8192 * 8, 7168), fp8.ACTIVATION_BLOCK),
    ("deepseek_v3 dispatched rows, weight-gradient blocks", (8192 * 8, 7168), fp8.TRANSPOSED_ACTIVATION_BLOCK),
    ("deepseek_v3 expert up weights [E, H, 2F]", (32, 7168, 2 * 2048), fp8.WEIGHT_BLOCK),
)
SMOKE_ROWS = 256


def moved_bytes(shape, block) -> int:
    elements = math.prod(shape)
    blocks = elements // (block[0] * block[1])
    return elements * (jnp.dtype(jnp.bfloat16).itemsize + 1) + 4 * blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows of each case, one sample")
    args = parser.parse_args()
    settings = timing.SMOKE if args.smoke else timing.FULL
    ceiling = timing.copy_ceiling(settings)
    print(f"{jax.devices()[0].device_kind}: copy {ceiling.bytes_per_s / 1e9:.0f} GB/s")
    for name, shape, block in CASES:
        if args.smoke:
            shape = (*shape[:-2], SMOKE_ROWS, shape[-1])
        random = timing.RandomArrays(0, len(name))
        arg_sets = [(random.normal(shape, jnp.bfloat16),)
                    for _ in range(settings.num_sets(moved_bytes(shape, block)))]
        run = timing.rotated(lambda x, block=block: fp8.quantize(x, block))
        t = timing.measure(run, arg_sets, settings)
        rate = moved_bytes(shape, block) / t.median_s
        print(f"{name:52s} {str(shape):22s} block {str(block):10s} {t.median_s * 1e6:9.1f} us "
              f"{rate / 1e9:7.0f} GB/s  {100 * rate / ceiling.bytes_per_s:4.0f}% of copy")


if __name__ == "__main__":
    main()
