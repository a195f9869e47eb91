"""Forward values of oxmoe.permutation against the float64 reference (permutation_reference.py),
on fresh random data: the dispatch / combine shapes of real models (Mixtral, DeepSeek-V3,
Qwen3-MoE) at small token counts, every dtype and alignment, routing maps with idle experts
and dropped entries, capacity drops under jit, sort_chunks / unsort_chunks, and the same
results under jit, vmap and with the tokens sharded over eight devices.

dispatch, sort_chunks and unsort_chunks only move data, so their outputs must equal the
reference bit for bit; combine sums in float32 and rounds once to the output dtype
(checks.assert_rounded_sum_close)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import devices
import permutation_checks as checks
import permutation_reference as ref
from oxmoe import permutation
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER, LAYER_SHAPES, MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ALIGN_SIZES = [None, 16, 128]
VARIANTS = ["topk", "idle_experts", "ragged"]
# Small token counts, none a power of two: the CPU suite must stay fast.
NUM_TOKENS = {"mixtral": 300, "deepseek_v3": 67, "qwen3_30b_a3b": 131}

MODELS = pytest.mark.parametrize("model", LAYER_SHAPES, ids=lambda m: m.name)
ALIGNS = pytest.mark.parametrize("align_size", ALIGN_SIZES, ids=lambda a: f"align{a}")
DTYPE_PARAMS = pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))


def np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def draw(rng, shape, dtype) -> np.ndarray:
    """Random normal values, rounded to dtype (a host array)."""
    return rng.standard_normal(shape).astype(np.float32).astype(np_dtype(dtype))


def draw_probs(rng, routing_map, dtype) -> np.ndarray:
    """Positive weights [T, E], non-zero off the map too (dispatch must copy only routed ones)."""
    return (rng.random(routing_map.shape) + 0.05).astype(np.float32).astype(np_dtype(dtype))


def model_inputs(model, rng, dtype, variant="topk", num_tokens=None):
    num_tokens = num_tokens or NUM_TOKENS[model.name]
    routing_map = checks.routing_map_variant(rng, num_tokens, model.num_experts, model.topk, variant)
    return draw(rng, (num_tokens, model.hidden), dtype), routing_map


def expert_rows_for(layout: ref.DispatchLayout, rng, hidden: int, dtype) -> np.ndarray:
    """Expert outputs [R, H] for combine: random where a (t, e) points, NaN on padding and unused
    rows, which combine must never read."""
    rows = np.full((layout.num_rows, hidden), np.nan, dtype=np_dtype(dtype))
    used = layout.source_tokens >= 0
    rows[used] = draw(rng, (int(used.sum()), hidden), dtype)
    return rows


def check_combine(out, expert_tokens, dest_rows, merging_probs, *, context, what="combine"):
    """combine's [T, H] output: a float32 sum over a token's experts, rounded to the dtype."""
    rows, compact_dest = ref.compact_rows(expert_tokens, dest_rows)
    expected = ref.combine(rows, compact_dest, merging_probs)
    terms = ref.combine_abs_terms(rows, compact_dest, merging_probs)
    num_terms = max(int((np.asarray(dest_rows) >= 0).sum(axis=1).max(initial=0)), 1)
    checks.assert_rounded_sum_close(out, expected, terms, np.asarray(expert_tokens).dtype, num_terms=num_terms,
                                 what=what, context=context)


def dispatch_with_layout(x, routing_map, model, align_size):
    """oxmoe's dispatch of a top-k routing (room for T * k copies) and the reference layout it must have."""
    d = permutation.dispatch(x, routing_map, topk=model.topk, align_size=align_size)
    return d, ref.dispatch_layout(routing_map, num_out_tokens=x.shape[0] * model.topk, align_size=align_size)


def weighted_sum_of_each_token(tokens, routing_map, weights) -> np.ndarray:
    """The round trip's expected value: sum over routed e of w[t, e] * x[t] (float64)."""
    w = np.where(routing_map, ref.as_f64(weights), 0.0)
    return w.sum(axis=1, keepdims=True) * ref.as_f64(tokens)


def capacity_that_drops(routing_map, align_size, rng) -> int:
    """A num_out_tokens below the routed count for which dispatch must drop entries (with
    align_size, R keeps room for the worst-case padding, so a smaller capacity may still fit)."""
    num_out_tokens = int(routing_map.sum() * rng.uniform(0.3, 0.8))
    while num_out_tokens > 0 and not ref.dispatch_layout(routing_map, num_out_tokens=num_out_tokens,
                                                         align_size=align_size).dropped.any():
        num_out_tokens //= 2
    return num_out_tokens


def is_heavy(model, align_size) -> bool:
    """DeepSeek-V3 with align_size 128: room for 256 experts' padding makes ~33k rows of 7168
    even at small T. The CPU suite runs it in a few tests only (test_permutation_gpu.py at scale)."""
    return model is DEEPSEEK_V3_LAYER and align_size == 128


def model_align_params():
    """(model, align_size) for every model and alignment, but the heavy one."""
    return [pytest.param(m, a, id=f"{m.name}-align{a}") for m in LAYER_SHAPES for a in ALIGN_SIZES
            if not is_heavy(m, a)]


def dispatch_combine_cases(with_heavy: bool = True):
    """(model, align_size, dtype) for every combination; the heavy one in bf16 only, if at all."""
    cases = []
    for model in LAYER_SHAPES:
        for align_size in ALIGN_SIZES:
            for name, dtype in DTYPES.items():
                if is_heavy(model, align_size) and (name != "bf16" or not with_heavy):
                    continue
                cases.append(pytest.param(model, align_size, dtype, id=f"{model.name}-align{align_size}-{name}"))
    return cases


MODEL_ALIGNS = pytest.mark.parametrize("model, align_size", model_align_params())


