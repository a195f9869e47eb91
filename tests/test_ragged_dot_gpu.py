"""oxmoe's CUDA grouped GEMM (ragged_dot, its vjp, transposed_ragged_dot) checked where only a
GPU can check it. Every test here is marked `gpu` and skipped when jax has no GPU device.

(The rest of the ragged_dot suite also runs on the GPU when it is the default device, e.g.
with JAX_PLATFORMS=cuda,cpu.) This file adds:

- the four expert GEMMs of the issue at full size: Mixtral up (M=65536, K=1024, N=4096, G=8),
  Qwen3-30B-A3B up (M=131072, K=2048, N=768, G=128), DeepSeek-V3 8-way expert parallel up
  (M=32768, K=7168, N=2048, G=32) and down (M=32768, K=2048, N=7168, G=32), in bfloat16 and
  float16, both rhs layouts, a Dirichlet(4) split of all rows and a split with ~10% empty
  groups and a tail of rows in no group: the forward, d lhs (ragged_dot of the cotangent with
  the rhs layout flipped) and d rhs (transposed_ragged_dot), through jax.vjp;
- small odd shapes (the generic kernel: odd K or N, float32), shapes the tensor-core kernel
  takes whose groups start and end across its row tiles, empty groups, windows of groups
  (group_offset), rows past the groups' total, more groups than the tensor-core kernel
  holds, empty dimensions (M, K, N or the local groups 0), the transposed product over
  chunks of rows (up to the most, one empty), against the float64 reference;
- ragged_dot under jit called with new group sizes: no recompilation, right values;
- rows (and groups) outside every group are exactly zero even in memory that held NaN;
- with the rows outside the window left unwritten (zero_unused_rows=False), ragged_dot's and
  ragged_dot_activation's rows of the window bit for bit the default call's, at full size.

References at full size. Every element of every result is checked on the GPU against plain
JAX, group by group in float32 with precision HIGHEST (each group's rows sliced with the sizes
the host drew), under the float32-accumulation bound of ragged_dot_reference.py counted twice
(the reference's own float32 sums err as much as the kernel's may); only counts and the worst
elements come back to the host. On top of that, a float64 NumPy check with the plain bound:
64 rows of the forward and of d lhs, from a few groups, and a subsampled [64, 64] block of d
rhs for a few groups.

With OXMOE_TEST_GPU_STAND_IN=cpu (devices.py) the tests run on a CPU device at a fraction of
the size (M / 64, K and N / 16), which checks the tests' own logic only.
"""

import functools
import gc
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ragged_dot_checks as checks
import ragged_dot_reference as ref
from oxmoe import grouped_gemm
from oxmoe.model_shapes import EXPERT_GEMMS, QWEN3_30B_A3B_LAYER, GemmShape
from test_permutation_gpu import run_poisoned
from test_ragged_dot_activation import check_hidden
from test_ragged_dot_values import (EDGE_CASES, EMPTY_DIMENSION_CASES, SMALL_SHAPES, WINDOW_OFFSETS, describe,
                                    edge_sizes, offset_array)

GPUS = devices.gpu_devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)]

STAND_IN = os.environ.get(devices.GPU_STAND_IN_ENV) == "cpu"
HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32
LAYOUTS = pytest.mark.parametrize("rhs_transposed", [False, True], ids=["rhs_KN", "rhs_NK"])

# (shape, M at full size).
FULL_SIZE = [(shape, shape.m) for shape in EXPERT_GEMMS]
# Per shape, (dtype, rhs layout, group size draw): each shape sees both dtypes, both layouts and
# both draws (every dtype-layout pair of the tensor-core kernel is also crossed below, at
# smaller sizes). Each case compiles its own references (a few seconds of XLA time), which
# is what bounds the count here: (bf16, NK) and (f16, KN) are the two to add with more time.
FULL_SIZE_VARIANTS = [(jnp.bfloat16, False, "dirichlet"), (jnp.float16, True, "empty10")]
# The float64 check: rows (forward, d lhs) and d rhs blocks from this many groups.
SAMPLE_GROUPS, SAMPLE_ROWS, SAMPLE_KN = 4, 64, 64


def scaled(shape: GemmShape, m: int) -> tuple[int, int, int, int]:
    """(M, K, N, G) to run: full size, or the stand-in's fraction."""
    if STAND_IN:
        return m // 64, max(shape.k // 16, 8), max(shape.n // 16, 8), shape.groups
    return m, shape.k, shape.n, shape.groups


def full_size_cases():
    cases = []
    for shape, m in FULL_SIZE:
        for dtype, transposed, draw in FULL_SIZE_VARIANTS:
            mm, k, n, g = scaled(shape, m)
            cases.append(pytest.param(shape, m, dtype, transposed, draw,
                                      id=f"{shape.name}-M{mm}-{jnp.dtype(dtype).name}-{'NK' if transposed else 'KN'}"
                                         f"-{draw}"))
    return cases


# -- helpers --------------------------------------------------------------------------


def run_on(device, fn, *args):
    """jax.jit(fn) with every input committed to `device`; the outputs as NumPy arrays, after
    checking that they were computed there."""
    out = jax.jit(fn)(*jax.device_put(args, device))
    for leaf in jax.tree.leaves(out):
        assert leaf.devices() == {device}, f"an output is on {leaf.devices()}, expected {device}"
    return jax.tree.map(np.asarray, out)


