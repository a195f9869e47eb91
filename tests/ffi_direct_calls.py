"""Calls the oxmoe FFI handlers directly with wrong buffers and attributes, bypassing the
Python checks. Run as a script (in its own process, so that a handler that crashes, or a
CUDA error that poisons the process's GPU context, cannot take the test session with it);
prints one JSON line per case, then one valid call's result and the platform it ran on.

`--platform cpu` (or gpu) runs every call on that platform's first device, otherwise on
the default device. Used by test_router_ffi_errors.py (cpu) and test_router_gpu.py (gpu);
`python tests/ffi_direct_calls.py --platform cpu` shows the messages.

Importing this module touches no device: the inputs are NumPy arrays, placed on the
chosen device when a call runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import router_reference as ref

T, E = 4, 8


def _attrs(**changes):
    attrs = dict(
        topk=np.int64(2),
        score_function="softmax",
        use_pre_softmax=np.bool_(False),
        num_groups=np.int64(1),
        group_topk=np.int64(1),
        scaling_factor=np.float32(1.0),
    )
    attrs.update(changes)
    return {k: v for k, v in attrs.items() if v is not None}


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _call(target, rets, *args, **attrs):
    return jax.ffi.ffi_call(target, rets)(*(jnp.asarray(a) for a in args), **attrs)


def topk_fwd(logits, *bias, probs_shape=None, **changes):
    shape = probs_shape or logits.shape
    rets = (_spec(shape, logits.dtype), _spec(shape, jnp.bool_))
    return _call("oxmoe_topk_fwd", rets, logits, *bias, **_attrs(**changes))


def topk_bwd(grad_probs, logits, routing_map, **changes):
    attrs = {k: v for k, v in _attrs(**changes).items() if k not in ("num_groups", "group_topk")}
    rets = _spec(logits.shape, logits.dtype)
    return _call("oxmoe_topk_bwd", rets, grad_probs, logits, routing_map, **attrs)


def scores_fwd(logits, **attrs):
    rets = (_spec(logits.shape, jnp.bool_), _spec(logits.shape, jnp.float32))
    return _call("oxmoe_aux_loss_scores_fwd", rets, logits, **attrs)


def scores_bwd(grad_scores, logits, **attrs):
    return _call("oxmoe_aux_loss_scores_bwd", _spec(logits.shape, logits.dtype), grad_scores, logits, **attrs)


def _aux_attrs(**changes):
    attrs = dict(total_num_tokens=np.int64(T), topk=np.int64(2), coeff=np.float32(0.1))
    attrs.update(changes)
    return {k: v for k, v in attrs.items() if v is not None}


def aux_fwd(probs, counts, **changes):
    return _call("oxmoe_aux_loss_fwd", _spec((), jnp.float32), probs, counts, **_aux_attrs(**changes))


def aux_bwd(grad_loss, counts, probs_shape=(T, E), **changes):
    rets = _spec(probs_shape, jnp.float32)
    return _call("oxmoe_aux_loss_bwd", rets, grad_loss, counts, **_aux_attrs(**changes))


LOGITS = np.arange(T * E, dtype=np.float32).reshape(T, E) % 5
MAP = LOGITS > 2
COUNTS = np.ones((E,), np.int32)
SCALAR = np.asarray(1.0, np.float32)

# name: (call, target, regular expressions the error message must all match, case-insensitive)
CASES = {
    "topk_fwd_int32_logits": (
        lambda: topk_fwd(LOGITS.astype(jnp.int32)), "oxmoe_topk_fwd", [r"s32|int32|i32"]),
    "topk_fwd_rank3_logits": (
        lambda: topk_fwd(LOGITS.reshape(2, 2, E)), "oxmoe_topk_fwd",
        [r"rank\D{0,30}3|3\D{0,10}dim|\[2, ?2, ?8\]|\(2, ?2, ?8\)|2x2x8"]),
    "topk_fwd_expert_bias_length": (
        lambda: topk_fwd(LOGITS, np.zeros((E - 1,), np.float32), score_function="sigmoid"),
        "oxmoe_topk_fwd", [r"\b7\b"]),
    "topk_fwd_expert_bias_dtype": (
        lambda: topk_fwd(LOGITS, np.zeros((E,), np.float16), score_function="sigmoid"),
        "oxmoe_topk_fwd", [r"f16|float16"]),
    "topk_fwd_missing_topk": (lambda: topk_fwd(LOGITS, topk=None), "oxmoe_topk_fwd", [r"topk"]),
    "topk_fwd_missing_score_function": (
        lambda: topk_fwd(LOGITS, score_function=None), "oxmoe_topk_fwd", [r"score_function"]),
    "topk_fwd_unknown_score_function": (
        lambda: topk_fwd(LOGITS, score_function="relu"), "oxmoe_topk_fwd", [r"relu"]),
    "topk_fwd_topk_above_experts": (
        lambda: topk_fwd(LOGITS, topk=np.int64(E + 1)), "oxmoe_topk_fwd", [r"topk", r"\b9\b"]),
    "topk_fwd_float64_scaling_factor": (
        # 1.5, not 1.0: jax caches executables by attribute equality, and np.float64(1.0) == np.float32(1.0).
        lambda: topk_fwd(LOGITS, scaling_factor=np.float64(1.5)), "oxmoe_topk_fwd", [r"scaling_factor"]),
    "topk_fwd_groups_not_dividing_experts": (
        lambda: topk_fwd(LOGITS, num_groups=np.int64(3)), "oxmoe_topk_fwd", [r"num_groups", r"\b3\b"]),
    "topk_fwd_result_shape_mismatch": (
        lambda: topk_fwd(LOGITS, probs_shape=(T, E + 1)), "oxmoe_topk_fwd", [r"\b9\b"]),
    "topk_bwd_float_routing_map": (
        lambda: topk_bwd(LOGITS, LOGITS, MAP.astype(jnp.float32)), "oxmoe_topk_bwd", [r"f32|float32"]),
    "topk_bwd_grad_shape_mismatch": (
        lambda: topk_bwd(np.zeros((T, E + 1), np.float32), LOGITS, MAP), "oxmoe_topk_bwd", [r"\b9\b"]),
    "aux_loss_scores_fwd_int32_logits": (
        lambda: scores_fwd(LOGITS.astype(jnp.int32), topk=np.int64(2), score_function="softmax"),
        "oxmoe_aux_loss_scores_fwd", [r"s32|int32|i32"]),
    "aux_loss_scores_fwd_unknown_score_function": (
        lambda: scores_fwd(LOGITS, topk=np.int64(2), score_function="tanh"),
        "oxmoe_aux_loss_scores_fwd", [r"tanh"]),
    "aux_loss_scores_bwd_f16_grad_scores": (
        lambda: scores_bwd(LOGITS.astype(jnp.float16), LOGITS, score_function="softmax"),
        "oxmoe_aux_loss_scores_bwd", [r"f16|float16"]),
    "aux_loss_fwd_counts_length": (
        lambda: aux_fwd(LOGITS, COUNTS[:-1]), "oxmoe_aux_loss_fwd", [r"\b7\b"]),
    "aux_loss_fwd_missing_coeff": (
        lambda: aux_fwd(LOGITS, COUNTS, coeff=None), "oxmoe_aux_loss_fwd", [r"coeff"]),
    "aux_loss_fwd_zero_total_tokens": (
        lambda: aux_fwd(LOGITS, COUNTS, total_num_tokens=np.int64(0)), "oxmoe_aux_loss_fwd", [r"total_num_tokens"]),
    "aux_loss_bwd_counts_length": (
        lambda: aux_bwd(SCALAR, COUNTS[:-1]), "oxmoe_aux_loss_bwd", [r"\b7\b"]),
    "aux_loss_bwd_rank1_grad_loss": (
        lambda: aux_bwd(np.ones((2,), np.float32), COUNTS), "oxmoe_aux_loss_bwd",
        [r"rank|scalar|dim|\[2\]|\(2,?\)"]),
}

# -- calls no Python wrapper makes: aliased results, extra results, unknown attributes, no
# experts, offsets past int32 (the handlers' own checks, for callers other than oxmoe). A
# call whose results are all empty never reaches a handler: XLA skips it.


def aliased(target, rets, *args, **attrs):
    """The call with result 0 in argument 0's memory (input_output_aliases on a donated argument)."""
    call = jax.ffi.ffi_call(target, rets, input_output_aliases={0: 0})
    return jax.jit(lambda *a: call(*a, **attrs), donate_argnums=0)(*(jnp.asarray(a) for a in args))


