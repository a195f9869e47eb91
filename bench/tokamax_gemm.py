"""oxmoe's grouped GEMM forward against ``tokamax.ragged_dot``, untuned and autotuned, at the
benchmark's shapes, in one run (issue 19 asks for tokamax autotuned on the same shapes).

Per shape of :data:`oxmoe.model_shapes.EXPERT_GEMMS` (``bench/gemm_ab.py``'s draws: the
benchmark's first draw of group sizes, its forward product's operands and its dense GEMM's):
``lhs [M, K] x rhs [G, K, N]`` in bf16 by oxmoe, by each of tokamax's
GPU implementations (``mosaic``: Pallas Mosaic GPU; ``triton``: Pallas Triton) with its default
configuration and after ``tokamax.autotune`` on these operands (its whole search space for the
implementation; each autotuning's wall time, its fastest configuration and that configuration's
time by tokamax's own timing are printed), and a dense ``jnp.dot`` of the same
FLOPs; median of 5 x 20 calls (``step_ab.median_seconds``). Every tokamax output is compared with
oxmoe's (relative max-norm error). Prints a line per timing and a last ``JSON {...}`` line.
Arguments, if any, select the cases whose ``"<shape> <implementation>"`` contains one of them
(``python3 bench/tokamax_gemm.py "mixtral mosaic"``): autotuning takes minutes a case.

tokamax is not a dependency of oxmoe: it needs JAX 0.11.1 or newer and a GPU. On a machine
without network, carry its wheels (``tokamax``, ``qwix``, ``einshape``, ``immutabledict``,
``pydantic`` with ``pydantic-core``, ``annotated-types`` and ``typing-inspection``; ``jax-triton``
for the Triton implementation, which also needs the ``triton`` it names), install them
into a directory on ``PYTHONPATH`` and run ``python3 bench/tokamax_gemm.py``. tokamax imports
``xprof.cli.tools.get_kernel_stats_tool`` for its own profiling only; where xprof is missing, a
stub module that defines it as ``None`` satisfies the import.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokamax

import oxmoe
from oxmoe.bench.grouped_gemm import PRODUCTS
from oxmoe.model_shapes import EXPERT_GEMMS
from gemm_ab import dense_operands, group_sizes, product_operands
from step_ab import median_seconds

IMPLEMENTATIONS = ("mosaic", "triton")
FORWARD = next(product for product in PRODUCTS if product.name == "fwd")


def timed(results, name, flops, call, *args):
    seconds = median_seconds(call, *args, calls=20, samples=5)
    results[name] = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12}
    print(f"{name}: {seconds * 1e6:.0f} us {flops / seconds / 1e12:.0f} TFLOP/s", flush=True)
    return seconds


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def main(selected: list[str]) -> None:
    results = {}
    for shape in EXPERT_GEMMS:
        implementations = [i for i in IMPLEMENTATIONS
                           if not selected or any(part in f"{shape.name} {i}" for part in selected)]
        if not implementations:
            continue
        sizes = group_sizes(shape)
        lhs, rhs = product_operands(FORWARD, shape)
        flops = 2 * shape.m * shape.k * shape.n
        ours = jax.jit(FORWARD.oxmoe)
        expected = ours(lhs, rhs, sizes)
        oxmoe_s = timed(results, f"{shape.name} oxmoe", flops, ours, lhs, rhs, sizes)
        timed(results, f"{shape.name} dense", flops, jax.jit(jnp.dot), *dense_operands(FORWARD.dense, shape))
        for implementation in implementations:
            def product(a, b, s, implementation=implementation):
                return tokamax.ragged_dot(a, b, s, implementation=implementation)

            name = f"{shape.name} tokamax {implementation}"
            try:
                untuned = jax.jit(product)
                error = relative_error(untuned(lhs, rhs, sizes), expected)
                seconds = timed(results, name, flops, untuned, lhs, rhs, sizes)
                results[name].update(error=error, oxmoe_speedup=seconds / oxmoe_s)
                start = time.perf_counter()
                tuning = tokamax.autotune(product, lhs, rhs, sizes, progress_bar=False, timeout=60.0)
                tuning_s = time.perf_counter() - start
                (bound, data), = tuning.data
                best = data.fastest_config
                best_ms = data[best].median_evaluation_time_ms
                print(f"{name}: autotuning timed {len(data.prune_errors())} of {len(data)} configurations; "
                      f"the fastest {best_ms * 1e3:.0f} us by its own timing: {best}", flush=True)
                # The op called with the fastest configuration, as `tokamax.ragged_dot` calls it. (In
                # tokamax 0.0.17 `with tuning:` does not reach ragged_dot: its results are keyed by
                # the op, whose VJP closures differ between instances, so the lookup misses.)
                def tuned(a, b, s, op=bound.op.replace(config=best), kwargs=bound.kwargs):
                    return op(a, b, **{**kwargs, "group_sizes": s})

                tuned = jax.jit(tuned)
                error = relative_error(tuned(lhs, rhs, sizes), expected)
                seconds = timed(results, f"{name} autotuned", flops, tuned, lhs, rhs, sizes)
                results[f"{name} autotuned"].update(error=error, oxmoe_speedup=seconds / oxmoe_s,
                                                    autotuning_s=tuning_s, own_timing_us=best_ms * 1e3,
                                                    config=str(best))
                print(f"{name} autotuned in {tuning_s:.0f} s; oxmoe {seconds / oxmoe_s:.2f}x its speed, "
                      f"error against oxmoe {error:.1e}", flush=True)
            except Exception as exc:  # a tokamax implementation that fails here is reported, not fatal
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"{name}: failed: {results[name]['error']}", flush=True)
    print("JSON", json.dumps({"build": oxmoe.build_id(), "tokamax": tokamax.__version__, "jax": jax.__version__,
                              "device": jax.devices()[0].device_kind, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
