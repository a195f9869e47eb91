"""Backward passes of oxmoe.permutation: jax.vjp against the reference's gradient formulas
(permutation_reference.py), those formulas against central finite differences of the
reference's float64 forward, and oxmoe's float32 gradients against finite differences of
oxmoe itself (jax.test_util.check_grads); with and without align_size, with entries dropped.

d probs of dispatch, d sort_chunks and d unsort_chunks only move the cotangent, so they must
equal the reference bit for bit; d tokens of dispatch and d merging_probs / d expert_tokens of
combine are float32 sums (or products) rounded once to the dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from finite_differences import vjp_by_finite_differences
import permutation_checks as checks
import permutation_reference as ref
from oxmoe import permutation
from oxmoe.model_shapes import LAYER_SHAPES, MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER
from test_permutation_values import (ALIGN_SIZES, DTYPES, capacity_that_drops, dispatch_combine_cases,
                                     dispatch_with_layout, draw, draw_probs,
                                     expert_rows_for, model_inputs, np_dtype, random_chunks)

ALIGNS = pytest.mark.parametrize("align_size", ALIGN_SIZES, ids=lambda a: f"align{a}")
DTYPE_PARAMS = pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))


def dispatch_with_vjp(routing_map, **kwargs):
    """A jitted fn(x, probs, g_tokens, g_probs) -> (Dispatched, d x, d probs): the vjp of
    dispatch's float outputs. The routing map is a jit argument, so a capacity drop is silent."""

    @jax.jit
    def fn(routing_map, x, probs, g_tokens, g_probs):
        def float_outputs(x, p):
            d = permutation.dispatch(x, routing_map, probs=p, **kwargs)
            return (d.tokens, d.probs), d

        _, vjp, d = jax.vjp(float_outputs, x, probs, has_aux=True)
        return (d, *vjp((g_tokens, g_probs)))

    return functools.partial(fn, routing_map)


def combine_with_vjp(row_id_map, with_probs: bool):
    """A jitted fn(expert_tokens, merging_probs, g_out) -> (out, d expert_tokens, d merging_probs)."""

    @jax.jit
    def fn(row_id_map, expert_tokens, merging_probs, g_out):
        if not with_probs:
            out, vjp = jax.vjp(lambda y: permutation.combine(y, row_id_map), expert_tokens)
            return (out, *vjp(g_out), None)
        out, vjp = jax.vjp(lambda y, w: permutation.combine(y, row_id_map, merging_probs=w), expert_tokens,
                           merging_probs)
        return (out, *vjp(g_out))

    return functools.partial(fn, row_id_map)


def dispatch_cotangents(layout, rng, hidden: int, dtype, probs_dtype):
    """Cotangents of dispatch's tokens [R, H] and probs [R]: random on the rows that hold a
    token, NaN on padding and tail rows, which hold none and must not reach any gradient."""
    g_tokens = expert_rows_for(layout, rng, hidden, dtype)
    g_probs = expert_rows_for(layout, rng, 1, probs_dtype)[:, 0]
    return g_tokens, g_probs


def check_dispatch_grads(dx, dp, x, probs, g_tokens, g_probs, layout, *, num_terms, context):
    rows, compact_dest = ref.compact_rows(g_tokens, layout.dest_rows)
    compact_probs, _ = ref.compact_rows(g_probs, layout.dest_rows)
    expected_dx, expected_dp = ref.dispatch_backward(rows, compact_probs, compact_dest)
    terms, _ = ref.dispatch_backward(np.abs(ref.as_f64(rows)), None, compact_dest)
    checks.assert_rounded_sum_close(dx, expected_dx, terms, x.dtype, num_terms=num_terms, what="d tokens", context=context)
    # d probs[t, e] is one element of the cotangent (zero off the map and where dropped).
    checks.assert_bitwise_equal(dp, expected_dp.astype(probs.dtype), what="d probs", context=context)


# --------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("model, align_size, dtype", dispatch_combine_cases(with_heavy=False))
def test_dispatch_vjp_matches_reference(model, align_size, dtype, seed, rng):
    x, routing_map = model_inputs(model, rng, dtype, "ragged")
    probs = draw_probs(rng, routing_map, dtype)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=x.shape[0] * model.topk, align_size=align_size)
    g_tokens, g_probs = dispatch_cotangents(layout, rng, model.hidden, dtype, dtype)
    fn = dispatch_with_vjp(routing_map, topk=model.topk, align_size=align_size)
    d, dx, dp = fn(x, probs, g_tokens, g_probs)
    context = f"{model.name}, align_size={align_size}, {jnp.dtype(dtype).name}, seed={seed}"
    checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=x.shape[0] * model.topk, align_size=align_size,
                       context=context)
    check_dispatch_grads(dx, dp, x, probs, g_tokens, g_probs, layout, num_terms=model.topk, context=context)


