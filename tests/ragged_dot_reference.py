"""Float64 NumPy reference for oxmoe.ragged_dot and oxmoe.transposed_ragged_dot (the grouped
GEMM) and their gradients, written from the API contract (notes: issue 5), not from the
implementation.

Every product is recomputed in float64 from the float64-cast inputs (a bfloat16 or float16
input is upcast exactly), one group at a time, with the row bookkeeping done the literal way:
group g (global index) owns rows [start_g, start_g + size_g), start_g the sum of the sizes
before it; negative sizes count as zero, every bound is clamped to M and the window's first
group g0 to [0, G] (what the jit path does; called eagerly such values raise instead).

Random inputs and the comparisons with this reference (its error bound): ragged_dot_checks.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np


# ------------------------------------------------------------------ group layout


def window_start(group_offset, num_groups: int) -> int:
    """g0: group_offset (None: 0) clamped to [0, G]."""
    if group_offset is None:
        return 0
    return int(min(max(int(np.asarray(group_offset).reshape(())), 0), num_groups))


def group_bounds(num_rows: int, group_sizes) -> list[tuple[int, int]]:
    """[start, end) of every global group: sizes below zero count as zero, bounds clamped to M."""
    bounds, start = [], 0
    for size in np.asarray(group_sizes).tolist():
        end = start + max(int(size), 0)
        bounds.append((min(start, num_rows), min(end, num_rows)))
        start = end
    return bounds


def local_group_rows(num_rows: int, group_sizes, num_local: int, group_offset=None) -> list[tuple[int, int]]:
    """[start, end) of each local group i (global group g0 + i); (0, 0) past the last group."""
    bounds = group_bounds(num_rows, group_sizes)
    g0 = window_start(group_offset, len(bounds))
    return [bounds[g0 + i] if g0 + i < len(bounds) else (0, 0) for i in range(num_local)]


def rows_in_window(num_rows: int, group_sizes, num_local: int, group_offset=None) -> np.ndarray:
    """[M] bool: the rows some local group owns (every other output row must be exactly zero)."""
    mask = np.zeros(num_rows, bool)
    for start, end in local_group_rows(num_rows, group_sizes, num_local, group_offset):
        mask[start:end] = True
    return mask


def as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


# -------------------------------------------------------------------- ragged_dot


@dataclasses.dataclass
class Expected:
    """A reference result: the float64 value, the scale of its float32 rounding error
    (the same product of |lhs| and |rhs|), the length of each element's float32 sum, and
    the elements that must be exactly zero."""

    value: np.ndarray
    scale: np.ndarray
    acc_len: np.ndarray | int
    zero: np.ndarray  # bool, broadcastable to value: elements that must be exactly 0

    def rows(self, mask: np.ndarray) -> Expected:
        """The reference of a ragged_dot result's rows that the [M] bool ``mask`` selects."""
        return Expected(self.value[mask], self.scale[mask], self.acc_len, self.zero[mask])


def _weights(rhs_i: np.ndarray, rhs_transposed: bool) -> np.ndarray:
    """rhs[i] as the [K, N] matrix it multiplies, in float64."""
    w = as_f64(rhs_i)
    return w.T if rhs_transposed else w


def ragged_dot(lhs, rhs, group_sizes, *, group_offset=None, rhs_transposed=False) -> Expected:
    """out[start_{g0+i} + r] = lhs[start_{g0+i} + r] @ rhs[i] (rhs[i].T with rhs_transposed) for
    local group i; every other row 0. rhs is [G_local, K, N] or [G_local, N, K]."""
    lhs = np.asarray(lhs)
    num_rows, k = lhs.shape
    num_local = rhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    value, scale = np.zeros((num_rows, n)), np.zeros((num_rows, n))
    for i, (start, end) in enumerate(local_group_rows(num_rows, group_sizes, num_local, group_offset)):
        if start == end:
            continue
        w = _weights(rhs[i], rhs_transposed)
        rows = as_f64(lhs[start:end])
        value[start:end] = rows @ w
        np.abs(w, out=w)
        scale[start:end] = np.abs(rows) @ w
        del w
    zero = ~rows_in_window(num_rows, group_sizes, num_local, group_offset)[:, None]
    return Expected(value, scale, k, zero)


def transposed_ragged_dot(lhs, rhs, group_sizes, *, num_groups=None, group_offset=None) -> Expected:
    """out[i] = lhs_g.T @ rhs_g over the rows of global group g = g0 + i ([num_groups, K, N]);
    zeros for an empty group or one past the last."""
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    num_rows, k = lhs.shape
    n = rhs.shape[1]
    num_local = len(np.asarray(group_sizes)) if num_groups is None else num_groups
    value, scale = np.zeros((num_local, k, n)), np.zeros((num_local, k, n))
    acc_len = np.zeros((num_local, 1, 1), np.int64)
    for i, (start, end) in enumerate(local_group_rows(num_rows, group_sizes, num_local, group_offset)):
        if start == end:
            continue
        a, b = as_f64(lhs[start:end]), as_f64(rhs[start:end])
        value[i] = a.T @ b
        scale[i] = np.abs(a).T @ np.abs(b)
        acc_len[i] = end - start
    return Expected(value, scale, acc_len, (acc_len == 0))


