"""Runs each router kernel once at the benchmark shapes, for a profiler.

    ncu --clock-control none -k regex:<kernel> python3 bench/profile_router.py
"""

import jax
import jax.numpy as jnp

from oxmoe import router
from oxmoe.bench.router import TOKENS
from oxmoe.model_shapes import DEEPSEEK_V3, MIXTRAL, QWEN3_MOE


def main():
    key = jax.random.key(0)
    logits = {c.num_experts: jax.random.normal(key, (TOKENS, c.num_experts), jnp.bfloat16)
              for c in (MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)}
    bias = 0.1 * jax.random.normal(key, (DEEPSEEK_V3.num_experts,), jnp.float32)

    def topk(c, expert_bias=None):
        return lambda: router.topk(logits[c.num_experts], c.topk, expert_bias=expert_bias, **c.topk_kwargs())

    ops = {
        "deepseek_v3 topk": topk(DEEPSEEK_V3, bias),
        "qwen3 topk": topk(QWEN3_MOE),
        "mixtral topk": topk(MIXTRAL),
        "deepseek_v3 scores": lambda: router.aux_loss_scores(logits[DEEPSEEK_V3.num_experts], DEEPSEEK_V3.topk,
                                                             score_function=DEEPSEEK_V3.score_function),
    }
    for name, op in ops.items():
        jax.block_until_ready(jax.jit(op)())
        print(name, "done")


if __name__ == "__main__":
    main()
