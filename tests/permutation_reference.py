"""Float64 NumPy reference for oxmoe.permutation (dispatch, combine, sort_chunks,
unsort_chunks and their gradients).

Written from the semantics in the API contract, not from the implementation: every
value is recomputed in float64 (a bfloat16 or float16 input is upcast exactly), index
bookkeeping is done one expert / one chunk at a time in the most literal way. The row
layout (`dispatch_layout`) is kept apart from the values so that the GPU tests can check
the layout of a very large dispatch without materialising its rows in float64.

Also here, NumPy only, for every permutation test file: random routing maps, and the
comparisons of oxmoe's outputs with the reference (bit for bit for data movement, a
float32-sum allowance for combine and the summing gradients).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def dispatched_rows(num_out_tokens: int, num_experts: int, align_size: int | None = None) -> int:
    """R: the static row count of dispatch's output."""
    if align_size is None:
        return num_out_tokens
    # Worst case: each of the (at most min(E, N)) non-empty experts pads by align_size - 1.
    worst = min(num_experts, num_out_tokens)
    return ((num_out_tokens + worst * (align_size - 1)) // align_size) * align_size


# ----------------------------------------------------------------------- dispatch


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    num_rows: int  # R
    dest_rows: np.ndarray  # [T, E] int64: row of (t, e), -1 if not routed or dropped
    source_tokens: np.ndarray  # [R] int64: token a row holds, -1 for padding / unused
    routed: np.ndarray  # [T, E] bool: the routing map
    dropped: np.ndarray  # [T, E] bool: routed but past row R
    counts: np.ndarray  # [E] c_e
    padded_counts: np.ndarray  # [E] p_e
    offsets: np.ndarray  # [E] off_e
    tokens_per_expert: np.ndarray  # [E]
    real_tokens_per_expert: np.ndarray  # [E]
    pad_offsets: np.ndarray | None  # [E], None without align_size


def dispatch_layout(routing_map, *, num_out_tokens: int, align_size: int | None = None) -> DispatchLayout:
    routed = np.asarray(routing_map, dtype=bool)
    num_tokens, num_experts = routed.shape
    a = 1 if align_size is None else align_size
    num_rows = dispatched_rows(num_out_tokens, num_experts, align_size)
    counts = routed.sum(axis=0).astype(np.int64)
    padded = -(-counts // a) * a  # ceil(c / a) * a
    offsets = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
    dest_rows = np.full((num_tokens, num_experts), -1, dtype=np.int64)
    source_tokens = np.full(num_rows, -1, dtype=np.int64)
    for e in range(num_experts):
        tokens_of_e = np.flatnonzero(routed[:, e])  # increasing token order
        rows = offsets[e] + np.arange(len(tokens_of_e))
        kept = rows < num_rows
        dest_rows[tokens_of_e[kept], e] = rows[kept]
        source_tokens[rows[kept]] = tokens_of_e[kept]
    room = num_rows - offsets
    return DispatchLayout(
        num_rows=num_rows,
        dest_rows=dest_rows,
        source_tokens=source_tokens,
        routed=routed,
        dropped=routed & (dest_rows < 0),
        counts=counts,
        padded_counts=padded,
        offsets=offsets,
        tokens_per_expert=np.clip(room, 0, padded),
        real_tokens_per_expert=np.clip(room, 0, counts),
        pad_offsets=None if align_size is None else offsets - np.concatenate([[0], np.cumsum(counts)[:-1]]),
    )


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    layout: DispatchLayout
    tokens: np.ndarray  # [R, H] float64
    probs: np.ndarray | None  # [R] float64


def dispatch(tokens, routing_map, probs=None, *, num_out_tokens: int, align_size: int | None = None) -> DispatchResult:
    x = as_f64(tokens)
    layout = dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    out = np.zeros((layout.num_rows, x.shape[1]))
    out_probs = None if probs is None else np.zeros(layout.num_rows)
    p = None if probs is None else as_f64(probs)
    for row, t in enumerate(layout.source_tokens):
        if t < 0:
            continue
        out[row] = x[t]
    if p is not None:
        t_idx, e_idx = np.nonzero(layout.dest_rows >= 0)
        out_probs[layout.dest_rows[t_idx, e_idx]] = p[t_idx, e_idx]
    return DispatchResult(layout, out, out_probs)


def dispatch_backward(grad_tokens, grad_probs, dest_rows) -> tuple[np.ndarray, np.ndarray | None]:
    """d tokens [T, H] and d probs [T, E] (None when grad_probs is None) from the cotangents of
    dispatch's tokens [R, H] and probs [R]."""
    g = as_f64(grad_tokens)
    dest_rows = np.asarray(dest_rows)
    num_tokens, num_experts = dest_rows.shape
    d_tokens = np.zeros((num_tokens, g.shape[1]))
    for e in range(num_experts):
        routed = dest_rows[:, e] >= 0
        d_tokens[routed] += g[dest_rows[routed, e]]
    if grad_probs is None:
        return d_tokens, None
    d_probs = np.zeros(dest_rows.shape)
    routed = dest_rows >= 0
    d_probs[routed] = as_f64(grad_probs)[dest_rows[routed]]
    return d_tokens, d_probs


# ------------------------------------------------------------------------ combine


def _weights(merging_probs, dest_rows) -> np.ndarray:
    return np.ones(np.shape(dest_rows)) if merging_probs is None else as_f64(merging_probs)


def combine(expert_tokens, dest_rows, merging_probs=None) -> np.ndarray:
    """out[t] = sum over routed e (increasing) of w[t, e] * expert_tokens[dest_rows[t, e]]: [T, H]."""
    y = as_f64(expert_tokens)
    dest_rows = np.asarray(dest_rows)
    w = _weights(merging_probs, dest_rows)
    num_tokens, num_experts = dest_rows.shape
    out = np.zeros((num_tokens, y.shape[1]))
    for e in range(num_experts):
        routed = dest_rows[:, e] >= 0
        out[routed] += w[routed, e][:, None] * y[dest_rows[routed, e]]
    return out


def combine_abs_terms(expert_tokens, dest_rows, merging_probs=None) -> np.ndarray:
    """sum_e |w[t, e] * expert_tokens[row, h]|: the scale of combine's float32 rounding error."""
    return combine(np.abs(as_f64(expert_tokens)), dest_rows, None if merging_probs is None else np.abs(as_f64(merging_probs)))


def compact_rows(expert_tokens, dest_rows) -> tuple[np.ndarray, np.ndarray]:
    """Only the rows some (t, e) points to, and dest_rows renumbered into them: the same combine
    (and combine_backward's d merging_probs), without the padding rows' cost."""
    dest_rows = np.asarray(dest_rows)
    used = np.unique(dest_rows[dest_rows >= 0])
    return np.asarray(expert_tokens)[used], np.where(dest_rows >= 0, np.searchsorted(used, dest_rows), -1)


def combine_backward(grad_out, expert_tokens, dest_rows, merging_probs=None) -> tuple[np.ndarray, np.ndarray]:
    """d expert_tokens [R, H] (zero on rows no (t, e) refers to) and d merging_probs [T, E]."""
    g = as_f64(grad_out)
    y = as_f64(expert_tokens)
    dest_rows = np.asarray(dest_rows)
    w = _weights(merging_probs, dest_rows)
    d_expert_tokens = np.zeros_like(y)
    d_probs = np.zeros(dest_rows.shape)
    for t, e in zip(*np.nonzero(dest_rows >= 0)):
        row = dest_rows[t, e]
        d_expert_tokens[row] += w[t, e] * g[t]
        d_probs[t, e] = float(g[t] @ y[row])
    return d_expert_tokens, d_probs


def combine_of_any_maps(expert_tokens, dest_rows, merging_probs=None) -> np.ndarray:
    """combine for row maps that need not come from a dispatch: a token whose dest_rows row has
    an entry out of range (neither -1 nor a row of expert_tokens) gives a NaN row."""
    dest_rows = np.asarray(dest_rows)
    valid = (dest_rows >= -1) & (dest_rows < len(expert_tokens))
    out = combine(expert_tokens, np.where(valid, dest_rows, -1), merging_probs)
    out[~valid.all(axis=1)] = np.nan
    return out


def combine_backward_of_any_maps(grad_out, expert_tokens, dest_rows, source_tokens, merging_probs=None):
    """combine's (d expert_tokens, d merging_probs) for row maps that need not come from a
    dispatch (the contract of combine's backward): row r of d expert_tokens comes from the token
    t = source_tokens[r] names, as s * g[t] with s the sum of w[t, e] over the e whose
    dest_rows[t, e] is r; zero where t is -1; NaN where the maps disagree (t out of range, or no
    dest_rows[t, e] is r). d merging_probs[t, e] = g[t] . y[dest_rows[t, e]], 0 where the entry
    is -1, NaN where it is out of range."""
    g, y = as_f64(grad_out), as_f64(expert_tokens)
    dest_rows, source_tokens = np.asarray(dest_rows), np.asarray(source_tokens)
    w = _weights(merging_probs, dest_rows)
    num_tokens = len(dest_rows)
    d_rows = np.zeros_like(y)
    for r, t in enumerate(source_tokens.tolist()):
        if t == -1:
            continue
        copies = np.flatnonzero(dest_rows[t] == r) if 0 <= t < num_tokens else []
        d_rows[r] = w[t, copies].sum() * g[t] if len(copies) else np.nan
    d_probs = np.zeros(dest_rows.shape)
    for (t, e), r in np.ndenumerate(dest_rows):
        if r != -1:
            d_probs[t, e] = g[t] @ y[r] if 0 <= r < len(y) else np.nan
    return d_rows, d_probs


def combine_backward_abs_terms(grad_out, expert_tokens, dest_rows) -> np.ndarray:
    """sum_h |d_out[t, h] * expert_tokens[row, h]| per (t, e): the error scale of d merging_probs."""
    _, terms = combine_backward(np.abs(as_f64(grad_out)), np.abs(as_f64(expert_tokens)), dest_rows)
    return terms


# ------------------------------------------------------------------- sort_chunks


def chunk_bounds(num_rows: int, split_sizes) -> list[tuple[int, int]]:
    """[start, end) of each chunk: sizes below zero count as zero, everything clipped at num_rows."""
    bounds, start = [], 0
    for s in np.asarray(split_sizes).tolist():
        end = start + max(int(s), 0)
        bounds.append((min(start, num_rows), min(end, num_rows)))
        start = end
    return bounds


def listed_chunks(num_chunks: int, sorted_indices) -> list[int]:
    """The chunks sorted_indices lists, in order: each index in [0, C) at its first position
    (an index out of range, or listed again, lists nothing)."""
    listed = []
    for i in np.asarray(sorted_indices).tolist():
        if 0 <= i < num_chunks and i not in listed:
            listed.append(i)
    return listed


def sort_chunks_sources(num_rows: int, split_sizes, sorted_indices) -> np.ndarray:
    """For each row of sort_chunks' output, the input row it copies (-1: a zero row)."""
    bounds = chunk_bounds(num_rows, split_sizes)
    pieces = [np.arange(*bounds[i]) for i in listed_chunks(len(bounds), sorted_indices)]
    moved = np.concatenate(pieces + [np.zeros(0, np.int64)])
    return np.concatenate([moved, np.full(num_rows - len(moved), -1)]).astype(np.int64)


def unsort_chunks_sources(num_rows: int, split_sizes, sorted_indices) -> np.ndarray:
    """For each row of unsort_chunks' output, the input row it copies (-1: a zero row): the
    k-th listed chunk of the sorted order goes back to its own place. The inverse of
    sort_chunks on the rows of the listed chunks, and its transpose."""
    bounds = chunk_bounds(num_rows, split_sizes)
    sources = np.full(num_rows, -1, dtype=np.int64)
    position = 0
    for i in listed_chunks(len(bounds), sorted_indices):
        start, end = bounds[i]
        sources[start:end] = np.arange(position, position + end - start)
        position += end - start
    return sources


def sort_chunks(tokens, split_sizes, sorted_indices) -> np.ndarray:
    x = as_f64(tokens)
    return gather_rows(x, sort_chunks_sources(x.shape[0], split_sizes, sorted_indices))


def unsort_chunks(tokens, split_sizes, sorted_indices) -> np.ndarray:
    x = as_f64(tokens)
    return gather_rows(x, unsort_chunks_sources(x.shape[0], split_sizes, sorted_indices))


def sort_chunks_backward(grad_out, split_sizes, sorted_indices) -> np.ndarray:
    """d tokens of sort_chunks: the cotangent unsorted (sort_chunks moves each row at most once,
    so its gradient is its transpose)."""
    return unsort_chunks(grad_out, split_sizes, sorted_indices)


def unsort_chunks_backward(grad_out, split_sizes, sorted_indices) -> np.ndarray:
    return sort_chunks(grad_out, split_sizes, sorted_indices)


# --------------------------------------------------------------- random inputs


def random_topk_map(rng: np.random.Generator, num_tokens: int, num_experts: int, topk: int) -> np.ndarray:
    """[T, E] bool with exactly topk distinct experts per token, chosen uniformly."""
    scores = rng.random((num_tokens, num_experts))
    chosen = np.argsort(scores, axis=-1)[:, :topk]
    routing_map = np.zeros((num_tokens, num_experts), dtype=bool)
    np.put_along_axis(routing_map, chosen, True, axis=-1)
    return routing_map


def routing_map_variant(rng: np.random.Generator, num_tokens: int, num_experts: int, topk: int, variant: str):
    """A routing map [T, E] bool of one of the shapes the tests need:

    - "topk": exactly topk experts per token;
    - "idle_experts": exactly topk per token, but a quarter of the experts (at least one)
      receive no token at all;
    - "ragged": topk per token, then ~30% of the entries removed (tokens with fewer than topk
      experts), one token with no expert at all and one expert with no token.
    """
    if variant == "topk":
        return random_topk_map(rng, num_tokens, num_experts, topk)
    if variant == "idle_experts":
        num_idle = max(1, min(num_experts // 4, num_experts - topk))
        active = np.sort(rng.permutation(num_experts)[num_idle:])
        routing_map = np.zeros((num_tokens, num_experts), dtype=bool)
        routing_map[:, active] = random_topk_map(rng, num_tokens, len(active), topk)
        return routing_map
    if variant == "ragged":
        routing_map = random_topk_map(rng, num_tokens, num_experts, topk)
        routing_map &= rng.random(routing_map.shape) >= 0.3
        routing_map[rng.integers(num_tokens)] = False
        routing_map[:, rng.integers(num_experts)] = False
        return routing_map
    raise ValueError(f"unknown routing map variant {variant!r}")


# ------------------------------------------------------------------ comparisons
#
# NumPy-only checks of oxmoe's outputs (JAX arrays are read through np.asarray) against the
# reference above, shared by the CPU and GPU test files.

F32_EPS = float(np.finfo(np.float32).eps)


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _where(bad: np.ndarray, limit: int = 6) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in w) for w in np.argwhere(bad)[:limit]]


def assert_bitwise_equal(actual, expected, *, what: str, context: str) -> None:
    """Same dtype, shape and bits (pure data movement: +0.0 padding, copies of the inputs)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype} ({context})"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape} ({context})"
    if actual.dtype.kind == "f":
        bad = _bits(actual) != _bits(expected)
    else:
        bad = actual != expected
    if bad.any():
        lines = [f"{w}: got {actual[w]!r}, expected {expected[w]!r}" for w in _where(bad)]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ (bitwise):\n  " + "\n  ".join(lines) + f"\n({context})"
        )


def assert_int_equal(actual, expected, *, what: str, context: str) -> None:
    """An int32 output equal to the reference's (which computes in int64)."""
    actual = np.asarray(actual)
    assert actual.dtype == np.int32, f"{what}: dtype {actual.dtype}, expected int32 ({context})"
    assert_bitwise_equal(actual, np.asarray(expected).astype(np.int32), what=what, context=context)


def sum_allowance(num_terms: int) -> float:
    """Float32 eps (relative to the sum of |terms|) that a float32 sum of num_terms products
    may be off by, in any order: the products' rounding plus the sum's (~sqrt(n) steps for
    random signs, as measured for the router; 8 + 2 sqrt(n) leaves a wide margin)."""
    return 8.0 + 2.0 * np.sqrt(num_terms)


def assert_rounded_sum_close(actual, expected, terms, dtype, *, num_terms: int, what: str, context: str, rows=None) -> None:
    """A value computed as a float32 sum of num_terms products, then rounded to dtype:
    |actual - expected| <= sum_allowance(num_terms) eps32 * terms + one ulp of dtype.
    `expected` and `terms` are float64 (the exact value and the sum of the |products|);
    `rows`, if given, selects the rows (first axis) to check."""
    dtype = np.dtype(dtype)
    actual = np.asarray(actual)
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype} ({context})"
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape} ({context})"
    a = actual.astype(np.float64)
    allowed = sum_allowance(num_terms) * F32_EPS * np.asarray(terms, np.float64)
    allowed = allowed + np.spacing(np.maximum(np.abs(a), np.abs(expected)).astype(dtype)).astype(np.float64)
    bad = ~(np.abs(a - expected) <= allowed)  # NaN counts as bad
    if rows is not None:
        bad &= np.asarray(rows, bool).reshape(-1, *([1] * (bad.ndim - 1)))
    if bad.any():
        lines = [f"{w}: got {a[w]!r}, expected {expected[w]!r}, allowed {float(np.broadcast_to(allowed, bad.shape)[w]):.3g}"
                 for w in _where(bad)]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements differ beyond a float32 sum of {num_terms} terms "
            f"rounded to {dtype}:\n  " + "\n  ".join(lines) + f"\n({context})"
        )


