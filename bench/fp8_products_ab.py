"""The FP8 layer's six expert products timed alone, for comparing two builds of oxmoe run in turn
at the power the GPU holds them to: at the FP8 benchmark's layers (bench/fp8_gemm.py: DeepSeek-V3
on one GPU, Qwen3-30B-A3B), with the groups the layer's router makes
(``profile_fp8_weight_grad.layer_group_sizes``), the forward and d lhs products of the up and the
down projection (``oxmoe.fp8.ragged_dot``, K-major weights) and their weight gradients
(``oxmoe.fp8.transposed_ragged_dot``), and the weight gradients again with their right operand
(the output gradient) in 128 x 128 blocks instead of 128 x 1 (each must equal, bit for bit, the
product of the same tensor in 128 x 1 blocks), bf16 outputs. Per product: the median time
(``oxmoe.bench.timing.measure``, 100 samples of >= 10 ms over 4 input sets), TFLOP/s, the GPU's SM
clock and power over the timed samples (``timing.ClockSampler``), and a digest of one output (two
builds with the same digests computed the same bits). Run it once per build, alternating, e.g.

    for i in 1 2; do
      OXMOE_LIBRARY=old/liboxmoe.so python3 bench/fp8_products_ab.py before_$i
      python3 bench/fp8_products_ab.py after_$i
    done

``--only TEXT`` times only the products whose names contain it (``--only 128x128``: the square
weight gradients). Prints one line per product and a last ``JSON {...}`` line with the label,
the build id and every number. Needs a GPU (``--smoke``: the benchmark's tiny layers, a check of
this script).
"""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import fp8_gemm
import oxmoe
from gemm_ab import digest
from oxmoe import fp8
from oxmoe.bench import timing
from profile_fp8_weight_grad import layer_group_sizes

#: 100 samples of >= 10 ms: about a second timed a product, ~20 clock samples.
SETTINGS = dataclasses.replace(timing.FULL, repeats=100)
#: Input sets a product rotates through (each call reads its operands from device memory).
SETS = 4


def products(hidden: int, ffn: int) -> list[tuple[str, str, int, int]]:
    """(name, kind, K, N) of the layer's six products, and the weight gradients with square
    blocks: kind "rows" is ``fp8.ragged_dot`` (its contraction K, its output N columns),
    "weights" ``fp8.transposed_ragged_dot`` (a [K, N] weight gradient, a contraction over the
    rows), "square" the same with rhs in 128 x 128 blocks."""
    return [("up forward", "rows", hidden, 2 * ffn), ("down forward", "rows", ffn, hidden),
            ("up d lhs", "rows", 2 * ffn, hidden), ("down d lhs", "rows", hidden, ffn),
            ("up weight gradient", "weights", hidden, 2 * ffn), ("down weight gradient", "weights", ffn, hidden),
            ("up weight grad. 128x128", "square", hidden, 2 * ffn),
            ("down weight grad. 128x128", "square", ffn, hidden)]


def operands(key, kind: str, rows: int, groups: int, k: int, n: int):
    """One input set of a product: normal values, quantized as the layer quantizes them."""
    a, b = jax.random.split(key)
    lhs = jax.random.normal(a, (rows, k), jnp.bfloat16)
    if kind == "rows":
        rhs = jax.random.normal(b, (groups, n, k), jnp.bfloat16) * 0.02
        return fp8.quantize(lhs), fp8.quantize(rhs, fp8.WEIGHT_BLOCK)
    rhs = jax.random.normal(b, (rows, n), jnp.bfloat16)
    rhs_block = fp8.WEIGHT_BLOCK if kind == "square" else fp8.ACTIVATION_BLOCK
    return fp8.quantize(lhs, transpose=True), fp8.quantize(rhs, rhs_block, transpose=True)


def per_column(q: fp8.BlockQuantized) -> fp8.BlockQuantized:
    """rhsᵀ in 128 x 128 blocks as the same tensor in 128 x 1 blocks (each scale repeated)."""
    return fp8.BlockQuantized(q.values, jnp.repeat(q.scales, 128, axis=0), fp8.ACTIVATION_BLOCK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label", help="this run's name in the JSON line")
    parser.add_argument("--smoke", action="store_true", help="the benchmark's tiny layers, few samples")
    parser.add_argument("--only", default="", help="the products whose names contain this (e.g. 128x128)")
    args = parser.parse_args()
    settings = timing.SMOKE if args.smoke else SETTINGS
    print(oxmoe.build_id(), flush=True)
    row_product = lambda lhs, rhs, sizes: fp8.ragged_dot(lhs, rhs, sizes, rhs_transposed=True,
                                                         preferred_element_type=jnp.bfloat16)
    weight_product = lambda lhs, rhs, sizes: fp8.transposed_ragged_dot(lhs, rhs, sizes,
                                                                       preferred_element_type=jnp.bfloat16)
    results = []
    for layer_index, layer in enumerate(fp8_gemm.layers(smoke=args.smoke)):
        sizes = layer_group_sizes(layer)
        # The FP8 operands' rows are whole 128-row blocks, the padding in no group.
        rows = -(-int(sizes.sum()) // 128) * 128
        print(f"{layer.name}: {len(sizes)} groups of {sizes.min()}-{sizes.max()} rows, {rows} in all", flush=True)
        sizes = jnp.asarray(sizes)
        layer_products = products(layer.hidden, layer.ffn)
        for index, (name, kind, k, n) in enumerate(layer_products):
            if args.only not in name:
                continue
            # Each product's inputs whichever others run.
            keys = jax.random.split(jax.random.key(layer_index * len(layer_products) + index), SETS)
            sets = [(*operands(key, kind, rows, len(sizes), k, n), sizes) for key in keys]
            product = row_product if kind == "rows" else weight_product
            clocks = timing.ClockSampler()
            t = timing.measure(timing.rotated(product), sets, settings, clocks)
            flops = 2 * int(sizes.sum()) * k * n
            result = jax.jit(product)(*sets[0])
            if kind == "square":
                lhs, rhs, sizes_ = sets[0]
                if not bool((result == jax.jit(product)(lhs, per_column(rhs), sizes_)).all()):
                    raise SystemExit(f"{layer.name} {name}: not the product of its 128 x 1 blocks bit for bit")
            out = digest(result)
            tflops = flops / t.median_s / 1e12
            print(f"  {name:22s} {t.median_s * 1e6:8.0f} us {tflops:6.0f} TFLOP/s  {out}  "
                  f"{clocks.describe() or '(no nvidia-smi: no clocks)'}", flush=True)
            results.append(dict(layer=layer.name, product=name, k=k, n=n, median_us=t.median_s * 1e6,
                                tflops=tflops, digest=out, clocks=clocks.describe()))
    print("JSON " + json.dumps(dict(label=args.label, build=oxmoe.build_id(), products=results)), flush=True)


if __name__ == "__main__":
    main()
