"""The Flax front ends of the MoE layer: oxmoe.flax.MoEBlock (Linen) and oxmoe.nnx.MoE (NNX).

The modules own parameters and call oxmoe.moe; these tests check that they add nothing else:

- forward (y and every field of aux) and gradients (of x, gate, up, down) equal oxmoe.moe.moe
  called directly with the module's parameters (random weights handed to the module through
  its initialisers), bit for bit: on one device, and with expert and data axes on a
  data=2 x expert=4 mesh of the eight CPU devices, where the direct call is the contract's
  shard map written out here (tokens split over (data, expert), gate and expert bias
  replicated, up and down split over expert). The Linen block gets its mesh as an
  attribute, the NNX module from `jax.set_mesh` at the call;
- sharded initialisation with the default initialisers: the logical axis names resolve
  through rules to the expected PartitionSpecs, `jax.jit(init, out_shardings=...)` (and NNX's
  eager sharding when the module has a mesh) places every variable so, and the values equal
  the unsharded initialisation with the same key; under a mesh without rules, NNX names the
  logical axes that lack one;
- MoEConfig.float32_gate_logits and MoEConfig.fp8 reach the layer: with either the modules'
  output is oxmoe.moe.moe's with it, not without it;
- expert weights quantized once (oxmoe.flax.quantize_expert_weights, MoE.quantize_expert_weights)
  reach the layer as fp8_weights, in the oxmoe and MaxText layouts: given the module's own, its
  output and gradients are bit for bit those without; given another module's, those of the
  module with that one's expert weights (and its own gate);
- the expert-bias update (Linen helper on a nested model's variables, NNX method, eager and
  under nnx.jit) against the NumPy formula bias + rate * sign(mean(tokens) - tokens);
- `import oxmoe` does not import flax.
"""

import contextlib
import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", minversion="0.12", reason="oxmoe.flax and oxmoe.nnx need the oxmoe[flax] extra")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import devices  # noqa: E402
from oxmoe import fp8, moe  # noqa: E402
from oxmoe.flax import MoEBlock, quantize_expert_weights, update_expert_bias  # noqa: E402
from oxmoe.moe import MoEConfig, MoEParams  # noqa: E402
from oxmoe.nnx import MoE  # noqa: E402

H, F = 16, 8
MESH_AXES = ("data", "expert")
# "mlp" -> "data" as well as "exp" -> "expert", so that every logical name is seen to resolve.
RULES = (("exp", "expert"), ("embed", None), ("mlp", "data"))
EXPECTED_SPECS = {"gate": P(None, None), "up": P("expert", None, "data"), "down": P("expert", "data", None),
                  "expert_bias": P(None)}

CONFIGS = {
    # softmax routing, fused [E, H, 2F] up, both losses, float32 compute.
    "softmax_swiglu": MoEConfig(num_experts=8, topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                                dtype=jnp.float32),
    # sigmoid routing steered by a (random, non-zero) expert bias, plain [E, H, F] up, bfloat16.
    "sigmoid_bias_gelu": MoEConfig(num_experts=8, topk=3, score_function="sigmoid", use_expert_bias=True,
                                   activation="gelu", aux_loss_coeff=1e-2, dtype=jnp.bfloat16),
    # bfloat16 compute with a float32 router product: the option must reach the layer.
    "softmax_float32_gate_logits": MoEConfig(num_experts=8, topk=2, z_loss_coeff=1e-3, dtype=jnp.bfloat16,
                                             float32_gate_logits=True),
}
CONFIG_PARAMS = pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(devices.mesh_devices(8)).reshape(2, 4), MESH_AXES)


def total_loss(y, aux, y_weight):
    return jnp.sum(y.astype(jnp.float32) * y_weight) + aux.load_balancing_loss + aux.z_loss


