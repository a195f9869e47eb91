"""oxmoe.permutation's CUDA kernels at the shapes of real models, checked where only a GPU
can check them. Every test here is marked `gpu` and skipped when jax has no GPU device.

(The rest of the permutation suite also runs on the GPU when it is the default device, e.g.
with JAX_PLATFORMS=cuda,cpu: that checks the kernels on realistic random data against the
float64 reference at small token counts.) This file adds:

- Mixtral (T=32768, H=1024, E=8, k=2), Qwen3-MoE (T=32768, H=2048, E=128, k=8) and
  DeepSeek-V3 (T=32768, H=7168, E=256, k=8; T=8192 in float32 to bound memory), in float32,
  bfloat16 and float16, align_size None / 16 / 128: dispatch, combine, sort_chunks and
  unsort_chunks, forward and backward (vjp), the GPU against the CPU implementation (the
  same oxmoe functions committed to a CPU device) and against the float64 reference;
- a poison test: the memory the outputs land in was just filled with NaN bytes, so padding,
  tail and never-written rows that a kernel forgets to zero show up.

Exact data: the values here lie on grids (k/16 with |k| <= 8 for rows and cotangents, j/16
for weights) on which every float32 sum these functions form is exact, whatever its order.
So there is no tolerance at all: the GPU must equal the CPU implementation bit for bit, and
both must equal the exact float64 value rounded once to the output dtype. A kernel that
accumulates in bf16/f16, reads a wrong row or double-rounds still fails (the partial sums
need more bits than a half type holds). Realistic random data is the other files' job.

Big cotangents and expert outputs are made on the device from an integer hash of their
indices (`hashed_grid`, the same bits in jnp on either device and in NumPy), so the host
never holds them: it recomputes only the rows the reference check samples.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import permutation_checks as checks
import permutation_reference as ref
from oxmoe import permutation
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER, LAYER_SHAPES, MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER

GPUS = devices.gpu_devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)]

# With the CPU stand-in (devices.GPU_STAND_IN_ENV) the tests' logic runs on a CPU-only
# machine at a fraction of the size.
STAND_IN = os.environ.get(devices.GPU_STAND_IN_ENV) == "cpu"
BIG_TOKENS = 1024 if STAND_IN else 32768
DEEPSEEK_F32_TOKENS = 512 if STAND_IN else 8192
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ALIGN_SIZES = [None, 16, 128]
# The routing map of each alignment: every token routed k times; tokens routed to fewer
# (tail rows); a quarter of the experts idle.
VARIANT_OF_ALIGN = {None: "topk", 16: "ragged", 128: "idle_experts"}
# How many tokens (and rows) the float64 reference recomputes per big array.
SAMPLE = 512


def big_cases():
    cases = []
    for model in LAYER_SHAPES:
        for name, dtype in DTYPES.items():
            num_tokens = DEEPSEEK_F32_TOKENS if (model is DEEPSEEK_V3_LAYER and name == "f32") else BIG_TOKENS
            for align_size in ALIGN_SIZES:
                cases.append(pytest.param(model, num_tokens, dtype, align_size,
                                          id=f"{model.name}-T{num_tokens}-{name}-align{align_size}"))
    return cases


BIG_CASES = pytest.mark.parametrize("model, num_tokens, dtype, align_size", big_cases())


# -- exact data -----------------------------------------------------------------------


def hashed_grid(xp, rows, cols, salt: int, dtype):
    """[len(rows), len(cols)] values k/16, k in [-8, 8], from an integer hash of (row, col, salt):
    the same bits from jnp (on any device) and NumPy."""
    u32 = xp.uint32
    r = xp.asarray(rows).astype(u32)[:, None]
    c = xp.asarray(cols).astype(u32)[None, :]
    h = (r * u32(0x9E3779B1)) ^ (c * u32(0x85EBCA77)) ^ u32(salt & 0xFFFFFFFF)
    h = h ^ (h >> u32(15))
    h = h * u32(0x2C1B3C6D)
    h = h ^ (h >> u32(12))
    k = (h % u32(17)).astype(xp.int32) - 8
    return (k.astype(xp.float32) / 16).astype(dtype)


def device_grid(num_rows: int, num_cols: int, salt: int, dtype):
    return hashed_grid(jnp, jnp.arange(num_rows, dtype=jnp.uint32), jnp.arange(num_cols, dtype=jnp.uint32), salt,
                       dtype)


def host_grid(rows, num_cols: int, salt: int, dtype) -> np.ndarray:
    return hashed_grid(np, np.asarray(rows), np.arange(num_cols), salt, np.dtype(jnp.dtype(dtype)))


def grid_tokens(rng, shape, dtype) -> np.ndarray:
    return (rng.integers(-8, 9, shape, dtype=np.int8).astype(np.float32) / 16).astype(np.dtype(jnp.dtype(dtype)))


def grid_weights(rng, shape, dtype) -> np.ndarray:
    """Weights j/16, j in [1, 16]."""
    return (rng.integers(1, 17, shape, dtype=np.int8).astype(np.float32) / 16).astype(np.dtype(jnp.dtype(dtype)))


def test_hashed_grid_is_the_same_in_numpy_and_on_the_gpu(gpu):
    rows, cols = np.array([0, 1, 7, 65535, 294655]), 300
    on_gpu = run_on(gpu, lambda r: hashed_grid(jnp, r, jnp.arange(cols, dtype=jnp.uint32), 12345, jnp.bfloat16),
                    rows.astype(np.uint32))
    checks.assert_bitwise_equal(on_gpu, host_grid(rows, cols, 12345, jnp.bfloat16), what="hashed grid", context="")
    values = np.unique(np.asarray(host_grid(np.arange(1000), 64, 1, jnp.float32)))
    np.testing.assert_array_equal(values, np.arange(-8, 9) / 16)


# -- helpers --------------------------------------------------------------------------


def run_on(device, fn, *args):
    """jax.jit(fn) with every input committed to `device`; the outputs as NumPy arrays, after
    checking that they were computed there."""
    out = jax.jit(fn)(*jax.device_put(args, device))
    for leaf in jax.tree.leaves(out):
        assert leaf.devices() == {device}, f"an output is on {leaf.devices()}, expected {device}"
    return jax.tree.map(np.asarray, out)


def assert_same_bits(gpu_out, cpu_out, *, what: str, context: str, row_chunk: int = 16384) -> None:
    """The GPU's output equals the CPU implementation's bit for bit (a chunk of rows at a time)."""
    for (path, g), c in zip(jax.tree_util.tree_leaves_with_path(gpu_out), jax.tree.leaves(cpu_out)):
        name = f"{what}{jax.tree_util.keystr(path)}"
        assert g.shape == c.shape and g.dtype == c.dtype, f"{name}: GPU {g.dtype}{g.shape}, CPU {c.dtype}{c.shape}"
        for start in range(0, max(g.shape[0], 1), row_chunk):
            checks.assert_bitwise_equal(g[start : start + row_chunk], c[start : start + row_chunk],
                                     what=f"GPU vs CPU {name} rows from {start}", context=context)


def one_nan(a: np.ndarray) -> np.ndarray:
    """``a`` as float32 with every NaN the same NaN: the GPU's arithmetic gives its own NaN bits,
    which a bitwise comparison with the CPU's must not count."""
    a = a.astype(np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a)


