"""The ragged_dot tests' random inputs, drawn directly in the kernel's dtype, random group
sizes, the comparison of a result with the float64 reference (ragged_dot_reference.py)
under an error bound (`assert_gemm_close`) and with another result bit for bit
(`assert_same_bits`), NumPy only.

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

import ml_dtypes
import numpy as np

from ragged_dot_reference import Expected

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


# ------------------------------------------------------------------ comparisons


def eps_out(dtype) -> float:
    """The output dtype's epsilon; 0 for float32 (its rounding is part of the accumulation's)."""
    dt = np_dtype(dtype)
    return 0.0 if dt == np.float32 else float(ml_dtypes.finfo(dt).eps)


def tiny_out(dtype) -> float:
    return float(ml_dtypes.finfo(np_dtype(dtype)).smallest_subnormal)


def allowed_error(expected_value, scale, acc_len, dtype, block_sum_error: float = 0.0) -> np.ndarray:
    """eps_out |ref| + (C eps_acc sqrt(n) + block_sum_error) (|lhs| @ |rhs|) + tiny_out (see the
    module docstring; block_sum_error: a kernel's own summation error, a fraction of the
    magnitudes)."""
    accumulation = C * EPS_ACC * np.sqrt(np.asarray(acc_len, np.float64)) + block_sum_error
    return eps_out(dtype) * np.abs(expected_value) + accumulation * scale + tiny_out(dtype)


def _where(bad: np.ndarray, limit: int = 6) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in w) for w in np.argwhere(bad)[:limit]]


def assert_gemm_close(actual, expected: Expected, dtype, *, what: str, context: str,
                      chunk_elements: int = 1 << 21, block_sum_error: float = 0.0) -> None:
    """`actual` has dtype and shape of the reference, is within the error bound of it, and is
    exactly zero (+0.0 or -0.0, never NaN) wherever the reference must be zero. Compares a
    block of rows at a time (the float64 temporaries of a [G, K, N] result would take gigabytes).
    `block_sum_error`: see `allowed_error`."""
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
        allowed = allowed_error(value[rows], scale[rows], acc_len[rows], dt, block_sum_error)
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
            f"{what}: {bad_count} of {actual.size} elements off by more than the accumulation bound "
            f"(worst {worst[0]:.3g}x the bound at {index(*worst[1])}):\n  " + "\n  ".join(lines) + f"\n({context})")


def assert_same_bits(actual, desired, *, what: str, context: str) -> None:
    """`actual` is `desired` bit for bit (same dtype and shape; NaNs of the same bits equal)."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.dtype == desired.dtype and actual.shape == desired.shape, (
        f"{what}: {actual.dtype}{list(actual.shape)}, expected {desired.dtype}{list(desired.shape)} ({context})")
    bits = np.dtype(f"u{actual.dtype.itemsize}")
    differ = actual.view(bits) != desired.view(bits)
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {differ.size} elements differ, first at "
                              f"{_where(differ, 1)[0]}: {actual[differ][0]!r} against {desired[differ][0]!r} ({context})")