def draw_inputs(rng, config):
    """x [8, 4, H] (8 rows: one per token shard of the mesh), the loss's weight of y, a bias."""
    x = jnp.asarray(rng.standard_normal((8, 4, H)), jnp.float32)
    y_weight = jnp.asarray(rng.standard_normal((8, 4, H)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(config.num_experts) * 0.05, jnp.float32) if config.use_expert_bias else None
    return x, y_weight, bias


def draw_weights(rng, config) -> dict:
    """Random gate [H, E], up [E, H, 2F or F] and down [E, F, H] of the layer's scale."""
    e, up_cols = config.num_experts, 2 * F if config.glu else F
    normal = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)  # noqa: E731
    return {"gate": normal((H, e), H), "up": normal((e, H, up_cols), H), "down": normal((e, F, H), F)}


def given(array):
    """An initialiser that returns `array`, checking the shape and dtype it is asked for. The
    forward tests give the modules random weights this way: cheaper than compiling the default
    initialisers' random draws in every test, and it checks which weight goes where."""

    def init(key, shape, dtype):
        assert (tuple(shape), jnp.dtype(dtype)) == (array.shape, array.dtype), (shape, dtype, array.shape)
        return array

    return init


def given_inits(weights) -> dict:
    return {f"{name}_init": given(array) for name, array in weights.items()}


@functools.cache
def direct_value_and_grads(config, mesh=None):
    """jit of (x, params, y_weight) -> ((y, aux), (d x, d params)) of oxmoe.moe.moe itself: plain, or
    in the contract's shard map over MESH_AXES. Cached: the Linen and NNX tests share it."""
    layer = functools.partial(moe.moe, config=config)
    if mesh is not None:
        specs = MoEParams(gate=P(), up=P("expert"), down=P("expert"),
                          expert_bias=P() if config.use_expert_bias else None)
        layer = jax.shard_map(functools.partial(layer, expert_axis="expert", data_axes=("data",)), mesh=mesh,
                              in_specs=(P(MESH_AXES), specs), out_specs=(P(MESH_AXES), P()))

    def loss(x, params, y_weight):
        y, aux = layer(x, params)
        return total_loss(y, aux, y_weight), (y, aux)

    def value_and_grads(x, params, y_weight):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params, y_weight)
        return out, grads

    return jax.jit(value_and_grads)


def assert_identical(got, want, what):
    got, want = np.asarray(jnp.asarray(got).astype(jnp.float32)), np.asarray(jnp.asarray(want).astype(jnp.float32))
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_array_equal(got, want, err_msg=what)


def assert_same_as_direct(module_out, module_grads, direct_out, direct_grads, context):
    """Module and direct call agree on y, aux and the gradients of x, gate, up and down."""
    (y, aux), (dx, dweights) = module_out, module_grads
    (y_ref, aux_ref), (dx_ref, dparams_ref) = direct_out, direct_grads
    assert y.dtype == y_ref.dtype, f"y dtype ({context})"
    assert_identical(y, y_ref, f"y ({context})")
    for field in ("load_balancing_loss", "z_loss", "tokens_per_expert"):
        assert_identical(getattr(aux, field), getattr(aux_ref, field), f"aux.{field} ({context})")
    assert_identical(dx, dx_ref, f"d x ({context})")
    for name in ("gate", "up", "down"):
        assert_identical(dweights[name], getattr(dparams_ref, name), f"d {name} ({context})")


# ---------------------------------------------------------------- Linen


def linen_block(config, mesh=None, **inits):
    if mesh is None:
        return MoEBlock(config=config, ffn=F, **inits)
    return MoEBlock(config=config, ffn=F, expert_axis="expert", data_axes=("data",), mesh=mesh, **inits)


def linen_value_and_grads(block, variables, x, y_weight):
    state = {k: v for k, v in variables.items() if k != "params"}

    def loss(x, weights):
        y, aux = block.apply({"params": weights, **state}, x)
        return total_loss(y, aux, y_weight), (y, aux)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, variables["params"])
    return out, grads


