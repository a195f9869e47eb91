"""Times oxmoe's block-scaled FP8 expert GEMMs and the FP8 MoE layer's training step against
their bf16 twins and against dense GEMMs of the same FLOPs, side by side in one run on the
default device (issue 18's goals).

The grouped products, at the grouped GEMM benchmark's shapes (Mixtral up, Qwen3-30B-A3B up,
DeepSeek-V3 up and down on one rank of EP = 8) and its ``a=4`` draw of the group sizes:

- ``fwd``: ``fp8.ragged_dot(x, wt, gs, rhs_transposed=True)``, x ``[M, K]`` in 1 x 128
  blocks, the weights stored transposed, wt ``[G, N, K]`` in 128 x 128 blocks (both
  operands K-major: the form Hopper's 8-bit wgmma takes);
- ``dlhs``: ``fp8.ragged_dot(dy, w, gs, rhs_transposed=True)``, dy ``[M, N]`` in 1 x 128
  blocks, w ``[G, K, N]`` in 128 x 128 blocks, giving ``[M, K]``;
- ``drhs``: ``fp8.transposed_ragged_dot(xᵀ, dyᵀ, gs)``, x and dy in 128 x 1 blocks stored
  transposed (``[K, M]`` and ``[N, M]`` in 1 x 128 blocks: each column's tokens contiguous),
  giving ``[G, K, N]``.

Every output is bf16, and the operands are quantized outside the timed function. Each
product is timed beside oxmoe's bf16 product of the same shape (the grouped GEMM benchmark's
``fwd``, ``dlhs`` and ``drhs``: weights ``[G, K, N]``), XLA's scaled FP8 dot of the same
FLOPs with per-tensor scales as the ceiling (both operands e4m3 and K-major, each converted
to bf16 and multiplied by a scalar scale: the pattern XLA:GPU rewrites to a cuBLASLt FP8 GEMM
on Hopper; the table and the JSON say whether the compiled program holds that call), and the
grouped GEMM benchmark's dense bf16 GEMM. A dense GEMM has the product's FLOPs: ``M x K x N``,
or ``K x M x N`` contracting over ``M`` for drhs. Goals: FP8 at least
:data:`MIN_SPEEDUP_OVER_BF16` x oxmoe's bf16 product, and at least
:data:`MIN_FRACTION_OF_DENSE_FP8` of the dense FP8 GEMM's TFLOP/s.

Each FP8 product is checked against :mod:`oxmoe.reference.fp8` (the same semantics in plain
JAX) on the rows of the first two groups and the 128-row block after them (at least 256
rows): fwd and dlhs on those rows of the timed output, drhs run again on those rows alone.
An element off by more than :data:`MAX_REL_ERR` of its magnitude plus the output's RMS (the
RMS covers sums that cancel) fails the case; its times are still reported.

The layer: a training step (``jax.value_and_grad`` of :func:`oxmoe.moe.moe`, as the MoE layer
benchmark builds and times it) with ``MoEConfig(fp8=BlockScaling())`` against the same layer
in bf16, for DeepSeek-V3 on one GPU (8192 tokens, H 7168, F 2048, 32 experts, top-8 of 4 of
8 groups) and Qwen3-30B-A3B (16384 tokens, H 2048, F 768, 128 experts, top-8). Goal: the FP8
step at least :data:`MIN_LAYER_SPEEDUP` x faster. The FP8 step is timed again with
``align_size=`` :data:`ALIGNED_ROWS`, and each of the two again with its expert weights
quantized once outside the step (``fp8_weights=`` :func:`oxmoe.moe.quantize_expert_weights`, a
micro-batch's step under gradient accumulation; its outputs must be those of the step that
quantizes them bit for bit, or the case fails), and with ``BlockScaling(square_gradient_blocks=True)``
alone and with both options; all reported, not judged. The FP8 step's outputs' relative distance
from the bf16 step's is reported (the FP8 format's error, about 6%), with 128 x 128 gradient
blocks too, not judged.

Each timing is cut to about :data:`MEASURE_BUDGET_S` seconds, and the cases not started within
``--time-limit-s`` are reported as skipped. On a fresh H200 the twelve products took about 7.5
minutes, compilation included (2026-11-28): ``--only a=4 --time-limit-s 480`` runs them within a
10-minute slot, and ``--only fwd+bwd`` the layer steps in another. The JSON is rewritten after
every case.

    PYTHONPATH=jax_bindings python3 bench/fp8_gemm.py [--smoke] [--out fp8_gemm.json] [--only TEXT]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import sys
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe
from oxmoe import fp8, moe, reference
from oxmoe.bench import grouped_gemm, timing
from oxmoe.bench import moe as moe_bench
from oxmoe.bench.cases import CheckFailed, failure_text, format_tflops, format_us, text_table
from oxmoe.bench.grouped_gemm import DenseTimes
from oxmoe.model_shapes import DEEPSEEK_V3_EXPERT_PARALLEL, DEEPSEEK_V3_LAYER, QWEN3_30B_A3B_LAYER, GemmShape

BF16 = jnp.dtype(jnp.bfloat16)
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
#: The goals: the FP8 product against oxmoe's bf16 one (speed) and the dense FP8 GEMM (TFLOP/s),
#: the FP8 layer step against the bf16 one (speed).
MIN_SPEEDUP_OVER_BF16, MIN_FRACTION_OF_DENSE_FP8, MIN_LAYER_SPEEDUP = 1.75, 0.75, 1.4
#: The FP8 step is also timed with each expert's rows padded to whole blocks of this many
#: (``MoEConfig.align_size``): no 128-row block of the weight gradients' operands then holds two
#: experts' rows (the FP8 weight gradient takes such a block once for each).
ALIGNED_ROWS = 128
#: Largest error of an FP8 output element against the reference, relative to the element or,
#: where that is far smaller (a sum that cancels), to the output's RMS (:func:`max_rel_err`):
#: the same semantics, float32 sums in another order, each rounded once to bf16, differ by
#: at most about one bf16 ulp (2^-8 to 2^-7 of the element); the limit allows two.
MAX_REL_ERR = 2.0 ** -6
#: The check covers at least this many rows (two 128-row blocks: a weight gradient's block border).
MIN_CHECK_ROWS = 256
#: The custom call XLA:GPU makes of a scaled FP8 dot it hands to cuBLASLt.
CUBLASLT_FP8_CALL = "cublas$lt$matmul$f8"
#: The per-tensor scales of the dense FP8 GEMM (runtime arguments, so XLA cannot fold them).
DENSE_FP8_SCALES = (0.5, 0.25)

SHAPES = grouped_gemm.SHAPES
#: The smoke run: the same groups, M = 256 (two 128-row blocks), K and N multiples of 128.
SMOKE_SHAPES = tuple(dataclasses.replace(shape, m=256, k=k, n=n)
                     for shape, (k, n) in zip(SHAPES, ((128, 256), (256, 128), (256, 128), (128, 256))))
DRAW = grouped_gemm.DRAWS[0]  # a=4: Dirichlet(4) group sizes, none empty

#: A GPU run: 2-4 input sets per timed jit, 10 samples of at least 10 ms, a timing cut to
#: about MEASURE_BUDGET_S seconds (the SIMT fallbacks can be slow).
FULL = dataclasses.replace(timing.FULL, repeats=10, warmup=1, working_set_bytes=256 << 20, min_sets=2, max_sets=4,
                           memory_bytes=16 << 30)
MEASURE_BUDGET_S = 3.0
#: Cases not started this many seconds into the run are skipped (the GPU run has a hard limit).
TIME_LIMIT_S = 180.0


# -- the FP8 products -----------------------------------------------------------------

def _rows_times_weights(lhs, rhs, group_sizes):
    """fwd and dlhs: each group's rows times its weights read K-major."""
    return fp8.ragged_dot(lhs, rhs, group_sizes, rhs_transposed=True, preferred_element_type=BF16)