# ------------------------------------------------------------- the reference itself


def test_reference_dispatch_of_a_hand_computed_example():
    # Experts 0, 1, 2 get tokens {0, 2, 3}, {2}, {0, 1}; align 2 pads them to 4, 2, 2 rows.
    routing_map = np.array([[1, 0, 1], [0, 0, 1], [1, 1, 0], [1, 0, 0]], dtype=bool)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=6, align_size=2)
    assert layout.num_rows == 8  # ((6 + 3 * 1) // 2) * 2
    np.testing.assert_array_equal(layout.dest_rows, [[0, -1, 6], [-1, -1, 7], [1, 4, -1], [2, -1, -1]])
    np.testing.assert_array_equal(layout.source_tokens, [0, 2, 3, -1, 2, -1, 0, 1])
    np.testing.assert_array_equal(layout.group_sizes, [4, 2, 2])
    np.testing.assert_array_equal(layout.tokens_per_expert, [3, 1, 2])
    np.testing.assert_array_equal(layout.pad_offsets, [0, 1, 2])
    # Room for 6 rows only: expert 2's block (rows 6, 7) falls off the end.
    dropped = ref.dispatch_layout(routing_map, num_out_tokens=4, align_size=2)
    assert dropped.num_rows == 6
    np.testing.assert_array_equal(dropped.dest_rows, [[0, -1, -1], [-1, -1, -1], [1, 4, -1], [2, -1, -1]])
    np.testing.assert_array_equal(dropped.source_tokens, [0, 2, 3, -1, 2, -1])
    np.testing.assert_array_equal(dropped.group_sizes, [4, 2, 0])
    np.testing.assert_array_equal(dropped.tokens_per_expert, [3, 1, 0])
    np.testing.assert_array_equal(dropped.dropped, [[0, 0, 1], [0, 0, 1], [0, 0, 0], [0, 0, 0]])


def test_reference_sort_and_unsort_of_a_hand_computed_example():
    x = np.arange(10.0)[:, None]
    # Chunks [0, 1], [], [2, 3, 4], [5]; rows 6..9 belong to no chunk.
    out = ref.sort_chunks(x, [2, 0, 3, 1], [2, 0, 3, 1])
    np.testing.assert_array_equal(out[:, 0], [2, 3, 4, 0, 1, 5, 0, 0, 0, 0])
    np.testing.assert_array_equal(ref.unsort_chunks(out, [2, 0, 3, 1], [2, 0, 3, 1])[:, 0],
                                  [0, 1, 2, 3, 4, 5, 0, 0, 0, 0])
    # Negative sizes count as zero, indices outside [0, C) add nothing, chunks clip at N.
    np.testing.assert_array_equal(ref.sort_chunks(x, [-4, 3, 9], [2, 7, -1, 1, 0])[:, 0],
                                  [3, 4, 5, 6, 7, 8, 9, 0, 1, 2])


# ------------------------------------------------------------------ dispatched_rows


def test_dispatched_rows_matches_the_reference_formula():
    for num_out_tokens in [0, 1, 7, 64, 536, 2400, 262144]:
        for num_experts in [1, 8, 128, 256]:
            for align_size in [None, 1, 2, 16, 128]:
                got = permutation.dispatched_rows(num_out_tokens, num_experts, align_size)
                expected = ref.dispatched_rows(num_out_tokens, num_experts, align_size)
                assert got == expected and isinstance(got, int), (
                    f"dispatched_rows({num_out_tokens}, {num_experts}, {align_size}) = {got!r}, expected {expected}")


# ------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("model, align_size, variant", [
    pytest.param(m, a, v, id=f"{m.name}-align{a}-{v}") for m in LAYER_SHAPES for a in ALIGN_SIZES for v in VARIANTS
    if not is_heavy(m, a) or v == "ragged"])
def test_dispatch_matches_reference(model, align_size, variant, seed, rng):
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, variant)
    probs = draw_probs(rng, routing_map, jnp.float32)
    d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=align_size)
    num_out_tokens = x.shape[0] * model.topk
    checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size,
                       context=f"{model.name}, {variant}, align_size={align_size}, seed={seed}")


@MODELS
@pytest.mark.parametrize(
    "dtype, probs_dtype",
    [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16),
     (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.bfloat16)],
    ids=["f32", "bf16", "f16", "bf16_tokens_f32_probs", "f16_tokens_bf16_probs"])
def test_dispatch_copies_every_dtype_bit_for_bit(model, dtype, probs_dtype, seed, rng):
    x, routing_map = model_inputs(model, rng, dtype, "ragged")
    probs = draw_probs(rng, routing_map, probs_dtype)
    d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=16)
    assert d.tokens.dtype == x.dtype and d.probs.dtype == probs.dtype, (
        f"dtypes: tokens {d.tokens.dtype}, probs {d.probs.dtype}; expected {x.dtype}, {probs.dtype}")
    checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=x.shape[0] * model.topk, align_size=16,
                       context=f"{model.name}, seed={seed}")


@MODEL_ALIGNS
def test_dispatch_without_probs_returns_no_probs(model, align_size, seed, rng):
    x, routing_map = model_inputs(model, rng, jnp.float32, "idle_experts")
    d = permutation.dispatch(x, routing_map, topk=model.topk, align_size=align_size)
    checks.check_dispatch(d, x, routing_map, None, num_out_tokens=x.shape[0] * model.topk, align_size=align_size,
                       context=f"{model.name}, align_size={align_size}, seed={seed}")


