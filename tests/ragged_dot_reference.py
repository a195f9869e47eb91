"""Float64 NumPy reference for oxmoe.ragged_dot and oxmoe.transposed_ragged_dot (the grouped
GEMM) and their gradients, written from the API contract (notes: issue 5), not from the
implementation.

Every product is recomputed in float64 from the float64-cast inputs (a bfloat16 or float16
input is upcast exactly), one group at a time, with the row bookkeeping done the literal way:
group g (global index) owns rows [start_g, start_g + size_g), start_g the sum of the sizes
before it; negative sizes count as zero, every bound is clamped to M and the window's first
group g0 to [0, G] (what the jit path does; called eagerly such values raise instead).

Also here, NumPy only, for every ragged_dot test file: random inputs drawn directly in the
kernel's dtype, random group sizes, and the comparison of a result with the reference under
an error bound (`assert_gemm_close`).

The error bound. A float32 dot product of n terms (the kernels accumulate in float32, in
some order, perhaps in several partial sums) differs from the exact value by at most
gamma_n * sum|a_i b_i| with gamma_n ~ n u (u = 2**-24, the unit roundoff) in the worst case,
but for rounding errors that are independent and of mean zero, the error is a sum of n
random terms and stays below lambda * sqrt(n) * u * sum|a_i b_i| except with probability
about 2 exp(-lambda**2 / 2) (Higham and Mary, "A new approach to probabilistic rounding
error analysis", SIAM J. Sci. Comput. 2019). The bound used here,

    |got - ref| <= eps_out * |ref| + C * eps_acc * sqrt(n) * (|lhs| @ |rhs|) + tiny_out,

with eps_acc = 2**-23 = 2u and C = 4, is that with lambda = 8: a single element escapes it
with probability ~1e-14, so not even the GPU tests' billions of elements should. Two more
reasons the margin is right: (1) products of bfloat16 or float16 values are exact in
float32, so for half inputs only the additions round; (2) hardware that truncates instead of
rounding (tensor cores may) has biased errors, u * |partial sum| per addition with the sign of
the partial sum; for the zero-mean data drawn here partial sums wander like sqrt(k) times a
term and the biased total stays near (2/3) n sqrt(n) u |term|, still under the bound's
8 n sqrt(n) u |term|. The bound would not hold for data whose partial sums grow linearly (all
terms of one sign) under truncation: the tests draw zero-mean data for that reason.

eps_out is the output dtype's epsilon (twice its unit roundoff, so one rounding of the
float32 sum to bfloat16 / float16 fits with a factor 2 to spare) and 0 for a float32 output
(its last rounding is one of the accumulation's). tiny_out is the dtype's smallest subnormal:
a result that rounds into float16's subnormal range is off by up to half of it, however
small |ref| is.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

EPS_ACC = 2.0**-23
# lambda = 2 C = 8 unit roundoffs per sqrt(term): see the module docstring.
C = 4.0


# ------------------------------------------------------------------ random inputs

_HALF = {np.dtype(ml_dtypes.bfloat16): (0x81FF, 124 << 7), np.dtype(np.float16): (0x8FFF, 12 << 10)}


def np_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a jnp / NumPy / ml_dtypes dtype or its name."""
    return np.dtype(dtype)