def chunked_transposed_ragged_dot(lhs_chunks, rhs_chunks, group_sizes, *, num_groups=None,
                                  group_offset=None) -> Expected:
    """out[i] = lhs_g.T @ rhs_g where lhs_g, rhs_g stack the rows of group g = g0 + i of every
    chunk, chunk after chunk (chunk c's own sizes group_sizes[c], its own M_c); zeros where no
    chunk has rows of the group."""
    group_sizes = np.asarray(group_sizes)
    num_local = group_sizes.shape[1] if num_groups is None else num_groups
    bounds = [local_group_rows(len(lhs), sizes, num_local, group_offset)
              for lhs, sizes in zip(lhs_chunks, group_sizes)]
    k, n = np.shape(lhs_chunks[0])[1], np.shape(rhs_chunks[0])[1]
    value, scale = np.zeros((num_local, k, n)), np.zeros((num_local, k, n))
    acc_len = np.zeros((num_local, 1, 1), np.int64)
    for i in range(num_local):
        a = np.concatenate([as_f64(lhs[b[i][0]:b[i][1]]) for lhs, b in zip(lhs_chunks, bounds)]).reshape(-1, k)
        c = np.concatenate([as_f64(rhs[b[i][0]:b[i][1]]) for rhs, b in zip(rhs_chunks, bounds)]).reshape(-1, n)
        value[i], scale[i], acc_len[i] = a.T @ c, np.abs(a).T @ np.abs(c), len(a)
    return Expected(value, scale, acc_len, (acc_len == 0))


# ------------------------------------------------------------------- gradients


def ragged_dot_backward(lhs, rhs, group_sizes, grad_out, *, group_offset=None, rhs_transposed=False):
    """(d lhs, d rhs) of ragged_dot for the cotangent grad_out [M, N] (already cast to the input
    dtype, as the contract says the implementation does):
    d lhs rows of local group i = grad_out_g @ rhs[i].T ([K, N] view), zero outside the window;
    d rhs[i] = lhs_g.T @ grad_out_g (its transpose for an [N, K] rhs), zero for an empty group
    or one past G."""
    lhs, grad_out = np.asarray(lhs), np.asarray(grad_out)
    num_rows, k = lhs.shape
    num_local = rhs.shape[0]
    n = grad_out.shape[1]
    d_lhs, d_lhs_scale = np.zeros((num_rows, k)), np.zeros((num_rows, k))
    d_rhs, d_rhs_scale = np.zeros(rhs.shape), np.zeros(rhs.shape)
    acc_len = np.zeros((num_local, 1, 1), np.int64)
    for i, (start, end) in enumerate(local_group_rows(num_rows, group_sizes, num_local, group_offset)):
        if start == end:
            continue
        w = _weights(rhs[i], rhs_transposed)  # [K, N]
        g, a = as_f64(grad_out[start:end]), as_f64(lhs[start:end])
        d_lhs[start:end] = g @ w.T
        d_lhs_scale[start:end] = np.abs(g) @ np.abs(w).T
        d_w, d_w_scale = a.T @ g, np.abs(a).T @ np.abs(g)  # [K, N]
        d_rhs[i] = d_w.T if rhs_transposed else d_w
        d_rhs_scale[i] = d_w_scale.T if rhs_transposed else d_w_scale
        acc_len[i] = end - start
    zero_rows = ~rows_in_window(num_rows, group_sizes, num_local, group_offset)[:, None]
    return Expected(d_lhs, d_lhs_scale, n, zero_rows), Expected(d_rhs, d_rhs_scale, acc_len, acc_len == 0)


def transposed_ragged_dot_backward(lhs, rhs, group_sizes, grad_out, *, group_offset=None):
    """(d lhs, d rhs) of transposed_ragged_dot (out[i] = lhs_g.T @ rhs_g) for the cotangent
    grad_out [G_local, K, N]: d lhs_g = rhs_g @ grad_out[i].T, d rhs_g = lhs_g @ grad_out[i];
    rows outside the window zero."""
    lhs, rhs, grad_out = np.asarray(lhs), np.asarray(rhs), np.asarray(grad_out)
    num_rows, k = lhs.shape
    n = rhs.shape[1]
    num_local = grad_out.shape[0]
    d_lhs, d_lhs_scale = np.zeros((num_rows, k)), np.zeros((num_rows, k))
    d_rhs, d_rhs_scale = np.zeros((num_rows, n)), np.zeros((num_rows, n))
    for i, (start, end) in enumerate(local_group_rows(num_rows, group_sizes, num_local, group_offset)):
        if start == end:
            continue
        g = as_f64(grad_out[i])  # [K, N]
        a, b = as_f64(lhs[start:end]), as_f64(rhs[start:end])
        d_lhs[start:end] = b @ g.T
        d_lhs_scale[start:end] = np.abs(b) @ np.abs(g).T
        d_rhs[start:end] = a @ g
        d_rhs_scale[start:end] = np.abs(a) @ np.abs(g)
    zero_rows = ~rows_in_window(num_rows, group_sizes, num_local, group_offset)[:, None]
    return Expected(d_lhs, d_lhs_scale, n, zero_rows), Expected(d_rhs, d_rhs_scale, k, zero_rows)
