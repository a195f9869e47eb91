"""Times oxmoe.fp8.quantize (the oxmoe_fp8_quantize primitive) on the device against its copy
bandwidth (issue 18's goal: at least 75%, the kernel's aim 85%), beside XLA's fusions of the
same semantics in plain JAX (oxmoe.reference.fp8.quantize), at the operands of the FP8 expert
GEMMs of a layer step:

- activations, one scale per token per 128 channels: the dispatched rows (T k rows of H), at
  Qwen3-30B-A3B's and DeepSeek-V3's one-GPU sizes;
- the same rows quantized per 128 tokens per channel (the weight gradient's operand as the
  SIMT kernels read it);
- transposed, in (1, 128) blocks of the transpose: the weight gradient's token-contiguous
  operands, as Hopper's FP8 wgmma reads them, from the dispatched rows [T k, H] and from the
  hidden activations [T k, F] (values [H, T k] and [F, T k]);
- one GPU's expert weights (E_local experts of ``[H, 2F]``) in 128 x 128 blocks, as they are
  and transposed (the forward's ``[E, 2F, H]``);
- both ways from one read (``oxmoe.fp8.quantize_with_transpose``): the experts' up weights
  (the forward's ``[E, 2F, H]`` and the backward's ``[E, H, 2F]``) and the up projection's
  gradient rows ``[T k, 2F]`` (per row for d lhs, transposed for the up weight's gradient),
  also timed as the two ``quantize`` calls they replace;
- requantized from FP8 rows in 1 x 128 blocks (``oxmoe.fp8.requantize``, dequantized to bf16
  as they are read): the output gradient's rows ``[T k, H]`` transposed for the down weight's
  gradient, also timed as the ``dequantize`` and ``quantize`` it replaces.

Bytes are the fewest the op moves: the bf16 input (or the FP8 values and their scales) read
once, the e4m3 values (1 byte) and float32 scales written once (both ways: twice). Each
case's result is checked bit for bit against the plain-JAX reference on the same device.

    PYTHONPATH=jax_bindings python3 bench/fp8_quantize.py [--smoke] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import fp8
from oxmoe.bench import timing
from oxmoe.reference import fp8 as fp8_reference

#: Issue 18's goal and the kernel's aim, as fractions of the copy bandwidth.
GOAL, AIM = 0.75, 0.85
DTYPE = jnp.bfloat16


class Case(NamedTuple):
    """x of ``shape`` quantized in ``block`` blocks."""

    name: str
    shape: tuple[int, ...]
    block: tuple[int, int]
    orientation: str
    """The results: x's quantization ("as_is"), its transpose's ("transposed"), or both from
    one read ("both": quantize_with_transpose)."""
    fp8_input: bool = False
    """x given as its FP8 values and 1 x 128 scales (requantize, to bf16)."""


#: At Qwen3 (T 16384, k 8, H 2048, F 768, 128 experts) and DeepSeek-V3 on one GPU (T 8192,
#: k 8, H 7168, F 2048, 32 experts).
CASES = (
    Case("qwen3 dispatched rows [T k, H]", (16384 * 8, 2048), fp8.ACTIVATION_BLOCK, "as_is"),
    Case("qwen3 dispatched rows, weight-gradient blocks", (16384 * 8, 2048), fp8.TRANSPOSED_ACTIVATION_BLOCK, "as_is"),
    Case("qwen3 dispatched rows transposed [H, T k]", (16384 * 8, 2048), fp8.ACTIVATION_BLOCK, "transposed"),
    Case("qwen3 hidden rows transposed [F, T k]", (16384 * 8, 768), fp8.ACTIVATION_BLOCK, "transposed"),
    Case("qwen3 expert up weights [E, H, 2F]", (128, 2048, 2 * 768), fp8.WEIGHT_BLOCK, "as_is"),
    Case("qwen3 expert up weights transposed [E, 2F, H]", (128, 2048, 2 * 768), fp8.WEIGHT_BLOCK, "transposed"),
    Case("qwen3 expert up weights both ways", (128, 2048, 2 * 768), fp8.WEIGHT_BLOCK, "both"),
    Case("qwen3 up-projection gradient rows [T k, 2F] both ways", (16384 * 8, 2 * 768), fp8.ACTIVATION_BLOCK, "both"),
    Case("qwen3 output-gradient rows requantized transposed [H, T k]", (16384 * 8, 2048), fp8.ACTIVATION_BLOCK,
         "transposed", fp8_input=True),
    Case("deepseek_v3 dispatched rows [T k, H]", (8192 * 8, 7168), fp8.ACTIVATION_BLOCK, "as_is"),
    Case("deepseek_v3 dispatched rows, weight-gradient blocks", (8192 * 8, 7168), fp8.TRANSPOSED_ACTIVATION_BLOCK,
         "as_is"),
    Case("deepseek_v3 dispatched rows transposed [H, T k]", (8192 * 8, 7168), fp8.ACTIVATION_BLOCK, "transposed"),
    Case("deepseek_v3 hidden rows transposed [F, T k]", (8192 * 8, 2048), fp8.ACTIVATION_BLOCK, "transposed"),
    Case("deepseek_v3 expert up weights [E, H, 2F]", (32, 7168, 2 * 2048), fp8.WEIGHT_BLOCK, "as_is"),
    Case("deepseek_v3 expert up weights transposed [E, 2F, H]", (32, 7168, 2 * 2048), fp8.WEIGHT_BLOCK, "transposed"),
    Case("deepseek_v3 expert up weights both ways", (32, 7168, 2 * 2048), fp8.WEIGHT_BLOCK, "both"),
    Case("deepseek_v3 up-projection gradient rows [T k, 2F] both ways", (8192 * 8, 2 * 2048), fp8.ACTIVATION_BLOCK,
         "both"),
    Case("deepseek_v3 output-gradient rows requantized transposed [H, T k]", (8192 * 8, 7168), fp8.ACTIVATION_BLOCK,
         "transposed", fp8_input=True),
)
#: A smoke run's rows, and its experts.
SMOKE_ROWS, SMOKE_EXPERTS = 256, 2


def smoke_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    lead = tuple(min(d, SMOKE_EXPERTS) for d in shape[:-2])
    return (*lead, SMOKE_ROWS, shape[-1])


def moved_bytes(shape, block, orientation="as_is", fp8_input=False) -> int:
    """x read once (bf16, or FP8 values and their 1 x 128 scales); each result's values (1
    byte an element) and scales written once."""
    elements = math.prod(shape)
    blocks = elements // (block[0] * block[1])
    results = 2 if orientation == "both" else 1
    read = elements + 4 * (elements // 128) if fp8_input else elements * jnp.dtype(DTYPE).itemsize
    return read + results * (elements + 4 * blocks)


def same_bits(q, want) -> bool:
    """Equal values (NaN where NaN) and scales, of one BlockQuantized or a tuple of them."""
    if isinstance(q, tuple):
        return len(q) == len(want) and all(same_bits(a, b) for a, b in zip(q, want))
    values, want_values = (np.asarray(v.astype(jnp.float32)) for v in (q.values, want.values))
    return (values.shape == want_values.shape and np.array_equal(values, want_values, equal_nan=True)
            and np.array_equal(np.asarray(q.scales), np.asarray(want.scales), equal_nan=True))


def quantizations(module, case: Case):
    """``x ->`` the case's quantization by ``module`` (oxmoe.fp8 or oxmoe.reference.fp8)."""
    transpose = case.orientation == "transposed"
    if case.fp8_input:
        return lambda q: module.requantize(q, case.block, dtype=DTYPE, transpose=transpose)
    if case.orientation == "both":
        return lambda x: module.quantize_with_transpose(x, case.block)
    return lambda x: module.quantize(x, case.block, transpose=transpose)