def _weight_gradient(lhs, rhs, group_sizes):
    return fp8.transposed_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=BF16)


def _reference_rows_times_weights(lhs, rhs, group_sizes):
    return reference.fp8.ragged_dot(lhs, rhs, group_sizes, rhs_transposed=True, preferred_element_type=BF16)


def _reference_weight_gradient(lhs, rhs, group_sizes):
    return reference.fp8.transposed_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=BF16)


@jax.jit
def _quantize_fwd(x, w):
    """x ``[M, K]``, the weights ``[G, K, N]`` stored transposed, ``[G, N, K]``."""
    return fp8.quantize(x, fp8.ACTIVATION_BLOCK), fp8.quantize(jnp.swapaxes(w, 1, 2), fp8.WEIGHT_BLOCK)


@jax.jit
def _quantize_dlhs(dy, w):
    return fp8.quantize(dy, fp8.ACTIVATION_BLOCK), fp8.quantize(w, fp8.WEIGHT_BLOCK)


@jax.jit
def _quantize_drhs(x, dy):
    """x ``[M, K]`` and dy ``[M, N]`` in 128 x 1 blocks, stored transposed."""
    return (fp8.quantize(x, fp8.ACTIVATION_BLOCK, transpose=True),
            fp8.quantize(dy, fp8.ACTIVATION_BLOCK, transpose=True))


