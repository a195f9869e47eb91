"""oxmoe's grouped GEMM products against ``tokamax.ragged_dot``'s, untuned and tuned, at the
benchmark's shapes, in one run (issue 19 asks for tokamax autotuned on the same shapes), and the
tuning that ``bench/tokamax_layer.py`` applies to the layer's products.

Per shape of :data:`oxmoe.model_shapes.EXPERT_GEMMS` (``bench/gemm_ab.py``'s draws: the
benchmark's first draw of group sizes, each product's operands and its dense GEMM's) and per
product, as tokamax's VJP calls it (``fwd``: ``lhs [M, K] x rhs [G, K, N]``; ``dlhs``: ``dout [M,
N]`` times each group's ``rhs`` transposed; ``drhs``: ``lhs`` and ``dout`` contracted over each
group's rows into ``[G, K, N]``), in bf16: oxmoe's product, a dense ``jnp.dot`` of the same
FLOPs, and tokamax's Pallas Mosaic GPU implementation with its default configuration (what
``tokamax.ragged_dot`` runs on an H200: its autotuning cache has no entry for one) and tuned (the
fastest of :func:`candidates`); median of 5 x 20 calls (``step_ab.median_seconds``; a candidate
3 x 10). Every output, oxmoe's and tokamax's, goes through the benchmark's reference check
(``oxmoe.bench.grouped_gemm.Product.check``: relative error, and elements past its bound). Prints a line
per timing and a last ``JSON {...}`` line. Arguments, if any, select the cases whose ``"<shape>
<product>"`` contains one of them (``python3 bench/tokamax_gemm.py "mixtral up fwd"``).

Why candidates and not ``tokamax.autotune``: tokamax's sm90 search space is 384 configurations
(its tile's N fixed at 64 for a bf16 output), of which its autotuning timed the 51-52 that
compiled, about two minutes a product; on 2026-11-25 (``bench/NOTES.md``, "tokamax autotuned")
it chose the same configuration at all four forward shapes: 128-row tiles 128 deep, four stages,
persistent, an N-minor raster of width 8. The candidates are that configuration and its
neighbours in the same space, eight a product, so that all 30 products (these 12 and the three
layers' 18) fit in a session's device time. In tokamax 0.0.17, ``with tuning:`` also did not
reach ``ragged_dot`` (its results are keyed by the op, whose VJP closures differ between
instances), so a tuned product is the op built with its configuration, as here.

tokamax is not a dependency of oxmoe: it needs JAX 0.11.1 or newer and a GPU. On a machine
without network, carry its wheels (``tokamax``, ``qwix``, ``einshape``, ``immutabledict``,
``pydantic`` with ``pydantic-core``, ``annotated-types``, ``typing-inspection`` and
``typing-extensions``), install them into a directory on ``PYTHONPATH`` and run
``python3 bench/tokamax_gemm.py``. tokamax imports ``xprof.cli.tools.get_kernel_stats_tool`` for
its own profiling only; where xprof is missing, a stub module that defines it as ``None``
satisfies the import.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tokamax
# tokamax's public ragged_dot takes no configuration: the op class and its config are its own.
from tokamax._src.ops.ragged_dot import base as tokamax_ragged_dot
from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config, MatmulDimension

import oxmoe
from oxmoe.bench.grouped_gemm import PRODUCTS
from oxmoe.model_shapes import EXPERT_GEMMS
from gemm_ab import dense_operands, group_sizes, product_operands
from step_ab import median_seconds

#: The products tokamax's VJP makes of a ``ragged_dot``, by the benchmark's names.
DIMENSIONS = {"fwd": tokamax_ragged_dot.DEFAULT_RAGGED_DOT_DIM_NUMS,
              "dlhs": tokamax_ragged_dot.TRANS_RHS_RAGGED_DOT_DIM_NUMS,
              "drhs": tokamax_ragged_dot.RAGGED_CONTRACTING_DOT_DIM_NUMS}


def candidates(product: str) -> list[Config]:
    """The configurations tried for ``product``: the full autotuning's choice and its neighbours
    (tile rows 64 or 128, 128 or 256 deep; the forward kernel's raster M- or N-minor, the
    d rhs kernel's 2 or 4 stages: it is not persistent and has no raster)."""
    if product == "drhs":
        return [Config(block_m=m, block_n=64, block_k=k, num_stages=stages, split_k=1, persistent=False)
                for m in (128, 64) for k in (128, 256) for stages in (4, 2)]
    return [Config(block_m=m, block_n=64, block_k=k, num_stages=4, split_k=1, persistent=True,
                   grid_minor_dim=minor, grid_tile_width=8)
            for m in (128, 64) for k in (128, 256) for minor in (MatmulDimension.N, MatmulDimension.M)]


def describe(config: Config | None) -> str:
    if config is None:
        return "default"
    return (f"m{config.block_m} n{config.block_n} k{config.block_k} stages {config.num_stages}"
            + (f" persistent, {config.grid_minor_dim.name}-minor x{config.grid_tile_width}"
               if config.persistent else ""))


def tokamax_product(product: str, config: Config | None = None):
    """``(a, b, group_sizes) ->`` tokamax's ``product`` as its VJP calls it, with ``config``
    (None: its default, its heuristics' choice)."""
    op = PallasMosaicGpuRaggedDot(config=config)
    dimensions = DIMENSIONS[product]
    out_dtype = None if product == "fwd" else jnp.bfloat16  # the VJP's: the operand's dtype
    return lambda a, b, sizes: op(a, b, group_sizes=sizes, ragged_dot_dimension_numbers=dimensions,
                                  preferred_element_type=out_dtype)


def tune(label: str, product: str, args) -> Config:
    """The fastest of ``product``'s :func:`candidates` on ``args`` (a line per candidate)."""
    best: tuple[float, Config] | None = None
    for config in candidates(product):
        try:
            seconds = median_seconds(jax.jit(tokamax_product(product, config)), *args, calls=10, samples=3)
        except Exception as exc:  # a configuration that does not compile or fit is skipped, as tokamax's autotuning does
            print(f"{label} {describe(config)}: failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        print(f"{label} {describe(config)}: {seconds * 1e6:.0f} us", flush=True)
        if best is None or seconds < best[0]:
            best = (seconds, config)
    if best is None:
        raise RuntimeError(f"{label}: no candidate configuration ran")
    return best[1]


def timed(results: dict, name: str, flops: int, call, *args) -> float:
    seconds = median_seconds(call, *args, calls=20, samples=5)
    results[name] = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12}
    print(f"{name}: {seconds * 1e6:.0f} us {flops / seconds / 1e12:.0f} TFLOP/s", flush=True)
    return seconds


def checked(product, got, operands, sizes) -> dict:
    """``got`` against the benchmark's reference check of ``product`` (each group's product in
    float32 at full precision on the device): its relative error and the elements past its
    error bound."""
    errors = product.check(got, *operands, sizes, np.asarray(sizes), on_host=False)
    return {name: float(value) for name, value in errors.items()}


def describe_errors(errors: dict) -> str:
    return f"relative error {errors['rel_err']:.1e}, {errors['bound_violations']:.0f} elements past the bound"


def main(selected: list[str]) -> None:
    results: dict = {}
    for shape in EXPERT_GEMMS:
        sizes = group_sizes(shape)
        flops = 2 * shape.m * shape.k * shape.n
        for product in PRODUCTS:
            name = f"{shape.name} {product.name}"
            if product.name not in DIMENSIONS or (selected and not any(part in name for part in selected)):
                continue
            operands = product_operands(product, shape)
            ours = jax.jit(product.oxmoe)
            oxmoe_s = timed(results, f"{name} oxmoe", flops, ours, *operands, sizes)
            results[f"{name} oxmoe"].update(checked(product, ours(*operands, sizes), operands, sizes))
            timed(results, f"{name} dense", flops, jax.jit(jnp.dot), *dense_operands(product.dense, shape))
            best = tune(f"{name} tokamax", product.name, (*operands, sizes))
            for label, config in (("untuned", None), ("tuned", best)):
                call = jax.jit(tokamax_product(product.name, config))
                errors = checked(product, call(*operands, sizes), operands, sizes)
                seconds = timed(results, f"{name} tokamax {label}", flops, call, *operands, sizes)
                results[f"{name} tokamax {label}"].update(errors, oxmoe_speedup=seconds / oxmoe_s,
                                                          config=describe(config))
                print(f"{name} tokamax {label} ({describe(config)}): oxmoe {seconds / oxmoe_s:.2f}x its speed; "
                      f"{describe_errors(errors)} (oxmoe's {describe_errors(results[f'{name} oxmoe'])})", flush=True)
    print("JSON", json.dumps({"build": oxmoe.build_id(), "tokamax": tokamax.__version__, "jax": jax.__version__,
                              "device": jax.devices()[0].device_kind, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
