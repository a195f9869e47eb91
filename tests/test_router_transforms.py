"""The router primitives give the same results under jax.jit, jax.vmap, with extra leading
token dimensions, and with the tokens sharded over eight devices (no gather of the
logits), as the plain call and the float64 reference.

The sharded tests use the default backend's devices when it has eight, else the eight
host CPU devices conftest.py forces (on a one-GPU machine they run on CPU: devices.py)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import devices
import router_checks as rc
import router_reference as ref
from oxmoe.model_shapes import DEEPSEEK_V3, LLAMA4, MIXTRAL, QWEN3_MOE_PRE_SOFTMAX, ROUTER_CONFIGS
from oxmoe import router

CONFIGS = pytest.mark.parametrize("config", ROUTER_CONFIGS, ids=lambda c: c.name)


def topk_fn(config, bias=None):
    return lambda x: router.topk(x, config.topk, expert_bias=bias, **config.topk_kwargs())


def scores_fn(config):
    return functools.partial(router.aux_loss_scores, topk=config.topk, score_function=config.score_function)


def topk_loss_fn(config, bias=None):
    """A scalar loss of the probs (with a fixed cotangent) for jax.grad."""
    return lambda x, g: jnp.sum(topk_fn(config, bias)(x)[0].astype(jnp.float32) * g)


def inputs(config, rng, shape, dtype=jnp.float32):
    logits = rc.draw_logits(rng, shape + (config.num_experts,), dtype)
    bias = rc.draw_expert_bias(rng, config.num_experts) if config.use_expert_bias else None
    return logits, bias


def assert_identical(actual, expected, *, what, context):
    """Two oxmoe calls on the same rows: the same handler, so bit-for-bit the same."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype} ({context})"
    np.testing.assert_array_equal(actual, expected, err_msg=f"{what} ({context})")


def router_probs(rng, shape, num_experts, dtype=jnp.float32):
    p = rng.random(shape + (num_experts,))
    return jnp.asarray((p / p.sum(-1, keepdims=True)).astype(np.float32)).astype(dtype)


# ----------------------------------------------------------------------------- jit


@CONFIGS
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_topk_under_jit_equals_the_eager_call(config, dtype, seed, rng):
    logits, bias = inputs(config, rng, (1000,), dtype)
    probs, routing_map = jax.jit(topk_fn(config, bias))(logits)
    eager_probs, eager_map = topk_fn(config, bias)(logits)
    context = f"seed={seed}"
    assert_identical(probs, eager_probs, what="probs", context=context)
    assert_identical(routing_map, eager_map, what="routing_map", context=context)
    rc.check_topk(probs, routing_map, logits, config.topk, config.topk_kwargs(), bias, context=context)


@CONFIGS
def test_topk_gradient_under_jit_equals_the_eager_gradient(config, seed, rng):
    logits, bias = inputs(config, rng, (1000,))
    g = rc.draw_like(rng, logits.shape, jnp.float32)
    grad = jax.jit(jax.grad(topk_loss_fn(config, bias)))(logits, g)
    assert_identical(grad, jax.grad(topk_loss_fn(config, bias))(logits, g), what="d logits", context=f"seed={seed}")
    _, routing_map = topk_fn(config, bias)(logits)
    rc.check_topk_grad(grad, g, logits, routing_map, config.topk, config.topk_kwargs(), context=f"seed={seed}")


@pytest.mark.parametrize("config", [MIXTRAL, LLAMA4], ids=lambda c: c.name)
def test_aux_loss_scores_under_jit_equal_the_eager_call(config, seed, rng):
    logits, _ = inputs(config, rng, (1000,))
    routing_map, scores = jax.jit(scores_fn(config))(logits)
    eager_map, eager_scores = scores_fn(config)(logits)
    assert_identical(routing_map, eager_map, what="routing_map", context=f"seed={seed}")
    assert_identical(scores, eager_scores, what="scores", context=f"seed={seed}")
    rc.check_aux_loss_scores(routing_map, scores, logits, config.topk, config.score_function, context=f"seed={seed}")