ROWS = np.arange(6 * E, dtype=np.float32).reshape(6, E)  # [M, K] = [6, 8]
SIZES, OFFSET = np.array([2, 4], np.int32), np.zeros((1,), np.int32)
SPLITS, ORDER = np.array([2, 4], np.int32), np.array([1, 0], np.int32)
NO_EXPERTS = np.zeros((T, 0), bool)


#: A dispatch's map of T tokens over E experts into 2 rows of H = 3: token 0's copies for experts 0 and 1.
DEST_ROWS = np.full((T, E), -1, np.int32)
DEST_ROWS[0, :2] = [0, 1]


def combine_fwd(dest_rows=DEST_ROWS, *optional, weighted=np.bool_(False)):
    """oxmoe_combine_fwd of 2 rows of H = 3 (a None ``weighted`` leaves the attribute out)."""
    attrs = {} if weighted is None else {"weighted": weighted}
    return _call("oxmoe_combine_fwd", _spec((len(dest_rows), 3), jnp.float32), np.ones((2, 3), np.float32),
                 dest_rows, *optional, **attrs)


def dispatch_fwd(tokens, routing_map, rows, **attrs):
    t, e = routing_map.shape
    per_expert = _spec((e,), jnp.int32)
    rets = (_spec((rows, tokens.shape[1]), tokens.dtype), _spec((t, e), jnp.int32), _spec((rows,), jnp.int32),
            per_expert, per_expert, per_expert)
    return _call("oxmoe_dispatch_fwd", rets, tokens, routing_map, **attrs)