@pytest.mark.parametrize("model", [MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER], ids=lambda m: m.name)
@ALIGNS
def test_dispatch_vjp_after_a_capacity_drop_gives_dropped_entries_nothing(model, align_size, seed, rng):
    x, routing_map = model_inputs(model, rng, jnp.float32, "topk")
    probs = draw_probs(rng, routing_map, jnp.float32)
    num_out_tokens = capacity_that_drops(routing_map, align_size, rng)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    g_tokens, g_probs = dispatch_cotangents(layout, rng, model.hidden, jnp.float32, jnp.float32)
    fn = dispatch_with_vjp(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    d, dx, dp = fn(x, probs, g_tokens, g_probs)
    context = f"{model.name}, num_out_tokens={num_out_tokens}, align_size={align_size}, seed={seed}"
    checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size,
                       context=context)
    assert layout.dropped.any(), f"the test meant to drop entries, but none was dropped ({context})"
    check_dispatch_grads(dx, dp, x, probs, g_tokens, g_probs, layout, num_terms=model.topk, context=context)


def test_dispatch_vjp_without_probs_is_the_sum_of_each_tokens_rows(seed, rng):
    model = QWEN3_30B_A3B_LAYER
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "idle_experts")
    layout = ref.dispatch_layout(routing_map, num_out_tokens=x.shape[0] * model.topk, align_size=16)
    g_tokens = expert_rows_for(layout, rng, model.hidden, jnp.bfloat16)  # NaN on padding rows
    _, vjp = jax.vjp(lambda x: permutation.dispatch(x, routing_map, topk=model.topk, align_size=16).tokens, x)
    (dx,) = vjp(g_tokens)
    rows, compact_dest = ref.compact_rows(g_tokens, layout.dest_rows)
    expected, _ = ref.dispatch_backward(rows, None, compact_dest)
    terms, _ = ref.dispatch_backward(np.abs(ref.as_f64(rows)), None, compact_dest)
    checks.assert_rounded_sum_close(dx, expected, terms, jnp.bfloat16, num_terms=model.topk, what="d tokens",
                                 context=f"seed={seed}")


# ---------------------------------------------------------------------- combine


def check_combine_grads(d_rows, d_probs, g_out, expert_tokens, merging_probs, layout, *, context):
    # The reference on the rows some (t, e) points to (the others hold NaN, never read).
    rows, compact_dest = ref.compact_rows(expert_tokens, layout.dest_rows)
    used = np.unique(layout.dest_rows[layout.dest_rows >= 0])
    expected_rows, expected_probs = ref.combine_backward(g_out, rows, compact_dest, merging_probs)
    # A used row takes one (t, e)'s w * d_out: a product rounded to the dtype.
    checks.assert_rounded_sum_close(np.asarray(d_rows)[used], expected_rows, np.abs(expected_rows), expert_tokens.dtype,
                                 num_terms=1, what="d expert_tokens", context=context)
    # Rows no (t, e) refers to (padding, the tail) get exactly zero.
    checks.assert_rows_zero(d_rows, layout.source_tokens < 0, what="d expert_tokens on padding / unused rows",
                         context=context)
    if merging_probs is None:
        assert d_probs is None
        return
    terms = ref.combine_backward_abs_terms(g_out, rows, compact_dest)
    checks.assert_rounded_sum_close(d_probs, expected_probs, terms, merging_probs.dtype,
                                 num_terms=expert_tokens.shape[1], what="d merging_probs", context=context)
    checks.assert_bitwise_equal(np.asarray(d_probs)[layout.dest_rows < 0],
                             np.zeros(int((layout.dest_rows < 0).sum()), merging_probs.dtype),
                             what="d merging_probs off the map", context=context)