def test_aux_loss_and_its_gradient_under_jit_equal_the_eager_call(seed, rng):
    probs = router_probs(rng, (1000,), 64)
    counts = jnp.asarray(rng.integers(0, 200, 64), dtype=jnp.int32)
    kwargs = dict(total_num_tokens=1000, topk=4, coeff=1e-2)
    fn = functools.partial(router.aux_loss, **kwargs)
    loss, grad = jax.jit(jax.value_and_grad(fn))(probs, counts)
    eager_loss, eager_grad = jax.value_and_grad(fn)(probs, counts)
    assert_identical(loss, eager_loss, what="loss", context=f"seed={seed}")
    assert_identical(grad, eager_grad, what="d probs", context=f"seed={seed}")
    rc.check_aux_loss(loss, probs, counts, **kwargs, context=f"seed={seed}")


# ---------------------------------------------------------------------------- vmap


@CONFIGS
def test_topk_under_vmap_equals_the_call_on_each_batch_element(config, seed, rng):
    logits, bias = inputs(config, rng, (3, 333), jnp.bfloat16)
    probs, routing_map = jax.vmap(topk_fn(config, bias))(logits)
    for b in range(3):
        context = f"batch element {b}, seed={seed}"
        one_probs, one_map = topk_fn(config, bias)(logits[b])
        assert_identical(probs[b], one_probs, what="probs", context=context)
        assert_identical(routing_map[b], one_map, what="routing_map", context=context)
        rc.check_topk(probs[b], routing_map[b], logits[b], config.topk, config.topk_kwargs(), bias, context=context)


def test_topk_under_vmap_with_a_batched_expert_bias_uses_each_elements_bias(seed, rng):
    config = DEEPSEEK_V3
    logits, _ = inputs(config, rng, (3, 333))
    biases = jnp.stack([rc.draw_expert_bias(rng, config.num_experts) for _ in range(3)])
    fn = lambda x, b: router.topk(x, config.topk, expert_bias=b, **config.topk_kwargs())  # noqa: E731
    probs, routing_map = jax.vmap(fn)(logits, biases)
    for b in range(3):
        context = f"batch element {b}, seed={seed}"
        one_probs, one_map = fn(logits[b], biases[b])
        assert_identical(probs[b], one_probs, what="probs", context=context)
        assert_identical(routing_map[b], one_map, what="routing_map", context=context)
        rc.check_topk(
            probs[b], routing_map[b], logits[b], config.topk, config.topk_kwargs(), biases[b], context=context
        )


@CONFIGS
def test_topk_gradient_under_vmap_equals_each_batch_elements_gradient(config, seed, rng):
    logits, bias = inputs(config, rng, (3, 333))
    g = rc.draw_like(rng, logits.shape, jnp.float32)
    grads = jax.vmap(jax.grad(topk_loss_fn(config, bias)))(logits, g)
    for b in range(3):
        context = f"batch element {b}, seed={seed}"
        assert_identical(grads[b], jax.grad(topk_loss_fn(config, bias))(logits[b], g[b]), what="d logits", context=context)


@pytest.mark.parametrize("config", [QWEN3_MOE_PRE_SOFTMAX, DEEPSEEK_V3], ids=lambda c: c.name)
def test_aux_loss_scores_under_vmap_equal_the_call_on_each_batch_element(config, seed, rng):
    logits, _ = inputs(config, rng, (3, 333))
    routing_map, scores = jax.vmap(scores_fn(config))(logits)
    for b in range(3):
        context = f"batch element {b}, seed={seed}"
        one_map, one_scores = scores_fn(config)(logits[b])
        assert_identical(routing_map[b], one_map, what="routing_map", context=context)
        assert_identical(scores[b], one_scores, what="scores", context=context)
        rc.check_aux_loss_scores(
            routing_map[b], scores[b], logits[b], config.topk, config.score_function, context=context
        )