@dataclasses.dataclass(frozen=True)
class Fp8Product:
    """One FP8 product beside the grouped GEMM benchmark's bf16 product of the same name."""

    bf16: grouped_gemm.Product
    """Its operands' shapes, oxmoe's bf16 call, its dense GEMM."""
    quantize: Callable
    """The bf16 operands ``(a, b)`` -> the FP8 product's operands."""
    product: Callable
    reference: Callable
    call: str
    output_rows: bool
    """The output's rows are the operands' rows (fwd, dlhs); else ``[G, K, N]`` (drhs)."""

    @property
    def name(self) -> str:
        return self.bf16.name


_BF16_PRODUCTS = {p.name: p for p in grouped_gemm.PRODUCTS}
PRODUCTS = (
    Fp8Product(_BF16_PRODUCTS["fwd"], _quantize_fwd, _rows_times_weights, _reference_rows_times_weights,
               "fp8.ragged_dot(x [M,K] 1x128, wt [G,N,K] 128x128, gs, rhs_transposed=True)", True),
    Fp8Product(_BF16_PRODUCTS["dlhs"], _quantize_dlhs, _rows_times_weights, _reference_rows_times_weights,
               "fp8.ragged_dot(dy [M,N] 1x128, w [G,K,N] 128x128, gs, rhs_transposed=True)", True),
    Fp8Product(_BF16_PRODUCTS["drhs"], _quantize_drhs, _weight_gradient, _reference_weight_gradient,
               "fp8.transposed_ragged_dot(xt [K,M] 1x128, dyt [N,M] 1x128, gs)", False),
)


def _scaled_fp8_dot(a, b, a_scale, b_scale):
    """``a [R, C] . b [N, C]ᵀ`` of e4m3 operands with per-tensor bf16 scales, written as XLA:GPU's
    gemm rewriter matches a scaled FP8 GEMM: convert to bf16, multiply by the broadcast scalar
    scale (of the convert's dtype), dot."""
    a = a.astype(BF16) * a_scale
    b = b.astype(BF16) * b_scale
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=BF16)


# -- timing and checking one case ------------------------------------------------------

def _tflops(flops: int, seconds: float | None) -> float | None:
    return flops / seconds / 1e12 if seconds else None


def _median_s(entry: dict | None) -> float | None:
    return entry["median_us"] / 1e6 if entry else None


def _time(run, arg_sets, settings: timing.Settings) -> tuple[list, timing.Timing]:
    """The outputs of ``run`` (a :func:`timing.rotated` jit, compiled here), then its timing."""
    outs = jax.block_until_ready(run(arg_sets))
    return outs, grouped_gemm.measure_within(run, arg_sets, settings, MEASURE_BUDGET_S)


