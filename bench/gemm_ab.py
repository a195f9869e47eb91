"""oxmoe's bf16 grouped GEMM at the benchmark's shapes against a dense GEMM of the same FLOPs,
for comparing two builds of oxmoe run in turn (the benchmark's ``grouped_gemm`` family also
times ``jax.lax.ragged_dot``, which takes minutes at these shapes).

Per shape of :data:`oxmoe.model_shapes.EXPERT_GEMMS`, group sizes a Dirichlet(alpha = 4) split
of M (the benchmark's first draw, one fixed draw), the benchmark's four products
(``oxmoe.bench.grouped_gemm.PRODUCTS``) and its dense ``jnp.dot`` of each: median of 5 x 20
calls (``step_ab.median_seconds``), TFLOP/s = 2 M K N / time, and a digest of each output
(two builds with the same digests computed the same bits). Run it once per build,
alternating, e.g.

    for i in 1 2; do
      OXMOE_LIBRARY=old/liboxmoe.so PYTHONPATH=old/jax_bindings python3 bench/gemm_ab.py before_$i
      python3 bench/gemm_ab.py after_$i
    done

Prints one line per product and a last ``JSON {...}`` line with the label, the build id and
every number. Needs a GPU.
"""

import functools
import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe.bench.grouped_gemm import DENSE, DRAWS, PRODUCTS
from oxmoe.model_shapes import EXPERT_GEMMS
from step_ab import median_seconds


def digest(x) -> str:
    return hashlib.sha1(np.asarray(x).view(np.uint16).tobytes()).hexdigest()[:12]


def draw(key, shape):
    return jax.random.normal(key, shape, jnp.bfloat16)


def group_sizes(shape):
    """The benchmark's first draw of ``shape``'s group sizes, one fixed draw."""
    return jnp.asarray(DRAWS[0].sizes(np.random.default_rng(0), shape.m, shape.groups))


def product_operands(product, shape):
    """``product``'s bf16 operands at ``shape`` (the same draw for every build)."""
    keys = jax.random.split(jax.random.key(0), 2)
    return [draw(key, s) for key, s in zip(keys, product.operands(shape))]


def dense_operands(dense: str, shape):
    """The bf16 operands of the benchmark's dense GEMM ``dense`` (a key of ``DENSE``) at ``shape``."""
    keys = jax.random.split(jax.random.key(1), 2)
    return [draw(key, s) for key, s in zip(keys, DENSE[dense](shape))]


def main(label: str) -> None:
    results = {}
    for shape in EXPERT_GEMMS:
        sizes = group_sizes(shape)
        flops = 2 * shape.m * shape.k * shape.n

        @functools.cache
        def dense_seconds(dense: str) -> float:
            """The benchmark's dense GEMM of a product (shared by the two forwards)."""
            return median_seconds(jax.jit(jnp.dot), *dense_operands(dense, shape), calls=20, samples=5)

        for product in PRODUCTS:
            operands = product_operands(product, shape)
            timed = jax.jit(product.oxmoe)
            seconds = median_seconds(timed, *operands, sizes, calls=20, samples=5)
            dense = dense_seconds(product.dense)
            row = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12, "dense_tflops": flops / dense / 1e12,
                   "of_dense": dense / seconds, "digest": digest(timed(*operands, sizes))}
            name = f"{shape.name} {product.name}"
            results[name] = row
            print(f"{label} {name}: {row['us']:.0f} us {row['tflops']:.0f} TFLOP/s ({row['of_dense']:.0%} of dense "
                  f"{row['dense_tflops']:.0f}) out {row['digest']}", flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
