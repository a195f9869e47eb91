"""Projects the expert-parallel training step at DeepSeek-V3 sizes per GPU (8192 tokens,
H 7168, 256 experts, top-8 in the best 4 of 8 groups) to EP = 8, 16 and 64, from:

- the one-GPU step without an exchange, measured on an H200 (bench/RESULTS.md, issue 16,
  two H200s, 2026-11-23, second session: 38.68 ms with 128 experts, steps back to back; the
  expert GEMMs multiply T k rows whatever the experts per GPU);
- the all_to_all of the (token, shard) rows measured between two NVLink H200s in the same
  run: 16150 rows of 7168 bf16 in 2 slots of 8192 rows, 425 us, of which one slot (117 MB)
  leaves the GPU: 276 GB/s per GPU leaving it;
- an assumed 50 GB/s per GPU between nodes of 8 GPUs (one 400 Gb/s NIC per GPU): NOT measured;
- the bytes of the all_to_all exchange (oxmoe.moe.exchange): the (token, shard) pairs,
  shards_per_token(n) per token, padded by the slot ladder (the HLO test saw 3-16% at EP 2-8),
  four exchanges a step, nothing overlapped;
- what EP costs besides the bytes, measured at EP = 2 in the same run (the all_to_all step,
  44.75 ms, less the one-GPU step and four exchanges): the router over all experts, the
  dispatch of the received tokens, elementwise work over the padded row buffers, and the
  wait for the busier GPU. It is carried unchanged to every EP (an assumption: the load
  imbalance grows with EP, the padded buffers with the shards).

Prints a Markdown table. Run: PYTHONPATH=jax_bindings python3 bench/project_ep.py
"""

from oxmoe import model_shapes
from oxmoe.moe import MoEConfig
from oxmoe.moe.exchange import shards_per_token

TOKENS, HIDDEN, BYTES = 8192, model_shapes.DEEPSEEK_V3_LAYER.hidden, 2
ONE_GPU_STEP_MS = 38.68
NVLINK_GBPS, NETWORK_GBPS, GPUS_PER_NODE = 276.0, 50.0, 8
PADDING = 1.16
EXCHANGES_PER_STEP = 4
EP2_STEP_MS, EP2_EXCHANGE_MS = 44.75, 0.425
#: What EP = 2 cost besides its four exchanges.
OTHER_MS = EP2_STEP_MS - ONE_GPU_STEP_MS - EXCHANGES_PER_STEP * EP2_EXCHANGE_MS


def main() -> None:
    config = MoEConfig(**model_shapes.DEEPSEEK_V3.moe_kwargs())
    print("| EP | experts per GPU | shards per token | MB per exchange per GPU | leaving the node | "
          "ms per exchange | projected step ms | × one-GPU step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shards in (2, 8, 16, 64):
        u = shards_per_token(config, shards)
        wire = TOKENS * u * PADDING * HIDDEN * BYTES * (shards - 1) / shards  # the self share stays
        remote = max(0, shards - GPUS_PER_NODE) / shards * shards / (shards - 1)  # of what leaves the GPU
        ms = max(wire * (1 - remote) / NVLINK_GBPS, wire * remote / NETWORK_GBPS) / 1e6
        step = ONE_GPU_STEP_MS + OTHER_MS + EXCHANGES_PER_STEP * ms
        print(f"| {shards} | {config.num_experts // shards} | {u:.2f} | {wire / 1e6:.0f} | {100 * remote:.0f}% | "
              f"{ms:.2f} | {step:.1f} | {step / ONE_GPU_STEP_MS:.2f}× |")


if __name__ == "__main__":
    main()
