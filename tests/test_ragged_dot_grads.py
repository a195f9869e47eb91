"""Gradients of oxmoe.ragged_dot and oxmoe.transposed_ragged_dot: jax.vjp and jax.grad under
jit against the float64 reference's formulas (ragged_dot_reference.py), those formulas against
central finite differences of the reference's float64 forward, and oxmoe's float32 gradients
against finite differences of oxmoe itself (jax.test_util.check_grads, first and second
order); both rhs layouts, with and without a window of groups (group_offset), empty groups and
rows past the groups' total, and inside shard_map with the experts split over eight devices.

For ragged_dot (out = lhs_g @ rhs[i] per local group i, g = g0 + i):
    d lhs rows of group g = d out_g @ rhs[i].T    (zero outside the window)
    d rhs[i]              = lhs_g.T @ d out_g      (zero for an empty group or one past G)
with the cotangent first cast to the input dtype; d lhs and d rhs have the inputs' dtypes.
For transposed_ragged_dot (out[i] = lhs_g.T @ rhs_g): d lhs_g = rhs_g @ d out[i].T and
d rhs_g = lhs_g @ d out[i]. Each is a float32 sum (over N, over the group's rows, over K)
checked with ragged_dot_checks.assert_gemm_close's bound for that sum's length.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from finite_differences import vjp_by_finite_differences
import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm
from test_ragged_dot_values import (G_PER_SHARD, G_SHARDED, LAYOUTS, SHARDS, describe, draw_rhs, expert_mesh,
                                    offset_array, shard_offset)

M, K, N, G, G_LOCAL = 150, 72, 56, 6, 3
# (dtype, preferred_element_type): the half types also with a float32 output, whose float32
# cotangent the backward casts to the input dtype first.
GRAD_TYPES = [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float16, None), (jnp.bfloat16, jnp.float32),
              (jnp.float16, jnp.float32)]
GRAD_TYPE_PARAMS = pytest.mark.parametrize("dtype, pref", GRAD_TYPES,
                                           ids=["f32", "bf16", "f16", "bf16_out_f32", "f16_out_f32"])
# None: no group_offset (all G groups); an int: a window of G_LOCAL groups at a random g0 in
# [0, G] (so sometimes reaching past G, or entirely past it).
WINDOWS = pytest.mark.parametrize("windowed", [False, True], ids=["all_groups", "window"])


def grad_sizes(rng, num_groups: int, num_rows: int) -> np.ndarray:
    """Sizes with empty groups, a few rows past their total."""
    return checks.sizes_with_empty_groups(rng, num_groups, num_rows - int(rng.integers(1, 6)), fraction=0.2)


def cast_cotangent(grad, dtype) -> np.ndarray:
    """The cotangent as the backward sees it: cast to the input dtype."""
    return np.asarray(grad).astype(checks.np_dtype(dtype))


@functools.partial(jax.jit, static_argnames=("rhs_transposed", "pref"))
def ragged_dot_and_vjp(lhs, rhs, sizes, offset, grad, *, rhs_transposed, pref):
    out, vjp = jax.vjp(lambda l, r: grouped_gemm.ragged_dot(l, r, sizes, group_offset=offset,
                                                             rhs_transposed=rhs_transposed,
                                                             preferred_element_type=pref), lhs, rhs)
    return (out, *vjp(grad))


@functools.partial(jax.jit, static_argnames=("num_groups", "pref"))
def transposed_and_vjp(lhs, rhs, sizes, offset, grad, *, num_groups, pref):
    out, vjp = jax.vjp(lambda l, r: grouped_gemm.transposed_ragged_dot(l, r, sizes, num_groups=num_groups,
                                                                        group_offset=offset,
                                                                        preferred_element_type=pref), lhs, rhs)
    return (out, *vjp(grad))


# ------------------------------------ the reference's formulas vs finite differences


# (M, K, N, G, group_sizes, g0, G_local): with an empty group and rows past the total; a
# window; a window reaching past G.
FD_CASES = {
    "all_groups": (9, 3, 2, 3, [2, 0, 5], None, 3),
    "window": (9, 3, 2, 4, [1, 3, 0, 4], 1, 2),
    "window_past_g": (9, 3, 2, 4, [1, 3, 2, 2], 3, 2),
}


@pytest.mark.parametrize("case", FD_CASES)
@LAYOUTS
def test_reference_ragged_dot_backward_equals_finite_differences(case, rhs_transposed, seed, rng):
    m, k, n, _, sizes, g0, g_local = FD_CASES[case]
    offset = None if g0 is None else [g0]
    lhs = rng.standard_normal((m, k))
    rhs = rng.standard_normal((g_local, n, k) if rhs_transposed else (g_local, k, n))
    grad = rng.standard_normal((m, n))
    d_lhs, d_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, grad, group_offset=offset, rhs_transposed=rhs_transposed)
    forward = functools.partial(ref.ragged_dot, group_sizes=sizes, group_offset=offset, rhs_transposed=rhs_transposed)
    np.testing.assert_allclose(d_lhs.value, vjp_by_finite_differences(lambda v: forward(v, rhs).value, lhs, grad),
                               rtol=1e-9, atol=1e-9, err_msg=f"d lhs, {case}, seed={seed}")
    np.testing.assert_allclose(d_rhs.value, vjp_by_finite_differences(lambda v: forward(lhs, v).value, rhs, grad),
                               rtol=1e-9, atol=1e-9, err_msg=f"d rhs, {case}, seed={seed}")
    assert d_rhs.zero.any(), "every case has a local group with no rows"


@pytest.mark.parametrize("case", FD_CASES)
def test_reference_transposed_ragged_dot_backward_equals_finite_differences(case, seed, rng):
    m, k, n, _, sizes, g0, g_local = FD_CASES[case]
    offset = None if g0 is None else [g0]
    lhs, rhs = rng.standard_normal((m, k)), rng.standard_normal((m, n))
    grad = rng.standard_normal((g_local, k, n))
    d_lhs, d_rhs = ref.transposed_ragged_dot_backward(lhs, rhs, sizes, grad, group_offset=offset)
    forward = functools.partial(ref.transposed_ragged_dot, group_sizes=sizes, num_groups=g_local, group_offset=offset)
    np.testing.assert_allclose(d_lhs.value, vjp_by_finite_differences(lambda v: forward(v, rhs).value, lhs, grad),
                               rtol=1e-9, atol=1e-9, err_msg=f"d lhs, {case}, seed={seed}")
    np.testing.assert_allclose(d_rhs.value, vjp_by_finite_differences(lambda v: forward(lhs, v).value, rhs, grad),
                               rtol=1e-9, atol=1e-9, err_msg=f"d rhs, {case}, seed={seed}")


# -------------------------------------------------- oxmoe's vjp vs the reference


def window_args(rng, windowed: bool):
    """(G_local, g0 or None)."""
    return (G_LOCAL, int(rng.integers(0, G + 1))) if windowed else (G, None)


@GRAD_TYPE_PARAMS
@LAYOUTS
@WINDOWS
def test_ragged_dot_vjp_matches_reference(dtype, pref, rhs_transposed, windowed, seed, rng):
    g_local, g0 = window_args(rng, windowed)
    sizes = grad_sizes(rng, G, M)
    lhs, rhs = checks.draw(rng, (M, K), dtype), draw_rhs(rng, g_local, K, N, dtype, rhs_transposed)
    out_dtype = checks.np_dtype(dtype if pref is None else pref)
    grad = checks.draw(rng, (M, N), out_dtype)  # in every row: rows outside the window must not leak
    out, d_lhs, d_rhs = ragged_dot_and_vjp(lhs, rhs, sizes, offset_array(g0), grad, rhs_transposed=rhs_transposed,
                                           pref=pref)
    context = f"g0={g0}, {describe(sizes)}, seed={seed}"
    checks.assert_gemm_close(out, ref.ragged_dot(lhs, rhs, sizes, group_offset=offset_array(g0),
                                              rhs_transposed=rhs_transposed), out_dtype, what="out", context=context)
    e_lhs, e_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, cast_cotangent(grad, dtype), group_offset=offset_array(g0),
                                           rhs_transposed=rhs_transposed)
    checks.assert_gemm_close(d_lhs, e_lhs, dtype, what="d lhs", context=context)
    checks.assert_gemm_close(d_rhs, e_rhs, dtype, what="d rhs", context=context)


@pytest.mark.parametrize("dtype, pref", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float16, jnp.float32)],
                         ids=["f32", "bf16", "f16_out_f32"])
@WINDOWS
def test_transposed_ragged_dot_vjp_matches_reference(dtype, pref, windowed, seed, rng):
    g_local, g0 = window_args(rng, windowed)
    sizes = grad_sizes(rng, G, M)
    lhs, rhs = checks.draw(rng, (M, K), dtype), checks.draw(rng, (M, N), dtype)
    out_dtype = checks.np_dtype(dtype if pref is None else pref)
    grad = checks.draw(rng, (g_local, K, N), out_dtype)
    out, d_lhs, d_rhs = transposed_and_vjp(lhs, rhs, sizes, offset_array(g0), grad,
                                           num_groups=g_local if windowed else None, pref=pref)
    context = f"g0={g0}, {describe(sizes)}, seed={seed}"
    checks.assert_gemm_close(out, ref.transposed_ragged_dot(lhs, rhs, sizes, num_groups=g_local,
                                                         group_offset=offset_array(g0)),
                          out_dtype, what="out", context=context)
    e_lhs, e_rhs = ref.transposed_ragged_dot_backward(lhs, rhs, sizes, cast_cotangent(grad, dtype),
                                                      group_offset=offset_array(g0))
    checks.assert_gemm_close(d_lhs, e_lhs, dtype, what="d lhs", context=context)
    checks.assert_gemm_close(d_rhs, e_rhs, dtype, what="d rhs", context=context)


@LAYOUTS
def test_ragged_dot_grad_of_a_loss_under_jit(rhs_transposed, seed, rng):
    # jax.grad of a scalar loss: sum(out * c) has cotangent c, so the gradients are the
    # reference's for d out = c.
    g0 = int(rng.integers(0, G - G_LOCAL + 1))
    sizes = grad_sizes(rng, G, M)
    lhs, rhs = checks.draw(rng, (M, K), jnp.bfloat16), draw_rhs(rng, G_LOCAL, K, N, jnp.bfloat16, rhs_transposed)
    c = checks.draw(rng, (M, N), jnp.float32)

    @jax.jit
    def grads(lhs, rhs, sizes, offset, c):
        def loss(lhs, rhs):
            out = grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed,
                                          preferred_element_type=jnp.float32)
            return jnp.sum(out * c)

        return jax.grad(loss, argnums=(0, 1))(lhs, rhs)

    d_lhs, d_rhs = grads(lhs, rhs, sizes, offset_array(g0), c)
    e_lhs, e_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, cast_cotangent(c, jnp.bfloat16),
                                           group_offset=offset_array(g0), rhs_transposed=rhs_transposed)
    context = f"g0={g0}, {describe(sizes)}, seed={seed}"
    checks.assert_gemm_close(d_lhs, e_lhs, jnp.bfloat16, what="grad lhs", context=context)
    checks.assert_gemm_close(d_rhs, e_rhs, jnp.bfloat16, what="grad rhs", context=context)


def test_gradient_with_sizes_traced_needs_no_retrace(seed, rng):
    traces = []

    @jax.jit
    def grads(lhs, rhs, sizes, grad):
        traces.append(1)
        _, vjp = jax.vjp(lambda l, r: grouped_gemm.ragged_dot(l, r, sizes), lhs, rhs)
        return vjp(grad)

    lhs, rhs, grad = checks.draw(rng, (M, K), jnp.float32), draw_rhs(rng, G, K, N, jnp.float32, False), checks.draw(
        rng, (M, N), jnp.float32)
    for call in range(3):
        sizes = grad_sizes(rng, G, M)
        d_lhs, d_rhs = grads(lhs, rhs, sizes, grad)
        e_lhs, e_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, grad)
        context = f"call {call}, {describe(sizes)}, seed={seed}"
        checks.assert_gemm_close(d_lhs, e_lhs, jnp.float32, what="d lhs", context=context)
        checks.assert_gemm_close(d_rhs, e_rhs, jnp.float32, what="d rhs", context=context)
    assert len(traces) == 1, f"traced {len(traces)} times for 3 calls with new group sizes"


# --------------------------------------------------- no gradient for the integers


@pytest.mark.parametrize("fn_name", ["ragged_dot", "transposed_ragged_dot"])
def test_group_sizes_and_group_offset_get_no_gradient(fn_name, rng):
    sizes, offset = np.array([3, 0, 4], np.int32), np.array([1], np.int32)
    lhs = checks.draw(rng, (9, 4), jnp.float32)
    if fn_name == "ragged_dot":
        rhs = draw_rhs(rng, 2, 4, 5, jnp.float32, False)
        fn = lambda l, r, s, o: grouped_gemm.ragged_dot(l, r, s, group_offset=o)  # noqa: E731
    else:
        rhs = checks.draw(rng, (9, 5), jnp.float32)
        fn = lambda l, r, s, o: grouped_gemm.transposed_ragged_dot(l, r, s, num_groups=2, group_offset=o)  # noqa: E731
    out, vjp = jax.vjp(fn, lhs, rhs, sizes, offset)
    d_lhs, d_rhs, d_sizes, d_offset = vjp(jnp.ones_like(out))
    assert d_lhs.dtype == np.float32 and d_rhs.dtype == np.float32
    assert d_sizes.dtype == jax.dtypes.float0 and d_sizes.shape == sizes.shape, f"d group_sizes: {d_sizes!r}"
    assert d_offset.dtype == jax.dtypes.float0 and d_offset.shape == offset.shape, f"d group_offset: {d_offset!r}"
    d_sizes = jax.grad(lambda s: fn(lhs, rhs, s, offset).sum(), allow_int=True)(sizes)
    assert d_sizes.dtype == jax.dtypes.float0


# ---------------------------------------- oxmoe's float32 gradients vs finite differences

# Both functions are linear in each argument, so float32 central differences are exact up to
# rounding: eps 1e-2 keeps that rounding (~eps32 |f| / eps, |f| ~ 10 here) far below the
# tolerance.
F32_FD = dict(modes=["rev"], eps=1e-2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", FD_CASES)
@LAYOUTS
def test_oxmoe_ragged_dot_float32_gradients_equal_finite_differences(case, rhs_transposed, seed, rng):
    m, k, n, _, sizes, g0, g_local = FD_CASES[case]
    sizes, offset = np.array(sizes, np.int32), offset_array(g0)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g_local, n, k) if rhs_transposed else (g_local, k, n)), jnp.float32)
    fn = jax.jit(lambda l, r: grouped_gemm.ragged_dot(l, r, sizes, group_offset=offset, rhs_transposed=rhs_transposed))
    check_grads(fn, (lhs, rhs), order=1, **F32_FD)


@pytest.mark.parametrize("case", FD_CASES)
def test_oxmoe_transposed_ragged_dot_float32_gradients_equal_finite_differences(case, seed, rng):
    m, k, n, _, sizes, g0, g_local = FD_CASES[case]
    sizes, offset = np.array(sizes, np.int32), offset_array(g0)
    lhs, rhs = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((m, k), (m, n)))
    fn = jax.jit(lambda l, r: grouped_gemm.transposed_ragged_dot(l, r, sizes, num_groups=g_local, group_offset=offset))
    check_grads(fn, (lhs, rhs), order=1, **F32_FD)


@LAYOUTS
def test_oxmoe_ragged_dot_second_order_gradients_equal_finite_differences(rhs_transposed, seed, rng):
    # The backward is made of ragged_dot and transposed_ragged_dot, both differentiable: the
    # gradient of the gradient (e.g. a gradient penalty) works and is right.
    m, k, n, _, sizes, g0, g_local = FD_CASES["window"]
    sizes, offset = np.array(sizes, np.int32), offset_array(g0)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g_local, n, k) if rhs_transposed else (g_local, k, n)), jnp.float32)
    def fn(lhs, rhs):
        return grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed)

    check_grads(fn, (lhs, rhs), order=2, **F32_FD)


# ------------------------------------------------ experts sharded over eight devices


@LAYOUTS
def test_gradients_inside_shard_map_with_experts_sharded(rhs_transposed, seed, rng):
    # Each shard multiplies its 4 experts' rows; the outputs are summed over the shards. d rhs
    # stays sharded (each shard's own experts), d lhs sums the shards' contributions.
    m, k, n = 160, 48, 40
    sizes = checks.sizes_with_empty_groups(rng, G_SHARDED, m - 3)
    lhs = checks.draw(rng, (m, k), jnp.float32)
    rhs = draw_rhs(rng, G_SHARDED, k, n, jnp.float32, rhs_transposed)
    grad = checks.draw(rng, (m, n), jnp.float32)
    mesh = expert_mesh()

    def per_shard(lhs, rhs_local, sizes):
        out = grouped_gemm.ragged_dot(lhs, rhs_local, sizes, group_offset=shard_offset(), rhs_transposed=rhs_transposed)
        return jax.lax.psum(out, "experts")

    moe = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("experts"), P()), out_specs=P())

    @jax.jit
    def fn(lhs, rhs, sizes, grad):
        out, vjp = jax.vjp(lambda l, r: moe(l, r, sizes), lhs, rhs)
        return (out, *vjp(grad))

    out, d_lhs, d_rhs = fn(lhs, jax.device_put(rhs, NamedSharding(mesh, P("experts"))), sizes, grad)
    context = f"{SHARDS} shards of {G_PER_SHARD} experts, {describe(sizes)}, seed={seed}"
    checks.assert_gemm_close(out, ref.ragged_dot(lhs, rhs, sizes, rhs_transposed=rhs_transposed), jnp.float32,
                          what="out", context=context)
    e_lhs, e_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, grad, rhs_transposed=rhs_transposed)
    checks.assert_gemm_close(d_lhs, e_lhs, jnp.float32, what="d lhs", context=context)
    checks.assert_gemm_close(d_rhs, e_rhs, jnp.float32, what="d rhs", context=context)
