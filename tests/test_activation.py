"""oxmoe.activation.activation_bwd (the oxmoe_activation_bwd primitive: Rust on the CPU, the
CUDA kernel on a GPU) against a NumPy float64 reference that rounds where the semantics round,
and against the plain-JAX formula the MoE layer used before (oxmoe.reference.activation), on
the expert widths of real models (Mixtral, Qwen3-30B-A3B, DeepSeek-V3) and odd ones, every
activation, in float32, bfloat16 and float16, on fresh random data; vmap, jit and sharding;
with group_sizes, the groups' rows; and its errors (its rows or features 0:
test_empty_dimensions.py). With a GPU as the default device (scripts/gpu-check) the same tests
check the CUDA kernel; test_groups_rows_at_full_size_on_gpu adds a full-size dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import devices
import ragged_dot_checks as checks
from oxmoe import activation as act
from oxmoe import model_shapes
from oxmoe.reference import activation as reference_activation

ACTIVATIONS = act.ACTIVATIONS
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Expert widths F of the benchmark's models, and widths whose rows are not 16-byte multiples.
WIDTHS = [(64, layer.ffn) for layer in model_shapes.LAYER_SHAPES] + [(96, 100), (33, 1)]


def draw(rng, rows: int, features: int, activation: str, dtype):
    """grad_hidden [R, F], pre_activation [R, 2F or F] (spread so that SiLU and GELU see
    their tails: a tenth of the values past +-6) and row_probs [R] (some zero: padding)."""
    width = 2 * features if act.gated(activation) else features
    grad = rng.standard_normal((rows, features))
    pre = rng.standard_normal((rows, width)) * 2.0
    pre[rng.random(pre.shape) < 0.1] *= 5.0
    probs = rng.random(rows).astype(np.float32)
    probs[rng.random(rows) < 0.1] = 0.0
    return jnp.asarray(grad, dtype), jnp.asarray(pre, dtype), jnp.asarray(probs)


EPS32 = float(np.finfo(np.float32).eps)


def _value_and_slope(activation: str, x):
    """act(x), act'(x) in float64 (SiLU x sigmoid(x), or GELU's tanh approximation), and
    bounds on the errors of their float32 evaluation: the cancellations in 1 - s, 1 + t and
    1 - t^2 leave absolute errors of a few float32 ulps of the terms that meet there."""
    if activation in ("swiglu", "silu"):
        s = 1.0 / (1.0 + np.exp(np.minimum(-x, 700.0)))  # e^700 is finite in float64: no overflow warning
        value, slope = x * s, s * (1.0 + x * (1.0 - s))  # float64: no cancellation to speak of
        return value, slope, 8 * EPS32 * np.abs(value), 8 * EPS32 * (s + 2 * np.abs(x) * s)
    k, c = np.sqrt(2.0 / np.pi), 0.044715
    t = np.tanh(k * (x + c * x ** 3))
    value = 0.5 * x * (1.0 + t)
    slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x)
    value_error = 8 * EPS32 * (np.abs(value) + np.abs(x))
    slope_error = 8 * EPS32 * (1.0 + np.abs(x) * k * (1.0 + 3.0 * c * x * x))
    return value, slope, value_error, slope_error


def hidden_reference(pre, activation: str):
    """The hidden activation of ``pre`` (``[R, 2F]`` gated, else ``[R, F]``) in float64,
    rounded to its dtype as the semantics round it, and the bound on its distance from
    the float32 evaluation the primitives specify: ``(hidden, bound, value, slope,
    value_error, slope_error, up)``, the activation's value and slope (with the bounds of
    their float32 evaluation) and the up half (ones ungated), all float64."""
    dtype = pre.dtype
    eps = float(jnp.finfo(dtype).eps)
    # Rounding to the dtype's subnormals (float16's start at 2^-14) is off by up to half their
    # spacing, absolute: another term of each rounded value's bound.
    spacing = float(jnp.finfo(dtype).smallest_subnormal)
    x = np.asarray(pre.astype(jnp.float32), np.float64)
    up = None
    if act.gated(activation):
        x, up = np.split(x, 2, axis=1)
    up = np.ones_like(x) if up is None else up
    value, slope, value_error, slope_error = _value_and_slope(activation, x)
    hidden = np.asarray(np.asarray(value * up, np.float32).astype(dtype), np.float64)
    hidden_error = eps * np.abs(hidden) + spacing + np.abs(up) * value_error
    return hidden, hidden_error, value, slope, value_error, slope_error, up


def reference(grad, pre, probs, activation: str):
    """The semantics in float64, rounding to the inputs' dtype where they round (the hidden
    activation and the gradient after the weight): ``(grad_pre_activation, weighted_hidden,
    grad_row_probs)``, each with the bound on its distance from the float32 evaluation the
    primitive specifies (a few ulps of the dtype where a value was rounded the other way,
    and the float32 errors of the activation and of the row sums)."""
    dtype = grad.dtype
    eps = float(jnp.finfo(dtype).eps)
    # Rounding to the dtype's subnormals (float16's start at 2^-14) is off by up to half their
    # spacing, absolute: another term of each rounded value's bound.
    spacing = float(jnp.finfo(dtype).smallest_subnormal)
    round_ = lambda v: np.asarray(np.asarray(v, np.float32).astype(dtype), np.float64)  # noqa: E731
    g, p = (np.asarray(a.astype(jnp.float32), np.float64) for a in (grad, probs))
    p = p[:, None]
    features = g.shape[1]
    hidden, hidden_error, value, slope, value_error, slope_error, up = hidden_reference(pre, activation)
    c = round_(g * p)  # exact in both: a float32 product of float32 values, rounded once
    grad_x = c * up * slope
    grad_x_error = 3 * eps * np.abs(grad_x) + 2 * spacing + np.abs(c * up) * slope_error + 4 * EPS32 * np.abs(grad_x)
    if act.gated(activation):
        grad_up = c * value
        grad_up_error = 3 * eps * np.abs(grad_up) + 2 * spacing + np.abs(c) * value_error
        grad_pre, grad_pre_error = np.concatenate([grad_x, grad_up], 1), np.concatenate([grad_x_error, grad_up_error], 1)
    else:
        grad_pre, grad_pre_error = grad_x, grad_x_error
    weighted = hidden * p
    weighted_error = 3 * eps * np.abs(weighted) + 2 * spacing + np.abs(p) * hidden_error
    products = hidden * g
    sums_error = (np.abs(g) * hidden_error).sum(1) + features * EPS32 * np.abs(products).sum(1)
    return (grad_pre, grad_pre_error), (weighted, weighted_error), (products.sum(1), sums_error)


def assert_close(got, want_and_bound, what: str):
    want, bound = want_and_bound
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    # Absolute slack for values float32 cannot carry: e^-x overflows below x = -88, where the
    # float64 values are below 1e-35 and float32's are 0.
    bad = np.abs(got - want) > bound + 1e-30
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, e.g. got {got[bad][:4]} want {want[bad][:4]}"


@pytest.mark.parametrize("rows, features", WIDTHS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_bwd_matches_the_float64_reference(activation, dtype, rows, features, rng, seed):
    dtype = DTYPES[dtype]
    grad, pre, probs = draw(rng, rows, features, activation, dtype)
    got = jax.jit(act.activation_bwd, static_argnums=3)(grad, pre, probs, activation)
    what = f"{activation} {np.dtype(dtype).name} [{rows}, {features}], seed={seed}"
    assert got.grad_pre_activation.dtype == dtype and got.weighted_hidden.dtype == dtype
    for name, result, want in zip(got._fields, got, reference(grad, pre, probs, activation)):
        assert_close(result, want, f"{name}, {what}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_pre_activations_far_out_in_the_tails(activation, dtype, rng, seed):
    """Where e^-x overflows (x < -88) or tanh saturates, every result is still the reference's:
    no NaN from the infinity, no lost sign."""
    dtype = DTYPES[dtype]
    tails = np.array([-1000.0, -120.0, -89.0, -87.0, -20.0, 20.0, 87.0, 89.0, 120.0, 1000.0])
    features = 16 * tails.size
    grad, pre, probs = draw(rng, 8, features, activation, dtype)
    # The activation's input (a gated one's gate) in the tails, its up half as drawn.
    x = np.resize(tails, (8, features))
    rng.shuffle(x, axis=1)
    pre = jnp.asarray(np.concatenate([x, np.asarray(pre[:, features:].astype(jnp.float32))], axis=1), dtype)
    got = act.activation_bwd(grad, pre, probs, activation)
    for name, result, want in zip(got._fields, got, reference(grad, pre, probs, activation)):
        assert np.isfinite(np.asarray(result.astype(jnp.float32))).all(), name
        assert_close(result, want, f"{name}, {activation} {np.dtype(dtype).name}, seed={seed}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_bwd_is_the_vjp_of_the_layers_former_activation(activation, rng, seed):
    features = model_shapes.QWEN3_30B_A3B_LAYER.ffn
    grad, pre, probs = draw(rng, 128, features, activation, jnp.bfloat16)
    got = act.activation_bwd(grad, pre, probs, activation)
    # Within the float64 reference's bounds of each other: both are float32 evaluations of it.
    for name, result, former, (_, bound) in zip(got._fields, got, reference_activation.activation_bwd(grad, pre, probs, activation),
                                                reference(grad, pre, probs, activation)):
        assert_close(result, (np.asarray(former.astype(jnp.float32), np.float64), 2 * bound),
                     f"{name}, {activation}, seed={seed}")


def test_vmap_and_sharding_give_the_whole_result(rng, seed):
    grads, pres, probs = zip(*(draw(rng, 64, 768, "swiglu", jnp.bfloat16) for _ in range(3)))
    grad, pre, prob = jnp.stack(grads), jnp.stack(pres), jnp.stack(probs)
    mapped = jax.jit(jax.vmap(act.activation_bwd))(grad, pre, prob)
    for i in range(3):
        for got, want in zip(mapped, act.activation_bwd(grads[i], pres[i], probs[i])):
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want), err_msg=f"vmap, seed={seed}")
    mesh = jax.make_mesh((4,), ("data",), devices=devices.mesh_devices(4))
    on_mesh = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *[None] * (x.ndim - 1))))  # noqa: E731
    whole_device = mesh.devices.flat[0]
    sharded = act.activation_bwd(*(on_mesh(x) for x in (grads[0], pres[0], probs[0])))
    whole = act.activation_bwd(*(jax.device_put(x, whole_device) for x in (grads[0], pres[0], probs[0])))
    for got, want in zip(sharded, whole):
        assert got.sharding.spec[0] == "data", "rows stay where they are"
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"sharded, seed={seed}")


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((jnp.zeros((4, 8)), jnp.zeros((4, 16)), jnp.ones(4)), {"activation": "relu"}, ValueError,
     r"activation must be one of \('swiglu', 'geglu', 'gelu', 'silu'\), got 'relu'"),
    ((jnp.zeros((4, 8)), jnp.zeros((4, 8)), jnp.ones(4)), {}, ValueError,
     r"pre_activation must be float32\[4, 16\] for 'swiglu' with grad_hidden float32\[4, 8\], got float32\[4, 8\]"),
    ((jnp.zeros((4, 8)), jnp.zeros((4, 16)), jnp.ones(4)), {"activation": "gelu"}, ValueError,
     r"pre_activation must be float32\[4, 8\] for 'gelu'"),
    ((jnp.zeros((4, 8)), jnp.zeros((4, 16), jnp.bfloat16), jnp.ones(4)), {}, ValueError,
     r"pre_activation must be float32\[4, 16\] .* got bfloat16\[4, 16\]"),
    ((jnp.zeros((4, 8)), jnp.zeros((4, 16)), jnp.ones(4, jnp.bfloat16)), {}, ValueError,
     r"row_probs must be float32\[4\] \(one weight a row of grad_hidden\), got bfloat16\[4\]"),
    ((jnp.zeros((4, 8)), jnp.zeros((4, 16)), jnp.ones((4, 1))), {}, ValueError, r"row_probs must be float32\[4\]"),
    ((jnp.zeros((2, 4, 8)), jnp.zeros((2, 4, 16)), jnp.ones(4)), {}, ValueError,
     r"grad_hidden must be \[rows, features\], got shape \(2, 4, 8\)"),
    ((jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 16)), jnp.ones(4)), {}, TypeError,
     r"grad_hidden must be float32, bfloat16 or float16, got int32"),
    (([[0.0] * 8], jnp.zeros((1, 16)), jnp.ones(1)), {}, TypeError, r"grad_hidden must be a JAX or NumPy array"),
], ids=["activation", "ungated_width", "gated_width_for_gelu", "pre_dtype", "probs_dtype", "probs_shape", "rank",
        "int_grad", "not_an_array"])
def test_bad_input_is_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        act.activation_bwd(*args, **kwargs)


# -- group_sizes: only the groups' rows ----------------------------------------------------

# Qwen3-30B-A3B's layer on one of two expert-parallel ranks, its rows scaled down: 64 local
# experts, a worst-case buffer of twice the rows routed there.
GROUPS_LAYER = model_shapes.QWEN3_30B_A3B_LAYER
LOCAL_GROUPS = GROUPS_LAYER.num_experts // 2


def assert_covered_rows_equal(got, want, covered: int, what: str):
    """Each result's first ``covered`` rows, bit for bit (the others are unspecified)."""
    for name, a, b in zip(want._fields, got, want):
        a, b = np.asarray(a[:covered]), np.asarray(b[:covered])
        differ = int((a.view(np.uint8) != b.view(np.uint8)).sum())
        assert differ == 0, f"{name}, {what}: {differ} bytes of the {covered} covered rows differ"


