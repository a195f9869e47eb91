"""Times the MoE layer's training step (forward + backward) on one GPU at the
issue's shapes, with its parts: the forward alone, the expert GEMMs alone, and
a dense GEMM for the device's peak. The short loop for layer work; the numbers
that count come from `python -m oxmoe.bench --only moe_layer`.

    python3 bench/profile_moe.py [--shape mixtral|qwen3] [--nsys]
"""

import argparse
import time

import jax
import jax.numpy as jnp

from oxmoe import moe, ragged_dot, transposed_ragged_dot
from oxmoe.model_shapes import MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER

SHAPES = {"mixtral": MIXTRAL_LAYER, "qwen3": QWEN3_30B_A3B_LAYER}


def seconds(fn, *args, iters=20):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    args = parser.parse_args()
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    peak = 2 * 8192**3 / seconds(jax.jit(lambda a: a @ a), a)
    print(f"dense bf16 8192^3: {peak / 1e12:.0f} TFLOP/s")
    for name in args.shape or sorted(SHAPES):
        shape = SHAPES[name]
        t, h, f, e, k = shape.tokens, shape.hidden, shape.ffn, shape.num_experts, shape.topk
        config = moe.MoEConfig(**shape.router.moe_kwargs(), aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
        params = moe.init_params(jax.random.key(1), config, h, f, jnp.bfloat16)
        x = jax.random.normal(jax.random.key(2), (t, h), jnp.bfloat16)

        def loss(x, params):
            y, aux = moe.moe(x, params, config)
            return jnp.sum(y.astype(jnp.float32)) + aux.load_balancing_loss + aux.z_loss

        gemm_flops = 3 * (2 * t * k * h * 2 * f + 2 * t * k * f * h)
        step = seconds(jax.jit(jax.grad(loss, (0, 1))), x, params)
        fwd = seconds(jax.jit(lambda x, p: moe.moe(x, p, config)), x, params)
        # The four expert GEMM shapes of a step alone, on evenly split groups.
        rows = jax.random.normal(jax.random.key(3), (t * k, h), jnp.bfloat16)
        sizes = jnp.full((e,), t * k // e, jnp.int32)
        up_out = jax.random.normal(jax.random.key(4), (t * k, 2 * f), jnp.bfloat16)
        hidden = up_out[:, :f]

        def gemms(rows, up_out, hidden, p):
            return (ragged_dot(rows, p.up, sizes), ragged_dot(hidden, p.down, sizes),
                    ragged_dot(rows, p.down, sizes, rhs_transposed=True),
                    transposed_ragged_dot(hidden, rows, sizes, num_groups=e),
                    ragged_dot(up_out, p.up, sizes, rhs_transposed=True),
                    transposed_ragged_dot(rows, up_out, sizes, num_groups=e))

        gemm = seconds(jax.jit(gemms), rows, up_out, hidden, params)
        print(f"{name}: step {step * 1e3:.2f} ms = {gemm_flops / step / 1e12:.0f} TFLOP/s "
              f"({gemm_flops / step / peak:.0%} of dense); forward {fwd * 1e3:.2f} ms; "
              f"the six GEMMs alone {gemm * 1e3:.2f} ms ({gemm_flops / gemm / peak:.0%} of dense)")


if __name__ == "__main__":
    main()