@pytest.mark.parametrize("model, align_size, dtype", dispatch_combine_cases(with_heavy=False))
def test_combine_vjp_matches_reference(model, align_size, dtype, seed, rng):
    x, routing_map = model_inputs(model, rng, dtype, "ragged")
    d, layout = dispatch_with_layout(x, routing_map, model, align_size)
    context = f"{model.name}, align_size={align_size}, {jnp.dtype(dtype).name}, seed={seed}"
    checks.check_dispatch_layout(d, layout, context=context)
    # NaN on the rows combine never reads: they must reach neither the output nor d merging_probs.
    expert_tokens = expert_rows_for(layout, rng, model.hidden, dtype)
    merging_probs = draw_probs(rng, routing_map, dtype)
    g_out = draw(rng, x.shape, dtype)
    _, d_rows, d_probs = combine_with_vjp(d.row_id_map, True)(expert_tokens, merging_probs, g_out)
    check_combine_grads(d_rows, d_probs, g_out, expert_tokens, merging_probs, layout, context=context)


# Bit patterns the copy must keep: a signalling NaN, a negative quiet NaN with a payload, the
# smallest subnormal and -0, as 16- and 32-bit words.
SPECIAL_BITS = {np.uint16: [0x7F81, 0xFFC1, 0x0001, 0x8000], np.uint32: [0x7F800001, 0xFFC12345, 0x00000001, 0x80000000]}


@pytest.mark.parametrize("model", LAYER_SHAPES, ids=lambda m: m.name)
@pytest.mark.parametrize("align_size", [None, 16], ids=lambda a: f"align{a}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_combine_vjp_without_merging_probs_copies_the_cotangent(model, align_size, dtype, seed, rng):
    x, routing_map = model_inputs(model, rng, dtype, "idle_experts")
    d, layout = dispatch_with_layout(x, routing_map, model, align_size)
    expert_tokens = expert_rows_for(layout, rng, model.hidden, dtype)
    # Any bits: with weight one, row dest_rows[t, e] of d expert_tokens is d_out[t] itself, bit for
    # bit (zero elsewhere). The layer moves float8 rows this way, four bytes a float32 word.
    bits = {2: np.uint16, 4: np.uint32}[jnp.dtype(dtype).itemsize]
    g_bits = rng.integers(0, np.iinfo(bits).max, x.shape, dtype=bits, endpoint=True)
    g_bits[0, :4] = SPECIAL_BITS[bits]
    _, d_rows, _ = combine_with_vjp(d.row_id_map, False)(expert_tokens, None, g_bits.view(np_dtype(dtype)))
    checks.assert_bitwise_equal(np.asarray(d_rows).view(bits), ref.gather_rows(g_bits, layout.source_tokens),
                                what="d expert_tokens", context=f"{model.name}, align_size={align_size}, seed={seed}")


def test_combine_vjp_after_a_capacity_drop(seed, rng):
    model = QWEN3_30B_A3B_LAYER
    x, routing_map = model_inputs(model, rng, jnp.float32, "topk")
    num_out_tokens = capacity_that_drops(routing_map, 16, rng)
    d = jax.jit(lambda x, m: permutation.dispatch(x, m, num_out_tokens=num_out_tokens, align_size=16))(x, routing_map)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=16)
    context = f"num_out_tokens={num_out_tokens}, seed={seed}"
    checks.check_dispatch_layout(d, layout, context=context)
    assert layout.dropped.any()
    expert_tokens = expert_rows_for(layout, rng, model.hidden, jnp.float32)
    merging_probs = draw_probs(rng, routing_map, jnp.float32)
    g_out = draw(rng, x.shape, jnp.float32)
    _, d_rows, d_probs = combine_with_vjp(d.row_id_map, True)(expert_tokens, merging_probs, g_out)
    check_combine_grads(d_rows, d_probs, g_out, expert_tokens, merging_probs, layout, context=context)


def maps_no_dispatch_made(rng, num_tokens: int, num_experts: int, num_rows: int):
    """A RowIdMap of a top-2 dispatch, then broken: dest_rows entries past the rows and below
    -1, source_tokens entries past the tokens and below -1, rows that name a token whose
    dest_rows do not list them, and a token that lists one row for two experts."""
    routing_map = checks.random_topk_map(rng, num_tokens, num_experts, 2)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_rows)
    dest_rows, source_tokens = layout.dest_rows.copy(), layout.source_tokens.copy()
    picks = rng.permutation(num_tokens)
    dest_rows[picks[0], rng.integers(num_experts)] = num_rows + 3
    dest_rows[picks[1], rng.integers(num_experts)] = -5
    routed = np.flatnonzero(dest_rows[picks[2]] >= 0)
    dest_rows[picks[2], routed[1]] = dest_rows[picks[2], routed[0]]  # one row for two experts
    source_tokens[rng.integers(num_rows)] = num_tokens + 1
    source_tokens[rng.integers(num_rows)] = -2
    source_tokens[rng.integers(num_rows)] = picks[3]
    return permutation.RowIdMap(jnp.asarray(dest_rows, jnp.int32), jnp.asarray(source_tokens, jnp.int32))


