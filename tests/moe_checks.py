"""The MoE tests' random inputs, without near-ties in the routing, and the comparison of a
result with the dense reference (moe_reference.py): relative error of the norm plus elementwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_reference
from moe_reference import F32, GLU_ACTIVATIONS, Params, router_dtype


# ----------------------------------------------------------------- random inputs


def selection_margin(logits, config, expert_bias=None) -> np.ndarray:
    """[T] float64: how far each token's chosen experts and groups (of the routing and of the
    load-balancing loss's plain top-k) lie ahead of the best ones left out, relative to the
    largest score. Float32 rounding may change a selection only where this is tiny."""
    x = np.asarray(logits, np.float64)
    k = config.topk

    def gap(scores, chosen_count, eligible=None):
        s = np.where(eligible, scores, -np.inf) if eligible is not None else scores
        top = -np.sort(-s, axis=-1)
        if chosen_count >= s.shape[-1]:
            return np.full(s.shape[0], np.inf)
        return (top[:, chosen_count - 1] - top[:, chosen_count]) / np.abs(scores).max(axis=-1)

    sig = 1.0 / (1.0 + np.exp(-x))
    soft = np.exp(x - x.max(axis=-1, keepdims=True))
    soft /= soft.sum(axis=-1, keepdims=True)
    margins = [gap(soft if config.score_function == "softmax" else sig / sig.sum(axis=-1, keepdims=True), k)]
    if config.score_function == "softmax":
        scores = soft if config.use_pre_softmax else x
    else:
        bias = np.asarray(expert_bias, np.float64) if (config.use_expert_bias and expert_bias is not None) else 0.0
        scores = sig + bias
    eligible = None
    if config.num_groups is not None:
        t, e = scores.shape
        g = config.num_groups
        group = -np.sort(-scores.reshape(t, g, e // g), axis=-1)[..., : k // config.group_topk].sum(axis=-1)
        margins.append(gap(group, config.group_topk))
        order = np.argsort(-group, axis=-1, kind="stable")[:, : config.group_topk]
        eligible = np.zeros((t, g), bool)
        np.put_along_axis(eligible, order, True, axis=-1)
        eligible = np.repeat(eligible, e // g, axis=-1)
    margins.append(gap(scores, k, eligible))
    return np.minimum.reduce(margins)


# A float32 logit is a sum of H products: two summation orders differ by ~sqrt(H) ulps of the
# terms. Tokens whose routing is decided by less than this (relative) margin are redrawn.
MIN_MARGIN = 1e-4


def rounded(a, dtype) -> np.ndarray:
    """float32 a rounded to dtype (a NumPy / ml_dtypes / jnp dtype) and back."""
    return np.asarray(a, np.float32).astype(np.dtype(dtype)).astype(np.float32)


def draw_tokens(rng: np.random.Generator, shape, gate, config, expert_bias=None, *, min_margin=MIN_MARGIN,
                x_dtype=np.float32):
    """Random float32 tokens [..., H] none of whose routing is a near-tie (see `selection_margin`;
    judged on the tokens rounded to x_dtype, the layer's input, and as the router takes them and
    its weight: rounded to router_dtype(config)): the few tokens that are get redrawn."""
    h = shape[-1]
    gate64 = rounded(np.asarray(gate, np.float32), router_dtype(config)).astype(np.float64)
    x = rng.standard_normal((int(np.prod(shape[:-1])), h)).astype(np.float32)
    for _ in range(100):
        logits = rounded(rounded(x, x_dtype), router_dtype(config)).astype(np.float64) @ gate64
        bad = selection_margin(logits, config, expert_bias) < min_margin
        if not bad.any():
            return x.reshape(shape)
        x[bad] = rng.standard_normal((int(bad.sum()), h))
    raise RuntimeError("draw_tokens: could not draw tokens without near-ties in 100 rounds")


def draw_params(rng: np.random.Generator, config, hidden: int, ffn: int, *, glu: bool, dtype=np.float32,
                make=Params):
    """Random weights of the layer's scale (router logits ~ 1, GEMM outputs ~ 1) in `dtype`, built
    with `make(gate=, up=, down=, expert_bias=)` and, with config.shared_ffn, `shared_up=,
    shared_down=, shared_gate=` (the gate's logits ~ 1 too)."""
    e = config.num_experts

    def normal(shape, std):
        return jnp.asarray((rng.standard_normal(shape) * std).astype(np.float32)).astype(dtype)

    bias = None
    if config.use_expert_bias:
        bias = jnp.asarray((rng.standard_normal(e) * 0.05).astype(np.float32))
    routed = dict(gate=normal((hidden, e), 1.0 / np.sqrt(hidden)),
                  up=normal((e, hidden, 2 * ffn if glu else ffn), 1.0 / np.sqrt(hidden)),
                  down=normal((e, ffn, hidden), 1.0 / np.sqrt(ffn)), expert_bias=bias)
    fs = getattr(config, "shared_ffn", None)
    if fs is None:
        return make(**routed)
    return make(**routed, shared_up=normal((hidden, 2 * fs if glu else fs), 1.0 / np.sqrt(hidden)),
                shared_down=normal((fs, hidden), 1.0 / np.sqrt(fs)),
                shared_gate=normal((hidden, 1), 1.0 / np.sqrt(hidden)) if config.shared_gate else None)


# The weight of y in the differentiated loss sum(y * y_weight) + losses: with the losses'
# coefficients at AUX_LOSS_COEFF and Z_LOSS_COEFF, the three parts of the gradients of the
# tokens and of the router weight are of one size at ~128 tokens of width 128 (within 5x of
# each other; with weights ~ N(0, 1) y's would be 1e4 times the losses' and hide an error in
# them). At thousands of tokens y's part dominates.
Y_WEIGHT_SCALE = 1e-5
AUX_LOSS_COEFF, Z_LOSS_COEFF = 0.1, 0.001


def draw_inputs(rng: np.random.Generator, config, x_shape, ffn: int, *, make=Params, param_dtype=np.float32,
                x_dtype=np.float32):
    """(x, params, y_weight): tokens x_shape ([B, S, H] or [T, H]) without near-ties, the layer's
    weights (see draw_params) and a float32 weight of y in the loss (see Y_WEIGHT_SCALE)."""
    params = draw_params(rng, config, x_shape[-1], ffn, glu=config.activation in GLU_ACTIVATIONS,
                         dtype=param_dtype, make=make)
    x = draw_tokens(rng, x_shape, params.gate, config, params.expert_bias, x_dtype=x_dtype)
    y_weight = (rng.standard_normal(x_shape) * Y_WEIGHT_SCALE).astype(np.float32)
    return jnp.asarray(x).astype(x_dtype), params, jnp.asarray(y_weight)


# ------------------------------------------------------------------ the layer's inputs on a mesh


def param_specs(params, *, expert_axis="expert", weight_axes=()):
    """The partition specs of ``params`` (a MoEParams) in the layer's layout: up and down split
    over ``expert_axis`` (each shard's experts over ``weight_axes`` too), every other weight the
    params have whole."""
    experts = P((expert_axis, *weight_axes))
    return type(params)(**{f.name: None if getattr(params, f.name) is None else experts if f.name in ("up", "down")
                           else P() for f in dataclasses.fields(params)})


def put_on_mesh(mesh, x, params, y_weight, *, data_axes=("data",), expert_axis="expert", weight_axes=()):
    """x and y_weight split over (*data_axes, expert_axis), as the layer takes its tokens, and
    ``params`` placed by :func:`param_specs`."""
    tokens = NamedSharding(mesh, P((*data_axes, expert_axis)))
    specs = param_specs(params, expert_axis=expert_axis, weight_axes=weight_axes)
    placed = jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), params, specs)
    return jax.device_put(x, tokens), placed, jax.device_put(y_weight, tokens)


