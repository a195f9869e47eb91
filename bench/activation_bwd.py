"""The MoE layer's backward through its down projection and SwiGLU, three ways, at the
benchmark's layer shapes:

- ``ragged_dot``: the down projection's d lhs product alone, ``[M, H] x [E, F, H]ᵀ`` (the
  floor of the other two);
- ``unfused``: the product, then :func:`oxmoe.activation.activation_bwd` (one pass reading
  the product ``[M, F]`` and the pre-activation ``[M, 2F]``, writing ``[M, 2F]`` and
  ``[M, F]``): the layer's backward before the fused primitive;
- ``fused``: :func:`oxmoe.grouped_gemm.ragged_dot_activation_bwd`, the activation's backward
  in the product's epilogue on Hopper.

Group sizes: a Dirichlet(4) split of M (one fixed draw). Median of 7 x 10 calls
(``step_ab.median_seconds``). Checks before timing how many values of each result differ
from the unfused way's (the epilogue's approximate exponential may round an ulp apart; the
weights' gradients are sums in another order). Prints one line per shape and a last
``JSON {...}`` line with the build id and every time in us. Needs a GPU.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import activation, grouped_gemm
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER, MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER
from step_ab import median_seconds

# The down projections of the benchmark's layers: Mixtral and Qwen3-30B-A3B on one GPU,
# DeepSeek-V3 on one of eight expert-parallel ranks ([M, F] x [E, F, H]).
SHAPES = [MIXTRAL_LAYER.down_gemm(), QWEN3_30B_A3B_LAYER.down_gemm(), DEEPSEEK_V3_LAYER.down_gemm(8)]


def product(grad_out, down, sizes, pre, probs):
    return grouped_gemm.ragged_dot(grad_out, down, sizes, rhs_transposed=True)


def unfused(grad_out, down, sizes, pre, probs):
    return tuple(activation.activation_bwd(product(grad_out, down, sizes, pre, probs), pre, probs, "swiglu"))


def fused(grad_out, down, sizes, pre, probs):
    return tuple(grouped_gemm.ragged_dot_activation_bwd(grad_out, down, sizes, pre, probs, "swiglu"))


def main(label: str) -> None:
    results = {}
    for shape in SHAPES:
        m, features, hidden = shape.m, shape.k, shape.n
        keys = jax.random.split(jax.random.key(0), 4)
        grad_out = jax.random.normal(keys[0], (m, hidden), jnp.bfloat16)
        down = (jax.random.normal(keys[1], (shape.groups, features, hidden), jnp.float32)
                / np.sqrt(hidden)).astype(jnp.bfloat16)
        pre = (2.0 * jax.random.normal(keys[2], (m, 2 * features), jnp.float32)).astype(jnp.bfloat16)
        probs = jax.random.uniform(keys[3], (m,), jnp.float32)
        rng = np.random.default_rng(0)
        sizes = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.full(shape.groups, 4.0))), jnp.int32)
        args = (grad_out, down, sizes, pre, probs)
        ways = {"ragged_dot": jax.jit(product), "unfused": jax.jit(unfused), "fused": jax.jit(fused)}
        differing = {name: int(jnp.sum(a != b)) for name, a, b in
                     zip(activation.ActivationGrads._fields, ways["fused"](*args), ways["unfused"](*args))}
        us = {way: median_seconds(fn, *args) * 1e6 for way, fn in ways.items()}
        results[shape.name] = dict(us=us, values_differing=differing)
        print(f"{label} {shape.name} M{m} H{hidden} F{features}: " +
              ", ".join(f"{way} {t:.0f} us" for way, t in us.items()) +
              f"; fused / unfused {us['fused'] / us['unfused']:.3f}; values differing {differing}", flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