def linen_params(variables) -> MoEParams:
    return MoEParams(**variables["params"], expert_bias=variables.get("moe_state", {}).get("expert_bias"))


@CONFIG_PARAMS
@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "mesh_data2_expert4"])
def test_linen_block_is_moe_with_its_params(config, sharded, mesh, rng, seed):
    mesh = mesh if sharded else None
    x, y_weight, bias = draw_inputs(rng, config)
    weights = draw_weights(rng, config)
    block = linen_block(config, mesh, **given_inits(weights))
    # Initialised eagerly on one device (the sharded block's variables are the same).
    variables = nn.meta.unbox(linen_block(config, **given_inits(weights)).init(jax.random.key(seed), x))
    assert jax.tree.map(jnp.shape, variables) == {
        "params": {name: w.shape for name, w in weights.items()},
        **({"moe_state": {"expert_bias": (config.num_experts,)}} if config.use_expert_bias else {})}
    if bias is not None:
        assert_identical(variables["moe_state"]["expert_bias"], np.zeros(config.num_experts), "initial bias")
        variables["moe_state"]["expert_bias"] = bias
    out, grads = linen_value_and_grads(block, variables, x, y_weight)
    direct_out, direct_grads = direct_value_and_grads(config, mesh)(x, linen_params(variables), y_weight)
    assert_same_as_direct(out, grads, direct_out, direct_grads, f"Linen, mesh={mesh is not None}")


@pytest.mark.parametrize("config", [CONFIGS["softmax_swiglu"]], ids=["softmax_swiglu"])
def test_linen_block_with_weights_sharded_over_the_data_axis_is_moe(config, mesh, rng, seed):
    # "exp" on the expert then the data axis: up [E, H, 2F] and down [E, F, H] split over both;
    # the block gathers each expert shard's experts (weight_axes) and its gradients come back
    # split alike.
    x, y_weight, _ = draw_inputs(rng, config)
    weights = draw_weights(rng, config)
    block = MoEBlock(config=config, ffn=F, expert_axis="expert", data_axes=("data",), weight_axes=("data",),
                     mesh=mesh, **given_inits(weights))
    rules = (("exp", ("expert", "data")), ("embed", None), ("mlp", None))
    key = jax.random.key(seed)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(block.init, key, x)), mesh, rules)
    assert shardings["params"]["up"].spec == P(("expert", "data"), None, None)
    variables = nn.meta.unbox(jax.jit(block.init, out_shardings=shardings)(key, x))
    out, grads = linen_value_and_grads(block, variables, x, y_weight)
    direct_out, direct_grads = direct_value_and_grads(config, mesh)(x, linen_params(variables), y_weight)
    assert_same_as_direct(out, grads, direct_out, direct_grads, "Linen, weight_axes=('data',)")
    for name in ("up", "down"):
        assert grads[1][name].sharding.is_equivalent_to(variables["params"][name].sharding, 3), name


# ------------------------------------------------------------------ NNX


def nnx_value_and_grads(module, x, y_weight):
    graphdef, weights, rest = nnx.split(module, nnx.Param, ...)

    def loss(x, weights):
        y, aux = nnx.merge(graphdef, weights, rest)(x)
        return total_loss(y, aux, y_weight), (y, aux)

    (_, out), (dx, dweights) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, weights)
    return out, (dx, {name: dweights[name][...] for name in ("gate", "up", "down")})


def nnx_params(module) -> MoEParams:
    return MoEParams(gate=module.gate[...], up=module.up[...], down=module.down[...],
                     expert_bias=None if module.expert_bias is None else module.expert_bias[...])