# ------------------------------------------------------------------ the reference's result

_value_and_grads = jax.jit(moe_reference.value_and_grads, static_argnums=2)


def reference(x, params, config, y_weight):
    """((y, aux), (d x, d params)) of the dense reference (moe_reference.value_and_grads),
    jitted. The tokens go in as [T, H] and the config without the fields the reference ignores
    (how the layer pads, exchanges and chunks), so that the cases of one routing, dtype and
    token count share one compilation."""
    plain = dataclasses.replace(config, align_size=None, exchange="auto", token_chunks=1)
    h = x.shape[-1]
    (y, aux), (dx, dparams) = _value_and_grads(x.reshape(-1, h), params, plain, y_weight.reshape(-1, h))
    return (y.reshape(x.shape), aux), (dx.reshape(x.shape), dparams)


def describe(config) -> str:
    """The config's fields that differ from their defaults (and the expert count and top-k),
    for a failure's context."""
    defaults = type(config)(num_experts=config.num_experts, topk=config.topk)
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(defaults, f.name) or f.name in ("num_experts", "topk")}
    changed["dtype"] = jnp.dtype(config.dtype).name
    return ", ".join(f"{k}={v}" for k, v in changed.items())


# ------------------------------------------------------------------ comparisons

# (relative error of the norm, elementwise slack relative to the largest |reference|) for a
# result in the dtype: float32 differs from the reference only by the summation order; bfloat16
# results are rounded to 8 bits after each GEMM, so a different float32 sum can round one ulp
# (2^-8 relative) the other way, and those ulps travel through the next GEMM and the backward
# (a dispatch / combine implementation built from oxmoe's primitives differs from this
# reference by up to 3e-3 of the norm and 7e-3 of the largest element).
TOLERANCES = {jnp.dtype(jnp.float32): (1e-5, 1e-5), jnp.dtype(jnp.bfloat16): (1.5e-2, 3e-2)}
# The losses are float32 functions of float32 logits, whatever config.dtype.
LOSS_TOLERANCE = (1e-5, 0.0)