@pytest.mark.parametrize("model", [MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER], ids=lambda m: m.name)
@ALIGNS
def test_dispatch_with_room_to_spare_leaves_zero_tail_rows(model, align_size, seed, rng):
    x, routing_map = model_inputs(model, rng, jnp.float16, "ragged")
    num_out_tokens = int(routing_map.sum()) + int(rng.integers(1, 200))
    probs = draw_probs(rng, routing_map, jnp.float16)
    d = permutation.dispatch(x, routing_map, probs=probs, num_out_tokens=num_out_tokens, align_size=align_size)
    layout = checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size,
                                context=f"{model.name}, num_out_tokens={num_out_tokens}, seed={seed}")
    assert layout.num_rows > layout.padded_counts.sum(), "the test meant to leave tail rows"


@pytest.mark.parametrize("model", [MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER], ids=lambda m: m.name)
@ALIGNS
def test_dispatch_with_num_out_tokens_equal_to_the_routed_count(model, align_size, seed, rng):
    # The tightest valid capacity: no entry may be dropped, however the padding falls.
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "ragged")
    num_out_tokens = int(routing_map.sum())
    d = permutation.dispatch(x, routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    layout = checks.check_dispatch(d, x, routing_map, None, num_out_tokens=num_out_tokens, align_size=align_size,
                                context=f"{model.name}, num_out_tokens={num_out_tokens}, seed={seed}")
    assert not layout.dropped.any()


@MODEL_ALIGNS
def test_dispatch_under_jit_drops_what_does_not_fit_num_out_tokens(model, align_size, seed, rng):
    # Capacity drop: under jit the routing map is abstract, so dispatch cannot raise; entries
    # whose row would be >= R are dropped (dest_rows -1), counts clip at R.
    x, routing_map = model_inputs(model, rng, jnp.float32, "topk")
    num_out_tokens = capacity_that_drops(routing_map, align_size, rng)
    probs = draw_probs(rng, routing_map, jnp.float32)

    @jax.jit
    def dispatch_then_combine(x, routing_map, probs):
        d = permutation.dispatch(x, routing_map, probs=probs, num_out_tokens=num_out_tokens, align_size=align_size)
        return d, permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)

    d, out = dispatch_then_combine(x, routing_map, probs)
    context = f"{model.name}, num_out_tokens={num_out_tokens} of {int(routing_map.sum())}, seed={seed}"
    layout = checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size,
                                context=context)
    assert layout.dropped.any(), f"the test meant to drop entries, but none was dropped ({context})"
    # The round trip sums only the entries that were kept.
    kept = routing_map & ~layout.dropped
    checks.assert_rounded_sum_close(out, weighted_sum_of_each_token(x, kept, probs),
                                 weighted_sum_of_each_token(np.abs(x), kept, probs), jnp.float32,
                                 num_terms=model.topk, what="combine after a capacity drop", context=context)


def test_dispatch_of_nothing_into_zero_rows(seed, rng):
    x = draw(rng, (37, 64), jnp.float32)
    routing_map = np.zeros((37, 8), dtype=bool)
    probs = draw_probs(rng, routing_map, jnp.float32)
    d = permutation.dispatch(x, routing_map, probs=probs, num_out_tokens=0)
    checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=0, align_size=None, context=f"seed={seed}")
    out = permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)
    checks.assert_bitwise_equal(out, np.zeros((37, 64), np.float32), what="combine of no rows", context=f"seed={seed}")


# -------------------------------------------------------------------------- combine


@pytest.mark.parametrize("model, align_size, dtype", dispatch_combine_cases())
def test_combine_matches_reference(model, align_size, dtype, seed, rng):
    x, routing_map = model_inputs(model, rng, dtype, "ragged")
    d, layout = dispatch_with_layout(x, routing_map, model, align_size)
    context = f"{model.name}, align_size={align_size}, {jnp.dtype(dtype).name}, seed={seed}"
    checks.check_dispatch_layout(d, layout, context=context)
    expert_tokens = expert_rows_for(layout, rng, model.hidden, dtype)
    merging_probs = draw_probs(rng, routing_map, dtype)
    out = permutation.combine(expert_tokens, d.row_id_map, merging_probs=merging_probs)
    check_combine(out, expert_tokens, layout.dest_rows, merging_probs, context=context)


@MODEL_ALIGNS
def test_combine_without_merging_probs_sums_with_weight_one(model, align_size, seed, rng):
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "idle_experts")
    d, layout = dispatch_with_layout(x, routing_map, model, align_size)
    expert_tokens = expert_rows_for(layout, rng, model.hidden, jnp.bfloat16)
    out = permutation.combine(expert_tokens, d.row_id_map)
    check_combine(out, expert_tokens, layout.dest_rows, None, context=f"{model.name}, seed={seed}")


def test_combine_with_f32_merging_probs_on_bf16_rows_returns_bf16(seed, rng):
    model = QWEN3_30B_A3B_LAYER
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "topk")
    d = permutation.dispatch(x, routing_map, topk=model.topk)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=x.shape[0] * model.topk)
    expert_tokens = expert_rows_for(layout, rng, model.hidden, jnp.bfloat16)
    merging_probs = draw_probs(rng, routing_map, jnp.float32)
    out = permutation.combine(expert_tokens, d.row_id_map, merging_probs=merging_probs)
    check_combine(out, expert_tokens, layout.dest_rows, merging_probs, context=f"seed={seed}")


