"""The permutation tests' random inputs and their comparisons of oxmoe's outputs with the
float64 reference (permutation_reference.py), NumPy only (JAX arrays are read through
np.asarray), shared by the CPU and GPU test files: bit for bit for data movement, a
float32-sum allowance for combine and the summing gradients.
"""

from __future__ import annotations

import numpy as np

from permutation_reference import DispatchLayout, dispatch_layout, gather_rows


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
    if actual.dtype.kind == "f" or actual.dtype.name == "bfloat16":  # bfloat16's kind is "V"
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


def check_dispatch_layout(dispatched, layout: DispatchLayout, *, context: str) -> None:
    """The integer outputs of oxmoe's dispatch (a Dispatched) against the reference layout."""
    row_id_map = dispatched.row_id_map
    assert_int_equal(row_id_map.dest_rows, layout.dest_rows, what="row_id_map.dest_rows", context=context)
    assert_int_equal(row_id_map.source_tokens, layout.source_tokens, what="row_id_map.source_tokens", context=context)
    assert_int_equal(dispatched.group_sizes, layout.group_sizes, what="group_sizes", context=context)
    assert_int_equal(dispatched.tokens_per_expert, layout.tokens_per_expert, what="tokens_per_expert", context=context)
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