# Larger results are compared on their device (a GPU's gradients of 128 experts' weights would
# take gigabytes of float64 on the host); smaller ones in float64 NumPy.
HOST_COMPARE_MAX_ELEMENTS = 1 << 22


@jax.jit
def _discrepancy(actual, expected, rel, slack):
    """On the device: (|a - e|, |e|, max|e|, count of elements off, count not finite, the flat
    indices of the first 6 elements off (-1: none) and their values in a and e)."""
    a, e = actual.astype(F32).ravel(), expected.astype(F32).ravel()
    scale = jnp.max(jnp.abs(e))
    bad = ~(jnp.abs(a - e) <= rel * jnp.abs(e) + slack * scale)
    (where,) = jnp.nonzero(bad, size=6, fill_value=-1)
    return (jnp.linalg.norm(a - e), jnp.linalg.norm(e), scale, bad.sum(), (~jnp.isfinite(a)).sum(), where,
            a[jnp.maximum(where, 0)], e[jnp.maximum(where, 0)])


def _host_discrepancy(actual, expected, rel, slack):
    """_discrepancy in float64 NumPy."""
    a = np.asarray(jnp.asarray(actual).astype(F32), np.float64).ravel()
    e = np.asarray(jnp.asarray(expected).astype(F32), np.float64).ravel()
    scale = float(np.abs(e).max())
    bad = ~(np.abs(a - e) <= rel * np.abs(e) + slack * scale)
    where = np.flatnonzero(bad)[:6]
    return (np.linalg.norm(a - e), np.linalg.norm(e), scale, int(bad.sum()), int((~np.isfinite(a)).sum()), where,
            a[where], e[where])


