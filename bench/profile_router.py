"""Runs each router kernel once at the benchmark shapes, for a profiler.

    ncu --clock-control none -k regex:<kernel> python3 bench/profile_router.py
"""

import jax
import jax.numpy as jnp

from oxmoe import router

T = 65536


def main():
    key = jax.random.key(0)
    logits = {e: jax.random.normal(key, (T, e), jnp.bfloat16) for e in (8, 128, 256)}
    bias = 0.1 * jax.random.normal(key, (256,), jnp.float32)
    ops = {
        "deepseek_v3 topk": lambda: router.topk(logits[256], 8, score_function="sigmoid", num_groups=8,
                                                group_topk=4, scaling_factor=2.5, expert_bias=bias),
        "qwen3 topk": lambda: router.topk(logits[128], 8),
        "mixtral topk": lambda: router.topk(logits[8], 2),
        "deepseek_v3 scores": lambda: router.aux_loss_scores(logits[256], 8, score_function="sigmoid"),
    }
    for name, op in ops.items():
        jax.block_until_ready(jax.jit(op)())
        print(name, "done")


if __name__ == "__main__":
    main()