@MODELS
@pytest.mark.parametrize("with_probs", [False, True], ids=["no_merging_probs", "merging_probs"])
def test_combine_fwd_started_from_an_addend_is_their_sum_rounded_once(model, with_probs, seed, rng):
    # The layer's backward starts the sum of each token's copies (dispatch's backward) from the
    # router's float32 gradient. A token of no copies is its addend row rounded (-0 kept); the
    # token whose dest_rows row has an entry out of range is NaN; with a zero addend the result is
    # combine_fwd's without one, bit for bit.
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "ragged")
    routing_map[:5] = False
    d, layout = dispatch_with_layout(x, routing_map, model, 16)
    expert_tokens = expert_rows_for(layout, rng, model.hidden, jnp.bfloat16)
    merging_probs = draw_probs(rng, routing_map, jnp.float32) if with_probs else None
    addend = rng.standard_normal((len(x), model.hidden)).astype(np.float32) * 4
    addend[:5] = -0.0
    context = f"{model.name}, merging_probs={with_probs}, seed={seed}"

    out = np.asarray(permutation.combine_fwd(expert_tokens, d.row_id_map, merging_probs, addend=addend))
    rows, compact_dest = ref.compact_rows(expert_tokens, layout.dest_rows)
    expected = ref.as_f64(addend) + ref.combine(rows, compact_dest, merging_probs)
    terms = np.abs(ref.as_f64(addend)) + ref.combine_abs_terms(rows, compact_dest, merging_probs)
    num_terms = int(routing_map.sum(axis=1).max()) + 1
    checks.assert_rounded_sum_close(out, expected, terms, jnp.bfloat16, num_terms=num_terms,
                                    what="combine_fwd from an addend", context=context)
    checks.assert_bitwise_equal(out[:5], addend[:5].astype(jnp.bfloat16), what="tokens of no copies", context=context)

    zero = permutation.combine_fwd(expert_tokens, d.row_id_map, merging_probs, addend=np.zeros_like(addend))
    checks.assert_bitwise_equal(zero, permutation.combine_fwd(expert_tokens, d.row_id_map, merging_probs),
                                what="from a zero addend", context=context)

    bad = layout.dest_rows.copy()
    bad[7, np.flatnonzero(bad[7] < 0)[0]] = layout.num_rows + 3
    bad_map = permutation.RowIdMap(jnp.asarray(bad), d.row_id_map.source_tokens)
    out = np.asarray(permutation.combine_fwd(expert_tokens, bad_map, merging_probs, addend=addend))
    assert np.isnan(out.astype(np.float32)).any(axis=1).tolist() == [t == 7 for t in range(len(x))], context


@pytest.mark.parametrize("model, align_size, dtype", dispatch_combine_cases(with_heavy=False))
def test_dispatch_then_combine_is_the_weighted_sum_of_each_token(model, align_size, dtype, seed, rng):
    variant = VARIANTS[ALIGN_SIZES.index(align_size)]
    x, routing_map = model_inputs(model, rng, dtype, variant)
    probs = draw_probs(rng, routing_map, dtype)
    d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=align_size)
    out = permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)
    checks.assert_rounded_sum_close(out, weighted_sum_of_each_token(x, routing_map, probs),
                                 weighted_sum_of_each_token(np.abs(x), routing_map, probs), dtype,
                                 num_terms=model.topk, what="combine(dispatch(x))",
                                 context=f"{model.name}, {variant}, align_size={align_size}, seed={seed}")


# ------------------------------------- rows outside the groups left unwritten (zero_unused_rows=False)

# A dispatch's layout with padding (align_size) and a tail (a ragged map routes fewer than T * k copies).
UNUSED_ROWS_CASES = pytest.mark.parametrize("model, align_size", [
    pytest.param(MIXTRAL_LAYER, 128, id="mixtral-align128"),
    pytest.param(QWEN3_30B_A3B_LAYER, 16, id="qwen3_30b_a3b-align16")])


def reference_row_id_map(layout: ref.DispatchLayout) -> permutation.RowIdMap:
    return permutation.RowIdMap(jnp.asarray(layout.dest_rows, jnp.int32), jnp.asarray(layout.source_tokens, jnp.int32))


@UNUSED_ROWS_CASES
def test_dispatch_fwd_leaving_unused_rows_unwritten_writes_the_groups_rows_as_the_default_does(model, align_size,
                                                                                               seed, rng):
    # The rows outside the groups hold anything (whatever the buffer held): only the rows some copy
    # holds are compared, bit for bit; every other result is the default call's in full.
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "ragged")
    probs = draw_probs(rng, routing_map, jnp.float32)
    num_out_tokens = x.shape[0] * model.topk
    num_rows = permutation.dispatched_rows(num_out_tokens, model.num_experts, align_size)
    context = f"{model.name}, align_size={align_size}, seed={seed}"
    zeroed = permutation.dispatch_fwd(x, routing_map, probs, num_rows=num_rows, align_size=align_size)
    unwritten = permutation.dispatch_fwd(x, routing_map, probs, num_rows=num_rows, align_size=align_size,
                                         zero_unused_rows=False)
    # The default against the reference: the groups' rows are the tokens' rows, the others +0.0.
    layout = checks.check_dispatch(zeroed, x, routing_map, probs, num_out_tokens=num_out_tokens,
                                   align_size=align_size, context=context)
    covered = layout.source_tokens >= 0
    assert not covered.all(), f"the test meant to leave padding and tail rows ({context})"
    checks.assert_bitwise_equal(np.asarray(unwritten.tokens)[covered], np.asarray(zeroed.tokens)[covered],
                                what="the rows some copy holds", context=context)
    others = lambda d: (d.probs, d.row_id_map, d.group_sizes, d.tokens_per_expert, d.pad_offsets)  # noqa: E731
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(others(unwritten)), jax.tree.leaves(others(zeroed))):
        checks.assert_bitwise_equal(a, b, what=f"zero_unused_rows=False vs default {jax.tree_util.keystr(path)}",
                                    context=context)


