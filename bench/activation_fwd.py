"""The MoE layer's up projection with its SwiGLU, three ways, at the benchmark's layer shapes:

- ``ragged_dot``: the product alone, ``[M, H] x [E, H, 2F]`` (the floor of the other two);
- ``unfused``: the product, then the activation as the layer's forward computes it
  (``silu(gate) * up`` in float32 from the bf16 product, rounded: one XLA pass reading
  ``[M, 2F]`` and writing ``[M, F]``);
- ``fused``: :func:`oxmoe.grouped_gemm.ragged_dot_activation`, both results from one kernel
  on Hopper.

Group sizes: a Dirichlet(4) split of M (one fixed draw). Median of 7 x 10 calls
(``step_ab.median_seconds``). Checks before timing that the fused pre-activation is
bit for bit ``ragged_dot``'s and counts the hidden values that differ from the unfused
pass's (XLA's sigmoid and oxmoe's may round an ulp apart). Prints one line per shape and a
last ``JSON {...}`` line with the build id and every time in us. Needs a GPU.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import grouped_gemm
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER, MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER
from step_ab import median_seconds

# The up projections of the benchmark's layers: Mixtral and Qwen3-30B-A3B on one GPU,
# DeepSeek-V3 on one of eight expert-parallel ranks.
SHAPES = [MIXTRAL_LAYER.up_gemm(), QWEN3_30B_A3B_LAYER.up_gemm(), DEEPSEEK_V3_LAYER.up_gemm(8)]


def unfused(lhs, rhs, sizes):
    u = grouped_gemm.ragged_dot(lhs, rhs, sizes)
    gate, up = jnp.split(u.astype(jnp.float32), 2, axis=-1)
    return u, (jax.nn.silu(gate) * up).astype(u.dtype)


def main(label: str) -> None:
    results = {}
    for shape in SHAPES:
        key_lhs, key_rhs = jax.random.split(jax.random.key(0))
        lhs = jax.random.normal(key_lhs, (shape.m, shape.k), jnp.bfloat16)
        rhs = (jax.random.normal(key_rhs, (shape.groups, shape.k, 2 * shape.n), jnp.float32)
               / np.sqrt(shape.k)).astype(jnp.bfloat16)
        rng = np.random.default_rng(0)
        sizes = jnp.asarray(rng.multinomial(shape.m, rng.dirichlet(np.full(shape.groups, 4.0))), jnp.int32)
        ways = {"ragged_dot": jax.jit(grouped_gemm.ragged_dot), "unfused": jax.jit(unfused),
                "fused": jax.jit(lambda a, b, s: tuple(grouped_gemm.ragged_dot_activation(a, b, s, "swiglu")))}
        pre, hidden = ways["fused"](lhs, rhs, sizes)
        plain_pre, plain_hidden = ways["unfused"](lhs, rhs, sizes)
        assert bool(jnp.all(pre == plain_pre)), f"{shape.name}: the fused product differs from ragged_dot's"
        differ = int(jnp.sum(hidden != plain_hidden))
        us = {way: median_seconds(fn, lhs, rhs, sizes) * 1e6 for way, fn in ways.items()}
        results[shape.name] = dict(us=us, hidden_values_differing=differ, hidden_values=int(hidden.size))
        print(f"{label} {shape.name} M{shape.m} K{shape.k} F{shape.n}: " +
              ", ".join(f"{way} {t:.0f} us" for way, t in us.items()) +
              f"; fused / unfused {us['fused'] / us['unfused']:.3f}; hidden values differing {differ} of {hidden.size}",
              flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
