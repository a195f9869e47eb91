"""Shared experts (MoEConfig.shared_ffn, shared_gate; issue 20): a dense MLP of every token added
to the routed output, optionally scaled by a per-token sigmoid gate (Qwen2-MoE). Values and
gradients of the layer against the dense reference (moe_reference.py) on one device and inside
jax.shard_map with 2 or 4 expert shards and a data axis (the shared weights whole on every
shard), float32 and bfloat16, with and without the gate; the reference's MLP against a float64
formula; init_params; the errors for missing or misshapen shared weights; the Flax modules'
shared weights; the benchmark's DeepSeek-V3 case; and, in the forward's jaxpr under shard_map, no
input of the shared MLP's products computed from the all_to_all exchange (so XLA may overlap them).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import devices
import moe_checks as checks
import moe_reference as ref
from oxmoe import moe as moe_lib
from oxmoe.moe import MoEConfig, MoEParams

F32, BF16 = jnp.float32, jnp.bfloat16
HIDDEN, FFN, SHARED_FFN, TOKENS = 64, 32, 48, 128
SHARED = ("shared_up", "shared_down", "shared_gate")


def make_config(*, dtype, shared_gate: bool, activation="swiglu", **kwargs) -> MoEConfig:
    return MoEConfig(num_experts=8, topk=2, activation=activation, dtype=dtype, shared_ffn=SHARED_FFN,
                     shared_gate=shared_gate, aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF,
                     **kwargs)


def draw(rng, config, cpu, x_shape=(TOKENS, HIDDEN), param_dtype=np.float32):
    return jax.device_put(checks.draw_inputs(rng, config, x_shape, FFN, make=MoEParams, param_dtype=param_dtype), cpu)


# ------------------------------------------------------------------ the reference itself


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_reference_shared_experts_equal_a_float64_formula(activation, seed, rng):
    # y += sigmoid(x @ g) * act(x @ up) @ down, the gate half of a fused up first.
    config = make_config(dtype=F32, shared_gate=True, activation=activation)
    x, params, _ = checks.draw_inputs(rng, config, (16, HIDDEN), FFN)
    got = np.asarray(ref.shared_experts(x, params, config))
    x64, up, down, gate = (np.asarray(a, np.float64) for a in (x, params.shared_up, params.shared_down,
                                                                params.shared_gate))
    u = x64 @ up
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))  # noqa: E731
    h = silu(u[:, :SHARED_FFN]) * u[:, SHARED_FFN:] if activation == "swiglu" else gelu(u)
    expected = (h @ down) / (1 + np.exp(-(x64 @ gate)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=f"seed={seed}")


# ------------------------------------------------------------------ one device

ONE_DEVICE_CASES = {
    "f32-gate": (F32, True, "swiglu"),
    "f32-no_gate": (F32, False, "swiglu"),
    "bf16-gate": (BF16, True, "swiglu"),
    "bf16-no_gate-gelu": (BF16, False, "gelu"),
}


@pytest.mark.parametrize("case", ONE_DEVICE_CASES)
def test_shared_experts_on_one_device_match_the_dense_reference(case, cpu, seed, rng):
    dtype, gate, activation = ONE_DEVICE_CASES[case]
    config = make_config(dtype=dtype, shared_gate=gate, activation=activation)
    x, params, y_weight = draw(rng, config, cpu, (8, TOKENS // 8, HIDDEN), param_dtype=dtype)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: moe_lib.moe(x, p, config), x, p, w))(
        x, params, y_weight)
    expected = checks.reference(x, params, config, y_weight)
    errors = checks.compare(got, expected, config, context=f"{case}, seed={seed}")
    assert {"d shared_up", "d shared_down"} <= set(errors)
    assert ("d shared_gate" in errors) == gate
    if not gate:
        assert got[1][1].shared_gate is None


def test_shared_experts_change_the_output(cpu, rng):
    # The shared MLP is not lost on the way: without its weights' contribution y differs.
    config = make_config(dtype=F32, shared_gate=False)
    x, params, _ = draw(rng, config, cpu)
    with_shared, _ = moe_lib.moe(x, params, config)
    routed_only, _ = moe_lib.moe(x, dataclasses.replace(params, shared_up=None, shared_down=None),
                                 dataclasses.replace(config, shared_ffn=None))
    difference = np.asarray(with_shared - routed_only)
    expected = np.asarray(ref.shared_experts(x, params, config))
    np.testing.assert_allclose(difference, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


# ------------------------------------------------------------------ inside shard_map

# (data shards, expert shards, exchange, dtype, gate)
SHARDED_CASES = {
    "data4-ep2-all_to_all-f32-gate": (4, 2, "all_to_all", F32, True),
    "data4-ep2-ring-bf16-no_gate": (4, 2, "ring", BF16, False),
    "data2-ep4-all_to_all-bf16-gate": (2, 4, "all_to_all", BF16, True),
    "data2-ep4-ring-f32-no_gate": (2, 4, "ring", F32, False),
}


def mesh_of(data: int, ep: int):
    return jax.make_mesh((data, ep), ("data", "expert"), devices=devices.cpu_devices()[:data * ep])


@pytest.mark.parametrize("case", SHARDED_CASES)
def test_shared_experts_inside_shard_map_match_the_dense_reference(case, cpu, seed, rng):
    data, ep, exchange, dtype, gate = SHARDED_CASES[case]
    config = make_config(dtype=dtype, shared_gate=gate, exchange=exchange)
    x, params, y_weight = draw(rng, config, cpu)
    mesh, specs, tokens = mesh_of(data, ep), checks.param_specs(params), P(("data", "expert"))

    def per_shard(x, params):
        return moe_lib.moe(x, params, config, expert_axis="expert", data_axes=("data",))

    layer = jax.shard_map(per_shard, mesh=mesh, in_specs=(tokens, specs), out_specs=(tokens, P()))
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(
        *checks.put_on_mesh(mesh, x, params, y_weight))
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=f"{case}, seed={seed}")


def test_shard_map_moe_keeps_the_shared_weights_whole_under_weight_axes(cpu, seed, rng):
    config = make_config(dtype=F32, shared_gate=True, exchange="all_to_all")
    x, params, y_weight = draw(rng, config, cpu)
    mesh = mesh_of(4, 2)

    def layer(x, params):
        return moe_lib.shard_map_moe(x, params, config, mesh=mesh, expert_axis="expert", data_axes=("data",),
                                     weight_axes=("data",))

    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(
        *checks.put_on_mesh(mesh, x, params, y_weight, weight_axes=("data",)))
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=f"seed={seed}")
    grads = got[1][1]
    for name in SHARED:
        assert getattr(grads, name).sharding.is_fully_replicated, f"d {name}: {getattr(grads, name).sharding}"


# ------------------------------------------------------------------ init_params and errors


@pytest.mark.parametrize("activation, width", [("swiglu", 2 * SHARED_FFN), ("silu", SHARED_FFN)])
def test_init_params_creates_the_shared_weights_and_keeps_the_routed_ones(activation, width):
    config = make_config(dtype=F32, shared_gate=True, activation=activation)
    params = moe_lib.init_params(jax.random.key(1), config, HIDDEN, FFN)
    assert params.shared_up.shape == (HIDDEN, width)
    assert params.shared_down.shape == (SHARED_FFN, HIDDEN)
    assert params.shared_gate.shape == (HIDDEN, 1)
    plain = moe_lib.init_params(jax.random.key(1), dataclasses.replace(config, shared_ffn=None, shared_gate=False),
                                HIDDEN, FFN)
    assert plain.shared_up is None and plain.shared_down is None and plain.shared_gate is None
    np.testing.assert_array_equal(np.asarray(plain.up), np.asarray(params.up))
    ungated = moe_lib.init_params(jax.random.key(1), dataclasses.replace(config, shared_gate=False), HIDDEN, FFN)
    assert ungated.shared_gate is None


def test_shared_gate_without_shared_ffn_is_refused():
    with pytest.raises(ValueError, match="shared_gate needs shared experts: set shared_ffn"):
        MoEConfig(num_experts=8, topk=2, shared_gate=True)
    with pytest.raises(ValueError, match="shared_ffn"):
        MoEConfig(num_experts=8, topk=2, shared_ffn=0)


def _params(config):
    return moe_lib.init_params(jax.random.key(0), config, HIDDEN, FFN)


BAD_PARAMS = {
    "missing_up": (True, dict(shared_up=None), r"config.shared_ffn is 48 but params.shared_up is None"),
    "missing_gate": (True, dict(shared_gate=None), r"config.shared_gate is True but params.shared_gate is None"),
    "up_not_fused": (True, dict(shared_up=jnp.zeros((HIDDEN, SHARED_FFN))),
                     r"params.shared_up must have shape \[hidden, 2 \* shared_ffn \(gate and up halves\)\] = "
                     r"\[64, 96\] for activation 'swiglu' \(whole on every shard\), got \[64, 48\]"),
    "down_transposed": (True, dict(shared_down=jnp.zeros((HIDDEN, SHARED_FFN))),
                        r"params.shared_down must have shape \[shared_ffn, hidden\] = \[48, 64\]"),
    "gate_flat": (True, dict(shared_gate=jnp.zeros((HIDDEN,))), r"params.shared_gate must have shape \[hidden, 1\]"),
    "gate_int": (True, dict(shared_gate=jnp.zeros((HIDDEN, 1), jnp.int32)),
                 r"params.shared_gate must be float32, bfloat16 or float16"),
    "gate_unasked": (False, dict(shared_gate=jnp.zeros((HIDDEN, 1))),
                     r"params.shared_gate is given but config.shared_gate is False"),
}


@pytest.mark.parametrize("case", BAD_PARAMS)
def test_bad_shared_params_are_named(case):
    gate, change, message = BAD_PARAMS[case]
    config = make_config(dtype=F32, shared_gate=gate)
    params = dataclasses.replace(_params(config), **change)
    with pytest.raises((ValueError, TypeError), match=message):
        moe_lib.moe(jnp.zeros((16, HIDDEN)), params, config)


def test_shared_params_without_shared_ffn_are_named():
    config = MoEConfig(num_experts=8, topk=2)
    params = dataclasses.replace(_params(config), shared_down=jnp.zeros((SHARED_FFN, HIDDEN)))
    with pytest.raises(ValueError, match=r"params.shared_down is given but config.shared_ffn is None"):
        moe_lib.moe(jnp.zeros((16, HIDDEN)), params, config)


# ------------------------------------------------------------------ the Flax modules


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_flax_modules_create_the_shared_weights_and_match_the_reference(front_end, cpu, seed, rng):
    pytest.importorskip("flax", minversion="0.12", reason="oxmoe.flax and oxmoe.nnx need the oxmoe[flax] extra")
    import flax.linen as nn
    from flax import nnx

    from oxmoe.flax import MoEBlock
    from oxmoe.nnx import MoE

    config = make_config(dtype=F32, shared_gate=True)
    x, _, y_weight = draw(rng, config, cpu)
    shapes = {"gate": (HIDDEN, 8), "up": (8, HIDDEN, 2 * FFN), "down": (8, FFN, HIDDEN),
              "shared_up": (HIDDEN, 2 * SHARED_FFN), "shared_down": (SHARED_FFN, HIDDEN), "shared_gate": (HIDDEN, 1)}
    axes = {"shared_up": ("embed", "mlp"), "shared_down": ("mlp", "embed"), "shared_gate": ("embed", None)}
    if front_end == "linen":
        block = MoEBlock(config=config, ffn=FFN)
        boxed = block.init(jax.random.key(seed), x)["params"]
        assert {k: tuple(v.names) for k, v in boxed.items() if k in axes} == axes
        weights = nn.meta.unbox(boxed)

        def layer(x, weights):
            return block.apply({"params": weights}, x)
    else:
        module = MoE(config, HIDDEN, FFN, rngs=nnx.Rngs(params=seed))
        assert {k: getattr(module, k).out_sharding for k in axes} == axes
        graphdef, weights, rest = nnx.split(module, nnx.Param, ...)

        def layer(x, weights):
            return nnx.merge(graphdef, weights, rest)(x)
    assert {k: tuple(weights[k].shape) for k in weights} == shapes
    got = jax.jit(lambda x, w, yw: ref.layer_value_and_grads(layer, x, w, yw))(x, weights, y_weight)
    (y, aux), (dx, dweights) = got
    dweights = {k: jnp.asarray(dweights[k][...] if front_end == "nnx" else dweights[k]) for k in shapes}
    weights = {k: jnp.asarray(weights[k][...] if front_end == "nnx" else weights[k]) for k in shapes}
    expected = checks.reference(x, MoEParams(**weights), config, y_weight)
    checks.compare(((y, aux), (dx, MoEParams(**dweights))), expected, config, context=f"{front_end}, seed={seed}")


# ------------------------------------------------------------------ the benchmark's case


def test_the_benchmarks_deepseek_v3_shared_case_checks_against_plain_jax():
    from oxmoe.bench import moe as bench_moe
    from oxmoe.model_shapes import DEEPSEEK_V3_LAYER

    (case,) = [layer for layer in bench_moe.LAYERS if layer.config.shared_ffn]
    assert (case.name, case.devices, case.config.num_experts, case.config.shared_ffn, case.config.shared_gate) == (
        "deepseek_v3 shared", 1, 256, 2048, False)
    # Its code path at a tiny size: the step against plain JAX's, the shared weights' gradients
    # among the errors, and the shared GEMMs in the FLOPs (tokens x H x 3 Fs, times 2 and 3).
    small = bench_moe._layer(DEEPSEEK_V3_LAYER, tokens=64, hidden=64, ffn=32, shared_ffn=32)
    place = bench_moe.Placement(None)
    params = bench_moe.draw_params(small, place, (0,))
    _, errors = bench_moe.check_at_sample(bench_moe.oxmoe_layer(small.config), small, place, params, (0,))
    assert {"dshared_up_rel_err", "dshared_down_rel_err"} <= set(errors)
    routed = bench_moe._layer(DEEPSEEK_V3_LAYER, tokens=64, hidden=64, ffn=32)
    assert small.flops - routed.flops == 3 * 2 * 64 * 64 * 3 * 32
    assert [g.name for g in small.gemms()][2:] == ["deepseek_v3 shared shared_up", "deepseek_v3 shared shared_down"]


# ------------------------------------------------------------------ free to overlap the exchange


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item.jaxpr


def _contains(eqn, predicate) -> bool:
    return predicate(eqn) or any(_contains(e, predicate) for j in _sub_jaxprs(eqn) for e in j.eqns)


def _only(jaxpr, name):
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == name]
    return eqn


def test_the_shared_mlp_depends_on_no_exchange_of_routed_tokens():
    # In the layer's forward under shard_map (all_to_all exchange, 2 expert shards), no input of
    # the shared experts' products is computed from an all_to_all: XLA is free to run them while
    # the routed tokens travel.
    config = make_config(dtype=F32, shared_gate=True, exchange="all_to_all")
    params = moe_lib.init_params(jax.random.key(0), config, HIDDEN, FFN)
    mesh = jax.make_mesh((1, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices.cpu_devices()[:2])
    specs, tokens = checks.param_specs(params), P(("data", "expert"))
    layer = jax.shard_map(lambda x, p: moe_lib.moe(x, p, config, expert_axis="expert", data_axes=("data",)),
                          mesh=mesh, in_specs=(tokens, specs), out_specs=(tokens, P()))
    jaxpr = jax.make_jaxpr(layer)(jnp.zeros((TOKENS, HIDDEN)), params).jaxpr
    body = _only(_only(jaxpr, "shard_map").params["jaxpr"], "custom_vjp_call")
    (inner,) = list(_sub_jaxprs(body))[:1]
    shared_shapes = {tuple(params.shared_up.shape), tuple(params.shared_down.shape), tuple(params.shared_gate.shape)}

    def exchange(eqn):
        return eqn.primitive.name == "all_to_all"

    def shared_product(eqn):
        return eqn.primitive.name == "dot_general" and any(
            tuple(getattr(v.aval, "shape", ())) in shared_shapes for v in eqn.invars)

    tainted, exchanges, products = set(), 0, 0
    for eqn in inner.eqns:
        reads_exchange = any(v in tainted for v in eqn.invars if not hasattr(v, "val"))
        if _contains(eqn, shared_product):
            products += 1
            assert not reads_exchange, f"a shared-expert product reads the exchange's result: {eqn}"
        if reads_exchange or _contains(eqn, exchange):
            exchanges += _contains(eqn, exchange)
            tainted.update(eqn.outvars)
    assert exchanges >= 2 and products >= 1, (exchanges, products)