@UNUSED_ROWS_CASES
@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_bwd_leaving_unused_rows_unwritten_writes_the_groups_rows_and_still_marks_bad_maps(
        model, align_size, with_probs, seed, rng):
    routing_map = checks.routing_map_variant(rng, NUM_TOKENS[model.name], model.num_experts, model.topk, "ragged")
    layout = ref.dispatch_layout(routing_map, num_out_tokens=routing_map.shape[0] * model.topk, align_size=align_size)
    g_out = draw(rng, (routing_map.shape[0], model.hidden), jnp.bfloat16)
    expert_tokens = expert_rows_for(layout, rng, model.hidden, jnp.bfloat16)
    merging_probs = draw_probs(rng, routing_map, jnp.float32) if with_probs else None
    context = f"{model.name}, align_size={align_size}, merging_probs={with_probs}, seed={seed}"
    row_id_map = reference_row_id_map(layout)
    zeroed = permutation.combine_bwd(g_out, expert_tokens, row_id_map, merging_probs)
    unwritten = permutation.combine_bwd(g_out, expert_tokens, row_id_map, merging_probs, zero_unused_rows=False)
    covered = layout.source_tokens >= 0
    assert not covered.all(), f"the test meant to leave padding and tail rows ({context})"
    checks.assert_rows_zero(zeroed[0], ~covered, what="default d expert_tokens outside the groups", context=context)
    # Each row of a group is its copy's w[t, e] * g[t] (g[t] bit for bit without weights).
    rows, compact_dest = ref.compact_rows(expert_tokens, layout.dest_rows)
    expected, _ = ref.combine_backward(g_out, rows, compact_dest, merging_probs)
    checks.assert_rounded_sum_close(np.asarray(unwritten[0])[covered], expected, np.abs(expected), jnp.bfloat16,
                                    num_terms=1, what="d expert_tokens in the groups", context=context)
    checks.assert_bitwise_equal(np.asarray(unwritten[0])[covered], np.asarray(zeroed[0])[covered],
                                what="d expert_tokens in the groups, against the default's", context=context)
    if with_probs:
        checks.assert_bitwise_equal(unwritten[1], zeroed[1], what="d merging_probs", context=context)

    # Maps from the caller that disagree: a padding or tail row naming a token that does not list it,
    # and a group's row naming a token out of range, are NaN whatever zero_unused_rows says.
    bad_rows = [rng.choice(np.flatnonzero(~covered)), rng.choice(np.flatnonzero(covered))]
    source_tokens = layout.source_tokens.copy()
    source_tokens[bad_rows] = [rng.integers(len(routing_map)), len(routing_map) + 3]
    bad_map = permutation.RowIdMap(row_id_map.dest_rows, jnp.asarray(source_tokens, jnp.int32))
    grad_rows, _ = permutation.combine_bwd(g_out, expert_tokens, bad_map, merging_probs, zero_unused_rows=False)
    grad_rows = np.asarray(grad_rows).astype(np.float32)
    assert np.isnan(grad_rows[bad_rows]).all(), f"rows {bad_rows} of disagreeing maps are not NaN ({context})"
    still_covered = covered.copy()
    still_covered[bad_rows] = False
    checks.assert_bitwise_equal(grad_rows[still_covered], np.asarray(zeroed[0])[still_covered].astype(np.float32),
                                what="d expert_tokens in the groups, the maps' other rows", context=context)


@pytest.mark.parametrize("value", [1, None, "False", np.array([False])], ids=["int", "None", "str", "array"])
def test_zero_unused_rows_must_be_a_bool(value):
    x, routing_map = np.ones((4, 8), np.float32), np.eye(4, 2, dtype=bool)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=4)
    with pytest.raises(ValueError, match="zero_unused_rows must be a bool"):
        permutation.dispatch_fwd(x, routing_map, None, num_rows=4, align_size=None, zero_unused_rows=value)
    with pytest.raises(ValueError, match="zero_unused_rows must be a bool"):
        permutation.combine_bwd(x, None, reference_row_id_map(layout), zero_unused_rows=value)


# ---------------------------------------------------------------------- sort_chunks


def random_chunks(rng, num_chunks: int, num_rows: int, fill: float):
    """int32 split sizes (about a quarter of them zero) summing to about fill * num_rows, and a
    random permutation of the chunks."""
    sizes = rng.integers(0, 2 * fill * num_rows / num_chunks + 1, num_chunks)
    sizes[rng.random(num_chunks) < 0.25] = 0
    while sizes.sum() > num_rows:
        sizes[rng.integers(num_chunks)] //= 2
    return sizes.astype(np.int32), rng.permutation(num_chunks).astype(np.int32)


# C = 32 is 8 expert-parallel shards of 4 local experts each.
CHUNK_SHAPES = [(1000, (1024,), 32), (333, (2048,), 5), (64, (3, 5), 1), (4097, (8,), 256)]
CHUNK_IDS = ["N1000xH1024_C32", "N333xH2048_C5", "N64x3x5_C1", "N4097xH8_C256"]


@pytest.mark.parametrize("num_rows, trailing, num_chunks", CHUNK_SHAPES, ids=CHUNK_IDS)
@DTYPE_PARAMS
def test_sort_and_unsort_chunks_match_reference_and_invert_each_other(num_rows, trailing, num_chunks, dtype,
                                                                     seed, rng):
    x = draw(rng, (num_rows,) + trailing, dtype)
    sizes, order = random_chunks(rng, num_chunks, num_rows, fill=rng.uniform(0.5, 1.0))
    context = f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}"
    flat = x.reshape(num_rows, -1)
    sorted_x = permutation.sort_chunks(x, sizes, order)
    expected = ref.sort_chunks(flat, sizes, order).astype(x.dtype).reshape(x.shape)
    checks.assert_bitwise_equal(sorted_x, expected, what="sort_chunks", context=context)
    back = permutation.unsort_chunks(sorted_x, sizes, order)
    expected_back = ref.unsort_chunks(expected.reshape(num_rows, -1), sizes, order).astype(x.dtype).reshape(x.shape)
    checks.assert_bitwise_equal(back, expected_back, what="unsort_chunks", context=context)
    # The round trip restores the rows that belong to a chunk; the rest are zero.
    total = int(sizes.sum())
    round_trip = np.concatenate([x[:total], np.zeros_like(x[total:])])
    checks.assert_bitwise_equal(back, round_trip, what="unsort_chunks(sort_chunks(x))", context=context)