def assert_close(actual, expected, dtype, *, what: str, context: str, tolerance=None) -> float:
    """|actual - expected| / |expected| (norms) <= rel and, elementwise,
    |actual - expected| <= rel |expected| + slack max|expected| (rel, slack: TOLERANCES[dtype]
    or `tolerance`), every element finite; returns the norm's relative error. Arrays of more
    than HOST_COMPARE_MAX_ELEMENTS are compared on their device (both on the same one)."""
    rel, slack = tolerance or TOLERANCES[jnp.dtype(dtype)]
    shape, expected_shape = jnp.shape(actual), jnp.shape(expected)
    assert shape == expected_shape, f"{what}: shape {shape}, expected {expected_shape} ({context})"
    if np.prod(shape, dtype=np.int64) == 0:
        return 0.0
    on_host = np.prod(shape, dtype=np.int64) <= HOST_COMPARE_MAX_ELEMENTS
    stats = (_host_discrepancy if on_host else _discrepancy)(actual, expected, rel, slack)
    diff_norm, norm, scale, bad_count, not_finite, where, got, want = jax.device_get(stats)
    assert not_finite == 0, f"{what}: {int(not_finite)} elements not finite ({context})"
    error = float(diff_norm / norm) if norm > 0 else float(diff_norm)
    assert error <= rel, f"{what}: relative error of the norm {error:.3g} > {rel:.3g} ({context})"
    if bad_count:
        lines = [f"{tuple(int(i) for i in np.unravel_index(int(w), shape))}: got {float(g)!r}, expected {float(x)!r}"
                 for w, g, x in zip(where, got, want) if w >= 0]
        raise AssertionError(f"{what}: {int(bad_count)} of {int(np.prod(shape))} elements off by more than "
                             f"{rel:.3g} |ref| + {slack:.3g} max|ref| (max|ref| = {float(scale):.3g}):\n  "
                             + "\n  ".join(lines) + f"\n({context})")
    return error


def compare(got, expected, config, *, context: str) -> dict:
    """Checks the layer's ((y, aux), (d x, d params)) against the reference's: y, d x and the
    weights' gradients within the dtype's tolerance, the losses within float32's, the counts
    exactly, expert_bias's gradient zero. Returns each quantity's relative error."""
    (y, aux), (dx, dparams) = got
    (y_ref, aux_ref), (dx_ref, dparams_ref) = expected
    dtype = jnp.dtype(config.dtype)
    assert y.dtype == dtype, f"y: dtype {y.dtype}, expected config.dtype {dtype} ({context})"
    assert y.shape == y_ref.shape, f"y: shape {y.shape}, expected {y_ref.shape} ({context})"
    counts, counts_ref = np.asarray(aux.tokens_per_expert), np.asarray(aux_ref.tokens_per_expert)
    assert aux.tokens_per_expert.dtype == jnp.int32, f"tokens_per_expert: dtype {aux.tokens_per_expert.dtype}"
    np.testing.assert_array_equal(counts, counts_ref, err_msg=f"tokens_per_expert ({context})")
    assert int(aux.dropped_copies) == int(aux_ref.dropped_copies), (
        f"dropped_copies: {int(aux.dropped_copies)}, expected {int(aux_ref.dropped_copies)} ({context})")
    errors = {}
    for name in ("load_balancing_loss", "z_loss"):
        value, value_ref = getattr(aux, name), getattr(aux_ref, name)
        assert jnp.shape(value) == () and value.dtype == F32, f"{name}: {value.dtype}{jnp.shape(value)}, expected f32[]"
        if float(value_ref) == 0.0:
            assert float(value) == 0.0, f"{name}: got {float(value)!r}, expected 0.0 ({context})"
        else:
            errors[name] = assert_close(value, value_ref, F32, what=name, context=context, tolerance=LOSS_TOLERANCE)
    errors["y"] = assert_close(y, y_ref, dtype, what="y", context=context)
    weights = [(f"d {name}", getattr(dparams, name), getattr(dparams_ref, name))
               for name in ("gate", "up", "down", "shared_up", "shared_down", "shared_gate")
               if getattr(dparams_ref, name, None) is not None]
    for name, g, g_ref in [("d x", dx, dx_ref), *weights]:
        assert g.dtype == g_ref.dtype, f"{name}: dtype {g.dtype}, expected {g_ref.dtype} ({context})"
        errors[name] = assert_close(g, g_ref, dtype, what=name, context=context)
    if dparams_ref.expert_bias is not None:
        bias = np.asarray(dparams.expert_bias)
        assert bias.shape == dparams_ref.expert_bias.shape and not bias.any(), (
            f"d expert_bias: expected zeros, got {bias!r} ({context})")
    return errors