def _first_rows(q: fp8.BlockQuantized, rows: int) -> fp8.BlockQuantized:
    """The first ``rows`` rows of a quantized ``[M, C]`` operand (a multiple of its block's rows)."""
    return fp8.BlockQuantized(q.values[:rows], q.scales[:rows // q.block[0]], q.block)


def _first_columns(q: fp8.BlockQuantized, rows: int) -> fp8.BlockQuantized:
    """The first ``rows`` rows of a transposed operand ``[C, M]`` (a multiple of 128)."""
    return fp8.BlockQuantized(q.values[:, :rows], q.scales[:, :rows // q.block[1]], q.block)


def check_rows(sizes: np.ndarray, m: int) -> int:
    """The rows the check covers: those of the first two groups and the 128-row block after
    them, at least :data:`MIN_CHECK_ROWS`."""
    return min(m, max(MIN_CHECK_ROWS, (int(np.cumsum(sizes)[1]) // 128 + 1) * 128))


def max_rel_err(got, expected) -> float:
    """``max |got - expected| / (|expected| + rms(expected))`` over the elements (NaN if any is NaN)."""
    got, expected = got.astype(jnp.float32), expected.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(expected * expected))
    return float(jnp.max(jnp.abs(got - expected) / (jnp.abs(expected) + rms)))


def check(product: Fp8Product, out, lhs, rhs, sizes: np.ndarray) -> dict:
    """The FP8 output ``out`` of ``(lhs, rhs, sizes)`` against the reference on :func:`check_rows`."""
    rows = check_rows(sizes, lhs.shape[0] if product.output_rows else lhs.shape[1])
    window_sizes = jnp.asarray(np.diff(np.minimum(np.cumsum(sizes), rows), prepend=0).astype(np.int32))
    if product.output_rows:
        lhs = _first_rows(lhs, rows)
        got = out[:rows]
    else:
        lhs, rhs = _first_columns(lhs, rows), _first_columns(rhs, rows)
        got = product.product(lhs, rhs, window_sizes)
    expected = jax.jit(product.reference)(lhs, rhs, window_sizes)
    error = max_rel_err(got, expected)
    return dict(rows=rows, max_rel_err=error, limit=MAX_REL_ERR, passed=error <= MAX_REL_ERR)


def time_dense_fp8(shape: GemmShape, product: Fp8Product, settings: timing.Settings, seed: int) -> dict:
    """XLA's scaled FP8 dot of the product's dense shape, both operands K-major."""
    a_shape, b_shape = grouped_gemm.DENSE[product.name](shape)
    b_shape = b_shape[::-1]
    num_sets = settings.num_sets(math.prod(a_shape) + math.prod(b_shape) + BF16.itemsize * a_shape[0] * b_shape[0])
    scales = tuple(jnp.asarray(s, BF16) for s in DENSE_FP8_SCALES)
    arg_sets = []
    for n in range(num_sets):
        random = timing.RandomArrays(seed, zlib.crc32(f"dense fp8 {shape} {product.name}".encode()), n)
        arg_sets.append((random.normal(a_shape, E4M3), random.normal(b_shape, E4M3), *scales))
    compiled = timing.rotated(_scaled_fp8_dot).lower(arg_sets).compile()
    hlo = compiled.as_text()
    cublaslt_fp8 = CUBLASLT_FP8_CALL in hlo
    _, t = _time(compiled, arg_sets, settings)
    return dict(**t.to_json(), call=f"dot_general(e4m3{list(a_shape)} * scale, e4m3{list(b_shape)} * scale)",
                cublaslt_fp8=cublaslt_fp8,
                kernel="cublaslt_fp8" if cublaslt_fp8 else grouped_gemm._gemm_kind(hlo))


def run_gemm(row: dict, shape: GemmShape, product: Fp8Product, settings: timing.Settings, dense_bf16: DenseTimes,
             seed: int) -> None:
    """Fills ``row``: each timing and the check (what is done stays if a step fails; a failed
    check raises :class:`CheckFailed` after the timings)."""
    case = grouped_gemm.GemmCase(shape, DRAW, product.bf16)
    drawn = [case.draw_set(seed, n) for n in range(settings.num_sets(case.bytes))]
    sizes = drawn[0][1]
    row["group_sizes"] = " ".join(map(str, sizes))
    bf16_sets = [args for args, _ in drawn]
    _, t = _time(timing.rotated(product.bf16.oxmoe), bf16_sets, settings)
    row["bf16"] = t.to_json()
    fp8_sets = [(*product.quantize(a, b), group_sizes) for a, b, group_sizes in bf16_sets]
    del drawn, bf16_sets
    outs, t = _time(timing.rotated(product.product), fp8_sets, settings)
    row["fp8"] = t.to_json()
    row["check"] = check(product, outs[0], *fp8_sets[0][:2], sizes)
    del outs, fp8_sets
    row["dense_fp8"] = time_dense_fp8(shape, product, settings, seed)
    dense = dense_bf16.get(shape, product.bf16.dense, settings, seed)
    row["dense_bf16"] = dict(**dense.timing.to_json(), kernel=dense.kernel)
    if not row["check"]["passed"]:
        raise CheckFailed(f"FP8 against oxmoe.reference.fp8: max rel err {row['check']['max_rel_err']:.3g} > "
                          f"{MAX_REL_ERR:g}")


def gemm_row(shape: GemmShape, product: Fp8Product) -> dict:
    case = grouped_gemm.GemmCase(shape, DRAW, product.bf16)
    return dict(name=case.name, family="fp8_gemm", model=shape.name, product=product.name, m=shape.m, k=shape.k,
                n=shape.n, groups=shape.groups, draw=DRAW.name, flops=case.flops, fp8_call=product.call,
                bf16_call=product.bf16.oxmoe_call)


def layers(smoke: bool) -> tuple[moe_bench.Layer, ...]:
    """DeepSeek-V3 on one GPU (one rank of EP = 8 as a one-device layer: 32 experts) and Qwen3."""
    sizes = dict(tokens=64, hidden=128, ffn=128) if smoke else {}
    deepseek = moe_bench._layer(DEEPSEEK_V3_LAYER, devices=DEEPSEEK_V3_EXPERT_PARALLEL,
                                **{"tokens": moe_bench.EP_TOKENS, **sizes})
    return deepseek.one_device(), moe_bench._layer(QWEN3_30B_A3B_LAYER, **sizes)


def layers_by_name(smoke: bool) -> dict[str, moe_bench.Layer]:
    """Every layer the benchmarks time, by name: :func:`layers` and the benchmark's own (whose
    Qwen3-30B-A3B is the one kept)."""
    own = moe_bench.SMOKE_LAYERS if smoke else moe_bench.LAYERS
    return {layer.name: layer for layer in (*layers(smoke), *own)}


def quantized_once_step(config: moe.MoEConfig) -> Callable:
    """``(x, params, w, fp8_weights) ->`` :func:`oxmoe.bench.moe.step`'s result, the layer given its
    expert weights quantized outside the step (a micro-batch's step under gradient accumulation)."""
    def step(x, params, w, fp8_weights):
        return moe_bench.step(lambda x, params: moe.moe(x, params, config, fp8_weights=fp8_weights))(x, params, w)
    return step


#: The FP8 step's variants timed beside it (reported, not judged), each with its table label: the
#: options alone and together; "quantized once" is the step given its expert weights quantized
#: outside it (``fp8_weights=``, a micro-batch's step under gradient accumulation).
LAYER_VARIANTS = (("fp8_aligned", f"fp8 align {ALIGNED_ROWS}"), ("fp8_quantized_once", "weights quantized once"),
                  ("fp8_aligned_quantized_once", "both"), ("fp8_square", "128x128 gradients"),
                  ("fp8_square_aligned_quantized_once", "all three"))


def run_layer(row: dict, layer: moe_bench.Layer, settings: timing.Settings, seed: int) -> None:
    """Fills ``row``: the FP8 step, its :data:`LAYER_VARIANTS` and the bf16 step on one input set (a
    step reads far more than the L2 cache), and the FP8 steps' outputs' distance from the bf16
    step's."""
    place = moe_bench.Placement(None)
    base = (seed, zlib.crc32(layer.name.encode()))
    x, w = moe_bench.draw_tokens(layer, place, base, layer.tokens)
    params = moe_bench.draw_params(layer, place, base)
    arg_sets = [(x, params, w)]
    fp8_config = dataclasses.replace(layer.config, fp8=fp8.BlockScaling())
    square = dataclasses.replace(layer.config, fp8=fp8.BlockScaling(square_gradient_blocks=True))
    aligned = functools.partial(dataclasses.replace, align_size=ALIGNED_ROWS)
    outs = {}
    for name, config in (("fp8", fp8_config), ("fp8_aligned", aligned(fp8_config)), ("fp8_square", square),
                         ("bf16", layer.config)):
        (outs[name],), t = _time(timing.rotated(moe_bench.step(moe_bench.oxmoe_layer(config))), arg_sets, settings)
        row[name] = t.to_json()
    for name in ("fp8", "fp8_square"):
        row[f"{name}_vs_bf16"] = {key: float(value) for key, value in moe_bench.compare(outs[name], outs["bf16"]).items()}
    for name, config in (("fp8", fp8_config), ("fp8_aligned", aligned(fp8_config)),
                         ("fp8_square_aligned", aligned(square))):
        quantized = jax.jit(functools.partial(moe.quantize_expert_weights, config=config))(params)
        (once,), t = _time(timing.rotated(quantized_once_step(config)), [(x, params, w, quantized)], settings)
        row[f"{name}_quantized_once"] = t.to_json()
        if name not in outs:  # all three options: no step of the same config timed without the weights given
            continue
        differ = [jax.tree_util.keystr(path) for (path, a), b in zip(jax.tree.leaves_with_path(once),
                                                                     jax.tree.leaves(outs[name]))
                  if not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))]
        if differ:
            raise CheckFailed(f"the {name} step given its weights quantized once differs from it in {differ}")


#: The step's outputs whose distance from the bf16 step's the table shows (the worst).
LAYER_OUTPUTS = ("y_rel_err", "dx_rel_err", "dgate_rel_err", "dup_rel_err", "ddown_rel_err")


def layer_row(layer: moe_bench.Layer) -> dict:
    return dict(name=f"{layer.name} fwd+bwd", family="fp8_layer", **layer.info(), flops=layer.flops)


# -- the report -------------------------------------------------------------------------

def add_ratios(row: dict, judge: bool) -> None:
    """TFLOP/s of each timing, the ratios and the goals (None where not judged or not timed)."""
    fp8_s = _median_s(row.get("fp8"))
    row["tflops"] = {key: _tflops(row["flops"], _median_s(row.get(key)))
                     for key in ("fp8", *(key for key, _ in LAYER_VARIANTS), "bf16", "dense_fp8", "dense_bf16")
                     if key in row}
    bf16_s = _median_s(row.get("bf16"))
    row["speedup_over_bf16"] = bf16_s / fp8_s if fp8_s and bf16_s else None
    if row["family"] == "fp8_gemm":
        dense_s = _median_s(row.get("dense_fp8"))
        row["fraction_of_dense_fp8"] = dense_s / fp8_s if fp8_s and dense_s else None
        goals = dict(speedup_over_bf16=(MIN_SPEEDUP_OVER_BF16, row["speedup_over_bf16"]),
                     fraction_of_dense_fp8=(MIN_FRACTION_OF_DENSE_FP8, row["fraction_of_dense_fp8"]))
    else:
        for key, _ in LAYER_VARIANTS:
            other_s = _median_s(row.get(key))
            row[f"{key}_speedup_over_bf16"] = bf16_s / other_s if other_s and bf16_s else None
        goals = dict(speedup_over_bf16=(MIN_LAYER_SPEEDUP, row["speedup_over_bf16"]))
    row["goals"] = {name: value >= goal if judge and value is not None else None
                    for name, (goal, value) in goals.items()}


def _cell(row: dict, key: str, text: Callable[[dict], str]) -> str:
    return text(row[key]) if row.get(key) is not None else "-"


def _us(row: dict, key: str) -> str:
    return _cell(row, key, lambda t: format_us(t["median_us"] / 1e6))


def _tflops_cell(row: dict, key: str) -> str:
    return _cell(row, key, lambda t: format_tflops(row["flops"], t["median_us"] / 1e6))


def _ratio_cell(value: float | None, met: bool | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    text = f"{100 * value:.0f}%" if percent else f"{value:.2f}x"
    return text + ("" if met is None else " ok" if met else " MISS")


def _status(row: dict) -> str:
    if row.get("skipped"):
        return "SKIPPED"
    if row.get("failure"):
        return "FAILED"
    return ""


def gemm_table(rows: list[dict]) -> str:
    header = ["case", "fp8 us", "TFLOP/s", "bf16 us", "TFLOP/s", f">={MIN_SPEEDUP_OVER_BF16:g}x bf16",
              "dense fp8 TFLOP/s", f">={100 * MIN_FRACTION_OF_DENSE_FP8:g}% dense fp8", "dense fp8 kernel",
              "dense bf16 TFLOP/s", "max rel err", "status"]
    lines = []
    for r in rows:
        goals = r.get("goals", {})
        lines.append([r["name"], _us(r, "fp8"), _tflops_cell(r, "fp8"), _us(r, "bf16"), _tflops_cell(r, "bf16"),
                      _ratio_cell(r.get("speedup_over_bf16"), goals.get("speedup_over_bf16")),
                      _tflops_cell(r, "dense_fp8"),
                      _ratio_cell(r.get("fraction_of_dense_fp8"), goals.get("fraction_of_dense_fp8"), percent=True),
                      _cell(r, "dense_fp8", lambda t: t["kernel"]), _tflops_cell(r, "dense_bf16"),
                      _cell(r, "check", lambda c: f"{c['max_rel_err']:.1e}" + ("" if c["passed"] else " FAILED")),
                      _status(r)])
    return text_table([header] + lines)


def _worst_error(row: dict, key: str) -> str:
    """The worst of :data:`LAYER_OUTPUTS` in ``row[key]`` (a step's distance from the bf16 step's)."""
    errors = row.get(key) or {}
    worst = max((errors[name] for name in LAYER_OUTPUTS if name in errors), default=None)
    return "-" if worst is None else f"{worst:.3f}"


def layer_table(rows: list[dict]) -> str:
    header = ["case", "fp8 step us", "TFLOP/s", "bf16 step us", "TFLOP/s", f">={MIN_LAYER_SPEEDUP:g}x bf16",
              *(text for _, label in LAYER_VARIANTS for text in (f"{label} us", "x bf16")),
              "max rel err vs bf16", "128x128 gradients", "status"]
    lines = []
    for r in rows:
        lines.append([r["name"], _us(r, "fp8"), _tflops_cell(r, "fp8"), _us(r, "bf16"), _tflops_cell(r, "bf16"),
                      _ratio_cell(r.get("speedup_over_bf16"), r.get("goals", {}).get("speedup_over_bf16")),
                      *(cell for key, _ in LAYER_VARIANTS
                        for cell in (_us(r, key), _ratio_cell(r.get(f"{key}_speedup_over_bf16"), None))),
                      _worst_error(r, "fp8_vs_bf16"), _worst_error(r, "fp8_square_vs_bf16"), _status(r)])
    return text_table([header] + lines)


def log_line(row: dict) -> str:
    """A case's outcome in one line of progress (what a run cut short still shows)."""
    if row.get("skipped") or row.get("failure"):
        return row.get("skipped") or row["failure"]
    text = (f"fp8 {_us(row, 'fp8')} us, bf16 {_us(row, 'bf16')} us "
            f"({_ratio_cell(row['speedup_over_bf16'], row['goals']['speedup_over_bf16'])})")
    if row["family"] == "fp8_gemm":
        text += (f", {_ratio_cell(row['fraction_of_dense_fp8'], row['goals']['fraction_of_dense_fp8'], True)} of "
                 f"dense fp8 ({row['dense_fp8']['kernel']}), max rel err {row['check']['max_rel_err']:.1e}")
    else:
        text += "".join(f"; {label} {_us(row, key)} us ({_ratio_cell(row[f'{key}_speedup_over_bf16'], None)})"
                        for key, label in LAYER_VARIANTS)
    return text


def goals_line(rows: list[dict], smoke: bool) -> str:
    if smoke:
        return "goals not judged at smoke sizes"
    counts = []
    for family, goal, text in (("fp8_gemm", "speedup_over_bf16", f"FP8 >= {MIN_SPEEDUP_OVER_BF16:g}x bf16"),
                               ("fp8_gemm", "fraction_of_dense_fp8",
                                f">= {100 * MIN_FRACTION_OF_DENSE_FP8:g}% of dense FP8"),
                               ("fp8_layer", "speedup_over_bf16", f"FP8 step >= {MIN_LAYER_SPEEDUP:g}x bf16")):
        judged = [r["goals"][goal] for r in rows if r["family"] == family and r["goals"].get(goal) is not None]
        counts.append(f"{text} {sum(judged)}/{len(judged)}")
    return "goals met: " + "; ".join(counts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (multiples of 128), few samples")
    parser.add_argument("--out", type=pathlib.Path, help="write every row to this JSON file (after each case)")
    parser.add_argument("--only", help="run only the cases whose name contains this text")
    parser.add_argument("--time-limit-s", type=float, default=TIME_LIMIT_S,
                        help="skip the cases not started this many seconds into the run")
    args = parser.parse_args(argv)
    settings, shapes = (timing.SMOKE, SMOKE_SHAPES) if args.smoke else (FULL, SHAPES)
    start = time.monotonic()
    seed = 0
    dense_bf16 = DenseTimes()
    plan = ([(gemm_row(shape, product),
              lambda row, shape=shape, product=product: run_gemm(row, shape, product, settings, dense_bf16, seed))
             for shape in shapes for product in PRODUCTS]
            + [(layer_row(layer), lambda row, layer=layer: run_layer(row, layer, settings, seed))
               for layer in layers(args.smoke)])
    plan = [(row, run) for row, run in plan if args.only is None or args.only in row["name"]]
    report = dict(benchmark="fp8_gemm", device=jax.devices()[0].device_kind, platform=jax.default_backend(),
                  jax_version=jax.__version__, oxmoe_build_id=oxmoe.build_id(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), smoke=args.smoke,
                  goals=dict(min_speedup_over_bf16=MIN_SPEEDUP_OVER_BF16,
                             min_fraction_of_dense_fp8=MIN_FRACTION_OF_DENSE_FP8,
                             min_layer_speedup=MIN_LAYER_SPEEDUP, max_rel_err=MAX_REL_ERR),
                  rows=[row for row, _ in plan])
    print(f"{report['device']} ({report['platform']}), oxmoe {report['oxmoe_build_id']}, {len(plan)} cases",
          file=sys.stderr)
    for n, (row, run) in enumerate(plan, 1):
        elapsed = time.monotonic() - start
        if elapsed > args.time_limit_s:
            row["skipped"] = f"not started: {elapsed:.0f} s into the run, past --time-limit-s {args.time_limit_s:g}"
        else:
            print(f"[{n}/{len(plan)}] {row['name']} ...", file=sys.stderr, flush=True)
            try:
                run(row)
            except Exception as e:  # noqa: BLE001 - one broken case must not hide the others' numbers
                row["failure"] = failure_text(e)
            row["seconds"] = time.monotonic() - start - elapsed
        add_ratios(row, judge=not args.smoke)
        dense = {r["dense_fp8"]["cublaslt_fp8"] for r in report["rows"] if r.get("dense_fp8")}
        report["dense_fp8_cublaslt"] = ("all" if dense == {True} else "none" if dense == {False}
                                        else "some" if dense else None)
        print(f"    {time.monotonic() - start:.0f} s: {log_line(row)}", file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
    gemm_rows = [r for r in report["rows"] if r["family"] == "fp8_gemm"]
    layer_rows = [r for r in report["rows"] if r["family"] == "fp8_layer"]
    print(f"{report['device']}: dense FP8 GEMMs compiled to cuBLASLt's FP8 GEMM ({CUBLASLT_FP8_CALL}): "
          f"{report['dense_fp8_cublaslt'] or 'none timed'}")
    print(goals_line(report["rows"], args.smoke))
    if gemm_rows:
        print(gemm_table(gemm_rows))
    if layer_rows:
        print(layer_table(layer_rows))
    if args.out:
        print(f"wrote {args.out}")
    if any(r.get("failure") for r in report["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