_HALF_BITS = {jnp.dtype(jnp.bfloat16): (0x81FF, 124 << 7), jnp.dtype(jnp.float16): (0x8FFF, 12 << 10)}


def _draw_bits(key, shape, dtype):
    """checks.draw's distribution made on the device: random sign, exponent among four binades,
    random mantissa (|x| in [1/8, 2), zero mean), directly in the dtype."""
    dt = jnp.dtype(dtype)
    if dt == jnp.float32:
        bits = (jax.random.bits(key, shape, jnp.uint32) & jnp.uint32(0x81FFFFFF)) + jnp.uint32(124 << 23)
    else:
        keep, exponent = _HALF_BITS[dt]
        bits = (jax.random.bits(key, shape, jnp.uint16) & jnp.uint16(keep)) + jnp.uint16(exponent)
    return jax.lax.bitcast_convert_type(bits, dt)


@functools.partial(jax.jit, static_argnames=("shapes", "dtype"))
def device_draws(key, *, shapes, dtype):
    """One array of each shape (on the key's device)."""
    return tuple(_draw_bits(k, s, dtype) for k, s in zip(jax.random.split(key, len(shapes)), shapes))


def bucket(n: int) -> int:
    """The row block the reference slices per group: a power of two >= n (few distinct compiles)."""
    return max(8, 1 << max(int(n) - 1, 0).bit_length())


def grouped_reference(lhs, rhs, starts, sizes, *, block, rhs_transposed):
    """Per group g, in float32 with precision HIGHEST: rows [starts[g], starts[g] + sizes[g]) of
    lhs times rhs[g] (rhs[g].T), and the same product of |lhs| and |rhs| (the error scale); other
    rows zero. Each group's rows are a `block`-row slice (>= its size) masked to its size."""
    m = lhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    padded = jnp.pad(lhs.astype(F32), ((0, block), (0, 0)))
    keep = jnp.arange(block)[:, None]

    def group(g, carry):
        value, scale = carry
        rows = jax.lax.dynamic_slice_in_dim(padded, starts[g], block)
        w = rhs[g].astype(F32)
        w = w.T if rhs_transposed else w
        mask = keep < sizes[g]
        v = jnp.where(mask, jnp.dot(rows, w, precision=HIGHEST), 0.0)
        s = jnp.where(mask, jnp.dot(jnp.abs(rows), jnp.abs(w), precision=HIGHEST), 0.0)
        add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            acc, jax.lax.dynamic_slice_in_dim(acc, starts[g], block) + x, starts[g], 0)
        return add(value, v), add(scale, s)

    zeros = jnp.zeros((m + block, n), F32)
    value, scale = jax.lax.fori_loop(0, sizes.shape[0], group, (zeros, zeros))
    return value[:m], scale[:m]


def transposed_reference(lhs, rhs, starts, sizes, *, block, transpose_out):
    """Per group g, in float32 with precision HIGHEST: lhs_g.T @ rhs_g ([G, K, N]; [G, N, K]
    with transpose_out) and the same of |lhs|, |rhs|."""
    pad = lambda x: jnp.pad(x.astype(F32), ((0, block), (0, 0)))  # noqa: E731
    a_all, b_all = pad(lhs), pad(rhs)
    keep = jnp.arange(block)[:, None]

    def group(g):
        mask = keep < sizes[g]
        a = jnp.where(mask, jax.lax.dynamic_slice_in_dim(a_all, starts[g], block), 0.0)
        b = jnp.where(mask, jax.lax.dynamic_slice_in_dim(b_all, starts[g], block), 0.0)
        if transpose_out:
            a, b = b, a
        return (jnp.dot(a.T, b, precision=HIGHEST), jnp.dot(jnp.abs(a).T, jnp.abs(b), precision=HIGHEST))

    return jax.lax.map(group, jnp.arange(sizes.shape[0]))


def violations(got, value, scale, acc_len, zero, *, eps_out, tiny):
    """How many elements are off by more than twice the accumulation bound (the float32
    reference errs too) or non-zero where they must be zero; the worst one and the first
    non-zero one (flat index, got, reference value), and the worst ratio to the bound."""
    g = got.astype(F32)
    allowed = eps_out * jnp.abs(value) + 2 * checks.C * checks.EPS_ACC * jnp.sqrt(jnp.asarray(acc_len, F32)) * scale + tiny
    error = jnp.abs(g - value)
    bad = ~(error <= allowed)
    ratio = jnp.where(bad & ~jnp.isfinite(error), jnp.inf, error / allowed).ravel()
    nonzero = (jnp.broadcast_to(zero, g.shape) & (g != 0)).ravel()
    worst, first = jnp.argmax(ratio), jnp.argmax(nonzero)
    flat_got, flat_value = g.ravel(), value.ravel()
    return dict(num_bad=bad.sum(), worst=worst, worst_ratio=ratio[worst], worst_got=flat_got[worst],
                worst_value=flat_value[worst], num_nonzero=nonzero.sum(), first_nonzero=first,
                first_nonzero_got=flat_got[first])