def combine_of_any_maps_and_vjp(row_id_map, y, w, g):
    """combine and its vjp: (out, d expert_tokens, d merging_probs), the last None without w."""
    if w is None:
        out, vjp = jax.vjp(lambda y: permutation.combine(y, row_id_map), y)
        return (out, *vjp(g), None)
    out, vjp = jax.vjp(lambda y, w: permutation.combine(y, row_id_map, merging_probs=w), y, w)
    return (out, *vjp(g))


def check_combine_of_any_maps(out, d_rows, d_probs, row_id_map, y, w, g, *, context: str) -> None:
    """combine and its vjp on maps no dispatch made against the float64 reference: NaN exactly
    where the contract says, the rest within float32 rounding."""
    dest_rows, source_tokens = np.asarray(row_id_map.dest_rows), np.asarray(row_id_map.source_tokens)
    expected_out = ref.combine_of_any_maps(y, dest_rows, w)
    expected_rows, expected_probs = ref.combine_backward_of_any_maps(g, y, dest_rows, source_tokens, w)
    checked = [("combine", out, expected_out), ("d expert_tokens", d_rows, expected_rows)]
    if w is not None:
        checked.append(("d merging_probs", d_probs, expected_probs))
    for what, actual, expected in checked:
        actual = np.asarray(actual, np.float64)
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"NaN of {what} ({context})")
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=f"{what} ({context})")


@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_and_its_vjp_on_maps_no_dispatch_made_follow_the_contract(with_probs, seed, rng):
    # Without merging probs, a row one token lists for two experts gets twice its gradient.
    num_tokens, num_experts, hidden, num_rows = 64, 8, 32, 160
    row_id_map = maps_no_dispatch_made(rng, num_tokens, num_experts, num_rows)
    y, g = draw(rng, (num_rows, hidden), jnp.float32), draw(rng, (num_tokens, hidden), jnp.float32)
    w = draw(rng, (num_tokens, num_experts), jnp.float32) if with_probs else None
    outs = jax.jit(combine_of_any_maps_and_vjp)(row_id_map, y, w, g)
    check_combine_of_any_maps(*outs, row_id_map, y, w, g, context=f"seed={seed}")


@jax.default_device(jax.devices("cpu")[0])
def test_combine_merging_probs_gradient_in_float32_is_within_1e_6_of_float64(seed, rng):
    # The specification (the CPU implementation) at TransformerEngine's permutation tests'
    # shape and bound: 4096 tokens of hidden 4096. (The GPU sums in float32; its tests allow
    # a float32 sum's error.)
    num_tokens, num_experts, hidden = 4096, 8, 4096
    routing_map = checks.random_topk_map(rng, num_tokens, num_experts, 2)
    d = permutation.dispatch(jnp.zeros((num_tokens, hidden), jnp.float32), routing_map, topk=2)
    y = draw(rng, (num_tokens * 2, hidden), jnp.float32)
    w, g = draw(rng, routing_map.shape, jnp.float32), draw(rng, (num_tokens, hidden), jnp.float32)
    _, vjp = jax.vjp(lambda w: permutation.combine(y, d.row_id_map, merging_probs=w), w)
    (d_probs,) = jax.jit(vjp)(g)
    dest_rows = np.asarray(d.row_id_map.dest_rows)
    t, e = np.nonzero(dest_rows >= 0)
    expected = np.einsum("ij,ij->i", np.asarray(g, np.float64)[t], np.asarray(y, np.float64)[dest_rows[t, e]])
    error = np.abs(np.asarray(d_probs)[t, e] - expected) / np.abs(expected)
    assert error.max() <= 1e-6, f"worst relative error {error.max():.3g} at (token, expert) " \
                                f"{(int(t[error.argmax()]), int(e[error.argmax()]))} (seed={seed})"


# ------------------------------------------------------------------ sort_chunks


@pytest.mark.parametrize("num_rows, hidden, num_chunks", [(1000, 1024, 32), (333, 64, 5), (97, 16, 1)],
                         ids=["N1000_C32", "N333_C5", "N97_C1"])