@pytest.mark.parametrize("counts_batched", [False, True], ids=["shared_counts", "batched_counts"])
def test_aux_loss_under_vmap_gives_one_loss_per_batch_element(counts_batched, seed, rng):
    probs = router_probs(rng, (3, 333), 64)
    counts = jnp.asarray(rng.integers(0, 100, (3, 64) if counts_batched else (64,)), dtype=jnp.int32)
    kwargs = dict(total_num_tokens=333, topk=4, coeff=1e-2)
    fn = functools.partial(router.aux_loss, **kwargs)
    losses, grads = jax.vmap(jax.value_and_grad(fn), in_axes=(0, 0 if counts_batched else None))(probs, counts)
    assert losses.shape == (3,), f"losses shape {losses.shape}, expected (3,)"
    for b in range(3):
        context = f"batch element {b}, seed={seed}"
        counts_b = counts[b] if counts_batched else counts
        one_loss, one_grad = jax.value_and_grad(fn)(probs[b], counts_b)
        rc.assert_close(losses[b], one_loss, rc.F32, what="loss vs unbatched call", context=context)
        assert_identical(grads[b], one_grad, what="d probs", context=context)
        rc.check_aux_loss(losses[b], probs[b], counts_b, **kwargs, context=context)


# ---------------------------------------------------------------- leading dimensions


@CONFIGS
def test_topk_treats_leading_dimensions_as_tokens(config, seed, rng):
    logits, bias = inputs(config, rng, (4, 250))
    probs, routing_map = topk_fn(config, bias)(logits)
    flat_probs, flat_map = topk_fn(config, bias)(logits.reshape(1000, -1))
    context = f"seed={seed}"
    assert_identical(probs.reshape(1000, -1), flat_probs, what="probs", context=context)
    assert_identical(routing_map.reshape(1000, -1), flat_map, what="routing_map", context=context)
    rc.check_topk(probs, routing_map, logits, config.topk, config.topk_kwargs(), bias, context=context)
    g = rc.draw_like(rng, logits.shape, jnp.float32)
    grad = jax.grad(topk_loss_fn(config, bias))(logits, g)
    assert grad.shape == logits.shape, f"d logits shape {grad.shape} != {logits.shape}"
    rc.check_topk_grad(grad, g, logits, routing_map, config.topk, config.topk_kwargs(), context=context)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_scores_treat_leading_dimensions_as_tokens(score_function, seed, rng):
    logits = rc.draw_logits(rng, (2, 3, 111, 32), jnp.float32)
    routing_map, scores = router.aux_loss_scores(logits, 4, score_function=score_function)
    flat_map, flat_scores = router.aux_loss_scores(logits.reshape(-1, 32), 4, score_function=score_function)
    context = f"seed={seed}"
    assert_identical(routing_map.reshape(-1, 32), flat_map, what="routing_map", context=context)
    assert_identical(scores.reshape(-1, 32), flat_scores, what="scores", context=context)
    rc.check_aux_loss_scores(routing_map, scores, logits, 4, score_function, context=context)
    g = rc.draw_like(rng, logits.shape, jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(router.aux_loss_scores(x, 4, score_function=score_function)[1] * g))(logits)
    rc.check_aux_loss_scores_grad(grad, g, logits, score_function, context=context)


def test_aux_loss_counts_every_leading_dimension_as_tokens(seed, rng):
    probs = router_probs(rng, (4, 250), 64, jnp.bfloat16)
    counts = jnp.asarray(rng.integers(0, 100, 64), dtype=jnp.int32)
    kwargs = dict(total_num_tokens=1000, topk=4, coeff=1e-2)
    loss, grad = jax.value_and_grad(functools.partial(router.aux_loss, **kwargs))(probs, counts)
    context = f"seed={seed}"
    rc.check_aux_loss(loss, probs, counts, **kwargs, context=context)
    rc.assert_close(
        grad, ref.aux_loss_backward(1.0, probs.shape, counts, **kwargs), jnp.bfloat16, what="d probs", context=context
    )


# ------------------------------------------------------------------------ sharding

COLLECTIVES_THAT_MOVE_TOKENS = ("all-gather", "all-to-all", "collective-permute")
MESHES = {
    "1d_explicit": ((8,), ("data",), None, P("data", None)),
    "1d_auto": ((8,), ("data",), (AxisType.Auto,), P("data", None)),
    "2d": ((4, 2), ("data", "model"), None, P(("data", "model"), None)),
}
MESH_PARAMS = pytest.mark.parametrize("mesh_name", MESHES)


def token_sharding(mesh_name):
    shape, names, axis_types, spec = MESHES[mesh_name]
    mesh = jax.make_mesh(
        shape,
        names,
        axis_types=None if axis_types is None else axis_types * len(shape),
        devices=devices.mesh_devices(math.prod(shape)),
    )
    return NamedSharding(mesh, spec)


