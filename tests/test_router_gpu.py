"""oxmoe's CUDA router kernels, checked where only a GPU can check them. Every test here is
marked `gpu` and skipped when jax has no GPU device.

(The rest of the suite also runs on the GPU when it is the default device, e.g. with
JAX_PLATFORMS=cuda,cpu: every plain call there exercises the CUDA kernels against the
float64 reference.) This file adds:

- the GPU against the CPU implementation (the executable specification) on the same
  inputs, for the router configurations of real models, at the benchmark token count
  (65536) and an odd one (4097), forward and backward, in float32, bfloat16 and float16;
- determinism: the load-balancing loss (a sum over every token) is bit-identical from
  run to run (the kernels promise no float atomics);
- large expert counts (1024, 2048) against the float64 reference;
- bad arguments with GPU arrays raise in Python before anything is compiled or run, and
  the CUDA handlers, called directly with wrong buffers, return errors rather than crash.

How close the GPU must be to the CPU: both compute in float32 from the same inputs, but
exp/sigmoid differ by an ulp or two and sums run in different orders (the CPU adds a row's
terms one after the other, a GPU block in a tree). A float32 sum of n terms reordered
moves by about sqrt(n) rounding steps. Simulating, over 65536 rows, the CPU's formulas
with sequential sums against the same formulas with tree sums, an exp off by up to 2 ulps
and division by a reciprocal gave at most 6 float32 eps (relative, eps = 2**-23) for the
top-8 weights and their gradient, 10 and 12 for softmax scores over 128 and 256 experts,
and 17 for the softmax gradient over 256 experts (relative to the terms it subtracts).
The allowance below is 8 + 2 sqrt(n) eps (14, 31, 40 for n = 8, 128, 256), relative to
the value or, for a gradient that cancels, to the terms it subtracts
(router_checks.*_backward_terms); that is 2 to 6 times tighter than the float64-reference
tolerance (rtol 1e-5 = 84 eps). A value rounded to bfloat16/float16 may in addition land
one half-precision ulp apart, where the two float32 values straddle a rounding boundary.
"""

import functools
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import ffi_direct_calls
import router_checks as rc
import router_reference as ref
import test_router_errors
from oxmoe.model_shapes import DEEPSEEK_V3, LLAMA4, MIXTRAL, QWEN3_MOE, QWEN3_MOE_PRE_SOFTMAX, ROUTER_CONFIGS
from oxmoe import router

GPUS = devices.gpu_devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)]

DTYPES = pytest.mark.parametrize("dtype", list(rc.DTYPES.values()), ids=list(rc.DTYPES))
BENCHMARK_TOKENS, ODD_TOKENS = 65536, 4097
# The benchmark shapes (DeepSeek-V3, Qwen3-MoE, Mixtral) at the benchmark token count; every
# model configuration at an odd one.
BENCHMARK_CONFIGS = (MIXTRAL, QWEN3_MOE, QWEN3_MOE_PRE_SOFTMAX, DEEPSEEK_V3)


def config_cases(configs_at_odd, configs_at_benchmark):
    return [pytest.param(c, ODD_TOKENS, id=f"{c.name}-T{ODD_TOKENS}") for c in configs_at_odd] + [
        pytest.param(c, BENCHMARK_TOKENS, id=f"{c.name}-T{BENCHMARK_TOKENS}") for c in configs_at_benchmark
    ]


# -- helpers --------------------------------------------------------------------------


def run_on(device, fn, *args):
    """jax.jit(fn) with every input committed to `device`; the outputs as NumPy arrays,
    after checking that they were computed there."""
    out = jax.jit(fn)(*jax.device_put(args, device))
    for leaf in jax.tree.leaves(out):
        assert leaf.devices() == {device}, f"an output is on {leaf.devices()}, expected {device}"
    return jax.tree.map(np.asarray, out)


def host_logits(rng, shape, dtype):
    return np.asarray(rc.draw_logits(rng, shape, dtype))


def host_like(rng, shape, dtype):
    return np.asarray(rc.draw_like(rng, shape, dtype))


def host_bias(rng, config):
    return np.asarray(rc.draw_expert_bias(rng, config.num_experts)) if config.use_expert_bias else None


F32_EPS = float(np.finfo(np.float32).eps)


