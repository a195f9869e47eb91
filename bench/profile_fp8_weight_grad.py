"""Times the FP8 weight gradient (``oxmoe.fp8.transposed_ragged_dot``) and its bf16 twin
(``oxmoe.grouped_gemm.transposed_ragged_dot``) at the FP8 benchmark's layers (bench/fp8_gemm.py:
DeepSeek-V3 on one GPU, Qwen3-30B-A3B), for the up and the down projection, with the groups the
layer's router makes (each expert's tokens in the layer's forward on the benchmark's inputs)
and with equal groups of the same total: what ragged groups cost each kernel. A group boundary
inside a 128-row block makes that block a stage of both groups in the FP8 kernel (its other
group's rows zeroed in shared memory); bf16's kernel has no such blocks. Timed as the FP8
benchmark times its products (oxmoe.bench.timing, fp8_gemm.FULL's samples); the operands are
random (normal), quantized outside the timing.
With --once, each product runs twice and is not timed (for a profiler):

    python3 bench/profile_fp8_weight_grad.py [--smoke]
    ncu --section SourceCounters -k regex:fp8_transposed_ragged_dot_hopper -s 1 -c 1 -o wgrad \\
        python3 bench/profile_fp8_weight_grad.py --once
"""

import argparse
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import fp8_gemm
from oxmoe import fp8, grouped_gemm, moe
from oxmoe.bench import moe as bench_moe
from oxmoe.bench import timing


def layer_group_sizes(layer: bench_moe.Layer) -> np.ndarray:
    """Each expert's tokens in the layer's forward on the benchmark's inputs."""
    seed = (0, zlib.crc32(layer.name.encode()))
    ((x, params, _),) = bench_moe._draw_sets(layer, bench_moe.Placement(None), seed, 1)
    _, aux = jax.jit(lambda x, params: moe.moe(x, params, layer.config))(x, params)
    return np.asarray(aux.tokens_per_expert).astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="run each product twice, untimed (for a profiler)")
    parser.add_argument("--smoke", action="store_true", help="the benchmark's tiny layers (a check of this script)")
    args = parser.parse_args()
    settings = timing.SMOKE if args.smoke else fp8_gemm.FULL
    fp8_product = timing.rotated(lambda a, b, sizes: fp8.transposed_ragged_dot(a, b, sizes,
                                                                             preferred_element_type=jnp.bfloat16))
    bf16_product = timing.rotated(grouped_gemm.transposed_ragged_dot)
    rng = np.random.default_rng(0)
    for layer in fp8_gemm.layers(smoke=args.smoke):
        sizes = layer_group_sizes(layer)
        rows = int(sizes.sum())
        equal = np.full(len(sizes), rows // len(sizes), np.int32)
        equal[: rows % len(sizes)] += 1
        print(f"{layer.name}: {len(sizes)} groups of {sizes.min()}-{sizes.max()} rows (median "
              f"{int(np.median(sizes))}), {rows} in all", flush=True)
        padded = -(-rows // 128) * 128  # the FP8 operands' rows are whole 128-row blocks
        for name, k, n in (("up", layer.hidden, 2 * layer.ffn), ("down", layer.ffn, layer.hidden)):
            lhs = jnp.asarray(rng.standard_normal((padded, k)), jnp.bfloat16)
            rhs = jnp.asarray(rng.standard_normal((padded, n)), jnp.bfloat16)
            lhs_q, rhs_q = fp8.quantize(lhs, transpose=True), fp8.quantize(rhs, transpose=True)
            for label, group_sizes in (("the layer's groups", sizes), ("equal groups", equal)):
                group_sizes = jnp.asarray(group_sizes)
                fp8_args, bf16_args = [(lhs_q, rhs_q, group_sizes)], [(lhs, rhs, group_sizes)]
                if args.once:
                    for _ in range(2):
                        jax.block_until_ready(fp8_product(fp8_args))
                        jax.block_until_ready(bf16_product(bf16_args))
                    continue
                flops = 2 * rows * k * n
                t8 = timing.measure(fp8_product, fp8_args, settings).median_s
                t16 = timing.measure(bf16_product, bf16_args, settings).median_s
                print(f"  {name} ({k} x {n}), {label}: FP8 {t8 * 1e6:.0f} us {flops / t8 / 1e12:.0f} TFLOP/s, "
                      f"bf16 {t16 * 1e6:.0f} us {flops / t16 / 1e12:.0f} TFLOP/s ({t16 / t8:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