def replicated(x, sharding):
    """x whole on every device of the sharding's mesh (None stays None): the non-token inputs
    of a sharded call live on the mesh too, even when the mesh is not on the default backend."""
    return None if x is None else jax.device_put(x, NamedSharding(sharding.mesh, P()))


def assert_no_token_movement(fn, *args, what):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    found = [name for name in COLLECTIVES_THAT_MOVE_TOKENS if name in hlo]
    assert not found, f"{what}: compiled HLO of token-sharded inputs contains {found}"


def assert_token_sharded(array, sharding, *, what):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), (
        f"{what}: sharding {array.sharding}, expected tokens split as {sharding.spec}"
    )


@MESH_PARAMS
@pytest.mark.parametrize("config", [MIXTRAL, QWEN3_MOE_PRE_SOFTMAX, DEEPSEEK_V3], ids=lambda c: c.name)
def test_topk_on_token_sharded_logits_computes_per_shard(mesh_name, config, seed, rng):
    sharding = token_sharding(mesh_name)
    logits, bias = inputs(config, rng, (1000,), jnp.bfloat16)
    sharded = jax.device_put(logits, sharding)
    fn = topk_fn(config, replicated(bias, sharding))
    probs, routing_map = jax.jit(fn)(sharded)
    context = f"{mesh_name}, seed={seed}"
    assert_token_sharded(probs, sharding, what="probs")
    assert_token_sharded(routing_map, sharding, what="routing_map")
    rc.check_topk(probs, routing_map, logits, config.topk, config.topk_kwargs(), bias, context=context)
    assert_no_token_movement(fn, sharded, what="topk")


@MESH_PARAMS
@pytest.mark.parametrize("config", [QWEN3_MOE_PRE_SOFTMAX, DEEPSEEK_V3], ids=lambda c: c.name)
def test_topk_gradient_on_token_sharded_logits_computes_per_shard(mesh_name, config, seed, rng):
    sharding = token_sharding(mesh_name)
    logits, bias = inputs(config, rng, (1000,))
    g = rc.draw_like(rng, logits.shape, jnp.float32)
    sharded, sharded_g = jax.device_put(logits, sharding), jax.device_put(g, sharding)
    bias = replicated(bias, sharding)
    fn = jax.grad(topk_loss_fn(config, bias))
    grad = jax.jit(fn)(sharded, sharded_g)
    assert_token_sharded(grad, sharding, what="d logits")
    # The selection the gradient held fixed: computed where the gradient was (the mesh's backend).
    _, routing_map = jax.jit(topk_fn(config, bias))(sharded)
    rc.check_topk_grad(grad, g, logits, routing_map, config.topk, config.topk_kwargs(), context=f"seed={seed}")
    assert_no_token_movement(fn, sharded, sharded_g, what="topk backward")


@MESH_PARAMS
@pytest.mark.parametrize("config", [MIXTRAL, DEEPSEEK_V3], ids=lambda c: c.name)
def test_aux_loss_scores_on_token_sharded_logits_compute_per_shard(mesh_name, config, seed, rng):
    sharding = token_sharding(mesh_name)
    logits, _ = inputs(config, rng, (1000,), jnp.float16)
    sharded = jax.device_put(logits, sharding)
    fn = scores_fn(config)
    routing_map, scores = jax.jit(fn)(sharded)
    assert_token_sharded(scores, sharding, what="scores")
    assert_token_sharded(routing_map, sharding, what="routing_map")
    rc.check_aux_loss_scores(routing_map, scores, logits, config.topk, config.score_function, context=f"seed={seed}")
    assert_no_token_movement(fn, sharded, what="aux_loss_scores")


def sharded_aux_loss_problem(mesh_name, rng):
    sharding = token_sharding(mesh_name)
    probs = router_probs(rng, (1000,), 128, jnp.bfloat16)
    counts = replicated(jnp.asarray(rng.integers(0, 100, 128), dtype=jnp.int32), sharding)
    kwargs = dict(total_num_tokens=1000, topk=8, coeff=1e-2)
    return sharding, probs, counts, kwargs