def f32_allowance(num_terms: int) -> float:
    """How many float32 eps (relative) two float32 implementations may differ by on a value
    computed through a sum of num_terms terms (see the module docstring)."""
    return 8.0 + 2.0 * math.sqrt(num_terms)


def assert_gpu_matches_cpu(gpu, cpu, dtype, *, num_terms: int, what: str, context: str, rows=None, terms=None):
    """|gpu - cpu| <= f32_allowance(num_terms) eps * max(|cpu|, terms), plus one ulp of dtype
    when it is a half type; only on the token rows where `rows` (bool [T]) is true."""
    dtype = np.dtype(dtype)
    gpu, cpu = np.asarray(gpu), np.asarray(cpu)
    assert gpu.dtype == dtype and cpu.dtype == dtype, f"{what}: dtypes GPU {gpu.dtype}, CPU {cpu.dtype}, expected {dtype}"
    assert gpu.shape == cpu.shape, f"{what}: shapes GPU {gpu.shape}, CPU {cpu.shape} ({context})"
    g, c = gpu.astype(np.float64), cpu.astype(np.float64)
    scale = np.abs(c) if terms is None else np.maximum(np.abs(c), np.asarray(terms, np.float64))
    allowed = f32_allowance(num_terms) * F32_EPS * scale
    if dtype != np.float32:
        allowed = allowed + np.spacing(np.maximum(np.abs(g), np.abs(c)).astype(dtype)).astype(np.float64)
    bad = ~(np.abs(g - c) <= allowed)
    if rows is not None:
        bad &= np.asarray(rows, bool).reshape(-1, *([1] * (bad.ndim - 1)))
    if bad.any():
        where = [tuple(int(i) for i in w) for w in np.argwhere(bad)[:6]]
        with np.errstate(divide="ignore", invalid="ignore"):
            in_eps = np.abs(g - c) / (F32_EPS * scale)
        lines = [f"{w}: GPU {g[w]!r}, CPU {c[w]!r}, differ by {in_eps[w]:.3g} eps of {'terms' if terms is not None else 'the value'}"
                 for w in where]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} elements of the GPU differ from the CPU implementation by more "
            f"than {f32_allowance(num_terms):.3g} float32 eps{' + one ' + str(dtype) + ' ulp' if dtype != np.float32 else ''} "
            f"(largest: {np.nanmax(np.where(bad, in_eps, 0)):.3g} eps):\n  " + "\n  ".join(lines) + f"\n({context})"
        )


def topk_with_vjp(config):
    def fn(logits, bias, grad_probs):
        probs, vjp, routing_map = jax.vjp(
            lambda x: router.topk(x, config.topk, expert_bias=bias, **config.topk_kwargs()), logits, has_aux=True
        )
        (grad_logits,) = vjp(grad_probs)
        return probs, routing_map, grad_logits

    return fn


def scores_with_vjp(topk, score_function):
    def fn(logits, grad_scores):
        scores, vjp, routing_map = jax.vjp(
            lambda x: router.aux_loss_scores(x, topk, score_function=score_function)[::-1], logits, has_aux=True
        )
        (grad_logits,) = vjp(grad_scores)
        return routing_map, scores, grad_logits

    return fn


def aux_loss_with_vjp(kwargs):
    def fn(probs, tokens_per_expert, grad_loss):
        loss, vjp = jax.vjp(lambda p: router.aux_loss(p, tokens_per_expert, **kwargs), probs)
        (grad_probs,) = vjp(grad_loss)
        return loss, grad_probs

    return fn


def router_probs(rng, num_tokens, num_experts, topk, dtype):
    """Realistic aux-loss inputs: top-k softmax probabilities and the per-expert token counts."""
    logits = rng.standard_normal((num_tokens, num_experts))
    chosen = ref.indices_to_mask(ref.top_indices(logits, topk), num_experts)
    weights = np.where(chosen, np.exp(logits), 0.0)
    probs = (weights / weights.sum(-1, keepdims=True)).astype(np.float32).astype(dtype)
    return probs, chosen.sum(axis=0).astype(np.int32)


# -- the GPU against the CPU implementation ------------------------------------------


