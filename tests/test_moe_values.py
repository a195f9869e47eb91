"""Values and gradients of the MoE layer oxmoe.moe.moe against the dense plain-JAX reference
(moe_reference.py), on the host's eight CPU devices and fresh random data:

- inside jax.shard_map with the experts split over 1, 2, 4 and 8 devices and the tokens over
  those and 1 or 2 data shards, for each exchange the CPU runs ("all_to_all", "ring", "auto"),
  both align sizes, softmax top-2 and DeepSeek-style sigmoid routing (groups, expert bias,
  scaling), float32 and bfloat16;
- without shard_map (every expert local), for every activation, pre-softmax routing, top-1,
  tokens as [B, S, H] and [T, H], weights and tokens in float32 or bfloat16, zero loss
  coefficients;
- with float32_gate_logits: bfloat16 compute routing as a float32 router on thousands of tokens
  (and, without the option, not), and the layer against the reference with or without
  shard_map, with float32 and bfloat16 tokens and weights;
- through shard_map_moe, whose gradients keep the params' sharding;
- update_expert_bias against its NumPy formula, init_params' shapes;
- the reference itself: its router and losses against the float64 router reference of the
  router tests, its layer against a float64 loop over each token's chosen experts.

Each case checks y, both losses, tokens_per_expert (exactly) and the gradients of the tokens
and of gate, up and down for the loss sum(y * w) + losses (expert_bias's must be zero). The
layer's result does not depend on the sharding, exchange or padding, so every case has the
same reference; tokens whose routing is a near-tie are redrawn (moe_checks.draw_tokens).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import devices
import moe_checks as checks
import moe_reference as ref
import router_reference as router_ref
from oxmoe import moe as moe_lib
from oxmoe.moe import MoEConfig, MoEParams
from oxmoe.moe import layer as layer_lib

F32, BF16 = jnp.float32, jnp.bfloat16


def host_devices(count: int) -> list:
    """The first `count` host CPU devices: this file checks the layer's semantics on the host
    (on a GPU, XLA's default float32 matmul precision is TF32, which a float32 check at 1e-5
    does not admit; test_moe_gpu.py checks the GPU)."""
    return devices.choose_mesh_devices([], devices.cpu_devices(), count)


# Routings of real models, with experts enough for eight expert shards: Mixtral's softmax
# top-2, and DeepSeek-V3's sigmoid routing (4 of 32 experts, from the best 2 of 4 groups,
# steered by the expert bias, weights scaled).
ROUTINGS = {
    "softmax_top2": dict(num_experts=16, topk=2),
    "sigmoid_groups": dict(num_experts=32, topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                           scaling_factor=2.5, use_expert_bias=True),
}


def make_config(routing: str, **kwargs) -> MoEConfig:
    fields = dict(ROUTINGS[routing], aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF)
    fields.update(kwargs)
    return MoEConfig(**fields)


# ------------------------------------------------------------------ the reference itself

# (routing fields, with expert bias): the router of the reference against the float64 NumPy one
# of the router tests (router_reference.py), which shares no code with it.
REFERENCE_ROUTINGS = {
    "softmax_top2": dict(num_experts=16, topk=2, scaling_factor=1.5),
    "pre_softmax_top4": dict(num_experts=32, topk=4, use_pre_softmax=True),
    "sigmoid_groups_bias": ROUTINGS["sigmoid_groups"],
    "sigmoid_top1": dict(num_experts=16, topk=1, score_function="sigmoid"),
}


@pytest.mark.parametrize("routing", REFERENCE_ROUTINGS)
def test_reference_router_and_loss_equal_the_float64_router_reference(routing, seed, rng):
    config = MoEConfig(**REFERENCE_ROUTINGS[routing], aux_loss_coeff=0.3, z_loss_coeff=0.02, dtype=F32)
    e, t = config.num_experts, 256
    logits = (rng.standard_normal((t, e)) * 2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.05).astype(np.float32) if config.use_expert_bias else None
    keep = checks.selection_margin(logits, config, bias) > 1e-5  # float32 may order a near-tie either way
    context = f"{routing}, {int((~keep).sum())} near-ties left out, seed={seed}"
    probs, chosen = ref.route(jnp.asarray(logits), config, None if bias is None else jnp.asarray(bias))
    expected = router_ref.topk(logits, config.topk, expert_bias=bias, score_function=config.score_function,
                               use_pre_softmax=config.use_pre_softmax, num_groups=config.num_groups,
                               group_topk=config.group_topk, scaling_factor=config.scaling_factor)
    np.testing.assert_array_equal(np.asarray(chosen)[keep], expected.routing_map[keep], err_msg=context)
    np.testing.assert_allclose(np.asarray(probs)[keep], expected.probs[keep], rtol=1e-5, atol=1e-6, err_msg=context)
    scores = router_ref.aux_loss_scores(logits, config.topk, score_function=config.score_function)
    loss = router_ref.aux_loss(scores.scores, scores.routing_map.sum(0), total_num_tokens=t, topk=config.topk,
                               coeff=config.aux_loss_coeff)
    np.testing.assert_allclose(float(ref.load_balancing_loss(jnp.asarray(logits), config)), loss, rtol=1e-5,
                               err_msg=context)
    x = logits.astype(np.float64)
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(float(ref.z_loss(jnp.asarray(logits), config)), 0.02 * np.mean(lse**2), rtol=1e-5,
                               err_msg=context)


def silu64(u):
    return u / (1.0 + np.exp(-u))


def gelu64(u):
    return 0.5 * u * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (u + 0.044715 * u**3)))


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "silu"])
def test_reference_layer_equals_a_loop_over_tokens_and_their_experts(activation, seed, rng):
    # y[t] = sum over t's chosen experts e of probs[t, e] * act(x[t] @ up[e]) @ down[e], in float64,
    # the gate half of a fused up weight first.
    config = MoEConfig(num_experts=6, topk=2, activation=activation, dtype=F32)
    x, params, _ = checks.draw_inputs(rng, config, (2, 5, 24), 8)
    y, aux = ref.moe(x, params, config)
    xs = np.asarray(x, np.float64).reshape(-1, 24)
    probs, chosen = (np.asarray(a) for a in ref.route(ref.router_logits(x, params.gate, F32), config))
    up, down = np.asarray(params.up, np.float64), np.asarray(params.down, np.float64)
    act = {"swiglu": lambda u: silu64(u[:8]) * u[8:], "geglu": lambda u: gelu64(u[:8]) * u[8:], "gelu": gelu64,
           "silu": silu64}[activation]
    expected = np.zeros_like(xs)
    for t in range(len(xs)):
        assert chosen[t].sum() == 2
        for e in np.flatnonzero(chosen[t]):
            expected[t] += probs[t, e] * (act(xs[t] @ up[e]) @ down[e])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 24), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                               err_msg=f"{activation}, seed={seed}")
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), chosen.sum(0))


# ------------------------------------------------------------------ inside shard_map

# (data shards, expert shards, exchange, align_size, routing, dtype, tokens as [B, S, H]):
# every mesh of the eight devices with 1 or 2 data shards and 1, 2, 4 or 8 expert shards, once
# per exchange; each mesh sees both align sizes, both routings and both dtypes over its two
# cases, and the pairings rotate from mesh to mesh.
SHARDED_CASES = [
    (1, 1, "all_to_all", None, "softmax_top2", F32, False),
    (1, 1, "ring", 128, "sigmoid_groups", BF16, True),
    (1, 2, "all_to_all", 128, "sigmoid_groups", F32, True),
    (1, 2, "ring", None, "softmax_top2", BF16, False),
    (1, 4, "all_to_all", None, "sigmoid_groups", BF16, False),
    (1, 4, "ring", 128, "softmax_top2", F32, True),
    (1, 8, "all_to_all", 128, "softmax_top2", BF16, True),
    (1, 8, "ring", None, "sigmoid_groups", F32, False),
    (2, 1, "all_to_all", None, "softmax_top2", BF16, True),
    (2, 1, "ring", 128, "sigmoid_groups", F32, False),
    (2, 2, "all_to_all", 128, "softmax_top2", F32, False),
    (2, 2, "ring", None, "sigmoid_groups", BF16, True),
    (2, 4, "all_to_all", None, "sigmoid_groups", F32, True),
    (2, 4, "ring", 128, "softmax_top2", BF16, False),
    (2, 4, "auto", 128, "sigmoid_groups", BF16, False),  # auto: the slotted all_to_all
]
# 128 tokens in all: 16 to 64 per shard (128 on one device).
HIDDEN, FFN, TOKENS = 128, 64, 128


def sharded_case_id(case):
    data, ep, exchange, align, routing, dtype, bsh = case
    return (f"data{data}-ep{ep}-{exchange}-align{align}-{routing}-{jnp.dtype(dtype).name}"
            f"-{'BSH' if bsh else 'TH'}")


def mesh_of(data: int, ep: int):
    return jax.make_mesh((data, ep), ("data", "expert"), devices=host_devices(data * ep))


def layer_in_shard_map(config, mesh, params, *, data_axes=("data",), expert_axis="expert"):
    """layer(x, params) -> (y, aux) for weights like ``params``: moe inside jax.shard_map, the
    tokens split over (*data_axes, expert_axis), the weights as moe_checks.param_specs lays them."""
    tokens, specs = P((*data_axes, expert_axis)), checks.param_specs(params, expert_axis=expert_axis)

    def per_shard(x, params):
        return moe_lib.moe(x, params, config, expert_axis=expert_axis, data_axes=data_axes)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=(tokens, specs), out_specs=(tokens, P()))


@pytest.mark.parametrize("case", SHARDED_CASES, ids=[sharded_case_id(c) for c in SHARDED_CASES])
def test_layer_inside_shard_map_matches_the_dense_reference(case, cpu, seed, rng):
    data, ep, exchange, align, routing, dtype, bsh = case
    config = make_config(routing, dtype=dtype, exchange=exchange, align_size=align)
    x_shape = (16, TOKENS // 16, HIDDEN) if bsh else (TOKENS, HIDDEN)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, x_shape, FFN, make=MoEParams), cpu)
    context = f"{checks.describe(config)}, data={data}, expert={ep}, x {x_shape}, seed={seed}"
    mesh = mesh_of(data, ep)
    layer = layer_in_shard_map(config, mesh, params)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(
        *checks.put_on_mesh(mesh, x, params, y_weight))
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)


# --------------------------------------------------------------- without shard_map

# (name, routing fields, activation, x shape, ffn, dtype, weights' dtype, tokens' dtype,
# align_size, loss coefficients): every activation, pre-softmax and sigmoid top-1 routing,
# [B, S, H] and [T, H] tokens, float32 master weights for bfloat16 compute and bfloat16 weights
# and tokens, zero loss coefficients (both losses exactly 0).
LOCAL_CASES = [
    ("mixtral_like_swiglu", dict(num_experts=8, topk=2), "swiglu", (4, 16, 256), 128, F32, F32, F32, None, True),
    ("qwen_like_pre_softmax_geglu", dict(num_experts=32, topk=4, use_pre_softmax=True), "geglu", (64, 128), 32,
     BF16, F32, BF16, 128, True),
    ("deepseek_like_gelu", ROUTINGS["sigmoid_groups"], "gelu", (2, 24, 64), 64, BF16, BF16, BF16, None, True),
    ("llama4_like_sigmoid_top1_silu", dict(num_experts=16, topk=1, score_function="sigmoid"), "silu", (48, 192),
     96, F32, F32, F32, 128, True),
    ("softmax_top3_no_losses", dict(num_experts=12, topk=3, scaling_factor=0.5), "swiglu", (40, 96), 48, BF16, F32,
     F32, None, False),
]


@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_layer_without_shard_map_matches_the_dense_reference(case, cpu, seed, rng):
    _, routing, activation, x_shape, ffn, dtype, param_dtype, x_dtype, align, losses = case
    coeffs = dict(aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF) if losses else {}
    config = MoEConfig(**routing, **coeffs, activation=activation, dtype=dtype, align_size=align)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, x_shape, ffn, make=MoEParams,
                                                         param_dtype=param_dtype, x_dtype=x_dtype), cpu)
    context = f"{checks.describe(config)}, x {x.dtype}{list(x_shape)}, weights {jnp.dtype(param_dtype).name}, seed={seed}"
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: moe_lib.moe(x, p, config), x, p, w))(
        x, params, y_weight)
    errors = checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)
    if not losses:
        assert "load_balancing_loss" not in errors and "z_loss" not in errors


# ---------------------------------------------------------------- float32_gate_logits


def test_float32_gate_logits_routes_as_a_float32_router(seed, rng):
    # bfloat16 compute. With the option, the router's choices are a float32 router's on the same
    # float32 tokens and weight; without it, those of the product of both rounded to bfloat16,
    # which differ for a few tokens in a thousand (about 70 of these 4096).
    num_experts, topk, hidden, tokens = 64, 8, 256, 4096
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), F32)
    params = checks.draw_params(rng, MoEConfig(num_experts=num_experts, topk=topk), hidden, 8, glu=True,
                             make=MoEParams)
    maps = {}
    for option, router_dtype in ((True, F32), (False, BF16)):
        config = MoEConfig(num_experts=num_experts, topk=topk, dtype=BF16, float32_gate_logits=option)
        routing = jax.jit(lambda x, p: moe_lib.route(x, p, config))(x, params)
        probs, chosen = ref.route(ref.router_logits(x, params.gate, router_dtype), config)
        context = f"float32_gate_logits={option}, seed={seed}"
        np.testing.assert_array_equal(routing.routing_map, chosen, err_msg=context)
        np.testing.assert_allclose(routing.probs, probs, rtol=1e-5, atol=1e-7, err_msg=context)
        maps[option] = np.asarray(routing.routing_map)
    differ = int((maps[True] != maps[False]).any(-1).sum())
    assert differ > 0, f"bfloat16 and float32 router products chose alike for all {tokens} tokens (seed={seed})"


# (data shards or None: no shard_map, expert shards, tokens' dtype, weights' dtype)
FLOAT32_GATE_LOGITS_CASES = {
    "local_f32_tokens_and_weights": (None, 1, F32, F32),
    "local_bf16_tokens_and_weights": (None, 1, BF16, BF16),
    "data2_ep4_bf16_tokens_f32_weights": (2, 4, BF16, F32),
}


@pytest.mark.parametrize("case", FLOAT32_GATE_LOGITS_CASES)
def test_layer_with_float32_gate_logits_matches_the_dense_reference(case, cpu, seed, rng):
    # The reference's router takes the float32 tokens and weight too; its gradients reach x and
    # the gate in their own dtypes, and the layer's must as well.
    data, ep, x_dtype, param_dtype = FLOAT32_GATE_LOGITS_CASES[case]
    config = make_config("softmax_top2", dtype=BF16, exchange="all_to_all", float32_gate_logits=True)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams,
                                                         param_dtype=param_dtype, x_dtype=x_dtype), cpu)
    context = f"{case}, {checks.describe(config)}, seed={seed}"
    if data is None:
        layer, args = (lambda x, p: moe_lib.moe(x, p, config)), (x, params, y_weight)
    else:
        mesh = mesh_of(data, ep)
        layer, args = layer_in_shard_map(config, mesh, params), checks.put_on_mesh(mesh, x, params, y_weight)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(*args)
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)


# ----------------------------------------------------------------- capacity_factor

# (expert shards or None: no shard_map, exchange, align_size, routing, capacity_factor, dtype):
# drops on one device and over 2, 4 and 8 expert shards with each exchange the CPU runs; the
# reference drops the same copies (each expert's past ceil(factor * T k / E), in token order).
CAPACITY_CASES = {
    "local_softmax_top2_cf1": (None, "auto", None, "softmax_top2", 1.0, F32),
    "ep2_ring_sigmoid_groups_cf0.5": (2, "ring", 128, "sigmoid_groups", 0.5, BF16),
    "ep4_all_to_all_softmax_top2_cf1": (4, "all_to_all", None, "softmax_top2", 1.0, F32),
    "ep8_all_to_all_sigmoid_groups_cf1.25": (8, "all_to_all", 128, "sigmoid_groups", 1.25, F32),
}


@pytest.mark.parametrize("case", CAPACITY_CASES)
def test_capacity_factor_drops_the_reference_copies(case, cpu, seed, rng):
    ep, exchange, align, routing, factor, dtype = CAPACITY_CASES[case]
    config = make_config(routing, dtype=dtype, exchange=exchange, align_size=align, capacity_factor=factor)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    context = f"{case}, {checks.describe(config)}, seed={seed}"
    if ep is None:
        layer, args = (lambda x, p: moe_lib.moe(x, p, config)), (x, params, y_weight)
    else:
        mesh = mesh_of(1, ep)
        layer = layer_in_shard_map(config, mesh, params)
        args = checks.put_on_mesh(mesh, x, params, y_weight)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(*args)
    expected = checks.reference(x, params, config, y_weight)
    checks.compare(got, expected, config, context=context)
    if factor <= 1:  # a random routing overfills some expert
        assert int(got[0][1].dropped_copies) > 0, f"nothing dropped ({context})"


# ------------------------------------------------------------------- token_chunks

# (data shards, expert shards, exchange, align_size, routing, dtype, token_chunks, capacity_factor):
# each shard's tokens in 2 to 8 chunks (uneven ones: 32 tokens a shard in 3), every exchange
# the CPU runs, with and without alignment and a capacity; on one expert shard (no exchange)
# the tokens are not split.
TOKEN_CHUNK_CASES = {
    "ep2_all_to_all_softmax_2chunks": (1, 2, "all_to_all", None, "softmax_top2", F32, 2, None),
    "ep2_ring_softmax_8chunks": (1, 2, "ring", None, "softmax_top2", BF16, 8, None),
    "ep4_ring_sigmoid_groups_align_3chunks": (1, 4, "ring", 128, "sigmoid_groups", BF16, 3, None),
    "data2_ep4_all_to_all_sigmoid_groups_align_4chunks": (2, 4, "all_to_all", 128, "sigmoid_groups", F32, 4, None),
    "ep8_all_to_all_sigmoid_groups_8chunks": (1, 8, "all_to_all", None, "sigmoid_groups", F32, 8, None),
    "ep4_all_to_all_softmax_2chunks_cf1": (1, 4, "all_to_all", None, "softmax_top2", F32, 2, 1.0),
    "data2_ep1_auto_softmax_4chunks": (2, 1, "auto", None, "softmax_top2", BF16, 4, None),
}


@pytest.mark.parametrize("case", TOKEN_CHUNK_CASES)
def test_token_chunks_match_the_dense_reference(case, cpu, seed, rng):
    data, ep, exchange, align, routing, dtype, chunks, factor = TOKEN_CHUNK_CASES[case]
    config = make_config(routing, dtype=dtype, exchange=exchange, align_size=align, token_chunks=chunks,
                         capacity_factor=factor)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    context = f"{case}, {checks.describe(config)}, seed={seed}"
    mesh = mesh_of(data, ep)
    layer = layer_in_shard_map(config, mesh, params)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(
        *checks.put_on_mesh(mesh, x, params, y_weight))
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)
    if factor is not None:
        assert int(got[0][1].dropped_copies) > 0, f"nothing dropped ({context})"


# ------------------------------------------------------------ sharded expert weights

# (data shards, expert shards, exchange, align_size, routing, dtype): each expert shard's
# experts split over the data axis too (weight_axes), through shard_map_moe, whose gradients
# must come back split alike.
SHARDED_WEIGHT_CASES = {
    "expert2_data4_all_to_all_softmax": (4, 2, "all_to_all", None, "softmax_top2", F32),
    "expert2_data4_ring_sigmoid_groups_align": (4, 2, "ring", 128, "sigmoid_groups", BF16),
    "expert4_data2_all_to_all_sigmoid_groups_align": (2, 4, "all_to_all", 128, "sigmoid_groups", F32),
    "expert4_data2_auto_softmax": (2, 4, "auto", None, "softmax_top2", BF16),
}


@pytest.mark.parametrize("case", SHARDED_WEIGHT_CASES)
def test_expert_weights_sharded_over_the_data_axis_match_the_dense_reference(case, cpu, seed, rng):
    data, ep, exchange, align, routing, dtype = SHARDED_WEIGHT_CASES[case]
    config = make_config(routing, dtype=dtype, exchange=exchange, align_size=align)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    context = f"{case}, {checks.describe(config)}, seed={seed}"
    mesh = mesh_of(data, ep)

    def layer(x, params):
        return moe_lib.shard_map_moe(x, params, config, mesh=mesh, expert_axis="expert", data_axes=("data",),
                                     weight_axes=("data",))

    x_d, placed, w_d = checks.put_on_mesh(mesh, x, params, y_weight, weight_axes=("data",))
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(x_d, placed, w_d)
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)
    (_, _), (_, grads) = got
    for name in ("up", "down"):
        sharding = getattr(grads, name).sharding
        assert sharding.is_equivalent_to(getattr(placed, name).sharding, 3), f"d {name}: {sharding} ({context})"


# ---------------------------------------------------------------------- shard_map_moe

# (mesh shape, axis names, expert_axis, data_axes, x shape)
SHARD_MAP_MOE_CASES = {
    "data2_expert4_BSH": ((2, 4), ("data", "expert"), "expert", ("data",), (8, 8, 64)),
    "expert8_TH": ((8,), ("expert",), "expert", (), (128, 64)),
}


@pytest.mark.parametrize("case", SHARD_MAP_MOE_CASES)
def test_shard_map_moe_matches_the_reference_and_keeps_the_shardings(case, cpu, seed, rng):
    shape, names, expert_axis, data_axes, x_shape = SHARD_MAP_MOE_CASES[case]
    config = make_config("sigmoid_groups", dtype=F32, exchange="all_to_all", align_size=128)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, x_shape, 32, make=MoEParams), cpu)
    mesh = jax.make_mesh(shape, names, devices=host_devices(int(np.prod(shape))))
    x_d, params_d, w_d = checks.put_on_mesh(mesh, x, params, y_weight, data_axes=data_axes, expert_axis=expert_axis)

    def layer(x, params):
        return moe_lib.shard_map_moe(x, params, config, mesh=mesh, expert_axis=expert_axis, data_axes=data_axes)

    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(x_d, params_d, w_d)
    context = f"{case}, {checks.describe(config)}, seed={seed}"
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)
    (y, aux), (dx, dparams) = got
    for name, value, like in (("y", y, x_d), ("d x", dx, x_d), ("d gate", dparams.gate, params_d.gate),
                              ("d up", dparams.up, params_d.up), ("d down", dparams.down, params_d.down),
                              ("d expert_bias", dparams.expert_bias, params_d.expert_bias)):
        assert value.sharding.is_equivalent_to(like.sharding, value.ndim), (
            f"{name}: sharding {value.sharding}, expected {like.sharding} ({context})")
    for name, value in (("load_balancing_loss", aux.load_balancing_loss), ("z_loss", aux.z_loss),
                        ("tokens_per_expert", aux.tokens_per_expert)):
        assert value.sharding.is_fully_replicated, f"{name}: sharding {value.sharding}, expected replicated"


# ------------------------------------------------------------ update_expert_bias, init


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_update_expert_bias_follows_the_formula(jit, seed, rng):
    # bias + rate * sign(mean(counts) - counts), in float32: experts below the mean load go up,
    # above it down, at it (the counts below include one) stay.
    e = 16
    counts = rng.integers(0, 200, e)
    counts[3] = 0  # an idle expert
    counts[0] += -np.delete(counts, 7).sum() % (e - 1)
    counts[7] = np.delete(counts, 7).sum() // (e - 1)  # exactly the mean
    counts = counts.astype(np.int32)
    assert counts[7] == counts.mean()
    bias = (rng.standard_normal(e) * 0.01).astype(np.float32)
    rate = 1e-3
    fn = lambda b, c: moe_lib.update_expert_bias(b, c, rate)  # noqa: E731
    got = (jax.jit(fn) if jit else fn)(jnp.asarray(bias), jnp.asarray(counts))
    expected = (bias.astype(np.float64) + rate * np.sign(counts.mean() - counts.astype(np.float64))).astype(np.float32)
    assert got.dtype == jnp.float32 and got.shape == (e,)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-7, err_msg=f"counts={counts}, seed={seed}")


@pytest.mark.parametrize("activation, use_expert_bias", [("swiglu", True), ("gelu", False)])
def test_init_params_draws_each_matrix_with_variance_one_over_its_fan_in(activation, use_expert_bias, seed):
    config = MoEConfig(num_experts=8, topk=2, activation=activation, score_function="sigmoid",
                       use_expert_bias=use_expert_bias)
    hidden, ffn = 256, 128
    params = moe_lib.init_params(jax.random.key(seed), config, hidden, ffn)
    up_width = 2 * ffn if config.glu else ffn
    for name, array, shape, fan_in in (("gate", params.gate, (hidden, 8), hidden),
                                       ("up", params.up, (8, hidden, up_width), hidden),
                                       ("down", params.down, (8, ffn, hidden), ffn)):
        values = np.asarray(array, np.float64) * np.sqrt(fan_in)
        assert array.shape == shape, name
        # Standard normal after scaling: the sample mean and std of n draws are within
        # 6 / sqrt(n) of 0 and 1 (n >= 2048 here).
        assert abs(values.mean()) < 6 / np.sqrt(values.size), (name, values.mean())
        assert abs(values.std() - 1) < 6 / np.sqrt(values.size), (name, values.std())
    if use_expert_bias:
        np.testing.assert_array_equal(np.asarray(params.expert_bias), np.zeros(8, np.float32))
    else:
        assert params.expert_bias is None


@pytest.mark.parametrize("tokens, hidden, experts", [(2048, 2048, 128), (1024, 7168, 32)])  # Qwen3's, DeepSeek-V3's
def test_router_gradients_through_bfloat16_parts_are_float32_products(tokens, hidden, experts, seed, rng):
    """The backward takes a bfloat16 router's gradients from the float32 logits' gradient in
    three bfloat16 parts (tensor-core products): their sum is the gradient exactly, and the
    products are within float32's rounding bound of float64 ones (one part alone, 8 bits,
    would be ~2^-9 off)."""
    to_bf16 = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    x = to_bf16(rng.standard_normal((tokens, hidden)))
    gate = to_bf16(rng.standard_normal((hidden, experts)) / np.sqrt(hidden))
    # Magnitudes over 2^-40 .. 2^20, both signs: every part carries bits.
    grad_logits = (rng.choice([-1.0, 1.0], (tokens, experts)) * 2.0 ** rng.uniform(-40, 20, (tokens, experts)))
    grad_logits = jnp.asarray(grad_logits, jnp.float32)
    parts = np.asarray(jax.jit(layer_lib._bf16_parts)(grad_logits), np.float64)
    np.testing.assert_array_equal(parts.reshape(tokens, 3, experts).sum(1), np.asarray(grad_logits, np.float64))
    got_x, got_gate = jax.jit(layer_lib._router_grads)(x, gate, grad_logits)
    x64, gate64, g64 = (np.asarray(a, np.float64) for a in (x, gate, grad_logits))
    for name, got, want, bound in (("tokens", got_x, g64 @ gate64.T, np.abs(g64) @ np.abs(gate64.T)),
                                   ("gate", got_gate, x64.T @ g64, np.abs(x64.T) @ np.abs(g64))):
        depth = 3 * experts if name == "tokens" else tokens  # the float32 sums' length
        error = np.abs(np.asarray(got, np.float64) - want)
        assert got.dtype == jnp.float32
        assert np.all(error <= depth * 2.0 ** -24 * bound), (name, seed, float((error / bound).max()))