@MESH_PARAMS
def test_aux_loss_on_token_sharded_probs_sums_across_shards(mesh_name, seed, rng):
    sharding, probs, counts, kwargs = sharded_aux_loss_problem(mesh_name, rng)
    sharded = jax.device_put(probs, sharding)
    fn = jax.value_and_grad(functools.partial(router.aux_loss, **kwargs))
    loss, grad = jax.jit(fn)(sharded, counts)
    context = f"{mesh_name}, seed={seed}"
    rc.check_aux_loss(loss, probs, counts, **kwargs, context=context)
    rc.assert_close(
        grad, ref.aux_loss_backward(1.0, probs.shape, counts, **kwargs), jnp.bfloat16, what="d probs", context=context
    )
    assert_no_token_movement(fn, sharded, counts, what="aux_loss")


@pytest.mark.parametrize("mesh_name", ["1d_explicit", "2d"])
def test_aux_loss_gradient_of_token_sharded_probs_stays_token_sharded(mesh_name, seed, rng):
    # On an explicit-sharding mesh the sharding is part of the type, as for plain
    # JAX: the gradient (which depends on no per-token value) must keep the
    # primal's token split, not be built whole on one device.
    sharding, probs, counts, kwargs = sharded_aux_loss_problem(mesh_name, rng)
    fn = jax.grad(functools.partial(router.aux_loss, **kwargs))
    with jax.set_mesh(sharding.mesh):
        grad = jax.jit(fn)(jax.device_put(probs, sharding), counts)
    rc.assert_close(
        grad, ref.aux_loss_backward(1.0, probs.shape, counts, **kwargs), jnp.bfloat16, what="d probs",
        context=f"{mesh_name}, seed={seed}",
    )
    assert_token_sharded(grad, sharding, what="d probs")


def test_aux_loss_gradient_reaching_token_sharded_logits_stays_token_sharded(seed, rng):
    # On an auto-sharding mesh the gradient's placement comes from its consumers,
    # as for plain JAX: through aux_loss_scores' backward to token-sharded logits
    # it must stay split, with no collective moving tokens.
    sharding = token_sharding("1d_auto")
    logits = rc.draw_logits(rng, (1000, 128), jnp.float32)
    counts = replicated(jnp.asarray(rng.integers(0, 100, 128), dtype=jnp.int32), sharding)
    kwargs = dict(total_num_tokens=1000, topk=8, coeff=1e-2)

    def loss(logits):
        _, scores = router.aux_loss_scores(logits, 8)
        return router.aux_loss(scores, counts, **kwargs)

    sharded = jax.device_put(logits, sharding)
    grad = jax.jit(jax.grad(loss))(sharded)
    # d logits = softmax backward of d scores, which cancels (g - <g, s>): compared with the
    # float32 error scale of the terms it subtracts, as every other logits gradient.
    grad_scores = ref.aux_loss_backward(1.0, logits.shape, counts, **kwargs)
    rc.check_aux_loss_scores_grad(grad, grad_scores, logits, "softmax", context=f"seed={seed}")
    assert_token_sharded(grad, sharding, what="d logits")
    assert_no_token_movement(jax.grad(loss), sharded, what="aux_loss gradient")


def test_topk_gradient_inside_shard_map_equals_the_unsharded_one(rng):
    # Inside shard_map the backward's result must carry the primal's manual axes, or JAX
    # rejects the custom VJP; each shard's gradient is then that of its own tokens.
    mesh = jax.make_mesh((8,), ("tokens",), devices=devices.mesh_devices(8))
    logits = jax.device_put(jnp.asarray(rng.normal(size=(8 * 16, 64)), jnp.float32),
                            NamedSharding(mesh, P("tokens", None)))
    weights = jnp.arange(64.0)
    per_shard = jax.shard_map(lambda x: router.topk(x, 4)[0], mesh=mesh, in_specs=P("tokens", None),
                              out_specs=P("tokens", None))
    sharded = jax.jit(jax.grad(lambda x: (per_shard(x) * weights).sum()))(logits)
    # The whole batch on the mesh's backend, so that only the sharding differs (on a GPU
    # machine the mesh is of CPU devices, and float32 rounding differs between backends).
    whole = jax.grad(lambda x: (router.topk(x, 4)[0] * weights).sum())(
        jax.device_put(np.asarray(logits), mesh.devices.flat[0]))
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(whole), rtol=1e-5, atol=1e-6)