@pytest.mark.parametrize("config, num_tokens", config_cases(ROUTER_CONFIGS, BENCHMARK_CONFIGS))
@DTYPES
def test_topk_and_its_vjp_on_gpu_match_the_cpu_implementation(config, num_tokens, dtype, gpu, cpu, seed, rng):
    kwargs = config.topk_kwargs()
    logits = host_logits(rng, (num_tokens, config.num_experts), dtype)
    bias = host_bias(rng, config)
    grad_probs = host_like(rng, logits.shape, dtype)
    fn = topk_with_vjp(config)
    gpu_probs, gpu_map, gpu_grad = run_on(gpu, fn, logits, bias, grad_probs)
    cpu_probs, cpu_map, cpu_grad = run_on(cpu, fn, logits, bias, grad_probs)
    context = f"{config.name}, T={num_tokens}, {jnp.dtype(dtype).name}, seed={seed}"

    expected = rc.check_topk(gpu_probs, gpu_map, logits, config.topk, kwargs, bias, context=f"GPU, {context}")
    rc.check_topk_grad(gpu_grad, grad_probs, logits, gpu_map, config.topk, kwargs, context=f"GPU, {context}")

    rc.assert_routing_matches(gpu_map, cpu_map, expected.margin, config.topk, what="GPU vs CPU routing_map",
                              context=context)
    same_selection = (gpu_map == cpu_map).all(axis=-1)
    # Pre-softmax weights come from a softmax over every expert; the others from the selection.
    num_terms = config.num_experts if config.use_pre_softmax else config.topk
    assert_gpu_matches_cpu(gpu_probs, cpu_probs, dtype, num_terms=num_terms, rows=same_selection,
                           what="probs", context=context)
    terms = rc.topk_backward_terms(grad_probs, logits, gpu_map, config.topk, kwargs)
    assert_gpu_matches_cpu(gpu_grad, cpu_grad, dtype, num_terms=num_terms, rows=same_selection, terms=terms,
                           what="d logits", context=context)


# aux_loss_scores depends on (experts, topk, score function) only: Qwen3 pre-softmax would repeat Qwen3.
SCORES_CONFIGS = (MIXTRAL, QWEN3_MOE, DEEPSEEK_V3, LLAMA4)


@pytest.mark.parametrize("config, num_tokens", config_cases(SCORES_CONFIGS, (MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)))
@DTYPES
def test_aux_loss_scores_and_their_vjp_on_gpu_match_the_cpu_implementation(config, num_tokens, dtype, gpu, cpu,
                                                                         seed, rng):
    topk, score_function = config.topk, config.score_function
    logits = host_logits(rng, (num_tokens, config.num_experts), dtype)
    grad_scores = host_like(rng, logits.shape, jnp.float32)
    fn = scores_with_vjp(topk, score_function)
    gpu_map, gpu_scores, gpu_grad = run_on(gpu, fn, logits, grad_scores)
    cpu_map, cpu_scores, cpu_grad = run_on(cpu, fn, logits, grad_scores)
    context = f"{config.name}, T={num_tokens}, {jnp.dtype(dtype).name}, seed={seed}"

    expected = rc.check_aux_loss_scores(gpu_map, gpu_scores, logits, topk, score_function, context=f"GPU, {context}")
    rc.check_aux_loss_scores_grad(gpu_grad, grad_scores, logits, score_function, context=f"GPU, {context}")

    rc.assert_routing_matches(gpu_map, cpu_map, expected.margin, topk, what="GPU vs CPU routing_map", context=context)
    # Both score functions normalise over every expert.
    assert_gpu_matches_cpu(gpu_scores, cpu_scores, jnp.float32, num_terms=config.num_experts, what="scores",
                           context=context)
    terms = rc.aux_loss_scores_backward_terms(grad_scores, logits, score_function)
    assert_gpu_matches_cpu(gpu_grad, cpu_grad, dtype, num_terms=config.num_experts, terms=terms, what="d logits",
                           context=context)


