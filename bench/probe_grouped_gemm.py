"""A quick look at the grouped GEMM on a GPU: checks each product against a
float32 plain-JAX reference on a few awkward shapes, then times forward,
d lhs and d rhs at the issue's shapes next to a dense bf16 GEMM of the same
FLOPs (cuBLAS through jnp.dot). The full benchmark is ``python -m oxmoe.bench``;
this is the short loop for kernel work (and for ncu with ``--only-time``).

    PYTHONPATH=jax_bindings python3 bench/probe_grouped_gemm.py [--only-time]
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import oxmoe

SHAPES = {"mixtral_up": (65536, 1024, 4096, 8), "qwen3_up": (131072, 2048, 768, 128),
          "dsv3_ep8_up": (32768, 7168, 2048, 32), "dsv3_ep8_down": (32768, 2048, 7168, 32)}
HIGHEST = jax.lax.Precision.HIGHEST


def dirichlet_sizes(rng, m, groups, empty_fraction=0.0):
    weights = rng.dirichlet(np.full(groups, 4.0))
    if empty_fraction:
        weights[rng.choice(groups, int(groups * empty_fraction), replace=False)] = 0
        weights /= weights.sum()
    sizes = np.floor(weights * m).astype(np.int64)
    sizes[np.argmax(weights)] += m - sizes.sum()
    return sizes.astype(np.int32)


def reference(lhs, rhs, sizes, offset, rhs_transposed):
    out = jnp.zeros((lhs.shape[0], rhs.shape[1] if rhs_transposed else rhs.shape[2]), jnp.float32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(rhs.shape[0]):
        g = offset + i
        if g >= len(sizes) or sizes[g] == 0:
            continue
        w = rhs[i].T if rhs_transposed else rhs[i]
        rows = slice(starts[g], starts[g + 1])
        out = out.at[rows].set(jnp.dot(lhs[rows].astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST))
    return out


def transposed_reference(lhs, rhs, sizes, offset, groups):
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = []
    for i in range(groups):
        g = offset + i
        if g >= len(sizes):
            out.append(jnp.zeros((lhs.shape[1], rhs.shape[1]), jnp.float32))
            continue
        rows = slice(starts[g], starts[g + 1])
        out.append(jnp.dot(lhs[rows].astype(jnp.float32).T, rhs[rows].astype(jnp.float32), precision=HIGHEST))
    return jnp.stack(out)


def report(name, got, want, k):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max() + 1e-30
    err = np.abs(got - want).max() / scale
    ok = err < 2e-2 and np.isfinite(got).all()
    print(f"  {'ok ' if ok else 'BAD'} {name}: max |err| / max |ref| = {err:.2e}", flush=True)
    return ok


def check(rng):
    ok = True
    cases = [  # m, k, n, groups, local, offset, total rows in groups, dtype
        (1000, 256, 384, 5, 5, 0, 900, jnp.bfloat16),
        (4096, 512, 1024, 8, 8, 0, 4096, jnp.bfloat16),
        (3000, 1024, 520, 16, 4, 6, 2500, jnp.float16),
        (777, 72, 200, 3, 3, 0, 700, jnp.bfloat16),
        (2048, 64, 128, 4, 2, 3, 2048, jnp.bfloat16),
        (300, 100, 50, 3, 3, 0, 290, jnp.bfloat16),  # odd K and N: the SIMT kernels
        (500, 96, 136, 4, 4, 0, 480, jnp.float32),
    ]
    for m, k, n, groups, local, offset, rows, dtype in cases:
        sizes = dirichlet_sizes(rng, rows, groups, 0.25)
        lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
        rhs = jnp.asarray(rng.standard_normal((local, k, n)) / np.sqrt(k), dtype)
        dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
        gs, go = jnp.asarray(sizes), jnp.asarray([offset], jnp.int32)
        window = dict(group_offset=go) if local != groups else {}
        print(f"m={m} k={k} n={n} G={groups} local={local} offset={offset} {jnp.dtype(dtype).name} sizes={sizes.tolist()}")
        fwd = jax.jit(lambda a, b, s: oxmoe.ragged_dot(a, b, s, preferred_element_type=jnp.float32, **window))
        ok &= report("fwd", fwd(lhs, rhs, gs), reference(lhs, rhs, sizes, offset, False), k)
        rhs_t = jnp.swapaxes(rhs, 1, 2)
        fwd_t = jax.jit(lambda a, b, s: oxmoe.ragged_dot(a, b, s, rhs_transposed=True, **window))
        ok &= report("fwd [G,N,K] (bf16 out)", fwd_t(lhs, rhs_t, gs), reference(lhs, rhs, sizes, offset, False), k)
        dlhs = jax.jit(lambda g, b, s: oxmoe.ragged_dot(g, b, s, rhs_transposed=True, preferred_element_type=jnp.float32, **window))
        ok &= report("d lhs", dlhs(dout, rhs, gs), reference(dout, rhs, sizes, offset, True), n)
        drhs = jax.jit(lambda a, g, s: oxmoe.transposed_ragged_dot(
            a, g, s, num_groups=local, preferred_element_type=jnp.float32, **window))
        ok &= report("d rhs", drhs(lhs, dout, gs), transposed_reference(lhs, dout, sizes, offset, local), rows)
    return ok


def seconds(fn, *args, repeats=20):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / repeats)
    return float(np.median(samples))


def time_shapes(rng):
    print(f"{'case':<16}{'product':<10}{'oxmoe ms':>10}{'TFLOP/s':>9}{'dense ms':>10}{'TFLOP/s':>9}{'ratio':>7}")
    for name, (m, k, n, groups) in SHAPES.items():
        sizes = jnp.asarray(dirichlet_sizes(rng, m, groups))
        lhs = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        rhs = (jax.random.normal(jax.random.key(2), (groups, k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
        dout = jax.random.normal(jax.random.key(3), (m, n), jnp.bfloat16)
        flops = 2 * m * k * n
        products = {
            "fwd": (jax.jit(lambda a, b, s: oxmoe.ragged_dot(a, b, s)), (lhs, rhs, sizes),
                    jax.jit(lambda a, b: jnp.dot(a, b)), (lhs, rhs[0])),
            "d lhs": (jax.jit(lambda g, b, s: oxmoe.ragged_dot(g, b, s, rhs_transposed=True)), (dout, rhs, sizes),
                      jax.jit(lambda g, b: jnp.dot(g, b.T)), (dout, rhs[0])),
            "d rhs": (jax.jit(lambda a, g, s: oxmoe.transposed_ragged_dot(a, g, s)), (lhs, dout, sizes),
                      jax.jit(lambda a, g: jnp.dot(a.T, g)), (lhs, dout)),
        }
        for product, (ours, ours_args, dense, dense_args) in products.items():
            t, d = seconds(ours, *ours_args), seconds(dense, *dense_args)
            print(f"{name:<16}{product:<10}{t * 1e3:>10.3f}{flops / t / 1e12:>9.0f}{d * 1e3:>10.3f}"
                  f"{flops / d / 1e12:>9.0f}{d / t:>7.2f}", flush=True)
        del lhs, rhs, dout


def main():
    rng = np.random.default_rng(0)
    print(jax.devices()[0].device_kind)
    ok = True if "--only-time" in sys.argv else check(rng)
    time_shapes(rng)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