@DTYPE_PARAMS
def test_sort_and_unsort_chunks_vjps_are_each_other(num_rows, hidden, num_chunks, dtype, seed, rng):
    x = draw(rng, (num_rows, hidden), dtype)
    g = draw(rng, (num_rows, hidden), dtype)
    sizes, order = random_chunks(rng, num_chunks, num_rows, fill=rng.uniform(0.5, 1.0))
    context = f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}"
    _, sort_vjp = jax.vjp(lambda x: permutation.sort_chunks(x, sizes, order), x)
    _, unsort_vjp = jax.vjp(lambda x: permutation.unsort_chunks(x, sizes, order), x)
    checks.assert_bitwise_equal(sort_vjp(g)[0], ref.sort_chunks_backward(g, sizes, order).astype(x.dtype),
                             what="d sort_chunks", context=context)
    checks.assert_bitwise_equal(unsort_vjp(g)[0], ref.unsort_chunks_backward(g, sizes, order).astype(x.dtype),
                             what="d unsort_chunks", context=context)


def test_sort_chunks_vjp_under_jit_with_repeated_and_foreign_indices_is_its_transpose(seed, rng):
    # Under jit a repeated index (and one out of range) lists nothing, so sort_chunks still
    # moves each row at most once: its gradient is unsort_chunks, the transpose.
    num_rows, hidden = 200, 16
    x, g = draw(rng, (num_rows, hidden), jnp.float32), draw(rng, (num_rows, hidden), jnp.float32)
    sizes = rng.integers(0, 40, 6).astype(np.int32)
    order = rng.choice([0, 1, 2, 3, 4, 5, 5, 1, -1, 9], 6, replace=False).astype(np.int32)
    context = f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}"
    for forward, backward, name in ((permutation.sort_chunks, ref.sort_chunks_backward, "sort"),
                                    (permutation.unsort_chunks, ref.unsort_chunks_backward, "unsort")):
        d_x = jax.jit(lambda x, g: jax.vjp(lambda x: forward(x, sizes, order), x)[1](g)[0])(x, g)
        checks.assert_bitwise_equal(d_x, backward(g, sizes, order).astype(np.float32), what=f"d {name}_chunks",
                                 context=context)
        # The transpose, checked as one: <forward(x), g> == <x, d_x>.
        forward_x = np.asarray(jax.jit(forward)(x, sizes, order), np.float64)
        np.testing.assert_allclose(np.vdot(forward_x, g), np.vdot(np.asarray(x, np.float64), d_x), rtol=1e-9,
                                   err_msg=context)


# ------------------------------------ the reference's formulas vs finite differences


FD_LAYOUTS = {
    # (tokens, experts, hidden, num_out_tokens, align_size)
    "exact": (7, 4, 3, 14, None),
    "aligned": (7, 4, 3, 14, 3),
    "dropped": (7, 4, 3, 6, None),
    "aligned_and_dropped": (7, 4, 3, 8, 2),
}


@pytest.mark.parametrize("case", FD_LAYOUTS)
def test_reference_dispatch_backward_equals_finite_differences(case, seed, rng):
    num_tokens, num_experts, hidden, num_out_tokens, align_size = FD_LAYOUTS[case]
    routing_map = checks.routing_map_variant(rng, num_tokens, num_experts, 2, "ragged")
    routing_map[0, :2] = True  # at least a few entries
    x, probs = rng.standard_normal((num_tokens, hidden)), rng.random((num_tokens, num_experts))
    forward = functools.partial(ref.dispatch, routing_map=routing_map, num_out_tokens=num_out_tokens,
                                align_size=align_size)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    g_tokens, g_probs = rng.standard_normal((layout.num_rows, hidden)), rng.standard_normal(layout.num_rows)
    dx, dp = ref.dispatch_backward(g_tokens, g_probs, layout.dest_rows)
    np.testing.assert_allclose(dx, vjp_by_finite_differences(lambda v: forward(v, probs=probs).tokens, x, g_tokens),
                               rtol=1e-9, atol=1e-9, err_msg=f"d tokens, {case}, seed={seed}")
    np.testing.assert_allclose(dp, vjp_by_finite_differences(lambda v: forward(x, probs=v).probs, probs, g_probs),
                               rtol=1e-9, atol=1e-9, err_msg=f"d probs, {case}, seed={seed}")


