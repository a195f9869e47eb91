"""Routes a batch of tokens through oxmoe's router and shows what it chose.

    python -m oxmoe.demo [--tokens N] [--seed S]

DeepSeek-V3-style routing (256 experts, top-8, sigmoid scores, 8 groups of
which the best 4 may be used, scaling 2.5, an expert bias) on random logits:
prints a few tokens' experts and weights, the load per expert group, the
load-balancing loss and its gradient norm, all computed by the oxmoe library.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import router

NUM_EXPERTS, TOPK, NUM_GROUPS, GROUP_TOPK, SCALING = 256, 8, 8, 4, 2.5


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)

    print(f"oxmoe {oxmoe.build_id()} on {jax.devices()[0].platform}: routing {args.tokens} tokens "
          f"to {TOPK} of {NUM_EXPERTS} experts ({NUM_GROUPS} groups, best {GROUP_TOPK} usable)")
    key_logits, key_bias = jax.random.split(jax.random.key(args.seed))
    logits = jax.random.normal(key_logits, (args.tokens, NUM_EXPERTS), jnp.bfloat16)
    expert_bias = 0.1 * jax.random.normal(key_bias, (NUM_EXPERTS,), jnp.float32)

    @jax.jit
    def route(logits):
        probs, routing_map = router.topk(
            logits, TOPK, score_function="sigmoid", num_groups=NUM_GROUPS, group_topk=GROUP_TOPK,
            scaling_factor=SCALING, expert_bias=expert_bias)
        tokens_per_expert = routing_map.sum(0, dtype=jnp.int32)
        _, scores = router.aux_loss_scores(logits, TOPK, score_function="sigmoid")
        loss, grad = jax.value_and_grad(lambda s: router.aux_loss(
            s, tokens_per_expert, total_num_tokens=logits.shape[0], topk=TOPK, coeff=1e-2))(scores)
        return probs, routing_map, tokens_per_expert, loss, jnp.linalg.norm(grad)

    route(logits)  # compile
    start = time.perf_counter()
    probs, routing_map, tokens_per_expert, loss, grad_norm = jax.block_until_ready(route(logits))
    elapsed = time.perf_counter() - start

    probs, routing_map = np.asarray(probs, np.float32), np.asarray(routing_map)
    print("\ntoken  experts (weight)")
    for t in range(4):
        chosen = np.flatnonzero(routing_map[t])
        order = chosen[np.argsort(-probs[t, chosen], kind="stable")]
        groups = sorted({int(e) // (NUM_EXPERTS // NUM_GROUPS) for e in chosen})
        print(f"{t:5d}  " + " ".join(f"{e}({probs[t, e]:.2f})" for e in order) + f"   groups {groups}")
    per_group = np.asarray(tokens_per_expert).reshape(NUM_GROUPS, -1).sum(1)
    print(f"\nassignments per group: {per_group.tolist()} (total {per_group.sum()} = tokens x {TOPK})")
    print(f"weights per token sum to {probs.sum(1).mean():.3f} (the scaling factor {SCALING})")
    print(f"load-balancing loss {float(loss):.6f}, |d loss / d scores| = {float(grad_norm):.3e}")
    print(f"routing + loss + gradient: {elapsed * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
