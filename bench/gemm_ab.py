"""oxmoe's bf16 grouped GEMM at the benchmark's shapes against a dense GEMM of the same FLOPs,
for comparing two builds of oxmoe run in turn (the benchmark's ``grouped_gemm`` family also
times ``jax.lax.ragged_dot``, which takes minutes at these shapes).

Per shape of :data:`oxmoe.model_shapes.EXPERT_GEMMS`, group sizes a Dirichlet(alpha = 4) split
of M (the benchmark's first draw, one fixed draw), the four products of the benchmark (fwd,
fwd with [G, N, K] weights, dlhs, drhs) and the dense ``jnp.dot`` of each: median of 5 x 20
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

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import grouped_gemm
from oxmoe.bench.grouped_gemm import DRAWS
from oxmoe.model_shapes import EXPERT_GEMMS
from step_ab import median_seconds


def digest(x) -> str:
    return hashlib.sha1(np.asarray(x).view(np.uint16).tobytes()).hexdigest()[:12]


def main(label: str) -> None:
    results = {}
    products = {
        "fwd": (lambda a, b, s: grouped_gemm.ragged_dot(a, b, s), lambda a, b: jnp.dot(a, b)),
        "fwd [G,N,K]": (lambda a, b, s: grouped_gemm.ragged_dot(a, b, s, rhs_transposed=True), None),
        "dlhs": (lambda a, b, s: grouped_gemm.ragged_dot(a, b, s, rhs_transposed=True), lambda a, b: jnp.dot(a, b.T)),
        "drhs": (lambda a, b, s: grouped_gemm.transposed_ragged_dot(a, b, s), lambda a, b: jnp.dot(a.T, b)),
    }
    for shape in EXPERT_GEMMS:
        m, k, n, g = shape.m, shape.k, shape.n, shape.groups
        sizes = jnp.asarray(DRAWS[0].sizes(np.random.default_rng(0), m, g))
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        dout = jax.random.normal(keys[1], (m, n), jnp.bfloat16)
        w = (jax.random.normal(keys[2], (g, k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        operands = {"fwd": (x, w), "fwd [G,N,K]": (x, jnp.swapaxes(w, 1, 2)), "dlhs": (dout, w), "drhs": (x, dout)}
        dense_operands = {"fwd": (x, w[0]), "dlhs": (dout, w[0]), "drhs": (x, dout)}
        flops = 2 * m * k * n
        for product, (ours, dense) in products.items():
            timed = jax.jit(ours)
            seconds = median_seconds(timed, *operands[product], sizes, calls=20, samples=5)
            row = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12,
                   "digest": digest(timed(*operands[product], sizes))}
            if dense is not None:
                dense_seconds = median_seconds(jax.jit(dense), *dense_operands[product], calls=20, samples=5)
                row["dense_tflops"] = flops / dense_seconds / 1e12
                row["of_dense"] = dense_seconds / seconds
            name = f"{shape.name} {product}"
            results[name] = row
            of_dense = f" ({row['of_dense']:.0%} of dense {row['dense_tflops']:.0f})" if dense else ""
            print(f"{label} {name}: {row['us']:.0f} us {row['tflops']:.0f} TFLOP/s{of_dense} out {row['digest']}",
                  flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