@pytest.mark.parametrize("covered", ["half", "all"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_group_sizes_compute_the_groups_rows_as_without_them(activation, covered, rng, seed):
    rows = 512
    grad, pre, probs = draw(rng, rows, GROUPS_LAYER.ffn, activation, jnp.bfloat16)
    total = rows // 2 + 7 if covered == "half" else rows
    sizes = jnp.asarray(checks.sizes_with_empty_groups(rng, LOCAL_GROUPS, total))
    got = act.activation_bwd(grad, pre, probs, activation, group_sizes=sizes)
    want = act.activation_bwd(grad, pre, probs, activation)
    assert_covered_rows_equal(got, want, total, f"{activation}, {total} of {rows} rows, seed={seed}")


def test_under_jit_negative_sizes_count_as_zero_and_the_total_stops_at_the_rows(rng, seed):
    """Traced sizes are not checked: as the grouped products count them, a negative size covers
    no rows, and groups past the rows end there."""
    rows = 256
    grad, pre, probs = draw(rng, rows, GROUPS_LAYER.ffn, "swiglu", jnp.bfloat16)
    of_groups = jax.jit(lambda sizes: act.activation_bwd(grad, pre, probs, group_sizes=sizes))
    want = act.activation_bwd(grad, pre, probs)
    for sizes, covered in [([100, -50, 30], 130), ([200, 0, 300], rows)]:
        got = of_groups(jnp.asarray(sizes, jnp.int32))
        assert_covered_rows_equal(got, want, covered, f"group_sizes {sizes}, seed={seed}")


@pytest.mark.parametrize("sizes, error, message", [
    (np.array([3, -2, 1], np.int32), ValueError, r"group_sizes must be >= 0, got -2 at group 1"),
    (np.array([3, 1], np.int64), TypeError, r"group_sizes must be int32, got int64"),
    (np.zeros((0,), np.int32), ValueError, r"group_sizes must have shape \[num_groups\] with at least one group, "
                                           r"got \(0,\)"),
    (np.zeros((2, 2), np.int32), ValueError, r"group_sizes must have shape \[num_groups\] .* got \(2, 2\)"),
    ([3, 1], TypeError, r"group_sizes must be a JAX or NumPy array"),
], ids=["negative", "int64", "no_groups", "rank", "not_an_array"])
def test_bad_group_sizes_are_named(sizes, error, message):
    with pytest.raises(error, match=message):
        act.activation_bwd(jnp.zeros((4, 8)), jnp.zeros((4, 16)), jnp.ones(4), group_sizes=sizes)


GPUS = devices.gpu_devices()


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_groups_rows_at_full_size_on_gpu(activation, cpu, rng, seed):
    """Qwen3-30B-A3B's rows on one of two expert-parallel ranks, bfloat16, half of a worst-case
    buffer routed: on the GPU the covered rows are bit for bit those of the call without group
    sizes, and within the float64 reference's bound of the CPU's (both float32 evaluations of
    it; exp and tanh differ between the two in the last bits)."""
    gpu = GPUS[0]
    shape = GROUPS_LAYER.up_gemm(2)
    rows, features = 2 * shape.m, shape.n
    if gpu.platform == "cpu":  # the stand-in: a fraction of the size
        rows //= 64
    grad, pre, probs = draw(rng, rows, features, activation, jnp.bfloat16)
    sizes = checks.sizes_with_empty_groups(rng, shape.groups, rows // 2)
    total = int(sizes.sum())
    on_gpu = [jax.device_put(x, gpu) for x in (grad, pre, probs, jnp.asarray(sizes))]
    run = jax.jit(act.activation_bwd, static_argnums=3)
    got = run(*on_gpu[:3], activation, group_sizes=on_gpu[3])
    what = f"{activation} [{rows}, {features}], {total} rows in {shape.groups} groups, seed={seed}"
    assert_covered_rows_equal(got, run(*on_gpu[:3], activation), total, what)
    on_cpu = run(*(jax.device_put(x, cpu) for x in (grad, pre, probs)), activation)
    sample = np.sort(rng.choice(total, min(512, total), replace=False))
    bounds = reference(grad[sample], pre[sample], probs[sample], activation)
    for name, result, want, (_, bound) in zip(got._fields, got, on_cpu, bounds):
        assert_close(np.asarray(result)[sample], (np.asarray(want[sample].astype(jnp.float32), np.float64), 2 * bound),
                     f"{name}, {what}")