def sample_indices(rng, n: int) -> np.ndarray:
    """SAMPLE random indices of range(n), the first and the last included."""
    return np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, SAMPLE)]))


def exact(values_f64: np.ndarray, dtype) -> np.ndarray:
    """An exact float64 value rounded once to dtype (exact in float32 on these grids)."""
    assert np.array_equal(values_f64.astype(np.float32).astype(np.float64), values_f64), "not exact in float32"
    return values_f64.astype(np.float32).astype(np.dtype(jnp.dtype(dtype)))


def inputs(model, num_tokens, dtype, align_size, rng):
    routing_map = checks.routing_map_variant(rng, num_tokens, model.num_experts, model.topk, VARIANT_OF_ALIGN[align_size])
    x = grid_tokens(rng, (num_tokens, model.hidden), dtype)
    probs = grid_weights(rng, routing_map.shape, dtype)
    return x, routing_map, probs


# -- dispatch ------------------------------------------------------------------------

SALT_ROWS, SALT_PROBS, SALT_OUT = 0x51, 0x52, 0x53


def dispatch_fn(topk, align_size):
    def fn(x, routing_map, probs):
        return permutation.dispatch(x, routing_map, probs=probs, topk=topk, align_size=align_size)

    return fn


def dispatch_vjp_fn(topk, align_size):
    """d x and d probs for cotangents made on the device (hashed grids)."""

    def fn(x, routing_map, probs):
        outs, vjp = jax.vjp(lambda x, p: (lambda d: (d.tokens, d.probs))(dispatch_fn(topk, align_size)(x, routing_map, p)),
                            x, probs)
        num_rows, hidden = outs[0].shape
        g_tokens = device_grid(num_rows, hidden, SALT_ROWS, x.dtype)
        g_probs = device_grid(num_rows, 1, SALT_PROBS, probs.dtype)[:, 0]
        return vjp((g_tokens, g_probs))

    return fn


@BIG_CASES
def test_dispatch_and_its_vjp_on_gpu_match_the_cpu_and_the_reference(model, num_tokens, dtype, align_size, gpu, cpu,
                                                                    seed, rng):
    x, routing_map, probs = inputs(model, num_tokens, dtype, align_size, rng)
    context = f"{model.name}, T={num_tokens}, {jnp.dtype(dtype).name}, align_size={align_size}, seed={seed}"
    fn = dispatch_fn(model.topk, align_size)
    gpu_d = run_on(gpu, fn, x, routing_map, probs)
    # Every row against the reference (bit for bit), then against the CPU implementation.
    layout = checks.check_dispatch(gpu_d, x, routing_map, probs, num_out_tokens=num_tokens * model.topk,
                                align_size=align_size, context=f"GPU, {context}")
    cpu_d = run_on(cpu, fn, x, routing_map, probs)
    assert_same_bits(gpu_d, cpu_d, what="dispatch", context=context)
    del gpu_d, cpu_d

    bwd = dispatch_vjp_fn(model.topk, align_size)
    gpu_dx, gpu_dp = run_on(gpu, bwd, x, routing_map, probs)
    cpu_dx, cpu_dp = run_on(cpu, bwd, x, routing_map, probs)
    assert_same_bits((gpu_dx, gpu_dp), (cpu_dx, cpu_dp), what="dispatch vjp", context=context)
    # d probs: the cotangent of each (t, e)'s row, in full.
    g_probs = host_grid(np.arange(layout.num_rows), 1, SALT_PROBS, dtype)[:, 0]
    _, expected_dp = ref.dispatch_backward(np.zeros((layout.num_rows, 1)), g_probs, layout.dest_rows)
    checks.assert_bitwise_equal(gpu_dp, expected_dp.astype(probs.dtype), what="GPU d probs", context=context)
    # d tokens on a sample of tokens: the sum of the cotangent rows of their copies.
    tokens = sample_indices(rng, num_tokens)
    dest = layout.dest_rows[tokens]
    needed = np.unique(dest[dest >= 0])
    g_rows = host_grid(needed, model.hidden, SALT_ROWS, dtype)
    compact_dest = np.where(dest >= 0, np.searchsorted(needed, dest), -1)
    expected_dx, _ = ref.dispatch_backward(g_rows, None, compact_dest)
    checks.assert_bitwise_equal(gpu_dx[tokens], exact(expected_dx, dtype), what="GPU d tokens (sampled tokens)",
                             context=context)


