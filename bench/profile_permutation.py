"""Runs dispatch, combine and combine's backward once (after a warm-up call) at
the benchmark shapes, for a profiler.

    ncu --clock-control none -k regex:"count_routed|rank_chunks|assign_rows|scatter_rows|gather_rows" \\
        python3 bench/profile_permutation.py
"""

import jax
import jax.numpy as jnp

from oxmoe import permutation
from oxmoe.bench.permutation import MODELS


def main():
    key = jax.random.key(0)
    for model in MODELS:
        t, hidden, experts, topk = model.tokens, model.hidden, model.num_experts, model.topk
        x = jax.random.normal(key, (t, hidden), jnp.bfloat16)
        scores = jax.random.normal(key, (t, experts))
        chosen = jax.lax.top_k(scores, topk)[1]
        routing_map = jnp.zeros((t, experts), bool).at[jnp.arange(t)[:, None], chosen].set(True)
        probs = jnp.where(routing_map, jax.nn.softmax(scores), 0.0)
        for align_size in (None, 128):
            dispatch = jax.jit(lambda x, p: permutation.dispatch(
                x, routing_map, probs=p, topk=topk, align_size=align_size))
            combine_vjp = jax.jit(lambda g, rows, w, row_id_map: jax.vjp(
                lambda rows, w: permutation.combine(rows, row_id_map, merging_probs=w), rows, w)[1](g))
            for _ in range(2):
                d = jax.block_until_ready(dispatch(x, probs))
                jax.block_until_ready(permutation.combine(d.tokens, d.row_id_map, merging_probs=probs))
                jax.block_until_ready(combine_vjp(x, d.tokens, probs, d.row_id_map))


if __name__ == "__main__":
    main()