@CONFIG_PARAMS
@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "set_mesh_data2_expert4"])
def test_nnx_module_is_moe_with_its_params(config, sharded, mesh, rng, seed):
    x, y_weight, bias = draw_inputs(rng, config)
    weights = draw_weights(rng, config)
    axes = dict(expert_axis="expert", data_axes=("data",)) if sharded else {}
    # Created outside the mesh (so not placed: the eager-sharding tests below do that); the
    # sharded module finds the mesh of its shard map in the context at the call.
    module = MoE(config, H, F, rngs=nnx.Rngs(params=seed), **axes, **given_inits(weights))
    if bias is not None:
        assert_identical(module.expert_bias[...], np.zeros(config.num_experts), "initial bias")
        module.expert_bias[...] = bias
    with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
        out, grads = nnx_value_and_grads(module, x, y_weight)
    direct_out, direct_grads = direct_value_and_grads(config, mesh if sharded else None)(x, nnx_params(module),
                                                                                     y_weight)
    assert_same_as_direct(out, grads, direct_out, direct_grads, f"NNX, mesh={sharded}")


def test_float32_gate_logits_reaches_both_modules(rng, seed):
    # The modules hand the layer their whole MoEConfig: with the option, their output is the
    # layer's with it, which differs from the layer's without it (the router's product rounded to
    # bfloat16 moves every routing weight).
    config = CONFIGS["softmax_float32_gate_logits"]
    x, _, _ = draw_inputs(rng, config)
    weights = draw_weights(rng, config)
    with_option = moe.moe(x, MoEParams(**weights), config)[0]
    without = moe.moe(x, MoEParams(**weights), dataclasses.replace(config, float32_gate_logits=False))[0]
    outputs = {"Linen": linen_block(config, **given_inits(weights)).apply({"params": weights}, x)[0],
               "NNX": MoE(config, H, F, rngs=nnx.Rngs(params=seed), **given_inits(weights))(x)[0]}
    for name, y in outputs.items():
        assert_identical(y, with_option, f"{name} y with float32_gate_logits (seed={seed})")
        assert not np.array_equal(np.asarray(y), np.asarray(without)), f"{name}: the option made no difference"


def test_the_fp8_recipe_reaches_both_modules(rng, seed):
    # The same for MoEConfig.fp8, at sizes FP8 can block (multiples of 128): the modules' output
    # is the FP8 layer's, which differs from the layer's without it.
    config = MoEConfig(num_experts=8, topk=2, dtype=jnp.float32, fp8=fp8.BlockScaling())
    hidden = ffn = 128
    x = jnp.asarray(rng.standard_normal((64, hidden)), jnp.float32)
    normal = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)  # noqa: E731
    weights = {"gate": normal((hidden, 8), hidden), "up": normal((8, hidden, 2 * ffn), hidden),
               "down": normal((8, ffn, hidden), ffn)}
    with_recipe = moe.moe(x, MoEParams(**weights), config)[0]
    without = moe.moe(x, MoEParams(**weights), dataclasses.replace(config, fp8=None))[0]
    outputs = {"Linen": MoEBlock(config=config, ffn=ffn, **given_inits(weights)).apply({"params": weights}, x)[0],
               "NNX": MoE(config, hidden, ffn, rngs=nnx.Rngs(params=seed), **given_inits(weights))(x)[0]}
    for name, y in outputs.items():
        assert_identical(y, with_recipe, f"{name} y with fp8 (seed={seed})")
        assert not np.array_equal(np.asarray(y), np.asarray(without)), f"{name}: the recipe made no difference"


# ---------------------------------------------------- FP8 weights quantized once

FP8_CONFIG = MoEConfig(num_experts=8, topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, dtype=jnp.bfloat16,
                       fp8=fp8.BlockScaling())
FP8_HIDDEN, FP8_FFN = 256, 128  # multiples of FP8's 128 x 128 blocks
FP8_LAYOUTS = pytest.mark.parametrize("layout", ["oxmoe", "maxtext"])