# -- combine -------------------------------------------------------------------------


def combine_fn(hidden: int, dtype):
    """combine of hashed expert rows (NaN on the rows no token points to: never read), and its
    vjp for a hashed cotangent."""

    def fn(row_id_map, merging_probs):
        num_rows, num_tokens = row_id_map.source_tokens.shape[0], row_id_map.dest_rows.shape[0]
        rows = device_grid(num_rows, hidden, SALT_ROWS, dtype)
        rows = jnp.where((row_id_map.source_tokens >= 0)[:, None], rows, jnp.nan).astype(dtype)
        out, vjp = jax.vjp(lambda y, w: permutation.combine(y, row_id_map, merging_probs=w), rows, merging_probs)
        d_rows, d_probs = vjp(device_grid(num_tokens, hidden, SALT_OUT, dtype))
        return out, d_rows, d_probs

    return fn


def reference_row_id_map(layout):
    return permutation.RowIdMap(dest_rows=jnp.asarray(layout.dest_rows, jnp.int32),
                                source_tokens=jnp.asarray(layout.source_tokens, jnp.int32))


@BIG_CASES
def test_combine_and_its_vjp_on_gpu_match_the_cpu_and_the_reference(model, num_tokens, dtype, align_size, gpu, cpu,
                                                                    seed, rng):
    routing_map = checks.routing_map_variant(rng, num_tokens, model.num_experts, model.topk, VARIANT_OF_ALIGN[align_size])
    merging_probs = grid_weights(rng, routing_map.shape, dtype)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_tokens * model.topk, align_size=align_size)
    row_id_map = reference_row_id_map(layout)
    context = f"{model.name}, T={num_tokens}, {jnp.dtype(dtype).name}, align_size={align_size}, seed={seed}"
    fn = combine_fn(model.hidden, dtype)
    gpu_out = run_on(gpu, fn, row_id_map, merging_probs)
    cpu_out = run_on(cpu, fn, row_id_map, merging_probs)
    assert_same_bits(gpu_out, cpu_out, what="combine and vjp", context=context)
    del cpu_out
    out, d_rows, d_probs = gpu_out

    # The reference on a sample of tokens: out[t] = sum_e w y[row]; d merging_probs[t, e] = g[t] . y[row].
    tokens = sample_indices(rng, num_tokens)
    dest = layout.dest_rows[tokens]
    needed = np.unique(dest[dest >= 0])
    y = host_grid(needed, model.hidden, SALT_ROWS, dtype)
    compact_dest = np.where(dest >= 0, np.searchsorted(needed, dest), -1)
    g = host_grid(tokens, model.hidden, SALT_OUT, dtype)
    expected_out = ref.combine(y, compact_dest, merging_probs[tokens])
    checks.assert_bitwise_equal(out[tokens], exact(expected_out, dtype), what="GPU combine (sampled tokens)",
                             context=context)
    _, expected_dp = ref.combine_backward(g, y, compact_dest, merging_probs[tokens])
    checks.assert_bitwise_equal(d_probs[tokens], exact(expected_dp, dtype), what="GPU d merging_probs (sampled tokens)",
                             context=context)
    # d expert_tokens: w[t, e] * g[t] on the rows of the sampled tokens, exactly zero on every row
    # no (t, e) refers to.
    rows_of_sample = dest[dest >= 0]
    t_of_rows = np.broadcast_to(tokens[:, None], dest.shape)[dest >= 0]
    w_of_rows = ref.as_f64(merging_probs[tokens])[dest >= 0]
    expected_rows = w_of_rows[:, None] * ref.as_f64(host_grid(t_of_rows, model.hidden, SALT_OUT, dtype))
    checks.assert_bitwise_equal(d_rows[rows_of_sample], exact(expected_rows, dtype),
                             what="GPU d expert_tokens (rows of sampled tokens)", context=context)
    unused = np.flatnonzero(layout.source_tokens < 0)
    checks.assert_bitwise_equal(d_rows[unused], np.zeros((len(unused), model.hidden), d_rows.dtype),
                             what="GPU d expert_tokens on padding and unused rows", context=context)


# -- rows outside the groups left unwritten (zero_unused_rows=False) ---------------------


def assert_same_covered_rows(gpu_rows, cpu_rows, covered, *, what: str, context: str, row_chunk: int = 16384) -> None:
    """The rows some copy covers (``covered``, a bool per row): the GPU's equal the CPU's bit for
    bit. The other rows hold whatever their buffer held, on either device."""
    for start in range(0, len(covered), row_chunk):
        mask = covered[start : start + row_chunk]
        checks.assert_bitwise_equal(gpu_rows[start : start + row_chunk][mask], cpu_rows[start : start + row_chunk][mask],
                                    what=f"GPU vs CPU {what} (covered rows from {start})", context=context)