@pytest.mark.parametrize("case", FD_LAYOUTS)
def test_reference_combine_backward_equals_finite_differences(case, seed, rng):
    num_tokens, num_experts, hidden, num_out_tokens, align_size = FD_LAYOUTS[case]
    routing_map = checks.routing_map_variant(rng, num_tokens, num_experts, 2, "ragged")
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    y, w = rng.standard_normal((layout.num_rows, hidden)), rng.random((num_tokens, num_experts))
    g = rng.standard_normal((num_tokens, hidden))
    d_rows, d_probs = ref.combine_backward(g, y, layout.dest_rows, w)
    np.testing.assert_allclose(d_rows, vjp_by_finite_differences(lambda v: ref.combine(v, layout.dest_rows, w), y, g),
                               rtol=1e-9, atol=1e-9, err_msg=f"d expert_tokens, {case}, seed={seed}")
    np.testing.assert_allclose(d_probs, vjp_by_finite_differences(lambda v: ref.combine(y, layout.dest_rows, v), w, g),
                               rtol=1e-9, atol=1e-9, err_msg=f"d merging_probs, {case}, seed={seed}")


def test_reference_sort_and_unsort_backward_equal_finite_differences(seed, rng):
    x, g = rng.standard_normal((23, 2)), rng.standard_normal((23, 2))
    sizes, order = random_chunks(rng, 6, 23, fill=0.8)
    np.testing.assert_allclose(ref.sort_chunks_backward(g, sizes, order),
                               vjp_by_finite_differences(lambda v: ref.sort_chunks(v, sizes, order), x, g),
                               rtol=1e-9, atol=1e-9, err_msg=f"sizes={sizes.tolist()}, order={order.tolist()}")
    np.testing.assert_allclose(ref.unsort_chunks_backward(g, sizes, order),
                               vjp_by_finite_differences(lambda v: ref.unsort_chunks(v, sizes, order), x, g),
                               rtol=1e-9, atol=1e-9, err_msg=f"sizes={sizes.tolist()}, order={order.tolist()}")


# ---------------------------------------- oxmoe's float32 gradients vs finite differences

# Every function here is linear in each argument, so float32 central differences are exact up
# to rounding: eps 1e-2 keeps that rounding (~eps32 |f| / eps) far below the tolerance.
F32_FD = dict(order=1, modes=["rev"], eps=1e-2, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", FD_LAYOUTS)
def test_oxmoe_dispatch_float32_gradient_equals_finite_differences(case, seed, rng):
    num_tokens, num_experts, hidden, num_out_tokens, align_size = FD_LAYOUTS[case]
    num_tokens, hidden = 5 * num_tokens, 4 * hidden
    routing_map = checks.routing_map_variant(rng, num_tokens, 2 * num_experts, 2, "ragged")
    x = jnp.asarray(draw(rng, (num_tokens, hidden), jnp.float32))
    probs = jnp.asarray(draw_probs(rng, routing_map, jnp.float32))
    fn = jax.jit(lambda x, m, p: permutation.dispatch(x, m, probs=p, num_out_tokens=5 * num_out_tokens,
                                                      align_size=align_size))
    check_grads(lambda x, p: (lambda d: (d.tokens, d.probs))(fn(x, routing_map, p)), (x, probs), **F32_FD)


@pytest.mark.parametrize("case", FD_LAYOUTS)
def test_oxmoe_combine_float32_gradient_equals_finite_differences(case, seed, rng):
    num_tokens, num_experts, hidden, num_out_tokens, align_size = FD_LAYOUTS[case]
    num_tokens, hidden = 5 * num_tokens, 4 * hidden
    routing_map = checks.routing_map_variant(rng, num_tokens, 2 * num_experts, 2, "ragged")
    d = jax.jit(lambda x, m: permutation.dispatch(x, m, num_out_tokens=5 * num_out_tokens, align_size=align_size))(
        jnp.zeros((num_tokens, hidden)), routing_map)
    expert_tokens = jnp.asarray(draw(rng, d.tokens.shape, jnp.float32))
    merging_probs = jnp.asarray(draw_probs(rng, routing_map, jnp.float32))
    check_grads(lambda y, w: permutation.combine(y, d.row_id_map, merging_probs=w), (expert_tokens, merging_probs),
                **F32_FD)


def test_oxmoe_sort_and_unsort_chunks_float32_gradients_equal_finite_differences(seed, rng):
    x = jnp.asarray(draw(rng, (97, 8), jnp.float32))
    sizes, order = random_chunks(rng, 8, 97, fill=0.8)
    check_grads(lambda x: permutation.sort_chunks(x, sizes, order), (x,), **F32_FD)
    check_grads(lambda x: permutation.unsort_chunks(x, sizes, order), (x,), **F32_FD)