def ragged_dot_violations(got, lhs, rhs, starts, sizes, zero, *, block, rhs_transposed, eps_out, tiny):
    """`got` (ragged_dot(lhs, rhs) or a d lhs) against grouped_reference."""
    value, scale = grouped_reference(lhs, rhs, starts, sizes, block=block, rhs_transposed=rhs_transposed)
    return violations(got, value, scale, lhs.shape[1], zero, eps_out=eps_out, tiny=tiny)


def transposed_violations(got, lhs, rhs, starts, sizes, *, block, transpose_out, eps_out, tiny):
    """`got` (a d rhs) against transposed_reference; empty groups must be zero."""
    value, scale = transposed_reference(lhs, rhs, starts, sizes, block=block, transpose_out=transpose_out)
    acc_len = sizes[:, None, None]
    return violations(got, value, scale, acc_len, acc_len == 0, eps_out=eps_out, tiny=tiny)


def assert_no_violations(found, shape, dtype, *, what: str, context: str) -> None:
    found = jax.device_get(found)

    def at(flat, got, value=None):
        index = tuple(int(i) for i in np.unravel_index(int(flat), shape))
        return f"{index}: got {float(got)!r}" + ("" if value is None else f", float32 reference {float(value)!r}")

    assert found["num_nonzero"] == 0, (
        f"{what}: {int(found['num_nonzero'])} elements that must be exactly zero are not, first "
        f"{at(found['first_nonzero'], found['first_nonzero_got'])} ({context})")
    assert found["num_bad"] == 0, (
        f"{what}: {int(found['num_bad'])} of {math.prod(shape)} elements off by more than twice the float32 "
        f"accumulation bound from the float32 HIGHEST reference; worst {float(found['worst_ratio']):.3g}x the bound "
        f"at {at(found['worst'], found['worst_got'], found['worst_value'])} ({context})")


def starts_of(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)


def pad_to(indices: np.ndarray, length: int) -> np.ndarray:
    """indices repeated at their last entry up to `length` (fixed shapes: one compile)."""
    return np.concatenate([indices, np.full(length - len(indices), indices[-1])]).astype(np.int32)


def gather_sample(out, d_lhs, d_rhs, lhs, rhs, dout, sample, *, rhs_transposed):
    """What the float64 check needs (rows, groups, subsampled blocks: fixed shapes)."""
    rows, groups, block_groups, group_rows, ks, ns = sample
    a = lhs[group_rows[:, :, None], ks[None, None, :]]  # [3, R, 64]
    b = dout[group_rows[:, :, None], ns[None, None, :]]
    d = d_rhs[block_groups]
    d = d[:, ns][:, :, ks] if rhs_transposed else d[:, ks][:, :, ns]
    return dict(out=out[rows], d_lhs=d_lhs[rows], lhs=lhs[rows], dout=dout[rows], rhs=rhs[groups], a=a, b=b, d_rhs=d)


def check_all(out, d_lhs, d_rhs, lhs, rhs, dout, starts, sizes, tail, sample, *, rhs_transposed, block, eps_out, tiny):
    """Every check of a full-size case in one device computation (one compilation): the
    violations of the forward, d lhs and d rhs, and the float64 check's sample."""
    bounds = dict(block=block, eps_out=eps_out, tiny=tiny)
    return (ragged_dot_violations(out, lhs, rhs, starts, sizes, tail, rhs_transposed=rhs_transposed, **bounds),
            ragged_dot_violations(d_lhs, dout, rhs, starts, sizes, tail, rhs_transposed=not rhs_transposed, **bounds),
            transposed_violations(d_rhs, lhs, dout, starts, sizes, transpose_out=rhs_transposed, **bounds),
            gather_sample(out, d_lhs, d_rhs, lhs, rhs, dout, sample, rhs_transposed=rhs_transposed))


def compile_without_autotuning(fn, *args, **static):
    """jax.jit(fn) compiled for these arguments with XLA's GEMM autotuning off: the reference's
    float32 dots need no fast kernel, and autotuning each case's shapes would cost more GPU
    time than running them."""
    jitted = jax.jit(fn, static_argnames=tuple(static))
    return jitted.lower(*args, **static).compile(compiler_options={"xla_gpu_autotune_level": 0})