def test_dispatch_fwd_leaving_unused_rows_unwritten_on_gpu_writes_the_groups_rows_as_the_cpu(gpu, cpu, seed, rng):
    # No zeroing blocks: padding (align_size 128) and tail (a ragged map) rows are left as they are.
    model, align_size, dtype = MIXTRAL_LAYER, 128, jnp.bfloat16
    routing_map = checks.routing_map_variant(rng, BIG_TOKENS, model.num_experts, model.topk, "ragged")
    x = grid_tokens(rng, (BIG_TOKENS, model.hidden), dtype)
    probs = grid_weights(rng, routing_map.shape, dtype)
    num_out_tokens = BIG_TOKENS * model.topk
    num_rows = permutation.dispatched_rows(num_out_tokens, model.num_experts, align_size)
    context = f"{model.name}, T={BIG_TOKENS}, align_size={align_size}, seed={seed}"

    def fn(x, routing_map, probs):
        d = permutation.dispatch_fwd(x, routing_map, probs, num_rows=num_rows, align_size=align_size,
                                     zero_unused_rows=False)
        return d.tokens, (d.probs, d.row_id_map, d.group_sizes, d.tokens_per_expert, d.pad_offsets)

    gpu_rows, gpu_others = run_on(gpu, fn, x, routing_map, probs)
    cpu_rows, cpu_others = run_on(cpu, fn, x, routing_map, probs)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_out_tokens, align_size=align_size)
    covered = layout.source_tokens >= 0
    assert not covered.all(), f"the test meant to leave padding and tail rows ({context})"
    assert_same_bits(gpu_others, cpu_others, what="dispatch_fwd's other results", context=context)
    assert_same_covered_rows(gpu_rows, cpu_rows, covered, what="tokens", context=context)
    for start in range(0, num_rows, 16384):
        sources = layout.source_tokens[start : start + 16384]
        checks.assert_bitwise_equal(gpu_rows[start : start + 16384][sources >= 0], x[sources[sources >= 0]],
                                    what=f"GPU tokens (covered rows from {start})", context=context)


@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_bwd_leaving_unused_rows_unwritten_on_gpu_writes_the_groups_rows_and_marks_bad_maps_as_the_cpu(
        with_probs, gpu, cpu, seed, rng):
    # Qwen3-MoE's 128 experts, align_size 16: the zeroing blocks still run, to mark the rows whose
    # maps disagree with NaN; they zero nothing. Two padding / tail rows name a token that does not
    # list them and a group's row names a token out of range: NaN on both devices.
    model, align_size, dtype = QWEN3_30B_A3B_LAYER, 16, jnp.bfloat16
    routing_map = checks.routing_map_variant(rng, BIG_TOKENS, model.num_experts, model.topk, "ragged")
    layout = ref.dispatch_layout(routing_map, num_out_tokens=BIG_TOKENS * model.topk, align_size=align_size)
    covered = layout.source_tokens >= 0
    assert not covered.all(), "the test meant to leave padding and tail rows"
    source_tokens = layout.source_tokens.copy()
    bad_rows = np.concatenate([rng.choice(np.flatnonzero(~covered), 2, replace=False),
                               rng.choice(np.flatnonzero(covered), 1)])
    source_tokens[bad_rows] = [*rng.integers(BIG_TOKENS, size=2), BIG_TOKENS + 3]
    row_id_map = permutation.RowIdMap(jnp.asarray(layout.dest_rows, jnp.int32), jnp.asarray(source_tokens, jnp.int32))
    merging_probs = grid_weights(rng, routing_map.shape, dtype) if with_probs else None
    hidden = model.hidden
    context = f"{model.name}, T={BIG_TOKENS}, bad rows {bad_rows.tolist()}, merging_probs={with_probs}, seed={seed}"

    def fn(row_id_map, merging_probs):
        rows = device_grid(layout.num_rows, hidden, SALT_ROWS, dtype)
        g = device_grid(BIG_TOKENS, hidden, SALT_OUT, dtype)
        return permutation.combine_bwd(g, rows, row_id_map, merging_probs, zero_unused_rows=False)

    gpu_rows, gpu_probs = run_on(gpu, fn, row_id_map, merging_probs)
    cpu_rows, cpu_probs = run_on(cpu, fn, row_id_map, merging_probs)
    for device, rows in (("GPU", gpu_rows), ("CPU", cpu_rows)):
        assert np.isnan(rows[bad_rows].astype(np.float32)).all(axis=1).all(), (
            f"{device}: rows of disagreeing maps are not NaN ({context})")
    covered[bad_rows] = False
    assert_same_covered_rows(gpu_rows, cpu_rows, covered, what="d expert_tokens", context=context)
    if with_probs:
        assert_same_bits(gpu_probs, cpu_probs, what="d merging_probs", context=context)


# -- sort_chunks / unsort_chunks ------------------------------------------------------


