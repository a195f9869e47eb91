"""What a dense GEMM from NVIDIA's own libraries gets out of this GPU in bf16 and in FP8, at the
power it holds them to: the ceiling issue 18's ratios (oxmoe's FP8 products against its bf16 ones,
and against a dense FP8 GEMM) are to be read against.

Through PyTorch (not a dependency of oxmoe; on the device image), at the grouped GEMM
benchmark's shapes (``bench/fp8_gemm.py``'s products), at the FP8 layers' forward products
(``bench/fp8_products_ab.py``: DeepSeek-V3 on one GPU and Qwen3-30B-A3B, their token rows as one
dense M) and at 8192 x 8192 x 8192, each case a dense ``[M, K] x [K, N]`` with a bf16 output:

- ``bf16``: ``torch.matmul`` (cuBLAS);
- ``fp8 tensor``: ``torch._scaled_mm`` with per-tensor scales and fast accumulation (cuBLASLt's
  FP8 GEMM at its fastest: no promotion of the tensor cores' sums);
- ``fp8 tensor promoted``: the same without fast accumulation (cuBLASLt promotes the sums);
- ``fp8 blocks``: DeepSeek-V3's recipe as oxmoe's ``fp8.ragged_dot`` computes it (the left
  operand in 1 x 128 blocks, the right in 128 x 128), through ``torch.nn.functional.scaled_mm``'s
  blockwise scaling (on Hopper), checked against the dequantized operands' float32 product.

Each case is timed with CUDA events over ~1 s of back-to-back calls (median of samples of >= 10
ms, rotating over input sets that together exceed the L2), with the SM clock and board power
sampled meanwhile (``oxmoe.bench.timing.ClockSampler``). Prints a table and a last ``JSON {...}``
line; ``--only TEXT`` runs the shapes whose names contain it.

    PYTHONPATH=jax_bindings python3 bench/dense_ceilings.py [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from oxmoe.bench import grouped_gemm
from oxmoe.bench.timing import ClockSampler

E4M3_MAX = 448.0
BLOCK = 128
#: (name, M, K, N): the benchmark's products, the FP8 layers' forward products (their rows, whole
#: 128-row blocks, as the layer pads them), and a square one.
SHAPES = [
    *((shape.name, shape.m, shape.k, shape.n) for shape in grouped_gemm.SHAPES),
    ("deepseek_v3 up forward", 65536, 7168, 4096),
    ("deepseek_v3 down forward", 65536, 2048, 7168),
    ("qwen3_30b_a3b up forward", 131072, 2048, 1536),
    ("qwen3_30b_a3b down forward", 131072, 768, 2048),
    ("square 8192", 8192, 8192, 8192),
]
#: Input sets a case rotates through: together past the 60 MB L2.
MIN_SET_BYTES = 256 << 20
SAMPLES = 60
MIN_SAMPLE_S = 10e-3
#: The block-scaled product's largest error, over its output's RMS, that is bf16's rounding of the
#: output (seen: 0.011-0.017); a scale layout read otherwise is off by the order of the output.
MAX_BLOCKS_ERROR = 0.05


def per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with one float32 scale (dequantized = values * scale)."""
    scale = (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def blocks(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] in e4m3 with a float32 scale per ``rows`` x 128 block: scales [R / rows, K / 128]."""
    r, k = x.shape
    tiles = x.float().reshape(r // rows, rows, k // BLOCK, BLOCK)
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    values = (tiles / scale[:, None, :, None]).reshape(r, k).to(torch.float8_e4m3fn)
    return values, scale


def dequantized(values: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    r, k = values.shape
    tiles = values.float().reshape(r // rows, rows, k // BLOCK, BLOCK) * scale[:, None, :, None]
    return tiles.reshape(r, k)


def operands(m: int, k: int, n: int, seed: int) -> dict:
    """One input set: x [M, K] and w [N, K] (K-major, as FP8 tensor cores read both) in every form."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    (x8, xs), (w8, ws) = per_tensor(x), per_tensor(w)
    xb, xbs = blocks(x, 1)
    wb, wbs = blocks(w, BLOCK)
    # scaled_mm's layouts: the 1 x 128 scales outer-dimension-major, the 128 x 128 ones as
    # [K / 128, N / 128] with K's blocks padded to a multiple of 4.
    k_blocks = k // BLOCK
    wbs_padded = F.pad(wbs, (0, -k_blocks % 4))
    return dict(x=x, wt=w.t(), x8=x8, xs=xs, w8t=w8.t(), ws=ws, xb=xb, xbs=xbs.t().contiguous().t(),
                wbt=wb.t(), wbs=wbs_padded.t())


#: Each case's call on an input set.
PRODUCTS = {
    "bf16": lambda o: torch.matmul(o["x"], o["wt"]),
    "fp8 tensor": lambda o: torch._scaled_mm(o["x8"], o["w8t"], o["xs"], o["ws"], out_dtype=torch.bfloat16,
                                             use_fast_accum=True),
    "fp8 tensor promoted": lambda o: torch._scaled_mm(o["x8"], o["w8t"], o["xs"], o["ws"],
                                                      out_dtype=torch.bfloat16, use_fast_accum=False),
    "fp8 blocks": lambda o: F.scaled_mm(o["xb"], o["wbt"], o["xbs"], F.ScalingType.BlockWise1x128, o["wbs"],
                                        F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
}


def check_blocks(product, o: dict) -> float:
    """The block-scaled product's largest error over its output's RMS, against the float32 product
    of its dequantized operands (rows of the first 512)."""
    k_blocks = o["xbs"].shape[1]
    rows = slice(0, 512)
    # The operands as scaled_mm takes them: w's values transposed, its scales transposed and padded.
    w = dequantized(o["wbt"].t(), o["wbs"].t()[:, :k_blocks], BLOCK)
    expected = dequantized(o["xb"][rows], o["xbs"][rows], 1) @ w.t()
    got = product(o)[rows].float()
    error = float((got - expected).abs().max() / expected.pow(2).mean().sqrt())
    if error > MAX_BLOCKS_ERROR:
        raise RuntimeError(f"the block-scaled product is off the dequantized one by {error:.3f} of its RMS")
    return error


def time_product(product, sets: list[dict]) -> tuple[float, str]:
    """Median seconds a call, and the clocks while it ran."""
    for o in sets:
        product(o)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    product(sets[0])
    end.record()
    end.synchronize()
    calls = max(len(sets), int(MIN_SAMPLE_S / max(start.elapsed_time(end) / 1e3, 1e-6)) + 1)
    samples = []
    with ClockSampler() as clocks:
        for _ in range(SAMPLES):
            start.record()
            for call in range(calls):
                product(sets[call % len(sets)])
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(samples), clocks.describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="the shapes whose names contain this (e.g. deepseek)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda, flush=True)
    rows = []
    for name, m, k, n in (shape for shape in SHAPES if args.only in shape[0]):
        set_bytes = (m * k + n * k) * 2
        sets = [operands(m, k, n, seed) for seed in range(max(1, -(-MIN_SET_BYTES // set_bytes)))]
        flops = 2 * m * k * n
        row = dict(shape=name, m=m, k=k, n=n)
        for kind, product in PRODUCTS.items():
            try:
                if kind == "fp8 blocks":
                    row["fp8 blocks error"] = check_blocks(product, sets[0])
                seconds, clocks = time_product(product, sets)
            except (RuntimeError, AttributeError, TypeError) as error:  # failed its check, or torch or the GPU lacks it
                row[kind] = dict(error=str(error).splitlines()[0])
                print(f"{name:28s} {kind:20s} not timed: {row[kind]['error']}", flush=True)
                continue
            row[kind] = dict(us=seconds * 1e6, tflops=flops / seconds / 1e12, clocks=clocks)
            print(f"{name:28s} {kind:20s} {seconds * 1e6:9.0f} us {row[kind]['tflops']:6.0f} TFLOP/s  {clocks}",
                  flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    print("\n| shape | bf16 | FP8 per tensor | promoted | FP8 1 x 128 / 128 x 128 | blocks / bf16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    tf = lambda row, kind: row[kind].get("tflops", float("nan"))
    for row in rows:
        print(f"| {row['shape']} | {tf(row, 'bf16'):.0f} | {tf(row, 'fp8 tensor'):.0f} | "
              f"{tf(row, 'fp8 tensor promoted'):.0f} | {tf(row, 'fp8 blocks'):.0f} | "
              f"{tf(row, 'fp8 blocks') / tf(row, 'bf16'):.2f}x |")
    print("JSON " + json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)))


if __name__ == "__main__":
    main()