def test_unsort_chunks_of_unsorted_input_matches_reference(seed, rng):
    # unsort_chunks on its own (not fed by sort_chunks): the k-th chunk in sorted order goes
    # to the place of chunk order[k].
    x = draw(rng, (1000, 256), jnp.float32)
    sizes, order = random_chunks(rng, 32, 1000, fill=0.9)
    out = permutation.unsort_chunks(x, sizes, order)
    checks.assert_bitwise_equal(out, ref.unsort_chunks(x, sizes, order).astype(np.float32), what="unsort_chunks",
                             context=f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}")


@DTYPE_PARAMS
def test_sort_chunks_under_jit_clips_at_n_and_ignores_negative_sizes_and_foreign_indices(dtype, seed, rng):
    x = draw(rng, (500, 96), dtype)
    num_chunks = 11
    sizes = rng.integers(-50, 120, num_chunks).astype(np.int32)
    sizes[rng.choice(num_chunks, 3, replace=False)] = [-7, 0, 400]  # 400: the chunks run past N
    # Eight chunks in a random order, and three indices outside [0, C) that add nothing (called
    # eagerly, such indices raise).
    order = np.concatenate([rng.permutation(num_chunks)[:8], [num_chunks, -1, 100]])
    order = rng.permutation(order).astype(np.int32)
    out = jax.jit(permutation.sort_chunks)(x, sizes, order)
    checks.assert_bitwise_equal(out, ref.sort_chunks(x, sizes, order).astype(x.dtype), what="sort_chunks",
                             context=f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}")


def test_sort_chunks_under_jit_lists_a_repeated_index_once(seed, rng):
    # Under jit sorted_indices is not checked: a chunk listed again (and an index out of
    # range) lists nothing and takes no rows, so the rows after it are zero.
    x = draw(rng, (300, 32), jnp.float32)
    sizes = np.array([40, 0, 25, 60], np.int32)
    order = np.array([2, 2, 0, 7, 3], np.int32)[rng.permutation(5)]
    context = f"order={order.tolist()}, seed={seed}"
    sorted_x = jax.jit(permutation.sort_chunks)(x, np.append(sizes, 5).astype(np.int32), order)
    expected = ref.sort_chunks(x, np.append(sizes, 5), order)
    assert np.count_nonzero(np.abs(expected).sum(axis=1)) == 40 + 25 + 60, "each listed chunk's rows once"
    checks.assert_bitwise_equal(sorted_x, expected.astype(np.float32), what="sort_chunks", context=context)
    back = jax.jit(permutation.unsort_chunks)(sorted_x, np.append(sizes, 5).astype(np.int32), order)
    checks.assert_bitwise_equal(back, ref.unsort_chunks(np.asarray(sorted_x), np.append(sizes, 5), order).astype(np.float32),
                             what="unsort_chunks", context=context)


# ----------------------------------------------------------------------------- jit


@pytest.mark.parametrize("model", [MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER], ids=lambda m: m.name)
@pytest.mark.parametrize("align_size", [None, 16], ids=lambda a: f"align{a}")
def test_dispatch_and_combine_under_jit_equal_the_eager_calls(model, align_size, seed, rng):
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "ragged")
    probs = draw_probs(rng, routing_map, jnp.bfloat16)

    def fn(x, routing_map, probs):
        d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=align_size)
        return d, permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)

    jitted, eager = jax.jit(fn)(x, routing_map, probs), fn(x, routing_map, probs)
    context = f"{model.name}, seed={seed}"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jitted), jax.tree.leaves(eager)):
        checks.assert_bitwise_equal(a, b, what=f"jit vs eager {jax.tree_util.keystr(path)}", context=context)
    checks.check_dispatch(jitted[0], x, routing_map, probs, num_out_tokens=x.shape[0] * model.topk,
                       align_size=align_size, context=context)


def test_sort_and_unsort_chunks_under_jit_equal_the_reference(seed, rng):
    x = draw(rng, (1000, 512), jnp.bfloat16)
    sizes, order = random_chunks(rng, 32, 1000, fill=0.8)
    sort, unsort = jax.jit(permutation.sort_chunks), jax.jit(permutation.unsort_chunks)
    sorted_x = sort(x, sizes, order)
    context = f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}"
    checks.assert_bitwise_equal(sorted_x, ref.sort_chunks(x, sizes, order).astype(x.dtype), what="jit sort_chunks",
                             context=context)
    checks.assert_bitwise_equal(unsort(sorted_x, sizes, order),
                             ref.unsort_chunks(np.asarray(sorted_x), sizes, order).astype(x.dtype),
                             what="jit unsort_chunks", context=context)


# ---------------------------------------------------------------------------- vmap

BATCH = 3