def chunk_cases():
    # Rows after an expert-parallel all-to-all: T * k rows of the model's hidden size, in chunks
    # (source shard, local expert): 8 shards x (E / 8) local experts.
    cases = []
    for model in LAYER_SHAPES:
        for name, dtype in DTYPES.items():
            num_tokens = DEEPSEEK_F32_TOKENS if (model is DEEPSEEK_V3_LAYER and name == "f32") else BIG_TOKENS
            num_rows = num_tokens * model.topk // (4 if model is DEEPSEEK_V3_LAYER else 1)
            cases.append(pytest.param(model, num_rows, dtype, 8 * (model.num_experts // 8),
                                      id=f"{model.name}-N{num_rows}-{name}"))
    return cases


def chunks_for(rng, num_rows, num_chunks):
    sizes = rng.multinomial(int(num_rows * rng.uniform(0.85, 1.0)), np.ones(num_chunks) / num_chunks)
    sizes[rng.random(num_chunks) < 0.1] = 0
    return sizes.astype(np.int32), rng.permutation(num_chunks).astype(np.int32)


def sort_fn(inverse: bool):
    """sort (or unsort) of x and the vjp of a hashed cotangent."""

    def fn(x, sizes, order):
        f = permutation.unsort_chunks if inverse else permutation.sort_chunks
        out, vjp = jax.vjp(lambda x: f(x, sizes, order), x)
        (dx,) = vjp(device_grid(x.shape[0], x.shape[1], SALT_OUT, x.dtype))
        return out, dx

    return fn


@pytest.mark.parametrize("model, num_rows, dtype, num_chunks", chunk_cases())
@pytest.mark.parametrize("inverse", [False, True], ids=["sort", "unsort"])
def test_sort_and_unsort_chunks_and_their_vjps_on_gpu_match_the_cpu_and_the_reference(
        model, num_rows, dtype, num_chunks, inverse, gpu, cpu, seed, rng):
    x = grid_tokens(rng, (num_rows, model.hidden), dtype)
    sizes, order = chunks_for(rng, num_rows, num_chunks)
    context = f"{model.name}, N={num_rows}, C={num_chunks}, {jnp.dtype(dtype).name}, seed={seed}"
    fn = sort_fn(inverse)
    gpu_out, gpu_dx = run_on(gpu, fn, x, sizes, order)
    cpu_out, cpu_dx = run_on(cpu, fn, x, sizes, order)
    assert_same_bits((gpu_out, gpu_dx), (cpu_out, cpu_dx), what="unsort" if inverse else "sort", context=context)
    del cpu_out, cpu_dx
    forward = ref.unsort_chunks_sources if inverse else ref.sort_chunks_sources
    backward = ref.sort_chunks_sources if inverse else ref.unsort_chunks_sources
    # Every row of the output; the gradient's rows on a sample (its cotangent lives on the device).
    sources = forward(num_rows, sizes, order)
    for start in range(0, num_rows, 16384):
        checks.assert_bitwise_equal(gpu_out[start : start + 16384], ref.gather_rows(x, sources[start : start + 16384]),
                                 what=f"GPU output rows from {start}", context=context)
    rows = sample_indices(rng, num_rows)
    grad_sources = backward(num_rows, sizes, order)[rows]
    g = host_grid(np.maximum(grad_sources, 0), model.hidden, SALT_OUT, dtype)
    g[grad_sources < 0] = 0
    checks.assert_bitwise_equal(gpu_dx[rows], g, what="GPU d tokens (sampled rows)", context=context)


# -- poison: outputs placed in memory that was just full of NaN --------------------------


def poison(device, sizes) -> list[tuple[int, int]]:
    """Fills fresh device buffers of the given byte sizes with 0xFF bytes (a NaN in every float
    dtype), waits, then frees them: XLA's best-fit allocator hands those bytes to the next
    allocations of about those sizes. Returns the address ranges they covered."""
    buffers = [jax.device_put(jnp.full((-(-n // 4),), 0xFFFFFFFF, jnp.uint32), device) for n in sizes]
    jax.block_until_ready(buffers)
    ranges = [(b.unsafe_buffer_pointer(), b.unsafe_buffer_pointer() + b.nbytes) for b in buffers]
    for b in buffers:
        b.delete()
    return ranges


def _unpoisoned_outputs(out, ranges) -> list[str]:
    """The outputs of 1 MiB or more with less than half their bytes in the poisoned ranges."""
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        start = leaf.unsafe_buffer_pointer()
        end = start + leaf.nbytes
        poisoned = sum(max(0, min(end, b) - max(start, a)) for a, b in ranges)
        if leaf.nbytes >= (1 << 20) and 2 * poisoned < leaf.nbytes:
            bad.append(f"output {jax.tree_util.keystr(path)} ({leaf.nbytes} bytes at {start:#x}) lies {poisoned} "
                       f"bytes in the poisoned ranges {[(hex(a), hex(b)) for a, b in ranges]}")
    return bad


def run_poisoned(device, fn, *args, attempts: int = 5):
    """fn (jitted, inputs on device) run once to compile, then again on poisoned memory; the
    second run's outputs as NumPy arrays. The first run's outputs stay alive, so that the
    second's cannot simply reuse their (clean) memory; the poison buffers have the outputs'
    sizes and twice their total, each twice (the allocator merges a freed buffer with the
    clean free memory beside it, and may place an output across both: under pytest-xdist
    on one GPU three tries of one of each were sometimes not enough). On a real GPU, checks
    that every output of 1 MiB or more has at least half its bytes in poisoned memory (else
    the test would prove nothing), poisoning and running again when the allocator placed
    one elsewhere."""
    jitted = jax.jit(fn)
    args = jax.block_until_ready(jax.device_put(args, device))
    first = jax.block_until_ready(jitted(*args))
    sizes = [leaf.nbytes for leaf in jax.tree.leaves(first)]
    for _ in range(attempts):
        ranges = poison(device, 2 * (sizes + [2 * sum(sizes)]))
        out = jax.block_until_ready(jitted(*args))
        bad = [] if STAND_IN else _unpoisoned_outputs(out, ranges)
        if not bad:
            break
        del out
    assert not bad, "; ".join(bad) + f": after {attempts} tries the allocator did not reuse them, so this test checks nothing"
    del first
    return jax.tree.map(np.asarray, out)


def assert_no_nan(tree, *, what: str, context: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if leaf.dtype.kind == "f":
            nan = np.isnan(leaf.astype(np.float32))
            assert not nan.any(), (f"{what}{jax.tree_util.keystr(path)}: {int(nan.sum())} NaN "
                                   f"(first at {np.argwhere(nan)[0].tolist()}) left from the poisoned memory ({context})")


POISON_MODELS = pytest.mark.parametrize("model", [MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER], ids=lambda m: m.name)


@POISON_MODELS
@pytest.mark.parametrize("align_size", [None, 128], ids=lambda a: f"align{a}")
def test_dispatch_on_poisoned_memory_zeroes_padding_and_tail_rows(model, align_size, gpu, seed, rng):
    # A ragged map: padding rows (align_size) and tail rows (fewer entries than T * k).
    num_tokens, dtype = BIG_TOKENS, jnp.bfloat16
    routing_map = checks.routing_map_variant(rng, num_tokens, model.num_experts, model.topk, "ragged")
    x = grid_tokens(rng, (num_tokens, model.hidden), dtype)
    probs = grid_weights(rng, routing_map.shape, dtype)
    context = f"{model.name}, T={num_tokens}, align_size={align_size}, seed={seed}"
    d = run_poisoned(gpu, dispatch_fn(model.topk, align_size), x, routing_map, probs)
    assert_no_nan(d, what="dispatch", context=context)
    layout = checks.check_dispatch(d, x, routing_map, probs, num_out_tokens=num_tokens * model.topk,
                                align_size=align_size, context=context)
    assert (layout.source_tokens < 0).sum() > 0, "the test meant to leave padding / tail rows"
    dx, dp = run_poisoned(gpu, dispatch_vjp_fn(model.topk, align_size), x, routing_map, probs)
    assert_no_nan((dx, dp), what="dispatch vjp", context=context)
    # A token routed nowhere gets an exactly zero gradient.
    nowhere = np.flatnonzero(~routing_map.any(axis=1))
    checks.assert_bitwise_equal(dx[nowhere], np.zeros((len(nowhere), model.hidden), dx.dtype),
                             what="d tokens of unrouted tokens", context=context)
    checks.assert_bitwise_equal(dp[~routing_map], np.zeros(int((~routing_map).sum()), dp.dtype),
                             what="d probs off the map", context=context)


@POISON_MODELS
@pytest.mark.parametrize("align_size", [None, 128], ids=lambda a: f"align{a}")
@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_backward_on_poisoned_memory_zeroes_the_rows_no_token_uses(model, align_size, with_probs, gpu, seed,
                                                                            rng):
    num_tokens, dtype = BIG_TOKENS, jnp.bfloat16
    routing_map = checks.routing_map_variant(rng, num_tokens, model.num_experts, model.topk, "ragged")
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_tokens * model.topk, align_size=align_size)
    merging_probs = grid_weights(rng, routing_map.shape, dtype) if with_probs else None
    hidden = model.hidden

    def fn(row_id_map, merging_probs):
        rows = device_grid(layout.num_rows, hidden, SALT_ROWS, dtype)
        out, vjp = jax.vjp(lambda y: permutation.combine(y, row_id_map, merging_probs=merging_probs), rows)
        (d_rows,) = vjp(device_grid(num_tokens, hidden, SALT_OUT, dtype))
        return out, d_rows

    context = f"{model.name}, T={num_tokens}, align_size={align_size}, merging_probs={with_probs}, seed={seed}"
    out, d_rows = run_poisoned(gpu, fn, reference_row_id_map(layout), merging_probs)
    assert_no_nan((out, d_rows), what="combine and d expert_tokens", context=context)
    unused = np.flatnonzero(layout.source_tokens < 0)
    assert len(unused) > 0, "the test meant to leave padding / tail rows"
    checks.assert_bitwise_equal(d_rows[unused], np.zeros((len(unused), hidden), d_rows.dtype),
                             what="d expert_tokens on padding / unused rows", context=context)
    nowhere = np.flatnonzero(~routing_map.any(axis=1))
    checks.assert_bitwise_equal(out[nowhere], np.zeros((len(nowhere), hidden), out.dtype),
                             what="combine of tokens routed nowhere", context=context)


@pytest.mark.parametrize("inverse", [False, True], ids=["sort", "unsort"])
def test_sort_chunks_on_poisoned_memory_zeroes_the_rows_past_the_chunks(inverse, gpu, seed, rng):
    num_rows, hidden, dtype = BIG_TOKENS * 2, 1024, jnp.bfloat16
    x = grid_tokens(rng, (num_rows, hidden), dtype)
    sizes, order = chunks_for(rng, num_rows, 32)
    sizes = (sizes * 0.7).astype(np.int32)  # a long tail of rows in no chunk
    context = f"sizes={sizes.tolist()}, order={order.tolist()}, seed={seed}"
    out, dx = run_poisoned(gpu, sort_fn(inverse), x, sizes, order)
    assert_no_nan((out, dx), what="sort_chunks and vjp", context=context)
    forward = ref.unsort_chunks_sources if inverse else ref.sort_chunks_sources
    checks.assert_bitwise_equal(out, ref.gather_rows(x, forward(num_rows, sizes, order)), what="GPU output",
                             context=context)
    tail = int(sizes.sum())
    checks.assert_bitwise_equal(dx[tail:], np.zeros((num_rows - tail, hidden), dx.dtype),
                             what="d tokens past the chunks", context=context)


# -- row maps no dispatch made ----------------------------------------------------------


@pytest.mark.parametrize("num_experts", [8, 128], ids=lambda e: f"E{e}")
@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_and_its_vjp_on_maps_no_dispatch_made_on_gpu_follow_the_contract(num_experts, with_probs, gpu, cpu,
                                                                                seed, rng):
    # Entries out of range, rows naming a token that does not list them, a token listing one row
    # twice (its weights summed; without merging probs, twice its gradient): NaN and zeros where
    # the contract says, on the CPU and the GPU alike.
    from test_permutation_grads import check_combine_of_any_maps, combine_of_any_maps_and_vjp, maps_no_dispatch_made

    num_tokens, hidden, num_rows = 512, 256, 1100
    row_id_map = maps_no_dispatch_made(rng, num_tokens, num_experts, num_rows)
    y = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    g = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    w = rng.standard_normal((num_tokens, num_experts)).astype(np.float32) if with_probs else None
    context = f"E={num_experts}, merging_probs={with_probs}, seed={seed}"
    gpu_out = run_on(gpu, combine_of_any_maps_and_vjp, row_id_map, y, w, g)
    check_combine_of_any_maps(*gpu_out, row_id_map, y, w, g, context=context)
    cpu_out = run_on(cpu, combine_of_any_maps_and_vjp, row_id_map, y, w, g)
    # The rows move and scale alike; only d merging_probs' dot products are summed differently.
    # (NaN where both have it, already checked.)
    assert_same_bits([one_nan(a) for a in gpu_out[:2]], [one_nan(a) for a in cpu_out[:2]],
                     what="combine and d expert_tokens", context=context)


# -- combine of tokens of many copies -----------------------------------------------------


def tokens_of_0_to_20_copies(rng, num_tokens: int, num_experts: int):
    """``(copies, row_id_map)``: a dispatch's map of tokens of 0 to 20 copies each, one entry of
    one token's row out of range (a NaN row for combine)."""
    copies = rng.integers(0, 21, num_tokens)
    routing_map = np.zeros((num_tokens, num_experts), bool)
    for t, c in enumerate(copies):
        routing_map[t, rng.choice(num_experts, c, replace=False)] = True
    layout = ref.dispatch_layout(routing_map, num_out_tokens=int(copies.sum()))
    dest_rows = layout.dest_rows.copy()
    dest_rows[rng.integers(num_tokens), rng.integers(num_experts)] = len(layout.source_tokens) + 2
    return copies, permutation.RowIdMap(jnp.asarray(dest_rows, jnp.int32),
                                        jnp.asarray(layout.source_tokens, jnp.int32))


@pytest.mark.parametrize("dtype, hidden", [(jnp.bfloat16, 2048), (jnp.float32, 1028), (jnp.float16, 7168)],
                         ids=["bf16_H2048", "f32_H1028", "f16_H7168"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_of_tokens_of_0_to_20_copies_on_gpu_matches_the_cpu(dtype, hidden, with_probs, gpu, cpu, seed, rng):
    # Tokens of no copies, of fewer than a top-8's and of more (up to 20 of 32 experts), rows
    # that are not a whole number of the kernel's vectors a thread (H 1028 of float32), and an
    # entry out of range (a NaN row). Grid values and weights (j / 16): every sum is exact, so
    # the GPU must equal the CPU implementation bit for bit. (A gather with bulk copies, built
    # and reverted on 2026-11-29, moved a token's copies 8 at a time in pieces of a stage: this
    # is what it had to get right, and what any such kernel will.)
    num_tokens, num_experts = 300, 32
    _, row_id_map = tokens_of_0_to_20_copies(rng, num_tokens, num_experts)
    y = (rng.integers(-8, 9, (len(row_id_map.source_tokens), hidden)) / 16).astype(dtype)
    w = (rng.integers(-8, 9, (num_tokens, num_experts)) / 16).astype(np.float32) if with_probs else None
    combine = lambda y, w: permutation.combine(y, row_id_map, merging_probs=w)  # noqa: E731
    context = f"{jnp.dtype(dtype).name} H={hidden}, merging_probs={with_probs}, seed={seed}"
    gpu_out, cpu_out = run_on(gpu, combine, y, w), run_on(cpu, combine, y, w)
    assert np.isnan(one_nan(gpu_out)).any(axis=1).sum() == 1, f"the one token with an entry out of range, {context}"
    assert_same_bits(one_nan(gpu_out), one_nan(cpu_out), what="combine", context=context)


@pytest.mark.parametrize("dtype, hidden", [(jnp.bfloat16, 7168), (jnp.float32, 1028), (jnp.float16, 2048)],
                         ids=["bf16_H7168", "f32_H1028", "f16_H2048"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["no_merging_probs", "merging_probs"])
def test_combine_fwd_from_an_addend_on_gpu_matches_the_cpu_and_the_exact_sum(dtype, hidden, with_probs, gpu, cpu,
                                                                              seed, rng):
    # The layer's dispatch backward starts each token's sum from the router's float32 gradient
    # (combine_fwd's addend). Grid values, weights and addend: every float32 sum is exact, so the
    # GPU equals the CPU bit for bit and both the exact sum rounded once; a token of no copies is
    # its addend row (-0 kept), the token with an entry out of range NaN.
    num_tokens, num_experts = 300, 32
    copies, row_id_map = tokens_of_0_to_20_copies(rng, num_tokens, num_experts)
    y = (rng.integers(-8, 9, (len(row_id_map.source_tokens), hidden)) / 16).astype(dtype)
    w = (rng.integers(-8, 9, (num_tokens, num_experts)) / 16).astype(np.float32) if with_probs else None
    addend = (rng.integers(-64, 65, (num_tokens, hidden)) / 16).astype(np.float32)
    addend[copies == 0] = -0.0
    combine = lambda y, w, a: permutation.combine_fwd(y, row_id_map, w, addend=a)  # noqa: E731
    context = f"{jnp.dtype(dtype).name} H={hidden}, merging_probs={with_probs}, seed={seed}"
    gpu_out, cpu_out = run_on(gpu, combine, y, w, addend), run_on(cpu, combine, y, w, addend)
    assert_same_bits(one_nan(gpu_out), one_nan(cpu_out), what="combine_fwd from an addend", context=context)
    dest_rows = np.asarray(row_id_map.dest_rows)
    bad = ((dest_rows < -1) | (dest_rows >= len(y))).any(axis=1)
    assert np.isnan(gpu_out.astype(np.float32)).any(axis=1).tolist() == bad.tolist(), context
    exact = addend.astype(np.float64) + ref.combine(y, np.where(bad[:, None], -1, dest_rows), w)
    exact[copies == 0] = addend[copies == 0]  # -0 + 0 would be +0
    checks.assert_bitwise_equal(gpu_out[~bad], exact[~bad].astype(dtype), what="combine_fwd from an addend",
                                context=context)


@pytest.mark.parametrize("with_probs", [True, False], ids=["merging_probs", "no_merging_probs"])
def test_combine_backward_of_tokens_of_0_to_48_copies_and_a_block_whose_first_row_is_unlisted(with_probs, gpu, cpu,
                                                                                              seed, rng):
    # Combine's backward checks each token's copies a warp a token, a lane a copy: tokens of more
    # copies than a warp's 32 lanes (up to 48 of 64 experts) must have every copy checked. Its
    # zeroing blocks try the expert that lists a block's first row on every row of the block,
    # then scan whole dest_rows rows for the rest: a group boundary in a block, and a block whose
    # first row names a token that does not list it (NaN there, every other row of the block as
    # the reference has it), take the scan. Grid values: every sum is exact, so the GPU equals the
    # CPU bit for bit as well as the float64 reference.
    from test_permutation_grads import check_combine_of_any_maps, combine_of_any_maps_and_vjp

    num_tokens, num_experts, hidden, block_rows = 300, 64, 256, 32
    copies = rng.integers(0, 49, num_tokens)
    copies[rng.integers(num_tokens)] = 48
    routing_map = np.zeros((num_tokens, num_experts), bool)
    for t, c in enumerate(copies):
        routing_map[t, rng.choice(num_experts, c, replace=False)] = True
    layout = ref.dispatch_layout(routing_map, num_out_tokens=int(copies.sum()), align_size=16)
    dest_rows, source_tokens = layout.dest_rows.copy(), layout.source_tokens.copy()
    block_firsts = [r for r in range(0, len(source_tokens), block_rows) if source_tokens[r] >= 0]
    unlisted = block_firsts[rng.integers(len(block_firsts))]
    source_tokens[unlisted] = next(t for t in rng.permutation(num_tokens) if unlisted not in dest_rows[t])
    row_id_map = permutation.RowIdMap(jnp.asarray(dest_rows, jnp.int32), jnp.asarray(source_tokens, jnp.int32))
    num_rows = len(source_tokens)
    y = (rng.integers(-8, 9, (num_rows, hidden)) / 16).astype(np.float32)
    g = (rng.integers(-8, 9, (num_tokens, hidden)) / 16).astype(np.float32)
    w = (rng.integers(-8, 9, (num_tokens, num_experts)) / 16).astype(np.float32) if with_probs else None
    context = f"unlisted row {unlisted}, merging_probs={with_probs}, seed={seed}"
    gpu_out = run_on(gpu, combine_of_any_maps_and_vjp, row_id_map, y, w, g)
    check_combine_of_any_maps(*gpu_out, row_id_map, y, w, g, context=context)
    block = slice(unlisted, unlisted + block_rows)
    assert np.isnan(gpu_out[1][block]).any(axis=1).tolist() == [r == unlisted for r in range(num_rows)[block]], (
        f"NaN only in the block's first row ({context})")
    cpu_out = run_on(cpu, combine_of_any_maps_and_vjp, row_id_map, y, w, g)
    assert_same_bits([one_nan(a) for a in gpu_out if a is not None], [one_nan(a) for a in cpu_out if a is not None],
                     what="combine, d expert_tokens and d merging_probs", context=context)