def replaced(case: Case):
    """``x ->`` what the case's one call replaces, or None: for both ways, two ``quantize``
    calls, each reading ``x``; for FP8 input, its ``dequantize`` to bf16, then ``quantize``."""
    if case.fp8_input:
        return lambda q: fp8.quantize(fp8.dequantize(q, DTYPE), case.block, transpose=case.orientation == "transposed")
    if case.orientation == "both":
        return lambda x: (fp8.quantize(x, case.block), fp8.quantize(x, case.block, transpose=True))
    return None


def run_case(case: Case, shape, settings, ceiling) -> dict:
    random = timing.RandomArrays(0, len(case.name))
    moved = moved_bytes(shape, case.block, case.orientation, case.fp8_input)
    arg_sets = [(random.normal(shape, DTYPE),) for _ in range(settings.num_sets(moved))]
    if case.fp8_input:  # rows quantized per row, as the layer's output gradient travels
        arg_sets = [(jax.jit(fp8.quantize)(x),) for (x,) in arg_sets]
    ours, xla = quantizations(fp8, case), quantizations(fp8_reference, case)
    x = arg_sets[0][0]
    row = dict(name=case.name, shape=list(shape), block=list(case.block), orientation=case.orientation,
               fp8_input=case.fp8_input, dtype=jnp.dtype(DTYPE).name, bytes=moved,
               matches_reference=same_bits(jax.jit(ours)(x), jax.jit(xla)(x)))
    timed = [("oxmoe", ours), ("xla", xla)] + ([("replaced", replaced(case))] if replaced(case) else [])
    for key, fn in timed:
        t = timing.measure(timing.rotated(fn), arg_sets, settings)
        rate = row["bytes"] / t.median_s
        row[key] = dict(median_us=t.median_s * 1e6, gb_per_s=rate / 1e9, fraction_of_copy=rate / ceiling.bytes_per_s)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_ROWS} rows (and at most {SMOKE_EXPERTS} experts) of each case, few samples")
    parser.add_argument("--out", type=pathlib.Path, help="write the results to this JSON file")
    parser.add_argument("--only", help="run only the cases whose name contains this text")
    args = parser.parse_args(argv)
    settings = timing.SMOKE if args.smoke else timing.FULL
    ceiling = timing.copy_ceiling(settings)
    report = dict(benchmark="fp8_quantize", device=jax.devices()[0].device_kind, platform=jax.default_backend(),
                  jax_version=jax.__version__, oxmoe_build_id=oxmoe.build_id(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), smoke=args.smoke,
                  goal_fraction_of_copy=GOAL, aim_fraction_of_copy=AIM, copy=ceiling.to_json(), rows=[])
    print(f"{report['device']}: copy {ceiling.bytes_per_s / 1e9:.0f} GB/s; oxmoe's kernel against XLA's fusions "
          f"of the plain-JAX semantics (goal {GOAL:.0%} of copy, aim {AIM:.0%})")
    print("'replaced' times what one call replaces: both ways, the two quantize calls; requantized, the "
          "dequantize to bf16 and the quantize")
    print(f"{'case':65s} {'shape':22s} {'block':10s} {'oxmoe us':>9s} {'GB/s':>6s} {'copy':>5s}   "
          f"{'XLA us':>9s} {'copy':>5s}  {'replaced us':>11s}  bits")
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        shape = smoke_shape(case.shape) if args.smoke else case.shape
        row = run_case(case, shape, settings, ceiling)
        report["rows"].append(row)
        ours, xla = row["oxmoe"], row["xla"]
        before = f"{row['replaced']['median_us']:11.1f}" if "replaced" in row else " " * 11
        print(f"{case.name:65s} {str(shape):22s} {str(case.block):10s} {ours['median_us']:9.1f} "
              f"{ours['gb_per_s']:6.0f} {ours['fraction_of_copy']:5.0%}   {xla['median_us']:9.1f} "
              f"{xla['fraction_of_copy']:5.0%}  {before}  {'same' if row['matches_reference'] else 'DIFFER'}",
              flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    if not args.smoke and report["rows"]:
        worst = min(r["oxmoe"]["fraction_of_copy"] for r in report["rows"])
        print(f"slowest case at {worst:.0%} of copy: goal {'met' if worst >= GOAL else 'NOT met'}")
    if not all(r["matches_reference"] for r in report["rows"]):
        raise SystemExit("a case's result differs from oxmoe.reference.fp8.quantize's")


if __name__ == "__main__":
    main()