def _quantize_attrs(**changes):
    """oxmoe_fp8_quantize's attributes: (1, 128) blocks, orientation "as_is", unless `changes`
    say otherwise."""
    return dict(block_rows=np.int64(1), block_cols=np.int64(128), power_of_two_scales=np.bool_(False),
                orientation="as_is") | changes


def quantize(x, values_shape=None, scales_dtype=jnp.float32, results=None, **changes):
    """oxmoe_fp8_quantize of x [B, R, C], its attributes :func:`_quantize_attrs`'; with
    orientation "both", the transposed values and scales too (the first `results` of them,
    if given)."""
    attrs = _quantize_attrs(**changes)
    b, r, c = (x.shape if x.ndim == 3 else (1, *x.shape))
    block = int(attrs["block_rows"]), int(attrs["block_cols"])

    def quantization(rows, cols, values_shape=None):
        return (_spec(values_shape or (b, rows, cols), jnp.float8_e4m3fn),
                _spec((b, max(rows // block[0], 1), max(cols // block[1], 1)), scales_dtype))
    orientation = attrs["orientation"]
    rets = quantization(c, r, values_shape) if orientation == "transposed" else quantization(r, c, values_shape)
    if orientation == "both":
        rets += quantization(c, r)
    return _call("oxmoe_fp8_quantize", rets[:results], x, **attrs)


def activation_bwd(grad_hidden, pre_activation, row_probs=None, activation="swiglu"):
    """oxmoe_activation_bwd of grad_hidden [R, F] and pre_activation, its results shaped
    as a valid call's would be for those arguments."""
    rows = grad_hidden.shape[0]
    row_probs = np.ones((rows,), np.float32) if row_probs is None else row_probs
    rets = (_spec(pre_activation.shape, pre_activation.dtype), _spec(grad_hidden.shape, grad_hidden.dtype),
            _spec((rows,), jnp.float32))
    return _call("oxmoe_activation_bwd", rets, grad_hidden, pre_activation, row_probs, activation=activation)


def fp8_activation_bwd(grad_hidden, pre_activation, activation="swiglu", power_of_two_scales=np.bool_(False),
                       square_grad_transposed=np.bool_(False)):
    """oxmoe_fp8_activation_bwd of grad_hidden [R, F] and pre_activation, its results shaped
    as a valid call's would be for those arguments (the transposed gradient's as for 128 x 1
    blocks, whatever square_grad_transposed says)."""
    (rows, features), width = grad_hidden.shape, pre_activation.shape[1]

    def quantization(r, c):
        return (_spec((1, r, c), jnp.float8_e4m3fn), _spec((1, r, max(c // 128, 1)), jnp.float32))

    rets = (*quantization(rows, width), *quantization(width, rows), *quantization(features, rows),
            _spec((rows,), jnp.float32))
    return _call("oxmoe_fp8_activation_bwd", rets, grad_hidden, pre_activation, np.ones((rows,), np.float32),
                 activation=activation, power_of_two_scales=power_of_two_scales,
                 square_grad_transposed=square_grad_transposed)


def fp8_activation(pre_activation, features, activation="swiglu", power_of_two_scales=np.bool_(False)):
    """oxmoe_fp8_activation of pre_activation [R, 1, W], its results those of `features` hidden columns."""
    rows = pre_activation.shape[0]
    rets = (_spec((rows, 1, features), jnp.float8_e4m3fn), _spec((rows, 1, max(features // 128, 1)), jnp.float32))
    return _call("oxmoe_fp8_activation", rets, pre_activation, activation=activation,
                 power_of_two_scales=power_of_two_scales)


def requantize(values, scales, dequantized_dtype="bfloat16", source_rows=None, **changes):
    """oxmoe_fp8_quantize of FP8 values [B, R, C] and their scales (and `source_rows`, if
    given: then the results have its rows), as quantize's call (a `dequantized_dtype` of None:
    the attribute left out)."""
    attrs = _quantize_attrs(dequantized_dtype=dequantized_dtype, **changes)
    b, r, c = values.shape
    sources = () if source_rows is None else (source_rows,)
    r = r if source_rows is None else source_rows.shape[0]
    rets = (_spec((b, r, c), jnp.float8_e4m3fn), _spec((b, r, max(c // 128, 1)), jnp.float32))
    return _call("oxmoe_fp8_quantize", rets, values, scales, *sources,
                 **{k: v for k, v in attrs.items() if v is not None})


CASES.update({
    "ragged_dot_fwd_result_aliasing_lhs": (
        lambda: aliased("oxmoe_ragged_dot", (_spec(ROWS.shape, jnp.float32), _spec((12,), jnp.uint8)), ROWS,
                        np.ones((2, E, E), np.float32), SIZES, OFFSET, rhs_transposed=np.bool_(False)),
        "oxmoe_ragged_dot", [r"result 0 shares memory with argument 0", r"in place"]),
    "transposed_ragged_dot_a_chunk_without_rhs": (
        lambda: _call("oxmoe_transposed_ragged_dot", _spec((2, E, E), jnp.float32), ROWS, ROWS, ROWS,
                      SIZES, OFFSET),
        "oxmoe_transposed_ragged_dot", [r"got 5 arguments", r"the 2 operands of each chunk"]),
    "transposed_ragged_dot_sizes_of_other_chunks": (
        lambda: _call("oxmoe_transposed_ragged_dot", _spec((2, E, E), jnp.float32), ROWS, ROWS, ROWS, ROWS,
                      np.ones((3, 2), np.int32), OFFSET),
        "oxmoe_transposed_ragged_dot", [r"group_sizes has shape \[3, 2\]", r"expected \[2, groups\] for 2 chunks"]),
    "transposed_ragged_dot_nine_chunks": (
        lambda: _call("oxmoe_transposed_ragged_dot", _spec((2, E, E), jnp.float32), *[ROWS] * 18,
                      np.ones((9, 2), np.int32), OFFSET),
        "oxmoe_transposed_ragged_dot", [r"got 20 arguments, expected 4 to 18"]),
    "transposed_ragged_dot_chunks_of_two_widths": (
        lambda: _call("oxmoe_transposed_ragged_dot", _spec((2, E, E), jnp.float32), ROWS, ROWS[:, :3], ROWS, ROWS,
                      np.ones((2, 2), np.int32), OFFSET),
        "oxmoe_transposed_ragged_dot", [r"lhs\[1\] has shape float32\[6, 3\], expected \[6, 8\]"]),
    "fp8_ragged_dot_k_not_a_multiple_of_128": (
        lambda: _call("oxmoe_fp8_ragged_dot", _spec((4, 128), jnp.float32), np.zeros((4, 100), jnp.float8_e4m3fn),
                      np.ones((4, 1), np.float32), np.zeros((2, 100, 128), jnp.float8_e4m3fn),
                      np.ones((2, 1, 1), np.float32), SIZES, OFFSET, rhs_transposed=np.bool_(False)),
        "oxmoe_fp8_ragged_dot", [r"lhs has K = 100", r"K must be a multiple of 128"]),
    "fp8_ragged_dot_bf16_values": (
        lambda: _call("oxmoe_fp8_ragged_dot", _spec((4, 128), jnp.float32), np.zeros((4, 128), jnp.bfloat16),
                      np.ones((4, 1), np.float32), np.zeros((2, 128, 128), jnp.float8_e4m3fn),
                      np.ones((2, 1, 1), np.float32), SIZES, OFFSET, rhs_transposed=np.bool_(False)),
        "oxmoe_fp8_ragged_dot", [r"lhs", r"bfloat16", r"float8_e4m3fn"]),
    "fp8_transposed_ragged_dot_rows_not_a_multiple_of_128": (
        lambda: _call("oxmoe_fp8_transposed_ragged_dot", _spec((2, 128, 128), jnp.float32),
                      np.zeros((128, 6), jnp.float8_e4m3fn), np.ones((1, 128), np.float32),
                      np.zeros((128, 6), jnp.float8_e4m3fn), np.ones((1, 128), np.float32), SIZES, OFFSET),
        "oxmoe_fp8_transposed_ragged_dot", [r"lhs has M = 6", r"M must be a multiple of 128"]),
    "fp8_transposed_ragged_dot_rhs_scales_of_neither_blocks": (
        lambda: _call("oxmoe_fp8_transposed_ragged_dot", _spec((2, 128, 256), jnp.float32),
                      np.zeros((128, 128), jnp.float8_e4m3fn), np.ones((1, 128), np.float32),
                      np.zeros((256, 128), jnp.float8_e4m3fn), np.ones((1, 3), np.float32), SIZES, OFFSET),
        "oxmoe_fp8_transposed_ragged_dot", [r"rhs_scales has shape float32\[1, 3\], expected \[1, 256\]"]),
    "fp8_quantize_block_of_64_rows": (
        lambda: quantize(np.zeros((1, 128, 128), np.float32), block_rows=np.int64(64)), "oxmoe_fp8_quantize",
        [r"the block is \(64, 128\)", r"\(1, 128\), \(128, 128\) or \(128, 1\)"]),
    "fp8_quantize_rows_not_a_multiple_of_the_block": (
        lambda: quantize(np.zeros((1, 100, 128), np.float32), block_rows=np.int64(128)), "oxmoe_fp8_quantize",
        [r"x's rows \(100\) must be a multiple of the block's rows \(128\)"]),
    "fp8_quantize_transposed_columns_not_a_multiple_of_the_block": (
        lambda: quantize(np.zeros((1, 256, 100), np.float32), block_rows=np.int64(128), orientation="transposed"),
        "oxmoe_fp8_quantize",
        [r"x's columns \(100\), the transposed result's rows, must be a multiple of the block's rows \(128\)"]),
    "fp8_quantize_matrix_x": (
        lambda: quantize(np.zeros((128, 128), np.float32)), "oxmoe_fp8_quantize",
        [r"x has shape \[128, 128\], expected \[batch, rows, columns\]"]),
    "fp8_quantize_int32_x": (
        lambda: quantize(np.zeros((1, 128, 128), np.int32)), "oxmoe_fp8_quantize", [r"x has dtype int32"]),
    "fp8_quantize_untransposed_values": (
        lambda: quantize(np.zeros((1, 128, 256), np.float32), orientation="transposed", values_shape=(1, 128, 256)),
        "oxmoe_fp8_quantize", [r"values has shape float8_e4m3fn\[1, 128, 256\], expected \[1, 256, 128\]"]),
    "fp8_quantize_bf16_scales": (
        lambda: quantize(np.zeros((1, 128, 128), np.float32), scales_dtype=jnp.bfloat16), "oxmoe_fp8_quantize",
        [r"scales has dtype bfloat16, expected float32"]),
    "fp8_quantize_orientation_unknown": (
        lambda: quantize(np.zeros((1, 128, 128), np.float32), orientation="sideways"), "oxmoe_fp8_quantize",
        [r"orientation is \"sideways\", expected \"as_is\", \"transposed\" or \"both\""]),
    "fp8_quantize_orientation_as_a_bool": (
        lambda: quantize(np.zeros((1, 128, 128), np.float32), orientation=np.bool_(True)), "oxmoe_fp8_quantize",
        [r"attribute `orientation` is not a string"]),
    "fp8_quantize_both_of_rows_not_a_multiple_of_128": (
        lambda: quantize(np.zeros((1, 100, 128), np.float32), orientation="both"), "oxmoe_fp8_quantize",
        [r"x's rows \(100\), the transposed result's columns, must be a multiple of the block's columns \(128\)"]),
    "fp8_quantize_both_without_the_transposed_scales": (
        lambda: quantize(np.zeros((1, 128, 128), np.float32), orientation="both", results=3), "oxmoe_fp8_quantize",
        [r"result 3 \(transposed_scales\) is missing: the call has 3 results"]),
    "fp8_quantize_both_with_untransposed_values": (
        lambda: _call("oxmoe_fp8_quantize", (_spec((1, 128, 256), jnp.float8_e4m3fn), _spec((1, 128, 2), jnp.float32),
                                             _spec((1, 128, 256), jnp.float8_e4m3fn), _spec((1, 256, 1), jnp.float32)),
                      np.zeros((1, 128, 256), np.float32), block_rows=np.int64(1), block_cols=np.int64(128),
                      power_of_two_scales=np.bool_(False), orientation="both"),
        "oxmoe_fp8_quantize", [r"transposed_values has shape float8_e4m3fn\[1, 128, 256\], expected \[1, 256, 128\]"]),
    "fp8_requantize_values_of_100_columns": (
        lambda: requantize(np.zeros((1, 128, 100), jnp.float8_e4m3fn), np.ones((1, 128, 1), np.float32)),
        "oxmoe_fp8_quantize", [r"values has 100 columns, expected a multiple of 128"]),
    "fp8_requantize_scales_per_column": (
        lambda: requantize(np.zeros((1, 128, 256), jnp.float8_e4m3fn), np.ones((1, 128, 256), np.float32)),
        "oxmoe_fp8_quantize", [r"scales has shape float32\[1, 128, 256\], expected \[1, 128, 2\]"]),
    "fp8_requantize_bf16_values": (
        lambda: requantize(np.zeros((1, 128, 256), jnp.bfloat16), np.ones((1, 128, 2), np.float32)),
        "oxmoe_fp8_quantize", [r"values has dtype bfloat16", r"float8_e4m3fn"]),
    "fp8_requantize_to_int32": (
        lambda: requantize(np.zeros((1, 128, 256), jnp.float8_e4m3fn), np.ones((1, 128, 2), np.float32),
                           dequantized_dtype="int32"),
        "oxmoe_fp8_quantize", [r"dequantized_dtype is \"int32\", expected \"float32\", \"bfloat16\" or \"float16\""]),
    "fp8_requantize_float_source_rows": (
        lambda: requantize(np.zeros((1, 128, 256), jnp.float8_e4m3fn), np.ones((1, 128, 2), np.float32),
                           source_rows=np.zeros((128,), np.float32)),
        "oxmoe_fp8_quantize", [r"source_rows has dtype float32, expected int32"]),
    "fp8_requantize_source_rows_of_two_matrices": (
        lambda: requantize(np.zeros((2, 128, 256), jnp.float8_e4m3fn), np.ones((2, 128, 2), np.float32),
                           source_rows=np.zeros((128,), np.int32)),
        "oxmoe_fp8_quantize", [r"values has shape \[2, 128, 256\], expected one matrix \[1, rows, columns\] with source_rows"]),
    "fp8_requantize_without_its_dtype": (
        lambda: requantize(np.zeros((1, 128, 256), jnp.float8_e4m3fn), np.ones((1, 128, 2), np.float32),
                           dequantized_dtype=None),
        "oxmoe_fp8_quantize", [r"attribute `dequantized_dtype` \(a string\) is missing"]),
    "fp8_quantize_float_x_with_a_dequantized_dtype": (
        lambda: quantize(np.zeros((1, 128, 128), np.float32), dequantized_dtype="bfloat16"), "oxmoe_fp8_quantize",
        [r"unknown attribute `dequantized_dtype`"]),
    "sort_chunks_result_aliasing_tokens": (
        lambda: aliased("oxmoe_sort_chunks", _spec(ROWS.shape, jnp.float32), ROWS, SPLITS, ORDER,
                        inverse=np.bool_(False)),
        "oxmoe_sort_chunks", [r"result 0 shares memory with argument 0"]),
    "topk_fwd_extra_result": (
        lambda: _call("oxmoe_topk_fwd", (_spec((T, E), jnp.float32), _spec((T, E), jnp.bool_),
                                         _spec((T, E), jnp.float32)), LOGITS, **_attrs()),
        "oxmoe_topk_fwd", [r"3 results, expected 2"]),
    "topk_fwd_unknown_attribute": (
        lambda: topk_fwd(LOGITS, bogus_attr=np.int64(7)), "oxmoe_topk_fwd", [r"unknown attribute `bogus_attr`"]),
    "dispatch_fwd_align_size_past_int32": (
        lambda: dispatch_fwd(LOGITS, MAP, T * E, align_size=np.int64(2**62)), "oxmoe_dispatch_fwd",
        [r"align_size is 4611686018427387904", r"2147483647"]),
    "dispatch_fwd_no_experts": (
        lambda: dispatch_fwd(LOGITS, NO_EXPERTS, 4, align_size=np.int64(1)), "oxmoe_dispatch_fwd",
        [r"routing_map", r"no experts"]),
    "combine_fwd_no_experts": (
        lambda: combine_fwd(np.zeros((T, 0), np.int32)), "oxmoe_combine_fwd", [r"dest_rows", r"no experts"]),
    "combine_fwd_without_weighted": (
        lambda: combine_fwd(weighted=None), "oxmoe_combine_fwd", [r"attribute `weighted` \(a bool\) is missing"]),
    "combine_fwd_weighted_without_merging_probs": (
        lambda: combine_fwd(weighted=np.bool_(True)), "oxmoe_combine_fwd", [r"got 2 arguments, expected 3 to 4"]),
    "combine_fwd_addend_of_the_probs_shape": (
        lambda: combine_fwd(DEST_ROWS, np.ones((T, E), np.float32)), "oxmoe_combine_fwd",
        [r"addend has shape float32\[4, 8\], expected \[4, 3\]"]),
    "combine_fwd_addend_in_bfloat16": (
        lambda: combine_fwd(DEST_ROWS, np.ones((T, 3), jnp.bfloat16)), "oxmoe_combine_fwd",
        [r"addend has dtype bfloat16", r"float32"]),
    "combine_fwd_weighted_and_an_addend_and_more": (
        lambda: combine_fwd(DEST_ROWS, np.ones((T, E), np.float32), np.ones((T, 3), np.float32),
                            np.ones((T, 3), np.float32), weighted=np.bool_(True)),
        "oxmoe_combine_fwd", [r"got 5 arguments, expected 3 to 4"]),
    "aux_loss_fwd_without_its_workspace": (
        lambda: aux_fwd(LOGITS, COUNTS), "oxmoe_aux_loss_fwd",
        [r"result 1 \(workspace\) is missing: the call has 1 results"]),
    "ragged_dot_workspace_of_another_size": (
        lambda: _call("oxmoe_ragged_dot", (_spec(ROWS.shape, jnp.float32), _spec((4,), jnp.uint8)), ROWS,
                      np.ones((2, E, E), np.float32), SIZES, OFFSET, rhs_transposed=np.bool_(False)),
        "oxmoe_ragged_dot", [r"the workspace \(result 1\) is uint8\[4\], but this call needs uint8\[12\]"]),
    "activation_bwd_unknown_activation": (
        lambda: activation_bwd(np.zeros((4, 16), np.float32), np.zeros((4, 32), np.float32), activation="relu"),
        "oxmoe_activation_bwd", [r"activation is \"relu\", expected \"swiglu\", \"geglu\", \"gelu\" or \"silu\""]),
    "activation_bwd_ungated_width_for_swiglu": (
        lambda: activation_bwd(np.zeros((4, 16), np.float32), np.zeros((4, 16), np.float32)),
        "oxmoe_activation_bwd", [r"pre_activation has shape float32\[4, 16\], expected \[4, 32\]"]),
    "activation_bwd_mixed_dtypes": (
        lambda: activation_bwd(np.zeros((4, 16), np.float32), np.zeros((4, 32), jnp.bfloat16)),
        "oxmoe_activation_bwd", [r"pre_activation has dtype bfloat16", r"float32"]),
    "activation_bwd_row_probs_per_column": (
        lambda: activation_bwd(np.zeros((4, 16), np.float32), np.zeros((4, 32), np.float32),
                               row_probs=np.ones((4, 16), np.float32)),
        "oxmoe_activation_bwd", [r"row_probs has shape float32\[4, 16\], expected \[4\]"]),
    "fp8_activation_bwd_rows_not_a_multiple_of_128": (
        lambda: fp8_activation_bwd(np.zeros((100, 128), np.float32), np.zeros((100, 256), np.float32)),
        "oxmoe_fp8_activation_bwd", [r"grad_hidden is \[100, 128\], expected rows and features multiples of 128"]),
    "fp8_activation_bwd_features_not_a_multiple_of_128": (
        lambda: fp8_activation_bwd(np.zeros((128, 64), np.float32), np.zeros((128, 128), np.float32)),
        "oxmoe_fp8_activation_bwd", [r"grad_hidden is \[128, 64\], expected rows and features multiples of 128"]),
    "fp8_activation_bwd_ungated_width_for_swiglu": (
        lambda: fp8_activation_bwd(np.zeros((128, 128), np.float32), np.zeros((128, 128), np.float32)),
        "oxmoe_fp8_activation_bwd", [r"pre_activation has shape float32\[128, 128\], expected \[128, 256\]"]),
    "fp8_activation_bwd_power_of_two_not_a_bool": (
        lambda: fp8_activation_bwd(np.zeros((128, 128), np.float32), np.zeros((128, 256), np.float32),
                                   power_of_two_scales=np.int64(1)),
        "oxmoe_fp8_activation_bwd", [r"attribute `power_of_two_scales` has type int64, expected a bool"]),
    "fp8_activation_bwd_square_blocks_results_of_column_blocks": (
        lambda: fp8_activation_bwd(np.zeros((128, 128), np.float32), np.zeros((128, 256), np.float32),
                                   square_grad_transposed=np.bool_(True)),
        "oxmoe_fp8_activation_bwd", [r"grad_transposed_scales has shape float32\[1, 256, 1\], expected \[1, 2, 1\]"]),
    "fp8_activation_width_not_blocks": (
        lambda: fp8_activation(np.zeros((4, 1, 192), np.float32), 96),
        "oxmoe_fp8_activation", [r"pre_activation has 192 columns, expected a multiple of 256 for \"swiglu\""]),
    "fp8_activation_not_one_row_a_batch_element": (
        lambda: fp8_activation(np.zeros((4, 256), np.float32), 128),
        "oxmoe_fp8_activation", [r"pre_activation has shape \[4, 256\], expected \[rows, 1, columns\]"]),
    "fp8_activation_values_of_other_rows": (
        lambda: _call("oxmoe_fp8_activation", (_spec((5, 1, 128), jnp.float8_e4m3fn), _spec((4, 1, 1), jnp.float32)),
                      np.zeros((4, 1, 256), np.float32), activation="swiglu", power_of_two_scales=np.bool_(False)),
        "oxmoe_fp8_activation", [r"values has shape float8_e4m3fn\[5, 1, 128\], expected \[4, 1, 128\]"]),
    "fp8_activation_integer_pre_activation": (
        lambda: fp8_activation(np.zeros((4, 1, 256), np.int32), 128),
        "oxmoe_fp8_activation", [r"pre_activation has dtype int32, expected float32 or bfloat16 or float16"]),
    "ragged_dot_activation_odd_gated_width": (
        lambda: _call("oxmoe_ragged_dot_activation", (_spec((6, 7), jnp.float32), _spec((6, 3), jnp.float32),
                                                      _spec((12,), jnp.uint8)),
                      ROWS, np.ones((2, E, 7), np.float32), SIZES, OFFSET, activation="swiglu"),
        "oxmoe_ragged_dot_activation", [r"rhs has 7 columns, but \"swiglu\" takes \[gate, up\]: an even number"]),
    "ragged_dot_activation_hidden_of_the_product_s_width": (
        lambda: _call("oxmoe_ragged_dot_activation", (_spec((6, 8), jnp.float32), _spec((6, 8), jnp.float32),
                                                      _spec((12,), jnp.uint8)),
                      ROWS, np.ones((2, E, 8), np.float32), SIZES, OFFSET, activation="geglu"),
        "oxmoe_ragged_dot_activation", [r"hidden has shape float32\[6, 8\], expected \[6, 4\]"]),
    "ragged_dot_activation_unknown_activation": (
        lambda: _call("oxmoe_ragged_dot_activation", (_spec((6, 8), jnp.float32), _spec((6, 8), jnp.float32),
                                                      _spec((12,), jnp.uint8)),
                      ROWS, np.ones((2, E, 8), np.float32), SIZES, OFFSET, activation="relu"),
        "oxmoe_ragged_dot_activation", [r"activation is \"relu\", expected"]),
    "combine_bwd_no_experts": (
        lambda: _call("oxmoe_combine_bwd", _spec((2, 3), jnp.float32), np.ones((T, 3), np.float32),
                      np.zeros((T, 0), np.int32), np.zeros((2,), np.int32)),
        "oxmoe_combine_bwd", [r"dest_rows", r"no experts"]),
})

# After all the errors, the same process still computes a valid call correctly.
VALID_CALL = "valid_topk_fwd_after_the_errors"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", help="run every call on this platform's first device (cpu, gpu)")
    args = parser.parse_args(argv)
    if args.platform:
        jax.config.update("jax_default_device", jax.devices(args.platform)[0])

    import oxmoe  # noqa: F401  (registers the FFI targets)

    for name, (call, _, _) in CASES.items():
        print(json.dumps({"case": name, "started": True}), flush=True)
        try:
            jax.block_until_ready(call())
            result = {"case": name, "raised": None}
        except Exception as e:  # noqa: BLE001  (the type is part of the report)
            result = {
                "case": name,
                "raised": type(e).__name__,
                "jax_runtime_error": isinstance(e, jax.errors.JaxRuntimeError),
                "message": str(e),
            }
        print(json.dumps(result), flush=True)
    probs, routing_map = topk_fwd(LOGITS)
    print(json.dumps({
        "case": VALID_CALL,
        "platform": next(iter(probs.devices())).platform,
        "probs": np.asarray(probs).tolist(),
        "routing_map": np.asarray(routing_map).tolist(),
    }), flush=True)


# -- running it from a test --------------------------------------------------------


def run(platform: str, timeout: float = 600):
    """Runs every case in a child process on `platform`.

    The child gets this process's environment (JAX_PLATFORMS, OXMOE_LIBRARY, PYTHONPATH,
    XLA_FLAGS, ...) and working directory, except that it does not preallocate GPU memory:
    the test session may already hold most of it.

    Returns (results by case, the cases started in order, a description of the process's end).
    """
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    script = Path(__file__).resolve()
    proc = subprocess.run(
        [sys.executable, str(script), "--platform", platform], capture_output=True, text=True, timeout=timeout,
        env=env,
    )
    results, started = {}, []
    for line in proc.stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("started"):
            started.append(record["case"])
        else:
            results[record["case"]] = record
    process = f"{platform} process: exit status {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}"
    return results, started, process


def check_case(case: str, results: dict, started: list, process: str) -> None:
    """The handler rejected the bad call with a JaxRuntimeError whose message names the
    target and (besides the target's name) the offending value; the process lived on."""
    _, target, patterns = CASES[case]
    if case not in results:
        crashed_in = started[-1] if started else "(before the first case)"
        raise AssertionError(f"no result for {case}: the process died during {crashed_in}; {process}")
    result = results[case]
    assert result["raised"] is not None, f"{target} accepted the bad call {case} without an error"
    assert result["jax_runtime_error"], f"{case}: raised {result['raised']}, expected JaxRuntimeError: {result['message']}"
    message = result["message"]
    assert target in message, f"{case}: the message does not name {target}: {message!r}"
    # The offending value, not the target's name (which contains e.g. "topk").
    rest = message.replace(target, "")
    for pattern in patterns:
        assert re.search(pattern, rest, re.IGNORECASE), (
            f"{case}: the message does not name the offending value (/{pattern}/): {message!r}"
        )


def check_valid_call(results: dict, process: str, platform: str) -> None:
    """After all the errors, a valid call in the same process ran on `platform` and is right."""
    assert VALID_CALL in results, f"the valid call after the errors did not finish; {process}"
    result = results[VALID_CALL]
    family = lambda p: "gpu" if p in ("gpu", "cuda", "rocm") else p  # noqa: E731
    assert family(result["platform"]) == family(platform), f"the calls ran on {result['platform']}, not {platform}"
    expected = ref.topk(LOGITS, 2)
    np.testing.assert_array_equal(np.asarray(result["routing_map"]), expected.routing_map)
    np.testing.assert_allclose(np.asarray(result["probs"]), expected.probs, rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
    sys.exit(main())