def draw(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random values of the given dtype, drawn directly in it (so the reference sees exactly
    what the kernel sees): a random sign, a random exponent among four binades and random
    mantissa bits, i.e. |x| in [1/8, 2), zero mean. Built from raw random bits, because a
    real-model weight tensor holds half a billion elements and normal draws of that many
    take a quarter of a minute on a small CI machine."""
    dt = np_dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape))
    size = int(np.prod(shape, dtype=np.int64))
    words = rng.bit_generator.random_raw(-(-size * dt.itemsize // 8)).view(np.uint8)[: size * dt.itemsize]
    if dt == np.float32:
        bits = words.view(np.uint32)
        bits &= np.uint32(0x81FFFFFF)  # sign, two exponent-choice bits, 23 mantissa bits
        bits += np.uint32(124 << 23)  # exponent 124..127: [1/8, 2)
    elif dt in _HALF:
        keep, exponent = _HALF[dt]
        bits = words.view(np.uint16)
        bits &= np.uint16(keep)
        bits += np.uint16(exponent)
    else:
        raise TypeError(f"draw: unsupported dtype {dt}")
    return bits.view(dt).reshape(shape)


def dirichlet_sizes(rng: np.random.Generator, num_groups: int, total: int, alpha: float = 4.0) -> np.ndarray:
    """int32 sizes summing to `total`: a Dirichlet(alpha) split (multinomial rounding)."""
    p = rng.dirichlet(np.full(num_groups, alpha))
    return rng.multinomial(total, p).astype(np.int32)


def sizes_with_empty_groups(rng: np.random.Generator, num_groups: int, total: int, fraction: float = 0.1,
                            alpha: float = 4.0) -> np.ndarray:
    """int32 sizes summing to `total` with about `fraction` of the groups (at least one, when
    there are two or more) empty and the others a Dirichlet(alpha) split."""
    num_empty = min(max(1, round(fraction * num_groups)), num_groups - 1) if num_groups > 1 else 0
    empty = rng.choice(num_groups, num_empty, replace=False)
    p = rng.dirichlet(np.full(num_groups, alpha))
    p[empty] = 0
    p /= p.sum()
    sizes = rng.multinomial(total, p)
    assert (sizes[empty] == 0).all()
    return sizes.astype(np.int32)


def group_size_draw(rng: np.random.Generator, kind: str, num_groups: int, total: int) -> np.ndarray:
    if kind == "dirichlet":
        return dirichlet_sizes(rng, num_groups, total)
    if kind == "empty10":
        return sizes_with_empty_groups(rng, num_groups, total)
    raise ValueError(f"unknown group size draw {kind!r}")


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


# ------------------------------------------------------------------ comparisons


def eps_out(dtype) -> float:
    """The output dtype's epsilon; 0 for float32 (its rounding is part of the accumulation's)."""
    dt = np_dtype(dtype)
    return 0.0 if dt == np.float32 else float(ml_dtypes.finfo(dt).eps)


def tiny_out(dtype) -> float:
    return float(ml_dtypes.finfo(np_dtype(dtype)).smallest_subnormal)


def allowed_error(expected_value, scale, acc_len, dtype) -> np.ndarray:
    """eps_out |ref| + C eps_acc sqrt(n) (|lhs| @ |rhs|) + tiny_out (see the module docstring)."""
    return (eps_out(dtype) * np.abs(expected_value) + C * EPS_ACC * np.sqrt(np.asarray(acc_len, np.float64)) * scale
            + tiny_out(dtype))


def _where(bad: np.ndarray, limit: int = 6) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in w) for w in np.argwhere(bad)[:limit]]


def assert_gemm_close(actual, expected: Expected, dtype, *, what: str, context: str,
                      chunk_elements: int = 1 << 21) -> None:
    """`actual` has dtype and shape of the reference, is within the error bound of it, and is
    exactly zero (+0.0 or -0.0, never NaN) wherever the reference must be zero. Compares a
    block of rows at a time (the float64 temporaries of a [G, K, N] result would take gigabytes)."""
    dt = np_dtype(dtype)
    actual = np.asarray(actual)
    assert actual.dtype == dt, f"{what}: dtype {actual.dtype}, expected {dt} ({context})"
    shape = expected.value.shape
    assert actual.shape == shape, f"{what}: shape {actual.shape}, expected {shape} ({context})"
    if actual.size == 0:
        return
    last = shape[-1] if shape else 1
    lead = actual.size // max(last, 1)
    got, value, scale = (x.reshape(lead, last) for x in (actual, expected.value, expected.scale))
    zero = np.broadcast_to(expected.zero, shape[:-1] + (1,)).reshape(lead, 1)
    acc_len = np.broadcast_to(np.asarray(expected.acc_len), shape[:-1] + (1,)).reshape(lead, 1)
    nonzero_count, bad_count, nonzero_examples, bad_examples = 0, 0, [], []
    worst = (0.0, None)
    step = max(1, chunk_elements // max(last, 1))
    for start in range(0, lead, step):
        rows = slice(start, start + step)
        a = got[rows].astype(np.float64)
        nonzero = zero[rows] & ~(a == 0)
        if nonzero.any():
            nonzero_count += int(nonzero.sum())
            nonzero_examples += [(start + w[0], w[1], a[w]) for w in _where(nonzero)]
        allowed = allowed_error(value[rows], scale[rows], acc_len[rows], dt)
        error = np.abs(a - value[rows])
        bad = ~(error <= allowed)  # NaN counts as bad
        if bad.any():
            bad_count += int(bad.sum())
            bad_examples += [(start + w[0], w[1], a[w], value[rows][w], allowed[w]) for w in _where(bad)]
            ratio = np.where(np.isfinite(error), error / allowed, np.inf)
            w = np.unravel_index(np.argmax(ratio), ratio.shape)
            if ratio[w] > worst[0]:
                worst = (float(ratio[w]), (start + int(w[0]), int(w[1])))

    def index(row, col):
        return tuple(int(i) for i in np.unravel_index(row * last + col, shape))

    if nonzero_count:
        raise AssertionError(
            f"{what}: {nonzero_count} elements that must be exactly zero are not, e.g. "
            + ", ".join(f"{index(r, c)}: {x!r}" for r, c, x in nonzero_examples[:6]) + f" ({context})")
    if bad_count:
        lines = [f"{index(r, c)}: got {x!r}, expected {e!r}, allowed {float(b):.3g}"
                 for r, c, x, e, b in bad_examples[:6]]
        raise AssertionError(
            f"{what}: {bad_count} of {actual.size} elements off by more than the float32-accumulation bound "
            f"(worst {worst[0]:.3g}x the bound at {index(*worst[1])}):\n  " + "\n  ".join(lines) + f"\n({context})")