@pytest.mark.parametrize("align_size", [None, 16], ids=lambda a: f"align{a}")
def test_dispatch_and_combine_under_vmap_equal_the_call_on_each_batch_element(align_size, seed, rng):
    model = MIXTRAL_LAYER
    maps = np.stack([checks.routing_map_variant(rng, 200, model.num_experts, model.topk, v) for v in VARIANTS])
    x = draw(rng, (BATCH, 200, model.hidden), jnp.float32)
    probs = np.stack([draw_probs(rng, m, jnp.float32) for m in maps])

    def fn(x, routing_map, probs):
        d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=align_size)
        return d, permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)

    batched = jax.vmap(fn)(x, maps, probs)
    for b in range(BATCH):
        context = f"batch element {b} ({VARIANTS[b]}), align_size={align_size}, seed={seed}"
        one = fn(x[b], maps[b], probs[b])
        for (path, a), c in zip(jax.tree_util.tree_leaves_with_path(batched), jax.tree.leaves(one)):
            checks.assert_bitwise_equal(np.asarray(a)[b], c, what=f"vmap {jax.tree_util.keystr(path)}", context=context)
        checks.check_dispatch(jax.tree.map(lambda a: a[b], batched[0]), x[b], maps[b], probs[b],
                           num_out_tokens=200 * model.topk, align_size=align_size, context=context)
        checks.assert_rounded_sum_close(batched[1][b], weighted_sum_of_each_token(x[b], maps[b], probs[b]),
                                     weighted_sum_of_each_token(np.abs(x[b]), maps[b], probs[b]), jnp.float32,
                                     num_terms=model.topk, what="vmap combine(dispatch(x))", context=context)


def test_sort_and_unsort_chunks_under_vmap_use_each_elements_splits(seed, rng):
    x = draw(rng, (BATCH, 600, 64), jnp.float16)
    chunks = [random_chunks(rng, 32, 600, fill=0.9) for _ in range(BATCH)]
    sizes = np.stack([c[0] for c in chunks])
    order = np.stack([c[1] for c in chunks])
    sorted_x = jax.vmap(permutation.sort_chunks)(x, sizes, order)
    back = jax.vmap(permutation.unsort_chunks)(sorted_x, sizes, order)
    for b in range(BATCH):
        context = f"batch element {b}, sizes={sizes[b].tolist()}, order={order[b].tolist()}, seed={seed}"
        expected = ref.sort_chunks(x[b], sizes[b], order[b]).astype(x.dtype)
        checks.assert_bitwise_equal(np.asarray(sorted_x)[b], expected, what="vmap sort_chunks", context=context)
        checks.assert_bitwise_equal(np.asarray(back)[b], ref.unsort_chunks(expected, sizes[b], order[b]).astype(x.dtype),
                                 what="vmap unsort_chunks", context=context)


# ------------------------------------------------------------ tokens sharded along T


def token_sharding(ndim: int) -> NamedSharding:
    mesh = jax.make_mesh((8,), ("tokens",), devices=devices.mesh_devices(8))
    return NamedSharding(mesh, P("tokens", *([None] * (ndim - 1))))


@pytest.mark.parametrize("model", LAYER_SHAPES, ids=lambda m: m.name)
@pytest.mark.parametrize("align_size", [None, 16], ids=lambda a: f"align{a}")
def test_dispatch_and_combine_with_tokens_sharded_over_eight_devices(model, align_size, seed, rng):
    # dispatch orders rows by expert over *all* tokens, whatever the sharding: the sharded call
    # must give the unsharded result (and the reference), and the round trip the weighted sum.
    num_tokens = 8 * 37
    x, routing_map = model_inputs(model, rng, jnp.bfloat16, "ragged", num_tokens=num_tokens)
    probs = draw_probs(rng, routing_map, jnp.float32)
    sharding = token_sharding(2)
    args = [jax.device_put(a, sharding) for a in (x, routing_map, probs)]

    @jax.jit
    def fn(x, routing_map, probs):
        d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=align_size)
        return d, permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)

    d, out = fn(*args)
    context = f"{model.name}, align_size={align_size}, 8 token shards, seed={seed}"
    checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_tokens * model.topk, align_size=align_size,
                       context=context)
    checks.assert_rounded_sum_close(out, weighted_sum_of_each_token(x, routing_map, probs),
                                 weighted_sum_of_each_token(np.abs(x), routing_map, probs), jnp.bfloat16,
                                 num_terms=model.topk, what="sharded combine(dispatch(x))", context=context)
    unsharded = fn(x, routing_map, probs)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((d, out)), jax.tree.leaves(unsharded)):
        checks.assert_bitwise_equal(a, b, what=f"sharded vs unsharded {jax.tree_util.keystr(path)}", context=context)