def fp8_value_and_grads(layer):
    """jit of (x, weights, y_weight, fp8_weights) -> ((y, aux), (d x, d weights)) of
    `layer(x, weights, fp8_weights)`, `weights` a module's parameter tree."""

    def loss(x, weights, y_weight, fp8_weights):
        y, aux = layer(x, weights, fp8_weights)
        return total_loss(y, aux, y_weight), (y, aux)

    def value_and_grads(x, weights, y_weight, fp8_weights):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights, y_weight, fp8_weights)
        return out, grads

    return jax.jit(value_and_grads)


def assert_weights_quantized_once_are_the_weights(step, own, others, quantized_own, quantized_others, rng, context):
    """Given the quantization of its own weights `own`, the step (fp8_value_and_grads) is bit for
    bit the step that quantizes them itself; given that of another module's weights `others`,
    the step of the module with `others`' expert weights and `own`'s gate."""
    x = jnp.asarray(rng.standard_normal((64, FP8_HIDDEN)), jnp.float32)
    y_weight = jnp.asarray(rng.standard_normal((64, FP8_HIDDEN)), jnp.float32)
    mixed = {**others, "gate": own["gate"]}
    for name, quantized, weights in (("its own weights", quantized_own, own),
                                     ("another module's weights", quantized_others, mixed)):
        got, expected = step(x, own, y_weight, quantized), step(x, weights, y_weight, None)
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(expected)):
            assert_identical(a, b, f"{jax.tree_util.keystr(path)}, given {name} ({context})")


@FP8_LAYOUTS
def test_linen_block_takes_expert_weights_quantized_once(layout, rng, seed):
    block = MoEBlock(config=FP8_CONFIG, ffn=FP8_FFN, param_layout=layout)
    x = jnp.zeros((64, FP8_HIDDEN), jnp.float32)
    # init's variables as users keep them: boxed with their logical axes.
    own, others = (jax.jit(block.init)(jax.random.key(s), x) for s in (seed, seed ^ 1))
    step = fp8_value_and_grads(lambda x, weights, q: block.apply({"params": weights}, x, fp8_weights=q))
    assert_weights_quantized_once_are_the_weights(
        step, nn.meta.unbox(own["params"]), nn.meta.unbox(others["params"]), quantize_expert_weights(block, own),
        quantize_expert_weights(block, others), rng, f"Linen, {layout}, seed={seed}")


@FP8_LAYOUTS
def test_nnx_module_takes_expert_weights_quantized_once(layout, rng, seed):
    own, others = (MoE(FP8_CONFIG, FP8_HIDDEN, FP8_FFN, rngs=nnx.Rngs(params=s), param_layout=layout)
                   for s in (seed, seed ^ 1))
    graphdef, state, rest = nnx.split(own, nnx.Param, ...)

    def layer(x, weights, fp8_weights):
        nnx.replace_by_pure_dict(state, weights)
        return nnx.merge(graphdef, state, rest)(x, fp8_weights=fp8_weights)

    assert_weights_quantized_once_are_the_weights(
        fp8_value_and_grads(layer), nnx.to_pure_dict(nnx.state(own, nnx.Param)),
        nnx.to_pure_dict(nnx.state(others, nnx.Param)), own.quantize_expert_weights(),
        others.quantize_expert_weights(), rng, f"NNX, {layout}, seed={seed}")


def test_fp8_weights_without_the_fp8_recipe_are_refused(rng, seed):
    normal = lambda shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)  # noqa: E731
    weights = {"gate": normal((FP8_HIDDEN, 8)), "up": normal((8, FP8_HIDDEN, 2 * FP8_FFN)),
               "down": normal((8, FP8_FFN, FP8_HIDDEN))}
    quantized = moe.quantize_expert_weights(MoEParams(**weights), FP8_CONFIG)
    config = dataclasses.replace(FP8_CONFIG, fp8=None)
    x = jnp.zeros((64, FP8_HIDDEN), jnp.float32)
    message = r"fp8_weights are given but config.fp8 is None"
    with pytest.raises(ValueError, match=message):
        MoEBlock(config=config, ffn=FP8_FFN).apply({"params": weights}, x, fp8_weights=quantized)
    module = MoE(config, FP8_HIDDEN, FP8_FFN, rngs=nnx.Rngs(params=seed), **given_inits(weights))
    with pytest.raises(ValueError, match=message):
        module(x, fp8_weights=quantized)


