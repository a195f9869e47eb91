"""The MoE layer's dispatch and up projection (with its SwiGLU), two ways, at the benchmark's
one-GPU layer shapes:

- ``copied``: ``permutation.dispatch_fwd`` writes the dispatched rows ``[R, H]`` (the layer's
  forward before ``lhs_rows``), then ``ragged_dot_activation`` reads them;
- ``gathered``: the dispatch lays out its maps only (rows of width 0), and
  ``ragged_dot_activation(tokens, ..., lhs_rows=source_tokens)`` reads each row from its token
  as it loads its tiles (the layer's forward now);
- ``product``: ``ragged_dot_activation`` on rows already dispatched (the floor of both), and
  ``product_gathered`` the same product with the rows read through the map; ``plain`` and
  ``plain_gathered``: ``ragged_dot`` (no activation) both ways.

Routing: each token's top-k of random logits. Median of 7 x 10 calls
(``step_ab.median_seconds``). Checks before timing that both ways give the same results bit
for bit. Prints one line per shape and a last ``JSON {...}`` line with the build id and every
time in us. Needs a GPU.
"""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import grouped_gemm, permutation
from step_ab import median_seconds

# (name, tokens, H, F, experts, top-k): the benchmark's layers on one GPU.
LAYERS = [("mixtral", 32768, 1024, 4096, 8, 2), ("qwen3_30b_a3b", 16384, 2048, 768, 128, 8),
          ("deepseek_v3_E32", 8192, 7168, 2048, 32, 8)]


def copied(tokens, routing_map, probs, up, *, rows: int):
    d = permutation.dispatch_fwd(tokens, routing_map, probs, num_rows=rows, align_size=None)
    return tuple(grouped_gemm.ragged_dot_activation(d.tokens, up, d.group_sizes, "swiglu"))


def gathered(tokens, routing_map, probs, up, *, rows: int):
    d = permutation.dispatch_fwd(tokens[:, :0], routing_map, probs, num_rows=rows, align_size=None)
    return tuple(grouped_gemm.ragged_dot_activation(tokens, up, d.group_sizes, "swiglu",
                                                    lhs_rows=d.row_id_map.source_tokens))


def main(label: str) -> None:
    results = {}
    for name, tokens, hidden, ffn, experts, top_k in LAYERS:
        key_x, key_w, key_logits = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(key_x, (tokens, hidden), jnp.bfloat16)
        up = (jax.random.normal(key_w, (experts, hidden, 2 * ffn), jnp.float32) / np.sqrt(hidden)).astype(jnp.bfloat16)
        logits = jax.random.normal(key_logits, (tokens, experts), jnp.float32)
        _, chosen = jax.lax.top_k(logits, top_k)
        routing_map = jnp.zeros((tokens, experts), bool).at[jnp.arange(tokens)[:, None], chosen].set(True)
        probs = jnp.where(routing_map, 1.0 / top_k, 0.0).astype(jnp.float32)
        rows = permutation.dispatch_fwd(x, routing_map, probs, num_rows=tokens * top_k, align_size=None)
        ways = {way: jax.jit(functools.partial(fn, rows=tokens * top_k))
                for way, fn in (("copied", copied), ("gathered", gathered))}
        got, want = ways["gathered"](x, routing_map, probs, up), ways["copied"](x, routing_map, probs, up)
        for part, a, b in zip(("pre_activation", "hidden"), got, want):
            assert bool(jnp.all(a == b)), f"{name}: the gathered {part} differs from the copied rows'"
        us = {way: median_seconds(fn, x, routing_map, probs, up) * 1e6 for way, fn in ways.items()}
        # The products alone, on rows dispatched before (and the plain product, without the activation).
        source = rows.row_id_map.source_tokens
        products = {
            "product": (lambda r, w, s: tuple(grouped_gemm.ragged_dot_activation(r, w, s, "swiglu")), rows.tokens),
            "product_gathered": (lambda t, w, s: tuple(grouped_gemm.ragged_dot_activation(
                t, w, s, "swiglu", lhs_rows=source)), x),
            "plain": (lambda r, w, s: grouped_gemm.ragged_dot(r, w, s), rows.tokens),
            "plain_gathered": (lambda t, w, s: grouped_gemm.ragged_dot(t, w, s, lhs_rows=source), x),
        }
        for way, (fn, lhs) in products.items():
            us[way] = median_seconds(jax.jit(fn), lhs, up, rows.group_sizes) * 1e6
        results[name] = us
        print(f"{label} {name} T{tokens} H{hidden} F{ffn} E{experts} k{top_k}: " +
              ", ".join(f"{way} {t:.0f} us" for way, t in us.items()) +
              f"; gathered - copied {us['gathered'] - us['copied']:+.0f} us", flush=True)
    print("JSON", json.dumps({"label": label, "build": oxmoe.build_id(), "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
