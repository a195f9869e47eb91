"""The MoE layer's up-projection weight gradient, two ways, at the benchmark's one-GPU layer
shapes (Mixtral, Qwen3-30B-A3B, DeepSeek-V3 on one GPU with 32 experts):

- ``copied``: the dispatched rows gathered again from their tokens (``moe.exchange.rows_of``,
  the permutation's gather the layer used before), then ``transposed_ragged_dot`` on them;
- ``gathered``: ``transposed_ragged_dot(tokens, ..., lhs_rows=source_tokens)``, the product
  reading each row from its token as it loads its tiles (the layer's backward now);
- ``product``: ``transposed_ragged_dot`` alone on rows gathered before (the floor of both);
- ``in_order``: the gathered kernel on rows gathered before, through the identity map (what
  its one-row boxes cost without the gather's scattered reads).

Routing: each token's top-k of random logits. Median of 7 x 10 calls
(``step_ab.median_seconds``). Checks before timing that both ways give the same bits. Prints
one line per shape and a last ``JSON {...}`` line with the build id and every time in us.
Needs a GPU.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp

import oxmoe
from oxmoe import grouped_gemm, permutation
from oxmoe.moe.exchange import rows_of
from step_ab import median_seconds

# (name, tokens, H, F, experts, top-k): the benchmark's layers on one GPU.
LAYERS = [("mixtral", 32768, 1024, 4096, 8, 2), ("qwen3_30b_a3b", 16384, 2048, 768, 128, 8),
          ("deepseek_v3_E32", 8192, 7168, 2048, 32, 8)]


def copied(tokens, grad_up, sizes, row_map):
    return grouped_gemm.transposed_ragged_dot(rows_of(tokens, row_map), grad_up, sizes)


def gathered(tokens, grad_up, sizes, row_map):
    return grouped_gemm.transposed_ragged_dot(tokens, grad_up, sizes, lhs_rows=row_map.source_tokens)


def main(label: str) -> None:
    results = {}
    for name, tokens, hidden, ffn, experts, top_k in LAYERS:
        key_x, key_g, key_logits = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(key_x, (tokens, hidden), jnp.bfloat16)
        logits = jax.random.normal(key_logits, (tokens, experts), jnp.float32)
        _, chosen = jax.lax.top_k(logits, top_k)
        routing_map = jnp.zeros((tokens, experts), bool).at[jnp.arange(tokens)[:, None], chosen].set(True)
        d = permutation.dispatch(x, routing_map, topk=top_k)
        grad_up = jax.random.normal(key_g, (len(d.tokens), 2 * ffn), jnp.bfloat16)
        ways = {"copied": jax.jit(copied), "gathered": jax.jit(gathered)}
        args = (x, grad_up, d.group_sizes, d.row_id_map)
        got, want = ways["gathered"](*args), ways["copied"](*args)
        assert bool(jnp.all(got == want)), f"{name}: the gathered weight gradient differs from the copied rows'"
        us = {way: median_seconds(fn, *args) * 1e6 for way, fn in ways.items()}
        product = jax.jit(functools.partial(grouped_gemm.transposed_ragged_dot))
        us["product"] = median_seconds(product, d.tokens, grad_up, d.group_sizes) * 1e6
        in_order = jax.jit(lambda r, g, s: grouped_gemm.transposed_ragged_dot(
            r, g, s, lhs_rows=jnp.arange(len(r), dtype=jnp.int32)))
        us["in_order"] = median_seconds(in_order, d.tokens, grad_up, d.group_sizes) * 1e6
        flops = 2 * len(d.tokens) * hidden * 2 * ffn
        results[name] = us
        print(f"{label} {name} T{tokens} H{hidden} F{ffn} E{experts} k{top_k}: " +
              ", ".join(f"{way} {t:.0f} us" for way, t in us.items()) +
              f"; gathered - copied {us['gathered'] - us['copied']:+.0f} us, gathered / product "
              f"{us['gathered'] / us['product']:.3f}, product {flops / us['product'] / 1e6:.0f} TFLOP/s", flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