# ------------------------------------------------------------ sharded init

INIT_CONFIG = CONFIGS["sigmoid_bias_gelu"]  # has all four variables


def assert_placed(array, mesh, name, what):
    expected = NamedSharding(mesh, EXPECTED_SPECS[name])
    assert array.sharding.is_equivalent_to(expected, array.ndim), (
        f"{what} {name}: sharding {array.sharding}, expected {expected.spec}")


def test_linen_init_under_jit_shards_by_logical_names(mesh, seed, rng):
    x, _, _ = draw_inputs(rng, INIT_CONFIG)
    block = linen_block(INIT_CONFIG, mesh)
    key = jax.random.key(seed)
    specs = nn.get_partition_spec(jax.eval_shape(block.init, key, x))
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    for collection, name in [("params", "gate"), ("params", "up"), ("params", "down"), ("moe_state", "expert_bias")]:
        assert shardings[collection][name].spec == EXPECTED_SPECS[name], f"{collection}/{name}"

    sharded = nn.meta.unbox(jax.jit(block.init, out_shardings=shardings)(key, x))
    with jax.default_device(mesh.devices.flat[0]):  # the mesh's platform: a GPU rounds the draws differently
        plain = nn.meta.unbox(linen_block(INIT_CONFIG).init(key, x))
    for collection, name in [("params", "gate"), ("params", "up"), ("params", "down"), ("moe_state", "expert_bias")]:
        assert_placed(sharded[collection][name], mesh, name, "Linen init")
        assert_identical(sharded[collection][name], plain[collection][name], f"Linen {collection}/{name}")


def test_nnx_init_under_jit_shards_by_logical_names(mesh, seed):
    def create():
        return nnx.state(MoE(INIT_CONFIG, H, F, rngs=nnx.Rngs(params=seed)))

    with nnx.logical_axis_rules(RULES):
        abstract = jax.eval_shape(create)
        for name, spec in EXPECTED_SPECS.items():
            assert nnx.get_partition_spec(abstract)[name].get_value() == spec, name
        shardings = nnx.get_named_sharding(abstract, mesh)
    sharded = jax.jit(create, out_shardings=shardings)()
    with jax.default_device(mesh.devices.flat[0]):
        plain = create()
    for name in EXPECTED_SPECS:
        assert_placed(sharded[name][...], mesh, name, "NNX jit init")
        assert_identical(sharded[name][...], plain[name][...], f"NNX {name}")


def test_nnx_init_with_a_mesh_places_params_eagerly(mesh, seed):
    # The module's own mesh (not jax.set_mesh, under which every eager random draw compiles anew).
    # Both draw on the mesh's platform: a GPU rounds the draws differently.
    with jax.default_device(mesh.devices.flat[0]):
        with nnx.logical_axis_rules(RULES):
            sharded = MoE(INIT_CONFIG, H, F, rngs=nnx.Rngs(params=seed), expert_axis="expert", data_axes=("data",),
                          mesh=mesh)
        plain = MoE(INIT_CONFIG, H, F, rngs=nnx.Rngs(params=seed))
    for name in EXPECTED_SPECS:
        assert_placed(getattr(sharded, name)[...], mesh, name, "NNX eager init")
        assert_identical(getattr(sharded, name)[...], getattr(plain, name)[...], f"NNX {name}")


def test_nnx_init_under_a_mesh_without_rules_names_the_missing_axes(mesh):
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"\['embed', 'exp', 'mlp'\] have no rule"):
        MoE(INIT_CONFIG, H, F, rngs=nnx.Rngs(0))