@pytest.mark.parametrize("align_size", [None, 16], ids=lambda a: f"align{a}")
def test_dispatch_and_combine_inside_shard_map_permute_each_shard_s_own_tokens(align_size, seed, rng):
    # Inside shard_map each of the 8 shards dispatches its own 24 tokens: nothing is exchanged,
    # the counts are each slice's, and values and gradients are the per-token formulas.
    model = QWEN3_30B_A3B_LAYER
    x, routing_map = model_inputs(model, rng, jnp.float32, "ragged", num_tokens=8 * 24)
    probs = draw_probs(rng, routing_map, jnp.float32)
    sharding = token_sharding(2)
    args = [jax.device_put(a, sharding) for a in (x, routing_map, probs)]

    def per_shard(x, routing_map, probs):
        d = permutation.dispatch(x, routing_map, probs=probs, topk=model.topk, align_size=align_size)
        y = permutation.combine(d.tokens * d.probs[:, None], d.row_id_map, merging_probs=probs)
        return y, d.group_sizes[None]

    rows = P("tokens", None)
    fn = jax.jit(jax.shard_map(per_shard, mesh=sharding.mesh, in_specs=(rows,) * 3, out_specs=(rows, rows)))
    context = f"align_size={align_size}, 8 shards in shard_map, seed={seed}"
    hlo = fn.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo, f"tokens were exchanged ({context})"

    y, counts = fn(*args)
    p, m = np.asarray(probs, np.float64), np.asarray(routing_map)
    squares = (p * p * m).sum(axis=1)  # each copy weighted by its prob, then merged with it again
    np.testing.assert_allclose(np.asarray(y), np.asarray(x, np.float64) * squares[:, None], rtol=1e-5, atol=1e-6,
                               err_msg=context)
    routed = m.reshape(8, 24, -1).sum(axis=1)
    align = align_size or 1
    np.testing.assert_array_equal(np.asarray(counts), -(-routed // align) * align, err_msg=context)

    grad_x, grad_p = jax.jit(jax.grad(lambda x, p: fn(x, args[1], p)[0].sum(), argnums=(0, 1)))(args[0], args[2])
    np.testing.assert_allclose(np.asarray(grad_x), np.broadcast_to(squares[:, None], x.shape), rtol=1e-5,
                               err_msg=f"d x ({context})")
    # d probs[t, e] sums H products in float32: its error scales with the sum of their sizes.
    x64 = np.asarray(x, np.float64)
    expected, scale = 2 * p * m * x64.sum(axis=1)[:, None], 2 * p * m * np.abs(x64).sum(axis=1)[:, None]
    error = np.abs(np.asarray(grad_p, np.float64) - expected)
    assert (error <= 1e-5 * scale + 1e-7).all(), f"d probs: worst error {error.max():.3g} ({context})"


def test_sort_chunks_with_rows_sharded_over_eight_devices(seed, rng):
    x = draw(rng, (8 * 125, 256), jnp.float32)
    sizes, order = random_chunks(rng, 32, 1000, fill=0.9)
    sharded = jax.device_put(x, token_sharding(2))
    replicated = NamedSharding(sharded.sharding.mesh, P())
    sizes_r, order_r = (jax.device_put(a, replicated) for a in (sizes, order))
    out = jax.jit(permutation.sort_chunks)(sharded, sizes_r, order_r)
    back = jax.jit(permutation.unsort_chunks)(out, sizes_r, order_r)
    context = f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}"
    expected = ref.sort_chunks(x, sizes, order).astype(np.float32)
    checks.assert_bitwise_equal(out, expected, what="sharded sort_chunks", context=context)
    checks.assert_bitwise_equal(back, ref.unsort_chunks(expected, sizes, order).astype(np.float32),
                             what="sharded unsort_chunks", context=context)


# ---------------------------------------------------------- small random configurations

@st.composite
def dispatch_configs(draw_):
    num_experts = draw_(st.integers(1, 12))
    return dict(num_tokens=draw_(st.integers(1, 40)), num_experts=num_experts, topk=draw_(st.integers(1, num_experts)),
                hidden=draw_(st.sampled_from([1, 3, 8])), align_size=draw_(st.sampled_from([None, 1, 2, 3, 8])),
                variant=draw_(st.sampled_from(VARIANTS)), capacity=draw_(st.sampled_from(["topk", "spare", "drop"])),
                data_seed=draw_(st.integers(0, 2**32 - 1)))


@settings(max_examples=25)
@given(config=dispatch_configs())
def test_dispatch_and_combine_of_small_random_configurations(config):
    # Edges the model shapes do not reach: one token, one expert, topk = E, align_size 1, a
    # capacity of a single row. Under jit, so that a drop is silent.
    rng = np.random.default_rng(config["data_seed"])
    t, e, k, a = config["num_tokens"], config["num_experts"], config["topk"], config["align_size"]
    routing_map = checks.routing_map_variant(rng, t, e, k, config["variant"] if e > k else "topk")
    x, probs = draw(rng, (t, config["hidden"]), jnp.float32), draw_probs(rng, routing_map, jnp.float32)
    routed = int(routing_map.sum())
    if config["capacity"] == "topk":
        kwargs = dict(topk=k)
        num_out_tokens = t * k
    else:
        num_out_tokens = routed + 3 if config["capacity"] == "spare" else int(rng.integers(0, max(routed, 1)))
        kwargs = dict(num_out_tokens=num_out_tokens)

    @jax.jit
    def fn(x, routing_map, probs):
        d = permutation.dispatch(x, routing_map, probs=probs, align_size=a, **kwargs)
        return d, permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)

    d, out = fn(x, routing_map, probs)
    context = f"{config}"
    layout = checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_out_tokens, align_size=a, context=context)
    kept = routing_map & ~layout.dropped
    checks.assert_rounded_sum_close(out, weighted_sum_of_each_token(x, kept, probs),
                                 weighted_sum_of_each_token(np.abs(x), kept, probs), jnp.float32, num_terms=k,
                                 what="combine(dispatch(x))", context=context)


@settings(max_examples=25)
@given(num_rows=st.integers(1, 50), num_chunks=st.integers(1, 10), data_seed=st.integers(0, 2**32 - 1))
def test_sort_and_unsort_chunks_of_small_random_configurations(num_rows, num_chunks, data_seed):
    rng = np.random.default_rng(data_seed)
    x = draw(rng, (num_rows, 3), jnp.float32)
    sizes = rng.integers(-3, max(2 * num_rows // num_chunks, 1) + 2, num_chunks).astype(np.int32)
    order = rng.permutation(num_chunks).astype(np.int32)
    context = f"sizes={sizes.tolist()}, order={order.tolist()}"
    sorted_x = jax.jit(permutation.sort_chunks)(x, sizes, order)
    checks.assert_bitwise_equal(sorted_x, ref.sort_chunks(x, sizes, order).astype(np.float32), what="sort_chunks",
                             context=context)
    if np.maximum(sizes, 0).sum() <= num_rows:  # where unsort_chunks is sort_chunks' inverse
        back = jax.jit(permutation.unsort_chunks)(sorted_x, sizes, order)
        total = int(np.maximum(sizes, 0).sum())
        checks.assert_bitwise_equal(back, np.concatenate([x[:total], np.zeros_like(x[total:])]),
                                 what="unsort_chunks(sort_chunks(x))", context=context)