def draw_sample(rng, sizes, k: int, n: int):
    """SAMPLE_ROWS rows from SAMPLE_GROUPS non-empty groups (sorted, grouped), three of those
    groups' rows, SAMPLE_KN columns of K and of N: the float64 check's indices (fixed shapes),
    and what is needed to read them back."""
    starts = starts_of(sizes)
    nonempty = np.flatnonzero(sizes > 0)
    groups = np.sort(rng.choice(nonempty, min(SAMPLE_GROUPS, len(nonempty)), replace=False))
    rows, counts = [], []
    for g in groups:
        take = min(int(sizes[g]), SAMPLE_ROWS // len(groups))
        rows.append(starts[g] + np.sort(rng.choice(int(sizes[g]), take, replace=False)))
        counts.append(take)
    rows, counts = np.concatenate(rows), np.array(counts, np.int32)
    block_groups = groups[:3]
    longest = bucket(sizes[block_groups].max())
    group_rows = np.stack([pad_to(np.arange(starts[g], starts[g] + sizes[g]), longest) for g in block_groups])
    ks = np.sort(rng.choice(k, min(k, SAMPLE_KN), replace=False)).astype(np.int32)
    ns = np.sort(rng.choice(n, min(n, SAMPLE_KN), replace=False)).astype(np.int32)
    indices = (pad_to(rows, SAMPLE_ROWS), pad_to(groups, SAMPLE_GROUPS), pad_to(block_groups, 3), group_rows, ks, ns)
    return indices, dict(num_rows=len(rows), groups=groups, counts=counts, block_groups=block_groups, ks=ks, ns=ns)


def check_float64_sample(got, sample, sizes, *, rhs_transposed, dtype, context):
    """The forward and d lhs on the sampled rows, d rhs on [64, 64] blocks of three of the
    sampled groups, against the float64 reference."""
    r, groups = sample["num_rows"], sample["groups"]
    sample_context = f"{context}, sampled groups {groups.tolist()}"
    checks.assert_gemm_close(got["out"][:r], ref.ragged_dot(got["lhs"][:r], got["rhs"][:len(groups)], sample["counts"],
                                                         rhs_transposed=rhs_transposed),
                          dtype, what="forward (sampled rows, float64)", context=sample_context)
    # d lhs = d out_g @ rhs[g].T: the same product with rhs read the other way round.
    checks.assert_gemm_close(got["d_lhs"][:r], ref.ragged_dot(got["dout"][:r], got["rhs"][:len(groups)], sample["counts"],
                                                           rhs_transposed=not rhs_transposed),
                          dtype, what="d lhs (sampled rows, float64)", context=sample_context)
    for i, g in enumerate(sample["block_groups"]):
        size = int(sizes[g])
        expected = ref.transposed_ragged_dot(got["a"][i, :size], got["b"][i, :size], np.array([size], np.int32))
        block = got["d_rhs"][i].T if rhs_transposed else got["d_rhs"][i]
        checks.assert_gemm_close(block[None], expected, dtype,
                              what=f"d rhs[{g}] (rows {sample['ks'][:4].tolist()}..., columns "
                                   f"{sample['ns'][:4].tolist()}..., float64)", context=sample_context)


# -- full size ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape, full_m, dtype, rhs_transposed, draw_kind", full_size_cases())
def test_full_size_forward_and_vjp_match_the_references(shape, full_m, dtype, rhs_transposed, draw_kind, gpu, seed,
                                                        rng):
    m, k, n, g = scaled(shape, full_m)
    total = m if draw_kind == "dirichlet" else m - int(rng.integers(1, m // 50 + 2))  # a tail of rows in no group
    sizes = checks.group_size_draw(rng, draw_kind, g, total)
    if draw_kind == "empty10":
        assert (sizes == 0).any() and total < m
    layout = "[G, N, K]" if rhs_transposed else "[G, K, N]"
    context = (f"{shape.name}, M={m}, K={k}, N={n}, {jnp.dtype(dtype).name}, rhs {layout}, {draw_kind}, "
               f"total {total}, {describe(sizes)}, seed={seed}")
    rhs_shape = (g, n, k) if rhs_transposed else (g, k, n)
    sizes_d, starts_d = jax.device_put((sizes, starts_of(sizes)), gpu)

    @jax.jit
    def draw_and_run(key, sizes):
        lhs, rhs, dout = device_draws(key, shapes=((m, k), rhs_shape, (m, n)), dtype=dtype)
        out, vjp = jax.vjp(lambda l, r: grouped_gemm.ragged_dot(l, r, sizes, rhs_transposed=rhs_transposed), lhs, rhs)
        return (lhs, rhs, dout, out, *vjp(dout))

    lhs, rhs, dout, out, d_lhs, d_rhs = draw_and_run(jax.device_put(jax.random.key(seed), gpu), sizes_d)
    for name, x in (("out", out), ("d lhs", d_lhs), ("d rhs", d_rhs)):
        assert x.devices() == {gpu}, f"{name} is on {x.devices()} ({context})"
        assert x.dtype == jnp.dtype(dtype), f"{name}: dtype {x.dtype} ({context})"
    assert out.shape == (m, n) and d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape, context

    indices, sample = draw_sample(rng, sizes, k, n)
    args = (out, d_lhs, d_rhs, lhs, rhs, dout, starts_d, sizes_d, jax.device_put((np.arange(m) >= total)[:, None], gpu),
            jax.device_put(indices, gpu))
    static = dict(rhs_transposed=rhs_transposed, block=bucket(sizes.max()), eps_out=checks.eps_out(dtype),
                  tiny=checks.tiny_out(dtype))
    found_out, found_d_lhs, found_d_rhs, gathered = compile_without_autotuning(check_all, *args, **static)(*args)
    assert_no_violations(found_out, out.shape, dtype, what="forward", context=context)
    assert_no_violations(found_d_lhs, d_lhs.shape, dtype, what="d lhs", context=context)
    assert_no_violations(found_d_rhs, d_rhs.shape, dtype, what="d rhs", context=context)
    del out, d_lhs, d_rhs, lhs, rhs, dout, args
    check_float64_sample(jax.device_get(gathered), sample, sizes, rhs_transposed=rhs_transposed, dtype=dtype,
                         context=context)
    gc.collect()


# -- small shapes, both kernels --------------------------------------------------------


def forward_and_vjp_fn(rhs_transposed, pref=None):
    def fn(lhs, rhs, sizes, offset, dout):
        out, vjp = jax.vjp(lambda l, r: grouped_gemm.ragged_dot(l, r, sizes, group_offset=offset,
                                                                 rhs_transposed=rhs_transposed,
                                                                 preferred_element_type=pref), lhs, rhs)
        return (out, *vjp(dout))

    return fn


def check_forward_and_vjp(gpu, rng, lhs, rhs, sizes, g0, *, rhs_transposed, context, pref=None):
    """ragged_dot and its vjp (for a random cotangent) on the GPU against the float64 reference."""
    m = lhs.shape[0]
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    out_dtype = checks.np_dtype(lhs.dtype if pref is None else pref)
    dout = checks.draw(rng, (m, n), out_dtype)
    offset = offset_array(g0)
    out, d_lhs, d_rhs = run_on(gpu, forward_and_vjp_fn(rhs_transposed, pref), lhs, rhs, sizes, offset, dout)
    checks.assert_gemm_close(out, ref.ragged_dot(lhs, rhs, sizes, group_offset=offset, rhs_transposed=rhs_transposed),
                          out_dtype, what="GPU forward", context=context)
    e_lhs, e_rhs = ref.ragged_dot_backward(lhs, rhs, sizes, dout.astype(lhs.dtype), group_offset=offset,
                                           rhs_transposed=rhs_transposed)
    checks.assert_gemm_close(d_lhs, e_lhs, lhs.dtype, what="GPU d lhs", context=context)
    checks.assert_gemm_close(d_rhs, e_rhs, lhs.dtype, what="GPU d rhs", context=context)


def draw_rhs(rng, num_local, k, n, dtype, rhs_transposed):
    return checks.draw(rng, (num_local, n, k) if rhs_transposed else (num_local, k, n), dtype)


@pytest.mark.parametrize("m, k, n, g", SMALL_SHAPES, ids=[f"M{m}_K{k}_N{n}_G{g}" for m, k, n, g in SMALL_SHAPES])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@LAYOUTS
def test_small_odd_shapes_on_gpu(m, k, n, g, dtype, rhs_transposed, gpu, seed, rng):
    total = m - int(rng.integers(0, min(4, m) + 1))
    sizes = checks.group_size_draw(rng, ["dirichlet", "empty10"][int(rng.integers(2))], g, total)
    lhs, rhs = checks.draw(rng, (m, k), dtype), draw_rhs(rng, g, k, n, dtype, rhs_transposed)
    check_forward_and_vjp(gpu, rng, lhs, rhs, sizes, None, rhs_transposed=rhs_transposed,
                          context=f"{describe(sizes)}, seed={seed}")


# Shapes the tensor-core kernel takes (half types, K and N multiples of 8), with groups that
# start and end inside, at and across 64- and 128-row tiles, K and N not multiples of a tile,
# and N of an odd and of an even number of column tiles (two blocks share the rows' tiles).
TILE_SIZES = np.array([1, 63, 64, 65, 0, 127, 128, 129, 255, 7], np.int32)  # 839 rows
TILE_SHAPES = [(1000, 72, 200), (839, 8, 8), (900, 1024, 24), (860, 256, 4104), (839, 200, 1000)]


@pytest.mark.parametrize("m, k, n", TILE_SHAPES, ids=[f"M{m}_K{k}_N{n}" for m, k, n in TILE_SHAPES])
@pytest.mark.parametrize("dtype, pref", [(jnp.bfloat16, None), (jnp.float16, None), (jnp.bfloat16, jnp.float32)],
                         ids=["bf16", "f16", "bf16_out_f32"])
@LAYOUTS
def test_tensor_core_shapes_with_groups_across_tiles_on_gpu(m, k, n, dtype, pref, rhs_transposed, gpu, seed, rng):
    sizes = rng.permutation(TILE_SIZES).astype(np.int32)
    lhs, rhs = checks.draw(rng, (m, k), dtype), draw_rhs(rng, len(sizes), k, n, dtype, rhs_transposed)
    check_forward_and_vjp(gpu, rng, lhs, rhs, sizes, None, rhs_transposed=rhs_transposed, pref=pref,
                          context=f"{describe(sizes)}, seed={seed}")


# (dtype, K, N, rhs_transposed): the generic kernel (float32, odd N) and the tensor-core one
# (N of one column tile, and of two: two blocks sharing the rows' tiles).
KERNEL_VARIANTS = pytest.mark.parametrize("dtype, k, n, rhs_transposed", [
    (jnp.float32, 24, 19, False), (jnp.bfloat16, 64, 128, False), (jnp.float16, 64, 96, True),
    (jnp.bfloat16, 72, 512, True)],
    ids=["f32_KN", "bf16_tc_KN", "f16_tc_NK", "bf16_tc_NK_two_tiles"])


@pytest.mark.parametrize("case", EDGE_CASES)
@KERNEL_VARIANTS
def test_group_structure_on_gpu(case, dtype, k, n, rhs_transposed, gpu, seed, rng):
    sizes = edge_sizes(case, rng)
    lhs, rhs = checks.draw(rng, (41, k), dtype), draw_rhs(rng, 6, k, n, dtype, rhs_transposed)
    check_forward_and_vjp(gpu, rng, lhs, rhs, sizes, None, rhs_transposed=rhs_transposed,
                          context=f"{case}, {describe(sizes)}, seed={seed}")


@pytest.mark.parametrize("g0", WINDOW_OFFSETS, ids=lambda g: f"g0_{g}")
@KERNEL_VARIANTS
def test_window_of_groups_on_gpu(g0, dtype, k, n, rhs_transposed, gpu, seed, rng):
    m = 300
    sizes = checks.sizes_with_empty_groups(rng, 8, m - 3, fraction=0.25)
    lhs, rhs = checks.draw(rng, (m, k), dtype), draw_rhs(rng, 3, k, n, dtype, rhs_transposed)
    check_forward_and_vjp(gpu, rng, lhs, rhs, sizes, g0, rhs_transposed=rhs_transposed,
                          context=f"g0={g0}, {describe(sizes)}, seed={seed}")


@pytest.mark.parametrize("g0", [0, 5, 8], ids=lambda g: f"g0_{g}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16_tc"])
def test_transposed_ragged_dot_window_on_gpu(g0, dtype, gpu, seed, rng):
    m, k, n = 700, 64, 80
    sizes = checks.sizes_with_empty_groups(rng, 8, m - 9, fraction=0.25)
    lhs, rhs = checks.draw(rng, (m, k), dtype), checks.draw(rng, (m, n), dtype)
    out = run_on(gpu, lambda a, b, s, o: grouped_gemm.transposed_ragged_dot(a, b, s, num_groups=3, group_offset=o),
                 lhs, rhs, sizes, offset_array(g0))
    checks.assert_gemm_close(out, ref.transposed_ragged_dot(lhs, rhs, sizes, num_groups=3, group_offset=[g0]), dtype,
                          what="GPU transposed_ragged_dot", context=f"g0={g0}, {describe(sizes)}, seed={seed}")


# (rows of each chunk, K, N, G, dtype): the generic kernel (float32, odd N), the tensor-core
# one with groups across its 64-row boxes, an empty chunk, the most chunks, a layer's size.
CHUNK_CASES = [((300, 0, 211), 24, 19, 6, jnp.float32), ((839, 513), 72, 200, 10, jnp.bfloat16),
               ((64, 65, 1, 127, 128, 129, 0, 255), 64, 96, 3, jnp.float16),
               ((6000, 5800), 512, 768, 8, jnp.bfloat16)]


@pytest.mark.parametrize("rows, k, n, g, dtype", CHUNK_CASES,
                         ids=[f"chunks{len(c[0])}_K{c[1]}_N{c[2]}_{jnp.dtype(c[4]).name}" for c in CHUNK_CASES])
def test_transposed_ragged_dot_in_chunks_on_gpu(rows, k, n, g, dtype, gpu, seed, rng):
    lhs = [checks.draw(rng, (m, k), dtype) for m in rows]
    rhs = [checks.draw(rng, (m, n), dtype) for m in rows]
    sizes = np.stack([checks.sizes_with_empty_groups(rng, g, m - int(rng.integers(0, min(3, m) + 1)), fraction=0.2)
                      for m in rows]).astype(np.int32)
    g0 = int(rng.integers(0, 2))
    out = run_on(gpu, lambda a, b, s, o: grouped_gemm.transposed_ragged_dot(a, b, s, num_groups=g - 1, group_offset=o),
                 lhs, rhs, sizes, offset_array(g0))
    checks.assert_gemm_close(out, ref.chunked_transposed_ragged_dot(lhs, rhs, sizes, num_groups=g - 1,
                                                                    group_offset=[g0]),
                             dtype, what="GPU transposed_ragged_dot in chunks",
                             context=f"rows {rows}, g0={g0}, sizes {sizes.tolist() if g <= 10 else sizes.shape}, "
                                     f"seed={seed}")


@pytest.mark.parametrize("num_groups", [1024, 1100], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_many_groups_on_gpu(num_groups, dtype, gpu, seed, rng):
    # The tensor-core kernel keeps up to 1024 groups' bounds in shared memory; more take the
    # generic kernel. Most groups hold a row or two, many none.
    m, k, n = 3000, 64, 136
    sizes = checks.sizes_with_empty_groups(rng, num_groups, m - 17, fraction=0.3)
    lhs, rhs = checks.draw(rng, (m, k), dtype), draw_rhs(rng, num_groups, k, n, dtype, False)
    check_forward_and_vjp(gpu, rng, lhs, rhs, sizes, None, rhs_transposed=False,
                          context=f"G={num_groups}, {int((sizes == 0).sum())} empty groups, seed={seed}")


@pytest.mark.parametrize("case", EMPTY_DIMENSION_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_empty_dimensions_on_gpu(case, dtype, gpu, seed, rng):
    # K = 0 and N = 0 are multiples of 8: the tensor-core kernel's shapes.
    m, k, n, g_local, g0 = EMPTY_DIMENSION_CASES[case]
    sizes = checks.dirichlet_sizes(rng, 4, m)
    lhs, grad = checks.draw(rng, (m, k), dtype), checks.draw(rng, (m, n), dtype)
    rhs = draw_rhs(rng, g_local, k, n, dtype, False)
    offset = offset_array(g0)
    out, t = run_on(gpu, lambda a, b, c, s, o: (grouped_gemm.ragged_dot(a, b, s, group_offset=o),
                                                grouped_gemm.transposed_ragged_dot(a, c, s, num_groups=g_local,
                                                                                   group_offset=o)),
                    lhs, rhs, grad, sizes, offset)
    context = f"{case}, {describe(sizes)}, seed={seed}"
    checks.assert_gemm_close(out, ref.ragged_dot(lhs, rhs, sizes, group_offset=offset), dtype, what="GPU ragged_dot",
                          context=context)
    checks.assert_gemm_close(t, ref.transposed_ragged_dot(lhs, grad, sizes, num_groups=g_local, group_offset=offset),
                          dtype, what="GPU transposed_ragged_dot", context=context)


# -- jit: new group sizes, no recompilation ---------------------------------------------


def test_ragged_dot_under_jit_takes_new_group_sizes_without_recompiling(gpu, seed, rng):
    m, k, n, g = (4096, 512, 256, 16) if not STAND_IN else (512, 64, 32, 16)
    traces = []

    @jax.jit
    def fn(lhs, rhs, sizes):
        traces.append(1)
        return grouped_gemm.ragged_dot(lhs, rhs, sizes)

    lhs, rhs = checks.draw(rng, (m, k), jnp.bfloat16), checks.draw(rng, (g, k, n), jnp.bfloat16)
    lhs_d, rhs_d = jax.device_put((lhs, rhs), gpu)
    all_sizes = [checks.dirichlet_sizes(rng, g, m), checks.sizes_with_empty_groups(rng, g, m - 100)]
    on_device = [jax.device_put(s, gpu) for s in all_sizes]
    with jax.transfer_guard("disallow"):  # every input already on the GPU: nothing moves
        outs = [fn(lhs_d, rhs_d, s) for s in on_device]
    assert len(traces) == 1, f"traced {len(traces)} times for two calls with new group sizes"
    for sizes, out in zip(all_sizes, outs):
        assert out.devices() == {gpu}
        checks.assert_gemm_close(out, ref.ragged_dot(lhs, rhs, sizes), jnp.bfloat16, what="jit ragged_dot",
                              context=f"{describe(sizes)}, seed={seed}")


# -- poison: outputs placed in memory that was just full of NaN --------------------------


def test_rows_and_groups_outside_the_window_are_zero_in_poisoned_memory(gpu, seed, rng):
    m, k, n, g = (8192, 512, 1024, 8) if not STAND_IN else (512, 64, 64, 8)
    sizes = checks.sizes_with_empty_groups(rng, g, m - m // 12, fraction=0.25)
    g0 = 2
    lhs, rhs, dout = (checks.draw(rng, (m, k), jnp.bfloat16), checks.draw(rng, (4, k, n), jnp.bfloat16),
                      checks.draw(rng, (m, n), jnp.bfloat16))

    def fn(lhs, rhs, sizes, offset, dout):
        # Groups 2..5: rows of groups 0, 1, 6, 7 and the tail stay zero; the window reaching
        # past G (offset 6, two of four local groups past G) gives zero blocks of d rhs.
        out = grouped_gemm.ragged_dot(lhs, rhs, sizes, group_offset=offset)
        t = grouped_gemm.transposed_ragged_dot(lhs, dout, sizes, num_groups=4, group_offset=offset + 4)
        return out, t

    out, t = run_poisoned(gpu, fn, lhs, rhs, sizes, offset_array(g0), dout)
    context = f"{describe(sizes)}, seed={seed}"
    checks.assert_gemm_close(out, ref.ragged_dot(lhs, rhs, sizes, group_offset=[g0]), jnp.bfloat16,
                          what="ragged_dot on poisoned memory", context=context)
    checks.assert_gemm_close(t, ref.transposed_ragged_dot(lhs, dout, sizes, num_groups=4, group_offset=[g0 + 4]),
                          jnp.bfloat16, what="transposed_ragged_dot on poisoned memory", context=context)


# -- rows outside the window left unwritten (zero_unused_rows=False) ----------------------


def expert_parallel_window(rng, shape: GemmShape):
    """An expert-parallel rank's call at `shape` (scaled): its G local groups the middle ones of
    2G (other ranks' groups before and after them, a tenth of all empty), over all but an eighth
    of the rows (a tail in no group). Returns (M, K, N, G, group_sizes, group_offset, [M] bool:
    the window's rows)."""
    m, k, n, local = scaled(shape, shape.m)
    sizes = checks.sizes_with_empty_groups(rng, 2 * local, m - m // 8)
    offset = offset_array(local // 2)
    covered = ref.rows_in_window(m, sizes, local, offset)
    rows = np.flatnonzero(covered)
    assert rows.size and rows[0] > 0 and rows[-1] < m - 1, f"{describe(sizes)}: no rows before or after the window"
    return m, k, n, local, sizes, offset, covered


def window_differences(got, default, covered):
    """On the device: the elements of the window's rows (`covered`, [M] bool) whose bits differ
    between `got` and `default`, and those outside the window that are not zero in `default`."""
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731 (16-bit results)
    inside = covered[:, None]
    return jnp.sum(inside & (bits(got) != bits(default))), jnp.sum(~inside & (default != 0))


def assert_window_as_default(found, *, what: str, context: str) -> None:
    differ, nonzero = (int(x) for x in jax.device_get(found))
    assert differ == 0, f"{what}: {differ} elements of the window's rows differ from the default call's ({context})"
    assert nonzero == 0, f"{what}: {nonzero} elements outside the window are not zero in the default call ({context})"


def sample_window_rows(rng, sizes, g0: int, local: int, per_group: int = 32):
    """Up to `per_group` rows of each of two non-empty groups of the window, in order: (rows, the
    two local groups, their rows' counts)."""
    starts = starts_of(sizes)
    groups = np.sort(rng.choice([i for i in range(local) if sizes[g0 + i] > 0], 2, replace=False))
    picks = [starts[g0 + i] + np.sort(rng.choice(sizes[g0 + i], min(per_group, sizes[g0 + i]), replace=False))
             for i in groups]
    return np.concatenate(picks), groups, np.array([len(p) for p in picks], np.int32)


@LAYOUTS
def test_rows_left_unwritten_change_no_row_of_the_window_on_gpu(rhs_transposed, gpu, seed, rng):
    """DeepSeek-V3's down projection on one expert-parallel rank of 8, at full size, its groups a
    window: with zero_unused_rows=False (where the tensor-core kernel's walk ends with the
    groups' tiles) the window's rows are the default call's bit for bit, and 64 of them within
    the float64 reference's bound; the default call's other rows are zero."""
    shape = EXPERT_GEMMS[3]
    m, k, n, local, sizes, offset, covered = expert_parallel_window(rng, shape)
    rhs_shape = (local, n, k) if rhs_transposed else (local, k, n)
    context = f"{shape.name}, M={m}, K={k}, N={n}, rhs {rhs_shape}, g0={offset[0]}, {describe(sizes)}, seed={seed}"

    @jax.jit
    def run(key, sizes, offset, covered):
        lhs, rhs = device_draws(key, shapes=((m, k), rhs_shape), dtype=jnp.bfloat16)
        product = functools.partial(grouped_gemm.ragged_dot, lhs, rhs, sizes, group_offset=offset,
                                    rhs_transposed=rhs_transposed)
        out = product(zero_unused_rows=False)
        return window_differences(out, product(), covered), lhs, rhs, out

    found, lhs, rhs, out = run(*jax.device_put((jax.random.key(seed), sizes, offset, covered), gpu))
    assert_window_as_default(found, what="ragged_dot", context=context)
    rows, groups, counts = sample_window_rows(rng, sizes, int(offset[0]), local)
    expected = ref.ragged_dot(np.asarray(lhs[rows]), np.asarray(rhs[groups]), counts, rhs_transposed=rhs_transposed)
    checks.assert_gemm_close(np.asarray(out[rows]), expected, jnp.bfloat16,
                             what=f"ragged_dot(zero_unused_rows=False), rows of local groups {groups.tolist()}",
                             context=context)


def test_ragged_dot_activation_rows_left_unwritten_change_no_row_of_the_window_on_gpu(gpu, seed, rng):
    """Qwen3-30B-A3B's up projection and SwiGLU on one expert-parallel rank of 2, at full size,
    its groups a window: with zero_unused_rows=False both results' window rows are the default
    call's bit for bit, and the hidden activation of 512 of them within the float64 reference's
    bound; the default call's other rows are zero in both."""
    shape = QWEN3_30B_A3B_LAYER.up_gemm(2)
    m, k, features, local, sizes, offset, covered = expert_parallel_window(rng, shape)
    context = f"{shape.name}, M={m}, K={k}, F={features}, g0={offset[0]}, {describe(sizes)}, seed={seed}"

    @jax.jit
    def run(key, sizes, offset, covered):
        lhs, rhs = device_draws(key, shapes=((m, k), (local, k, 2 * features)), dtype=jnp.bfloat16)
        rhs = (rhs.astype(F32) * (3.0 / math.sqrt(k))).astype(jnp.bfloat16)  # products across SiLU's bend
        call = functools.partial(grouped_gemm.ragged_dot_activation, lhs, rhs, sizes, "swiglu", group_offset=offset)
        unwritten = call(zero_unused_rows=False)
        return [window_differences(u, d, covered) for u, d in zip(unwritten, call())], unwritten

    found, (pre, hidden) = run(*jax.device_put((jax.random.key(seed), sizes, offset, covered), gpu))
    for name, result in zip(("pre_activation", "hidden"), found):
        assert_window_as_default(result, what=f"ragged_dot_activation's {name}", context=context)
    rows = np.sort(rng.choice(np.flatnonzero(covered), min(512, int(covered.sum())), replace=False))
    check_hidden(np.asarray(hidden[rows]), np.asarray(pre[rows]), "swiglu", np.zeros(rows.size, bool), context)
