"""The Hopper grouped GEMM products of ``bench/gemm_ab.py`` (its shapes, draws and operands: the
``ragged_dot`` forwards and d lhs, and the weight gradient's transposed product) and the FP8
forward and weight gradient at the same shapes, each run twice, for kernel A/Bs under Nsight Compute at locked
clocks. At boost clocks an H200 throttles under load, and direct timing of cases run one after
another moved 5-20% (``bench/NOTES.md``); with the SM clock locked at base, two runs of one
build's kernels agreed within 2% (H200, 2026-11-25). Per build:

    ncu --clock-control base --metrics gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed \\
        -k "regex:^(fp8_)?(transposed_)?ragged_dot_hopper" --csv python3 bench/ncu_products.py > build.csv

ncu reports the launches in order, two per case; the script prints the cases' names in that
order. Needs a GPU.
"""

import jax
import jax.numpy as jnp

from oxmoe import fp8
from oxmoe.bench.grouped_gemm import PRODUCTS
from oxmoe.model_shapes import EXPERT_GEMMS
from gemm_ab import draw, group_sizes, product_operands


def run_twice(name, call, *args):
    for _ in range(2):
        jax.block_until_ready(call(*args))
    print(name, flush=True)


def main() -> None:
    fp8_forward = jax.jit(lambda x, w, sizes: fp8.ragged_dot(x, w, sizes, rhs_transposed=True))
    fp8_weight_gradient = jax.jit(
        lambda xt, dyt, sizes: fp8.transposed_ragged_dot(xt, dyt, sizes, preferred_element_type=jnp.bfloat16))
    for shape in EXPERT_GEMMS:
        sizes = group_sizes(shape)
        for product in PRODUCTS:
            operands = product_operands(product, shape)
            run_twice(f"{shape.name} {product.name}", jax.jit(product.oxmoe), *operands, sizes)
            if product.name == "drhs":
                x, dy = operands
                run_twice(f"{shape.name} fp8 drhs", fp8_weight_gradient, fp8.quantize(x, transpose=True),
                          fp8.quantize(dy, transpose=True), sizes)
        keys = jax.random.split(jax.random.key(1), 2)
        x = fp8.quantize(draw(keys[0], (shape.m, shape.k)))
        w = fp8.quantize(draw(keys[1], (shape.groups, shape.n, shape.k)) * 0.05, fp8.WEIGHT_BLOCK)
        run_twice(f"{shape.name} fp8 fwd", fp8_forward, x, w, sizes)


if __name__ == "__main__":
    main()
