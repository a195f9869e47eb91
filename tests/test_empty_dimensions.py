"""Every primitive, forward and backward, with each of its dimensions 0 in turn, on
results the handlers find filled with poison (``OXMOE_POISON_RESULTS=1``: NaN in float
results, 0x80808080 in int32 ones): whatever a dimension of 0 leaves of a result must
still be written, and equal the float64 reference (the loss of no tokens is 0, the
merging weights' gradient of rows of no elements is 0, a product over no rows is 0,
a dispatch of no tokens lays out no rows, a quantization of no elements has no scales,
the activation's weight gradient of rows of no features is 0, ...).

The poison is set when the library loads, so the cases run in a child process: this
file is also that child's script (``python tests/test_empty_dimensions.py --platform
cpu`` prints one JSON line per case). The CPU handlers run here; the CUDA ones where
there is a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import devices

# name: a function of a NumPy Generator returning [(what, oxmoe's value, the reference)].
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def draw(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def vjp(fn, *args):
    """fn(*args) and the gradient of <fn(*args), cotangent> for a fixed random cotangent."""
    import jax

    out, pullback = jax.vjp(fn, *args)
    rng = np.random.default_rng(0)
    cotangent = jax.tree.map(
        lambda o: jax.numpy.asarray(draw(rng, o.shape, o.dtype)) if o.dtype.kind == "f"
        else np.zeros(o.shape, jax.dtypes.float0), out)
    return out, cotangent, pullback(cotangent)


# -- router: tokens are the one dimension that can be 0 (topk >= 1 needs an expert) --


@case
def topk_of_no_tokens(rng):
    import router_reference as ref
    from oxmoe import router

    logits = np.zeros((0, 8), np.float32)
    (probs, routing_map), (g, _), (d_logits,) = vjp(lambda x: router.topk(x, 2), logits)
    return [("probs", probs, np.zeros((0, 8), np.float32)), ("routing_map", routing_map, np.zeros((0, 8), bool)),
            ("d logits", d_logits, ref.topk_backward(g, logits, routing_map, 2).astype(np.float32))]


@case
def aux_loss_scores_of_no_tokens(rng):
    from oxmoe import router

    logits = np.zeros((0, 16), np.float32)
    (routing_map, scores), _, (d_logits,) = vjp(lambda x: router.aux_loss_scores(x, 4), logits)
    return [("routing_map", routing_map, np.zeros((0, 16), bool)), ("scores", scores, np.zeros((0, 16), np.float32)),
            ("d logits", d_logits, np.zeros((0, 16), np.float32))]


@case
def aux_loss_of_no_tokens(rng):
    from oxmoe import router

    probs, counts = np.zeros((0, 8), np.float32), rng.integers(0, 9, 8).astype(np.int32)
    loss, _, (d_probs,) = vjp(lambda p: router.aux_loss(p, counts, total_num_tokens=16, topk=2, coeff=0.01), probs)
    return [("loss", loss, np.float32(0)), ("d probs", d_probs, np.zeros((0, 8), np.float32))]


# -- permutation ----------------------------------------------------------------------


def _dispatch_and_vjp(tokens, routing_map, probs, **kwargs):
    from oxmoe import permutation

    def fn(x, p):
        d = permutation.dispatch(x, routing_map, probs=p, **kwargs)
        return d.tokens, d.probs, d.row_id_map.dest_rows, d.row_id_map.source_tokens, d.group_sizes, \
            d.tokens_per_expert
    return vjp(fn, tokens, probs)


def _check_dispatch(tokens, routing_map, probs, *, num_out_tokens, align_size):
    import permutation_reference as ref

    outs, (g_rows, g_probs, *_), (d_tokens, d_probs) = _dispatch_and_vjp(
        tokens, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size)
    expected = ref.dispatch(tokens, routing_map, probs, num_out_tokens=num_out_tokens, align_size=align_size)
    layout = expected.layout
    expected_d_tokens, expected_d_probs = ref.dispatch_backward(g_rows, g_probs, layout.dest_rows)
    names = ["tokens", "probs", "dest_rows", "source_tokens", "group_sizes", "tokens_per_expert"]
    values = [expected.tokens.astype(np.float32), expected.probs.astype(np.float32), layout.dest_rows,
              layout.source_tokens, layout.group_sizes, layout.tokens_per_expert]
    return [(n, a, np.asarray(b).astype(np.asarray(a).dtype)) for n, a, b in zip(names, outs, values)] + [
        ("d tokens", d_tokens, expected_d_tokens.astype(np.float32)),
        ("d probs", d_probs, expected_d_probs.astype(np.float32))]


def _routing(rng, tokens, experts, topk):
    import permutation_checks as checks

    routing_map = checks.random_topk_map(rng, tokens, experts, topk)
    return routing_map, np.where(routing_map, rng.random(routing_map.shape), 0).astype(np.float32)


@case
def dispatch_of_rows_of_no_elements(rng):
    routing_map, probs = _routing(rng, 24, 8, 2)
    return _check_dispatch(np.zeros((24, 0), np.float32), routing_map, probs, num_out_tokens=48, align_size=4)


@case
def dispatch_of_no_tokens(rng):
    routing_map, probs = _routing(rng, 0, 8, 2)
    return _check_dispatch(np.zeros((0, 32), np.float32), routing_map, probs, num_out_tokens=16, align_size=4)


@case
def dispatch_into_no_rows(rng):
    routing_map, probs = np.zeros((24, 8), bool), np.zeros((24, 8), np.float32)
    return _check_dispatch(draw(rng, (24, 32)), routing_map, probs, num_out_tokens=0, align_size=None)


def _check_combine(rng, tokens, hidden, experts, num_rows_of):
    """combine and its vjp on the row map of a dispatch of `tokens` rows into
    num_rows_of(tokens * 2) rows (every copy that fits)."""
    import jax.numpy as jnp
    import permutation_reference as ref
    from oxmoe import permutation

    routing_map, probs = _routing(rng, tokens, experts, 2)
    num_out = num_rows_of(tokens * 2)
    if num_out < tokens * 2:
        routing_map, probs = np.zeros_like(routing_map), np.zeros_like(probs)
    d = permutation.dispatch(jnp.zeros((tokens, hidden)), routing_map, num_out_tokens=num_out)
    layout = ref.dispatch_layout(routing_map, num_out_tokens=num_out)
    rows = draw(rng, (layout.num_rows, hidden))
    out, g, (d_rows, d_probs) = vjp(lambda y, w: permutation.combine(y, d.row_id_map, w), rows, probs)
    expected_d_rows, expected_d_probs = ref.combine_backward(g, rows, layout.dest_rows, probs)
    return [("out", out, ref.combine(rows, layout.dest_rows, probs).astype(np.float32)),
            ("d expert_tokens", d_rows, expected_d_rows.astype(np.float32)),
            ("d merging_probs", d_probs, expected_d_probs.astype(np.float32))]


@case
def combine_of_rows_of_no_elements(rng):
    return _check_combine(rng, 24, 0, 8, lambda n: n)


@case
def combine_of_no_tokens(rng):
    return _check_combine(rng, 0, 32, 8, lambda n: 16)


@case
def combine_of_no_rows(rng):
    return _check_combine(rng, 24, 32, 8, lambda n: 0)


def _check_sort(rng, shape, sizes, order):
    import permutation_reference as ref
    from oxmoe import permutation

    x = draw(rng, shape)
    sizes, order = np.asarray(sizes, np.int32), np.asarray(order, np.int32)
    out, g, (d_x,) = vjp(lambda x: permutation.sort_chunks(x, sizes, order), x)
    as_rows = lambda a: np.asarray(a).reshape(shape[0], int(np.prod(shape[1:])))  # noqa: E731
    expected = ref.sort_chunks(as_rows(x), sizes, order).reshape(shape)
    expected_d = ref.sort_chunks_backward(as_rows(g), sizes, order).reshape(shape)
    return [("out", out, expected.astype(np.float32)), ("d tokens", d_x, expected_d.astype(np.float32))]


@case
def sort_chunks_of_no_rows(rng):
    return _check_sort(rng, (0, 16), [0, 0, 0], [2, 0, 1])


@case
def sort_chunks_of_rows_of_no_elements(rng):
    return _check_sort(rng, (12, 0), [5, 3, 4], [2, 0, 1])


# -- grouped GEMM ------------------------------------------------------------------


def _check_grouped(transposed: bool, rng, m, k, n, sizes):
    """ragged_dot (lhs [m, k], rhs [G, k, n]) or transposed_ragged_dot (lhs [m, k], rhs
    [m, n]) and their vjps against the reference."""
    import ragged_dot_reference as ref
    import oxmoe

    sizes = np.asarray(sizes, np.int32)
    lhs, rhs = draw(rng, (m, k)), draw(rng, (m, n) if transposed else (len(sizes), k, n))
    product = oxmoe.transposed_ragged_dot if transposed else oxmoe.ragged_dot
    reference = ref.transposed_ragged_dot if transposed else ref.ragged_dot
    backward = ref.transposed_ragged_dot_backward if transposed else ref.ragged_dot_backward
    out, g, (d_lhs, d_rhs) = vjp(lambda a, b: product(a, b, sizes), lhs, rhs)
    expected_d_lhs, expected_d_rhs = backward(lhs, rhs, sizes, g)
    return [("out", out, reference(lhs, rhs, sizes).value.astype(np.float32)),
            ("d lhs", d_lhs, np.asarray(expected_d_lhs.value).astype(np.float32)),
            ("d rhs", d_rhs, np.asarray(expected_d_rhs.value).astype(np.float32))]


@case
def ragged_dot_of_no_rows(rng):
    return _check_grouped(False, rng, 0, 32, 16, [0, 0, 0])


@case
def ragged_dot_contracting_nothing(rng):
    return _check_grouped(False, rng, 40, 0, 16, [10, 0, 25])


@case
def ragged_dot_of_no_columns(rng):
    return _check_grouped(False, rng, 40, 32, 0, [10, 0, 25])


@case
def ragged_dot_of_no_groups(rng):
    return _check_grouped(False, rng, 40, 32, 16, [])


def _check_ragged_dot_activation(rng, m, k, features, sizes):
    """ragged_dot_activation (SwiGLU, bfloat16: the fused kernel on Hopper where k > 0)
    against the reference product; its hidden activation is zero wherever a dimension of 0
    leaves the product zero (silu(0) * 0)."""
    import jax.numpy as jnp
    import ragged_dot_reference as ref
    from oxmoe import grouped_gemm

    sizes = np.asarray(sizes, np.int32)
    lhs = jnp.asarray(draw(rng, (m, k)), jnp.bfloat16)
    rhs = jnp.asarray(draw(rng, (len(sizes), k, 2 * features)), jnp.bfloat16)
    pre, hidden = grouped_gemm.ragged_dot_activation(lhs, rhs, sizes)
    return [("pre_activation", pre.astype(jnp.float32), ref.ragged_dot(lhs, rhs, sizes).value.astype(np.float32)),
            ("hidden", hidden.astype(jnp.float32), np.zeros((m, features), np.float32))]


@case
def ragged_dot_activation_of_no_rows(rng):
    return _check_ragged_dot_activation(rng, 0, 64, 128, [0, 0, 0])


@case
def ragged_dot_activation_contracting_nothing(rng):
    return _check_ragged_dot_activation(rng, 300, 0, 128, [100, 0, 150])


@case
def ragged_dot_activation_of_no_features(rng):
    return _check_ragged_dot_activation(rng, 300, 64, 0, [100, 0, 150])


@case
def ragged_dot_activation_of_no_groups(rng):
    return _check_ragged_dot_activation(rng, 300, 64, 128, [])


@case
def transposed_ragged_dot_of_no_rows(rng):
    return _check_grouped(True, rng, 0, 32, 16, [0, 0, 0])


@case
def transposed_ragged_dot_of_no_lhs_columns(rng):
    return _check_grouped(True, rng, 40, 0, 16, [10, 0, 25])


@case
def transposed_ragged_dot_of_no_rhs_columns(rng):
    return _check_grouped(True, rng, 40, 32, 0, [10, 0, 25])


# -- FP8 quantization ------------------------------------------------------------------


def _check_quantize(shape, block, transpose):
    """oxmoe.fp8.quantize of zeros of `shape`: values [..., R, C] ([..., C, R] transposed)
    and scales, each with a dimension of 0: nothing to write, and the shapes right."""
    import jax.numpy as jnp
    from oxmoe import fp8

    return _zero_quantization("", fp8.quantize(jnp.zeros(shape, jnp.bfloat16), block, transpose=transpose), shape,
                              block, transpose)


def _zero_quantization(name, q, shape, block, transpose):
    """The checks that ``q`` quantizes zeros of ``shape`` (transposed or not) in ``block``
    blocks: its values and scales zeros of the right shapes."""
    import jax.numpy as jnp

    *lead, rows, cols = shape
    rows, cols = (cols, rows) if transpose else (rows, cols)
    return [(f"{name}values", q.values.astype(jnp.float32), np.zeros((*lead, rows, cols), np.float32)),
            (f"{name}scales", q.scales, np.zeros((*lead, rows // block[0], cols // block[1]), np.float32))]


@case
def quantize_of_no_rows(rng):
    return _check_quantize((0, 256), (1, 128), False)


@case
def quantize_of_no_columns(rng):
    return _check_quantize((256, 0), (128, 1), False)


@case
def quantize_of_no_batch(rng):
    return _check_quantize((0, 128, 256), (128, 128), False)


@case
def quantize_transposed_of_no_rows(rng):
    return _check_quantize((0, 256), (128, 1), True)


@case
def quantize_transposed_of_no_columns(rng):
    return _check_quantize((3, 256, 0), (1, 128), True)


def _check_quantize_with_transpose(shape, block):
    """oxmoe.fp8.quantize_with_transpose of zeros of `shape`: both quantizations' values and
    scales, each with a dimension of 0."""
    import jax.numpy as jnp
    from oxmoe import fp8

    q, qt = fp8.quantize_with_transpose(jnp.zeros(shape, jnp.bfloat16), block)
    return _zero_quantization("", q, shape, block, False) + _zero_quantization("transposed ", qt, shape, block, True)


@case
def quantize_with_transpose_of_no_rows(rng):
    return _check_quantize_with_transpose((0, 256), (1, 128))


@case
def quantize_with_transpose_of_no_columns(rng):
    return _check_quantize_with_transpose((256, 0), (128, 1))


@case
def quantize_with_transpose_of_no_batch(rng):
    return _check_quantize_with_transpose((0, 128, 256), (128, 128))


def _check_requantize(shape, block, transpose):
    """oxmoe.fp8.requantize of FP8 zeros of `shape` in 1 x 128 blocks: values and scales, each
    with a dimension of 0."""
    import jax.numpy as jnp
    from oxmoe import fp8

    *lead, rows, cols = shape
    q = fp8.BlockQuantized(jnp.zeros(shape, jnp.float8_e4m3fn), jnp.ones((*lead, rows, cols // 128)), (1, 128))
    return _zero_quantization("", fp8.requantize(q, block, dtype=jnp.bfloat16, transpose=transpose), shape, block,
                              transpose)


@case
def requantize_of_no_rows(rng):
    return _check_requantize((0, 256), (1, 128), True)


@case
def requantize_of_no_columns(rng):
    return _check_requantize((256, 0), (128, 1), False)


@case
def requantize_of_no_batch(rng):
    return _check_requantize((0, 128, 256), (128, 128), True)


# -- the activation backward: rows or features can be 0 ------------------------------


def _check_activation_bwd(rows, features):
    """oxmoe.activation.activation_bwd (SwiGLU) of `rows` x `features`: every result whatever
    is left of it (a row of no features has a weight gradient of 0)."""
    import jax.numpy as jnp

    from oxmoe import activation

    grads = activation.activation_bwd(jnp.zeros((rows, features), jnp.bfloat16),
                                      jnp.zeros((rows, 2 * features), jnp.bfloat16), jnp.ones((rows,), jnp.float32))
    return [("grad_pre_activation", grads.grad_pre_activation.astype(jnp.float32), np.zeros((rows, 2 * features),
                                                                                            np.float32)),
            ("weighted_hidden", grads.weighted_hidden.astype(jnp.float32), np.zeros((rows, features), np.float32)),
            ("grad_row_probs", grads.grad_row_probs, np.zeros((rows,), np.float32))]


@case
def activation_bwd_of_no_rows(rng):
    return _check_activation_bwd(0, 768)


@case
def activation_bwd_of_no_features(rng):
    return _check_activation_bwd(5, 0)


def _check_fp8_activation(rows, features):
    """oxmoe.fp8.activation (SwiGLU) of zeros [rows, 2 features]: its values and scales, each
    with a dimension of 0."""
    import jax.numpy as jnp

    from oxmoe import fp8

    q = fp8.activation(jnp.zeros((rows, 2 * features), jnp.bfloat16))
    return _zero_quantization("", q, (rows, features), fp8.ACTIVATION_BLOCK, False)


@case
def fp8_activation_of_no_rows(rng):
    return _check_fp8_activation(0, 768)


@case
def fp8_activation_of_no_features(rng):
    return _check_fp8_activation(5, 0)


# -- the child process ---------------------------------------------------------------


def _mismatch(what, actual, expected) -> str | None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{what}: {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
    if actual.dtype.kind == "f":
        # Exactly the reference: every value here is a copy, a zero or an exact sum.
        bad = ~(actual == expected)
    else:
        bad = actual != expected
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        return f"{what}: {int(bad.sum())} of {bad.size} elements wrong, e.g. at {where}: {actual[where]!r}, " \
               f"expected {expected[where]!r}"
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_default_device", jax.devices(args.platform)[0])
    from oxmoe import _library

    print(json.dumps({"poisoned": bool(_library.library().oxmoe_poisons_results())}), flush=True)
    for name, fn in CASES.items():
        rng = np.random.default_rng([args.seed, len(name)])
        try:
            problems = [p for what, a, b in fn(rng) if (p := _mismatch(what, a, b))]
        except Exception as e:  # noqa: BLE001  (the error is the report)
            problems = [f"raised {type(e).__name__}: {e}"]
        print(json.dumps({"case": name, "problems": problems}), flush=True)


def run_cases(platform: str) -> tuple[dict, str]:
    """Every case in a child process with poisoned results, on fresh random data
    (OXMOE_TEST_SEED replays a run): (problems by case, how the child ended)."""
    seed = int(os.environ.get("OXMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    env = dict(os.environ, OXMOE_POISON_RESULTS="1")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--platform", platform, "--seed", str(seed)],
                          capture_output=True, text=True, timeout=900, env=env)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ending = f"replay with OXMOE_TEST_SEED={seed}; exit status {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}"
    assert records and records[0].get("poisoned"), f"the child's handlers do not poison their results; {ending}"
    return {r["case"]: r["problems"] for r in records[1:]}, ending


def check(name: str, results: dict, ending: str) -> None:
    assert name in results, f"no result for {name}: {ending}"
    assert not results[name], "; ".join(results[name]) + f" ({ending.splitlines()[0]})"


@pytest.mark.parametrize("name", CASES)
def test_cpu_handlers_write_every_element_when_a_dimension_is_zero(name, cpu_results):
    check(name, *cpu_results)


@pytest.mark.gpu
@pytest.mark.skipif(not devices.gpu_devices(), reason=devices.NO_GPU_REASON)
@pytest.mark.parametrize("name", CASES)
def test_cuda_handlers_write_every_element_when_a_dimension_is_zero(name, gpu_results):
    check(name, *gpu_results)


@pytest.fixture(scope="module")
def cpu_results():
    return run_cases("cpu")


@pytest.fixture(scope="module")
def gpu_results():
    return run_cases(devices.gpu_platform())


if __name__ == "__main__":
    main()
