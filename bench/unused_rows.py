"""What leaving the unused rows of the expert-row buffers unwritten saves, on one GPU: the
passes of the MoE layer that write or read a GPU's expert rows under expert parallelism (EP = 2),
timed with ``zero_unused_rows`` True (zeroed, as before) and False (as the layer now calls them).

At EP = 2 a GPU receives ``2 T`` tokens (two slots of ``T``) and dispatches them into a buffer of
``2 T min(k, El)`` rows (no token may be dropped), of which its experts take about half. Here each
received token goes to ``min(k, El) / 2`` of the ``El`` local experts, drawn at random, so that
the groups cover half the buffer, as in the layer's EP = 2 step. The passes, in a step's order:

- ``dispatch``: :func:`oxmoe.permutation.dispatch_fwd` of the received tokens;
- ``up``: :func:`oxmoe.grouped_gemm.ragged_dot_activation` (SwiGLU), ``down``: the down projection;
- ``grad rows`` (twice a step: the output's gradient, and the rows permuted again for the up
  weight's gradient): :func:`oxmoe.permutation.combine_bwd` without weights;
- ``down d lhs``, ``activation bwd`` (given ``group_sizes`` where the rows are left unwritten),
  ``up d lhs``.

    PYTHONPATH=jax_bindings python3 bench/unused_rows.py [--only qwen3_30b_a3b,deepseek_v3]

Prints each pass's time both ways and their sums, and a last ``JSON {...}`` line. Needs a GPU.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import activation, grouped_gemm, permutation
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER, MIXTRAL_8X7B_LAYER, QWEN3_30B_A3B_LAYER

from step_ab import median_seconds

#: (layer, tokens per GPU) of the benchmark's EP = 2 cases.
SHAPES = {"deepseek_v3": (DEEPSEEK_V3_LAYER, 8192), "qwen3_30b_a3b": (QWEN3_30B_A3B_LAYER, 16384),
          "mixtral_8x7b": (MIXTRAL_8X7B_LAYER, 32768)}
SHARDS = 2
PARTS = ("dispatch", "up", "down", "grad rows x2", "down d lhs", "activation bwd", "up d lhs")
#: Each pass's samples: at least this long, back to back (a pass is 0.2-26 ms).
SAMPLE_S = 0.05


def inputs(name: str):
    """The received tokens, their routing to the local experts, the weights and the gradients."""
    layer, tokens = SHAPES[name]
    config = layer.router.moe_kwargs()
    local = config["num_experts"] // SHARDS
    per_token = min(config["topk"], local)
    received, hidden, ffn = SHARDS * tokens, layer.hidden, layer.ffn
    rng = np.random.default_rng(0)
    chosen = np.argsort(rng.random((received, local)), axis=1)[:, :max(1, per_token // SHARDS)]
    routing_map = np.zeros((received, local), bool)
    np.put_along_axis(routing_map, chosen, True, axis=1)
    probs = np.where(routing_map, rng.random((received, local)), 0).astype(np.float32)
    key = jax.random.split(jax.random.key(0), 4)
    bf16 = jnp.bfloat16
    return dict(
        tokens=jax.random.normal(key[0], (received, hidden), bf16), routing_map=jnp.asarray(routing_map),
        probs=jnp.asarray(probs), rows=received * per_token,
        up=jax.random.normal(key[1], (local, hidden, 2 * ffn), bf16) * 0.02,
        down=jax.random.normal(key[2], (local, ffn, hidden), bf16) * 0.02,
        grad_y=jax.random.normal(key[3], (received, hidden), bf16))


def passes(x: dict, zero: bool) -> dict:
    """Each pass as a function of its operands, and its operands (from the passes before)."""
    def dispatch(tokens, routing_map, probs):
        return permutation.dispatch_fwd(tokens, routing_map, probs, num_rows=x["rows"], align_size=None,
                                        zero_unused_rows=zero)

    def up(rows, weight, sizes):
        return grouped_gemm.ragged_dot_activation(rows, weight, sizes, "swiglu", zero_unused_rows=zero)

    def down(hidden, weight, sizes):
        return grouped_gemm.ragged_dot(hidden, weight, sizes, zero_unused_rows=zero)

    def grad_rows(grad_y, row_map):
        return permutation.combine_bwd(grad_y, None, row_map, zero_unused_rows=zero)[0]

    def d_lhs(grad, weight, sizes):
        return grouped_gemm.ragged_dot(grad, weight, sizes, rhs_transposed=True, zero_unused_rows=zero)

    def activation_bwd(grad_hidden, pre, probs, sizes):
        return activation.activation_bwd(grad_hidden, pre, probs, "swiglu", group_sizes=None if zero else sizes)

    d = dispatch(x["tokens"], x["routing_map"], x["probs"])
    sizes, probs = d.group_sizes, d.probs.astype(jnp.float32)
    pre, hidden = up(d.tokens, x["up"], sizes)
    grad_out_rows = grad_rows(x["grad_y"], d.row_id_map)
    grad_hidden = d_lhs(grad_out_rows, x["down"], sizes)
    lhs_rows = activation_bwd(grad_hidden, pre, probs, sizes).grad_pre_activation
    return {
        "dispatch": (lambda *operands: dispatch(*operands).tokens, (x["tokens"], x["routing_map"], x["probs"])),
        "up": (up, (d.tokens, x["up"], sizes)),
        "down": (down, (hidden, x["down"], sizes)),
        "grad rows x2": (grad_rows, (x["grad_y"], d.row_id_map)),
        "down d lhs": (d_lhs, (grad_out_rows, x["down"], sizes)),
        "activation bwd": (activation_bwd, (grad_hidden, pre, probs, sizes)),
        "up d lhs": (d_lhs, (lhs_rows, x["up"], sizes)),
    }


def main(names) -> None:
    us = {}
    for name in names:
        x = inputs(name)
        covered = int(jnp.sum(x["routing_map"]))
        print(f"{name} EP = {SHARDS}: {len(x['tokens'])} received tokens, {x['rows']} rows, {covered} of them routed",
              flush=True)
        totals = {}
        for zero in (True, False):
            total = 0.0
            parts = passes(x, zero)
            assert tuple(parts) == PARTS
            for part, (fn, args) in parts.items():
                t = median_seconds(jax.jit(fn), *args, samples=9, sample_s=SAMPLE_S) * (2 if part.endswith("x2") else 1)
                us[f"{name} {part} {'zeroed' if zero else 'unwritten'}"] = t * 1e6
                total += t
            totals[zero] = total
            us[f"{name} total {'zeroed' if zero else 'unwritten'}"] = total * 1e6
        for part in PARTS:
            z, u = us[f"{name} {part} zeroed"], us[f"{name} {part} unwritten"]
            print(f"  {part:15s} zeroed {z:8.0f} us, unwritten {u:8.0f} us ({u - z:+7.0f})", flush=True)
        print(f"  {'sum':15s} zeroed {totals[True] * 1e6:8.0f} us, unwritten {totals[False] * 1e6:8.0f} us "
              f"({(totals[False] - totals[True]) * 1e6:+7.0f})", flush=True)
    print("JSON", json.dumps({"build": oxmoe.build_id(), "device": jax.devices()[0].device_kind, "us": us}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=lambda names: tuple(names.split(",")), default=tuple(SHAPES),
                        help=f"comma-separated shapes (of {tuple(SHAPES)})")
    args = parser.parse_args()
    main(args.only)