def assert_rows_zero(actual, rows, *, what: str, context: str) -> None:
    """The selected rows (bool mask or indices) are +0.0 in every bit."""
    actual = np.asarray(actual)
    selected = actual[rows]
    nonzero = (_bits(selected) != 0).reshape(len(selected), -1).any(axis=1)
    if nonzero.any():
        row_ids = np.arange(len(actual))[rows][nonzero]
        raise AssertionError(f"{what}: {len(row_ids)} rows are not all +0.0, e.g. row {row_ids[0]}: "
                             f"{selected[nonzero][0].reshape(-1)[:8]} ({context})")


def gather_rows(x: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """x[sources] in x's dtype, with a +0.0 row wherever sources < 0."""
    out = np.zeros((len(sources),) + x.shape[1:], dtype=x.dtype)
    used = sources >= 0
    out[used] = x[sources[used]]
    return out


def check_dispatch_layout(dispatched, layout: DispatchLayout, *, context: str) -> None:
    """The integer outputs of oxmoe's dispatch (a Dispatched) against the reference layout."""
    row_id_map = dispatched.row_id_map
    assert_int_equal(row_id_map.dest_rows, layout.dest_rows, what="row_id_map.dest_rows", context=context)
    assert_int_equal(row_id_map.source_tokens, layout.source_tokens, what="row_id_map.source_tokens", context=context)
    assert_int_equal(dispatched.tokens_per_expert, layout.tokens_per_expert, what="tokens_per_expert", context=context)
    assert_int_equal(dispatched.real_tokens_per_expert, layout.real_tokens_per_expert, what="real_tokens_per_expert",
                     context=context)
    if layout.pad_offsets is None:
        assert dispatched.pad_offsets is None, f"pad_offsets without align_size: {dispatched.pad_offsets} ({context})"
    else:
        assert_int_equal(dispatched.pad_offsets, layout.pad_offsets, what="pad_offsets", context=context)


def check_dispatch(dispatched, tokens, routing_map, probs, *, num_out_tokens: int, align_size, context: str,
                   row_chunk: int = 16384) -> DispatchLayout:
    """Every output of oxmoe's dispatch against the reference: the layout exactly, the rows and
    probs bit for bit (they are copies; padding and unused rows +0.0). Compares the rows a chunk
    at a time, so that it also serves the GPU tests' large shapes. Returns the reference layout."""
    layout = dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    check_dispatch_layout(dispatched, layout, context=context)
    x = np.asarray(tokens)
    out = np.asarray(dispatched.tokens)
    assert out.dtype == x.dtype, f"tokens: dtype {out.dtype}, expected {x.dtype} ({context})"
    assert out.shape == (layout.num_rows, x.shape[1]), (
        f"tokens: shape {out.shape}, expected {(layout.num_rows, x.shape[1])} ({context})")
    for start in range(0, layout.num_rows, row_chunk):
        sources = layout.source_tokens[start : start + row_chunk]
        assert_bitwise_equal(out[start : start + row_chunk], gather_rows(x, sources),
                             what=f"tokens rows {start}..{start + len(sources) - 1}", context=context)
    if probs is None:
        assert dispatched.probs is None, f"probs out without probs in: {dispatched.probs} ({context})"
    else:
        p = np.asarray(probs)
        expected = np.zeros(layout.num_rows, dtype=p.dtype)
        t_idx, e_idx = np.nonzero(layout.dest_rows >= 0)
        expected[layout.dest_rows[t_idx, e_idx]] = p[t_idx, e_idx]
        assert_bitwise_equal(dispatched.probs, expected, what="probs", context=context)
    return layout
