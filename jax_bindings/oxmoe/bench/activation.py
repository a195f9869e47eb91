"""The activation benchmark: oxmoe's activation backward against plain JAX's, and the FP8
layer's activations against their unfused paths.

Cases: ``<model> bf16 swiglu bwd``, :func:`oxmoe.activation.activation_bwd` of
the MoE layer's backward at each benchmark layer's rows (``R = T * k`` routed
rows; the expert width ``F``): ``grad_hidden [R, F]``, the pre-activation
``[R, 2F]`` (bf16) and the rows' weights ``[R]`` (float32) to the pre-activation's
gradient ``[R, 2F]``, the weighted hidden activation ``[R, F]`` and the weights'
gradient ``[R]``. The smoke run takes R=256 and F=128.

Plain JAX is :func:`oxmoe.reference.activation.activation_bwd`, the formula the
layer's backward used before: ``jax.vjp`` of the activation (``silu(gate) * up`` in
float32, rounded to bf16) applied to the gradient after the weight, the weighted
hidden activation and the row dot products written with ``jnp`` (XLA fuses them
into passes of its own). Each case compares
the two on every input set before timing (relative error of each result).

Byte floor: each input read once, each output written once: ``R * (12 F + 8)``
bytes (bf16 ``[R, F]`` read and written once each, ``[R, 2F]`` read and written once
each, float32 ``[R]`` read and written).

``<model> bf16 swiglu bwd fp8``: :func:`oxmoe.fp8.activation_bwd`, the FP8 layer's
form, whose results are quantized in the same pass (the pre-activation's gradient in
1 x 128 blocks and transposed, the weighted hidden activation transposed), against what
it replaces, oxmoe's unfused path (:func:`oxmoe.activation.activation_bwd`, then
:func:`oxmoe.fp8.quantize_with_transpose` and :func:`oxmoe.fp8.quantize`: three
kernels), whose results must be the same bit for bit. Byte floor: ``R * (11 F + 8)``
(bf16 inputs, FP8 values of ``[R, 2F]`` twice and ``[R, F]`` once) plus the scales,
``R * 5 F / 32``.

``<model> bf16 swiglu fwd fp8``: :func:`oxmoe.fp8.activation`, the FP8 layer's forward
activation, whose result is quantized per row in the same pass, against what the layer ran
before it: the activation in plain JAX (float32, rounded to bf16; one XLA fusion), then
:func:`oxmoe.fp8.quantize`. XLA's SiLU may differ from oxmoe's in a float32 ulp, so a few
elements round the other way (to bf16, then to FP8). Byte floor: ``R * 5 F`` (the bf16
pre-activation read, the FP8 values written) plus the scales, ``R * F / 32``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe import activation, fp8, reference
from oxmoe.bench.cases import Case, Family, Goals, rel_err
from oxmoe.model_shapes import LAYER_SHAPES, LayerShape

SMOKE_ROWS, SMOKE_FEATURES = 256, 128
ACTIVATION = "swiglu"

#: Goals: at least 75% of the copy bandwidth (the house goal of a kernel that moves bytes) ...
MIN_FRACTION_OF_COPY = 0.75
#: ... and faster than plain JAX by most of the bytes it saves: XLA's passes move 18 F bytes a
#: row (the pre-activation and grad_hidden read twice), oxmoe's 12 F.
MIN_SPEEDUP = 1.3
GOALS = Goals.fraction_of_copy(MIN_FRACTION_OF_COPY, MIN_SPEEDUP, f">= {MIN_SPEEDUP:g}x faster than plain JAX")

#: Largest ||oxmoe - plain|| / ||plain|| of each result. Under jit, XLA drops the bf16 rounding
#: of plain JAX's hidden activation and weighted gradient inside its fusions (its default
#: xla_allow_excess_precision), which oxmoe rounds as the layer's semantics say: results then
#: differ by about a bf16 ulp (measured 2.8e-3 on an H200), the row sums of those values too
#: (1.7e-3).
MAX_REL_ERR = {"grad_pre_activation": 1e-2, "weighted_hidden": 1e-2, "grad_row_probs": 1e-2}


def plain_activation_bwd(grad_hidden, pre_activation, row_probs):
    return reference.activation.activation_bwd(grad_hidden, pre_activation, row_probs, ACTIVATION)


def oxmoe_activation_bwd(grad_hidden, pre_activation, row_probs):
    return tuple(activation.activation_bwd(grad_hidden, pre_activation, row_probs, ACTIVATION))


@jax.jit
def _compare(ox, plain, context):
    del context
    return {f"{name}_rel_err": rel_err(a, b) for name, a, b in zip(activation.ActivationGrads._fields, ox, plain)}


def swiglu_bwd_case(model: LayerShape, rows: int, features: int) -> Case:
    def draw(random):
        return (random.normal((rows, features), jnp.bfloat16), random.normal((rows, 2 * features), jnp.bfloat16, 2.0),
                jnp.abs(random.normal((rows,), jnp.float32, 0.5)))

    return Case(
        name=f"{model.name} bf16 {ACTIVATION} bwd",
        bytes=rows * (12 * features + 8),
        draw=draw, prepare=None, oxmoe=oxmoe_activation_bwd, plain=plain_activation_bwd, compare=_compare,
        limits={f"{name}_rel_err": limit for name, limit in MAX_REL_ERR.items()},
        primitive="oxmoe_activation_bwd",
        info=dict(op=ACTIVATION, direction="bwd", dtype="bfloat16", rows=rows, features=features, model=model.name))


def fp8_activation_bwd(grad_hidden, pre_activation, row_probs):
    return tuple(fp8.activation_bwd(grad_hidden, pre_activation, row_probs, ACTIVATION))


def unfused_fp8_activation_bwd(grad_hidden, pre_activation, row_probs):
    g = activation.activation_bwd(grad_hidden, pre_activation, row_probs, ACTIVATION)
    return (*fp8.quantize_with_transpose(g.grad_pre_activation), fp8.quantize(g.weighted_hidden, transpose=True),
            g.grad_row_probs)


#: The quantized results are the unfused path's bit for bit; the row sums' order differs on a GPU.
MAX_FP8_REL_ERR = {name: 0.0 for name in fp8.QuantizedActivationGrads._fields[:3]} | {"grad_row_probs": 1e-5}


@jax.jit
def _compare_fp8(fused, unfused, context):
    del context
    as_float = lambda x: fp8.dequantize(x) if isinstance(x, fp8.BlockQuantized) else x  # noqa: E731
    return {f"{name}_rel_err": rel_err(as_float(a), as_float(b))
            for name, a, b in zip(fp8.QuantizedActivationGrads._fields, fused, unfused)}


def swiglu_bwd_fp8_case(model: LayerShape, rows: int, features: int) -> Case:
    case = swiglu_bwd_case(model, rows, features)
    return Case(
        name=f"{case.name} fp8", bytes=rows * (11 * features + 8) + rows * 5 * features // 32,
        draw=case.draw, prepare=None, oxmoe=fp8_activation_bwd, plain=unfused_fp8_activation_bwd,
        compare=_compare_fp8, limits={f"{name}_rel_err": limit for name, limit in MAX_FP8_REL_ERR.items()},
        primitive="oxmoe_fp8_activation_bwd", info=dict(case.info, fp8=True))


def fp8_activation(pre_activation):
    return fp8.activation(pre_activation, ACTIVATION)


def unfused_fp8_activation(pre_activation):
    gate, up = jnp.split(pre_activation.astype(jnp.float32), 2, axis=-1)
    return fp8.quantize((jax.nn.silu(gate) * up).astype(pre_activation.dtype))


#: A few elements of the hidden activation round the other way (XLA's SiLU against oxmoe's),
#: each off by a bf16 ulp, or an FP8 one where that moves it across an FP8 rounding boundary.
MAX_FP8_FWD_REL_ERR = 1e-2


@jax.jit
def _compare_fp8_fwd(fused, unfused, context):
    del context
    return {"hidden_rel_err": rel_err(fp8.dequantize(fused), fp8.dequantize(unfused))}


def swiglu_fwd_fp8_case(model: LayerShape, rows: int, features: int) -> Case:
    def draw(random):
        return (random.normal((rows, 2 * features), jnp.bfloat16, 2.0),)

    return Case(
        name=f"{model.name} bf16 {ACTIVATION} fwd fp8", bytes=rows * 5 * features + rows * features // 32,
        draw=draw, prepare=None, oxmoe=fp8_activation, plain=unfused_fp8_activation, compare=_compare_fp8_fwd,
        limits={"hidden_rel_err": MAX_FP8_FWD_REL_ERR}, primitive="oxmoe_fp8_activation",
        info=dict(op=ACTIVATION, direction="fwd", dtype="bfloat16", rows=rows, features=features, model=model.name,
                  fp8=True))


def cases(smoke: bool) -> list[Case]:
    """Per benchmark layer shape, in the order of :data:`oxmoe.model_shapes.LAYER_SHAPES`, the
    activation's backward, its FP8 form, then the FP8 forward."""
    sizes = [(m, SMOKE_ROWS, SMOKE_FEATURES) if smoke else (m, m.tokens * m.topk, m.ffn) for m in LAYER_SHAPES]
    return [make(*size) for size in sizes for make in (swiglu_bwd_case, swiglu_bwd_fp8_case, swiglu_fwd_fp8_case)]


FAMILY = Family(name="activation", goals=GOALS, cases=cases,
                sizes=lambda smoke: (f"R={SMOKE_ROWS}, F={SMOKE_FEATURES}" if smoke
                                     else "R = T * k, F of each layer shape"))
