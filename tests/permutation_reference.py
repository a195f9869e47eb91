"""Float64 NumPy reference for oxmoe.permutation (dispatch, combine, sort_chunks,
unsort_chunks and their gradients).

Written from the semantics in the API contract, not from the implementation: every
value is recomputed in float64 (a bfloat16 or float16 input is upcast exactly), index
bookkeeping is done one expert / one chunk at a time in the most literal way. The row
layout (`dispatch_layout`) is kept apart from the values so that the GPU tests can check
the layout of a very large dispatch without materialising its rows in float64.

Random inputs and the comparisons with this reference: permutation_checks.py.
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
    group_sizes: np.ndarray  # [E] rows of each expert's block (padded), as dispatch returns them
    tokens_per_expert: np.ndarray  # [E] routed tokens each expert holds
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
        group_sizes=np.clip(room, 0, padded),
        tokens_per_expert=np.clip(room, 0, counts),
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


def gather_rows(x: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """x[sources] in x's dtype, with a +0.0 row wherever sources < 0."""
    out = np.zeros((len(sources),) + x.shape[1:], dtype=x.dtype)
    used = sources >= 0
    out[used] = x[sources[used]]
    return out


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