# ------------------------------------------------------------ expert bias

RATE = 1e-3


def expected_bias(bias, tokens):
    bias, tokens = np.asarray(bias, np.float32), np.asarray(tokens, np.float64)
    return bias + np.float32(RATE) * np.sign(tokens.mean() - tokens).astype(np.float32)


# mean 4: experts at the mean keep their bias, those above lose RATE, those below gain it.
TOKENS = np.array([3, 5, 4, 4, 0, 8, 4, 4], np.int32)


class _Model(nn.Module):
    """A projection (the identity), then the block: the block's variables sit at .../moe."""

    config: MoEConfig
    weights: dict

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(H, kernel_init=lambda key, shape, dtype: jnp.eye(H, dtype=dtype), name="proj")(x)
        return MoEBlock(config=self.config, ffn=F, **given_inits(self.weights), name="moe")(x)


def test_linen_bias_update_moves_the_nested_blocks_bias_by_the_formula(rng, seed):
    x, _, bias = draw_inputs(rng, INIT_CONFIG)
    model = _Model(INIT_CONFIG, draw_weights(rng, INIT_CONFIG))
    boxed = model.init(jax.random.key(seed), x)  # as users keep them: the bias boxed with its logical axes
    state = boxed["moe_state"]["moe"]
    state["expert_bias"] = state["expert_bias"].replace_boxed(bias)
    _, aux = model.apply(boxed, x)

    for variables in (boxed, nn.meta.unbox(boxed)):
        for tokens in (TOKENS, aux.tokens_per_expert):
            updated = update_expert_bias(variables, tokens, RATE, path=("moe",))
            new = updated["moe_state"]["moe"]["expert_bias"]
            if variables is boxed:
                assert isinstance(new, nn.LogicallyPartitioned) and new.names == (None,), new
            np.testing.assert_allclose(nn.meta.unbox(new), expected_bias(bias, tokens), rtol=0, atol=1e-7)
            assert updated["params"] is variables["params"]
        assert_identical(nn.meta.unbox(variables["moe_state"]["moe"]["expert_bias"]), bias,
                         "the input variables' bias (unchanged)")

    with pytest.raises(KeyError, match="moe_state/nope/expert_bias"):
        update_expert_bias(boxed, TOKENS, RATE, path=("nope",))


def test_nnx_bias_update_moves_the_bias_by_the_formula_eagerly_and_under_jit(rng, seed):
    _, _, bias = draw_inputs(rng, INIT_CONFIG)
    module = MoE(INIT_CONFIG, H, F, rngs=nnx.Rngs(params=seed), **given_inits(draw_weights(rng, INIT_CONFIG)))
    module.expert_bias[...] = bias
    module.update_expert_bias(jnp.asarray(TOKENS), RATE)
    once = expected_bias(bias, TOKENS)
    np.testing.assert_allclose(module.expert_bias[...], once, rtol=0, atol=1e-7)

    tokens2 = rng.integers(0, 20, INIT_CONFIG.num_experts).astype(np.int32)
    nnx.jit(lambda m, t: m.update_expert_bias(t, RATE))(module, jnp.asarray(tokens2))
    np.testing.assert_allclose(module.expert_bias[...], expected_bias(once, tokens2), rtol=0, atol=1e-7)

    with pytest.raises(ValueError, match="use_expert_bias"):
        no_bias = CONFIGS["softmax_swiglu"]
        MoE(no_bias, H, F, rngs=nnx.Rngs(0), **given_inits(draw_weights(rng, no_bias))).update_expert_bias(
            jnp.asarray(TOKENS), RATE)


# ----------------------------------------------------------------- imports


def test_importing_oxmoe_does_not_import_flax():
    code = ("import sys, oxmoe, oxmoe.moe; "
            "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