@pytest.mark.parametrize("config, num_tokens", config_cases(SCORES_CONFIGS, (MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)))
@DTYPES
def test_aux_loss_and_its_vjp_on_gpu_match_the_cpu_implementation(config, num_tokens, dtype, gpu, cpu, seed, rng):
    probs, counts = router_probs(rng, num_tokens, config.num_experts, config.topk, dtype)
    kwargs = dict(total_num_tokens=num_tokens, topk=config.topk, coeff=1e-2)
    grad_loss = np.float32(rng.standard_normal())
    fn = aux_loss_with_vjp(kwargs)
    gpu_loss, gpu_grad = run_on(gpu, fn, probs, counts, grad_loss)
    cpu_loss, cpu_grad = run_on(cpu, fn, probs, counts, grad_loss)
    context = f"{config.name}, T={num_tokens}, {jnp.dtype(dtype).name}, seed={seed}"

    rc.check_aux_loss(gpu_loss, probs, counts, **kwargs, context=f"GPU, {context}")
    rc.check_aux_loss(cpu_loss, probs, counts, **kwargs, context=f"CPU, {context}")
    # The loss sums T * E terms, and the CPU adds each expert's column one row after another
    # (in blocks of 1024 rows), which alone moves it by ~1e-6: no tighter bound than the
    # reference tolerance is meaningful here; both also meet it against the float64 reference.
    rc.assert_close(gpu_loss, cpu_loss, rc.F32, what="GPU vs CPU loss", context=context)
    expected_grad = ref.aux_loss_backward(grad_loss, probs.shape, counts, **kwargs)
    rc.assert_close(gpu_grad, expected_grad, dtype, what="GPU d probs", context=context)
    assert_gpu_matches_cpu(gpu_grad, cpu_grad, dtype, num_terms=1, what="d probs", context=context)


# -- determinism ----------------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [256, 1024, 2048])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_aux_loss_on_gpu_is_bit_identical_from_run_to_run(num_experts, dtype, gpu, seed, rng):
    num_tokens, runs = BENCHMARK_TOKENS, 5
    p = rng.random((num_tokens, num_experts), dtype=np.float32)
    probs = (p / p.sum(axis=-1, keepdims=True)).astype(dtype)
    counts = rng.integers(0, num_tokens, num_experts).astype(np.int32)
    kwargs = dict(total_num_tokens=num_tokens, topk=8, coeff=1e-2)
    fn = functools.partial(router.aux_loss, **kwargs)
    losses = [run_on(gpu, fn, probs, counts) for _ in range(runs)]
    context = f"E={num_experts}, {jnp.dtype(dtype).name}, seed={seed}"
    bits = [int(loss.view(np.uint32)) for loss in losses]
    assert len(set(bits)) == 1, (
        f"aux_loss differs from run to run on the same input: {[float(loss) for loss in losses]} "
        f"(bits {[hex(b) for b in bits]}): a reduction whose order varies, e.g. float atomics ({context})"
    )
    rc.check_aux_loss(losses[0], probs, counts, **kwargs, context=context)


# -- large expert counts --------------------------------------------------------------

LARGE_E_TOKENS = 8193
LARGE_E_TOPK_MODES = {
    "softmax_post": (dict(score_function="softmax"), False),
    "softmax_pre": (dict(score_function="softmax", use_pre_softmax=True), False),
    "sigmoid_grouped_bias_scaled": (
        dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5), True),
}
LARGE_E = pytest.mark.parametrize("num_experts", [1024, 2048])
LARGE_E_DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])


@LARGE_E
@LARGE_E_DTYPES
@pytest.mark.parametrize("mode", LARGE_E_TOPK_MODES)
def test_topk_with_many_experts_on_gpu_matches_the_reference(mode, num_experts, dtype, gpu, seed, rng):
    kwargs, with_bias = LARGE_E_TOPK_MODES[mode]
    topk = 8
    logits = host_logits(rng, (LARGE_E_TOKENS, num_experts), dtype)
    bias = np.asarray(rc.draw_expert_bias(rng, num_experts)) if with_bias else None
    grad_probs = host_like(rng, logits.shape, dtype)

    def fn(logits, bias, grad_probs):
        probs, vjp, routing_map = jax.vjp(lambda x: router.topk(x, topk, expert_bias=bias, **kwargs), logits,
                                          has_aux=True)
        return probs, routing_map, vjp(grad_probs)[0]

    probs, routing_map, grad_logits = run_on(gpu, fn, logits, bias, grad_probs)
    context = f"{mode}, E={num_experts}, {jnp.dtype(dtype).name}, seed={seed}"
    rc.check_topk(probs, routing_map, logits, topk, kwargs, bias, context=context)
    rc.check_topk_grad(grad_logits, grad_probs, logits, routing_map, topk, kwargs, context=context)


