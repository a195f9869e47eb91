"""The oxmoe layer's training step against the same layer written as MaxText writes it on
``tokamax.ragged_dot``, untuned and tuned, at issue 19's three one-GPU layers, in one run (the
issue asks for oxmoe at 1.5x or more of the MaxText-style layer on autotuned tokamax).

Layers: Mixtral and Qwen3-30B-A3B (``oxmoe.bench.moe.LAYERS``) and DeepSeek-V3 on one GPU (one
rank of its EP = 8: 8192 tokens, 32 experts; ``bench/fp8_gemm.py``'s). The MaxText-style layer is
:func:`oxmoe.reference.moe.moe` (``jax.lax.top_k`` routing, the copies sorted by expert with
``argsort``, the two projections as ragged dots, unsorted and weight-summed) with its two
``jax.lax.ragged_dot`` calls made by tokamax's Pallas Mosaic GPU implementation, differentiated
by JAX through tokamax's VJP (the d lhs and d rhs products). Per layer:

- each of its six products (forward, d lhs and d rhs of the up and the down projection) tuned
  at the layer's shape and the group sizes its routing gives (``bench/tokamax_gemm.py``'s
  :func:`tune`: a line per candidate configuration);
- the training step (``oxmoe.bench.moe.step``: ``value_and_grad`` of ``sum(y * w)`` and the
  losses), median of 7 x 10 steps, of oxmoe, of the tokamax layer with tokamax's default
  configurations, and of the tokamax layer with each product's tuned one;
- the tuned tokamax step's outputs against oxmoe's (``oxmoe.bench.moe.compare``), and which of
  them are past the limits the benchmark holds oxmoe's to against plain JAX.

Prints a line per measurement and a last ``JSON {...}`` line. Arguments, if any, select the layers
whose name contains one of them. Needs a GPU and tokamax (``bench/tokamax_gemm.py`` says how to
carry it).
"""

import functools
import json
import sys
import zlib
from unittest import mock

import jax
import jax.numpy as jnp
import tokamax
from tokamax._src.ops.ragged_dot import base as tokamax_ragged_dot
from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot

import oxmoe
from oxmoe import reference
from oxmoe.bench import moe as bench_moe
from oxmoe.bench.grouped_gemm import PRODUCTS
import fp8_gemm
from gemm_ab import product_operands
from step_ab import median_seconds
from tokamax_gemm import DIMENSIONS, describe, tune


def layers() -> list[bench_moe.Layer]:
    by_name = fp8_gemm.layers_by_name(smoke=False)
    return [by_name[name] for name in ("mixtral", "qwen3_30b_a3b", "deepseek_v3 1 device E=32")]


def tuned_op(configs: dict) -> PallasMosaicGpuRaggedDot:
    """tokamax's op with ``configs["fwd"]``, whose VJP makes its d lhs and d rhs products with
    ``configs["dlhs"]`` and ``configs["drhs"]`` (as tokamax's own VJP does, with its default)."""
    vjp = functools.partial(tokamax_ragged_dot.vjp, dlhs_ragged_dot=PallasMosaicGpuRaggedDot(config=configs["dlhs"]),
                            drhs_ragged_dot=PallasMosaicGpuRaggedDot(config=configs["drhs"]))
    return PallasMosaicGpuRaggedDot(config=configs["fwd"], vjp=vjp)


def tokamax_layer(config, ops: dict):
    """The MaxText-style layer with each ``jax.lax.ragged_dot`` of weights of shape ``s`` made by
    ``ops[s]`` (the up projection's ``[E, H, 2F]`` and the down's ``[E, F, H]``)."""
    def ragged_dot(lhs, rhs, group_sizes):
        return ops[rhs.shape](lhs, rhs, group_sizes=group_sizes)

    def layer(x, params):
        # The reference calls jax.lax.ragged_dot by name while it is traced: only its two calls.
        with mock.patch.object(jax.lax, "ragged_dot", ragged_dot):
            return reference.moe.moe(x, params, config)
    return layer


def main(selected: list[str]) -> None:
    results: dict = {}
    for layer in layers():
        if selected and not any(part in layer.name for part in selected):
            continue
        (args,) = bench_moe._draw_sets(layer, bench_moe.Placement(None), (0, zlib.crc32(layer.name.encode())), 1)
        x, params, _ = args
        sizes = jax.jit(lambda x, p: reference.moe.moe(x, p, layer.config)[1].tokens_per_expert)(x, params)
        row: dict = {"group_sizes_max_over_mean": float(jnp.max(sizes) / jnp.mean(sizes.astype(jnp.float32)))}
        ops = {}
        for shape, weights in zip(layer.gemms()[:2], (params.up, params.down)):
            configs = {}
            for product in (p for p in PRODUCTS if p.name in DIMENSIONS):
                configs[product.name] = tune(f"{shape.name} {product.name} tokamax", product.name,
                                             (*product_operands(product, shape), sizes))
                row[f"{shape.name.split()[-1]} {product.name} config"] = describe(configs[product.name])
            ops[weights.shape] = tuned_op(configs)
        steps = {"oxmoe": bench_moe.oxmoe_layer(layer.config),
                 "tokamax untuned": tokamax_layer(layer.config, {w.shape: PallasMosaicGpuRaggedDot()
                                                                 for w in (params.up, params.down)}),
                 "tokamax tuned": tokamax_layer(layer.config, ops)}
        outputs = {}
        for name, fn in steps.items():
            step = jax.jit(bench_moe.step(fn))
            outputs[name] = step(*args)
            row[f"{name} ms"] = median_seconds(step, *args) * 1e3
            print(f"{layer.name} {name}: {row[f'{name} ms']:.2f} ms a step", flush=True)
        for name in ("tokamax untuned", "tokamax tuned"):
            row[f"oxmoe against {name}"] = row[f"{name} ms"] / row["oxmoe ms"]
            print(f"{layer.name}: oxmoe {row[f'oxmoe against {name}']:.2f}x the {name} layer", flush=True)
        errors = {name: float(value) for name, value in
                  bench_moe.compare(outputs["tokamax tuned"], outputs["oxmoe"]).items()}
        limits = bench_moe.limits_of(layer)
        row["tuned errors against oxmoe"] = errors
        row["tuned errors past the limits"] = [name for name, value in errors.items() if not value <= limits[name]]
        print(f"{layer.name}: the tuned tokamax layer's outputs against oxmoe's {errors}; past the benchmark's "
              f"limits: {row['tuned errors past the limits'] or 'none'}", flush=True)
        results[layer.name] = row
    print("JSON", json.dumps({"build": oxmoe.build_id(), "tokamax": tokamax.__version__, "jax": jax.__version__,
                              "device": jax.devices()[0].device_kind, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