@LARGE_E
@LARGE_E_DTYPES
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_scores_with_many_experts_on_gpu_match_the_reference(score_function, num_experts, dtype, gpu, seed,
                                                                     rng):
    topk = 8
    logits = host_logits(rng, (LARGE_E_TOKENS, num_experts), dtype)
    grad_scores = host_like(rng, logits.shape, jnp.float32)
    routing_map, scores, grad_logits = run_on(gpu, scores_with_vjp(topk, score_function), logits, grad_scores)
    context = f"{score_function}, E={num_experts}, {jnp.dtype(dtype).name}, seed={seed}"
    rc.check_aux_loss_scores(routing_map, scores, logits, topk, score_function, context=context)
    rc.check_aux_loss_scores_grad(grad_logits, grad_scores, logits, score_function, context=context)


@pytest.mark.parametrize("primitive", ["topk", "aux_loss_scores"])
def test_more_experts_than_the_gpu_kernels_hold_is_right_or_a_clear_error(primitive, gpu, seed, rng):
    # The CUDA kernels keep a token's row in registers (at most 2048 experts today); the Python
    # API does not know the backend's limit. Beyond it: the right answer, or an error from the
    # handler that says so, never wrong results or a crash.
    num_experts, topk = 4096, 8
    logits = host_logits(rng, (64, num_experts), jnp.float32)
    fn = (functools.partial(router.topk, topk=topk) if primitive == "topk"
          else functools.partial(router.aux_loss_scores, topk=topk))
    try:
        out = run_on(gpu, fn, logits)
    except jax.errors.JaxRuntimeError as e:
        message = str(e)
        assert f"oxmoe_{primitive}_fwd" in message, f"the error does not name the target: {message}"
        assert re.search(r"\b2048\b|experts", message), f"the error does not say what the limit is: {message}"
        return
    context = f"E={num_experts}, seed={seed}"
    if primitive == "topk":
        rc.check_topk(*out, logits, topk, {}, None, context=context)
    else:
        rc.check_aux_loss_scores(*out, logits, topk, "softmax", context=context)


# -- bad inputs -----------------------------------------------------------------------


@pytest.mark.parametrize("case", test_router_errors.CASES)
def test_bad_argument_with_gpu_arrays_raises_before_anything_is_compiled(case, gpu, caplog):
    fn, args, error, pattern = test_router_errors.CASES[case]
    args = jax.block_until_ready(jax.device_put(args, gpu))
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        with pytest.raises(error, match=pattern):
            fn(*args)
        with pytest.raises(error, match=pattern):
            jax.jit(fn)(*args)
    compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiled, f"{case}: something was compiled before the error: {compiled}"


def test_compile_logging_that_the_bad_argument_tests_rely_on_shows_a_compile(gpu, caplog):
    # The control for the test above: a valid call on a shape compiled nowhere else logs its
    # compilation, so that the absence of such a record there means something.
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 7 * 13, dtype=jnp.float32).reshape(7, 13), gpu)
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        jax.block_until_ready(router.topk(x, 5, score_function="sigmoid", scaling_factor=0.75))
    assert any("Compiling" in r.getMessage() for r in caplog.records), (
        f"jax.log_compiles logged no 'Compiling' record: {[r.getMessage() for r in caplog.records]}"
    )


@pytest.fixture(scope="module")
def gpu_direct_calls():
    """Every direct call of ffi_direct_calls.py, run once in a child process on the GPU."""
    return ffi_direct_calls.run(devices.gpu_platform())


@pytest.mark.parametrize("case", ffi_direct_calls.CASES)
def test_gpu_handler_given_a_wrong_buffer_returns_an_error_naming_it(case, gpu_direct_calls):
    ffi_direct_calls.check_case(case, *gpu_direct_calls)


def test_gpu_process_computes_correctly_after_the_handler_errors(gpu_direct_calls):
    results, _, process = gpu_direct_calls
    ffi_direct_calls.check_valid_call(results, process, devices.gpu_platform())
