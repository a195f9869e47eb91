"""Bad configurations of the MoE layer fail early with a message that names the offending value:
MoEConfig on construction, moe and shard_map_moe while tracing (jax.eval_shape on abstract
arrays: nothing runs), inside and outside shard_map."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import devices
from oxmoe import moe as moe_lib
from oxmoe.moe import MoEConfig, MoEParams

T, H, F, E = 16, 32, 8, 8


def spec(shape, dtype=jnp.float32, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def params_spec(*, experts=E, hidden=H, up_width=2 * F, ffn=F, gate=None, bias=None):
    return MoEParams(gate=spec(gate or (hidden, E)), up=spec((experts, hidden, up_width)),
                     down=spec((experts, ffn, hidden)), expert_bias=bias)


def trace(x, params, config, **kwargs):
    """Traces moe on abstract arrays (shapes and dtypes only)."""
    return jax.eval_shape(functools.partial(moe_lib.moe, config=config, **kwargs), x, params)


# ------------------------------------------------------------------------ MoEConfig

# name: (MoEConfig fields, pattern the ValueError's message must match)
CONFIG_CASES = {
    "topk_above_num_experts": (dict(num_experts=8, topk=9), r"topk.*8.*9"),
    "topk_zero": (dict(num_experts=8, topk=0), r"topk.*0"),
    "unknown_activation": (dict(num_experts=8, topk=2, activation="relu2"), r"activation.*'relu2'"),
    "unknown_exchange": (dict(num_experts=8, topk=2, exchange="all_gather"), r"exchange.*'all_gather'"),
    "unknown_score_function": (dict(num_experts=8, topk=2, score_function="tanh"), r"score_function.*'tanh'"),
    "expert_bias_with_softmax": (dict(num_experts=8, topk=2, use_expert_bias=True), r"expert_bias.*softmax"),
    "groups_not_dividing_experts": (dict(num_experts=8, topk=2, num_groups=3, group_topk=1), r"num_groups.*3"),
    "num_groups_without_group_topk": (dict(num_experts=8, topk=2, num_groups=4), r"group_topk"),
    "align_size_zero": (dict(num_experts=8, topk=2, align_size=0), r"align_size.*0"),
    "align_size_past_int32": (dict(num_experts=8, topk=2, align_size=2**62),
                              r"align_size.*2147483647.*4611686018427387904"),
    "negative_aux_loss_coeff": (dict(num_experts=8, topk=2, aux_loss_coeff=-0.1), r"aux_loss_coeff.*-0\.1"),
    "nan_aux_loss_coeff": (dict(num_experts=8, topk=2, aux_loss_coeff=float("nan")),
                           r"aux_loss_coeff must be a finite real number, got nan"),
    "inf_z_loss_coeff": (dict(num_experts=8, topk=2, z_loss_coeff=float("inf")),
                         r"z_loss_coeff must be a finite real number, got inf"),
    "negative_z_loss_coeff": (dict(num_experts=8, topk=2, z_loss_coeff=-1e-3), r"z_loss_coeff must be >= 0, got -0\.001"),
    "nan_scaling_factor": (dict(num_experts=8, topk=2, scaling_factor=float("nan")),
                           r"scaling_factor must be a finite real number, got nan"),
    "use_expert_bias_an_int": (dict(num_experts=8, topk=2, score_function="sigmoid", use_expert_bias=1),
                               r"use_expert_bias must be a bool, got 1"),
    "use_pre_softmax_an_int": (dict(num_experts=8, topk=2, use_pre_softmax=1), r"use_pre_softmax must be a bool, got 1"),
    "capacity_factor_zero": (dict(num_experts=8, topk=2, capacity_factor=0),
                             r"capacity_factor must be positive \(None: no capacity, no drops\), got 0"),
    "negative_capacity_factor": (dict(num_experts=8, topk=2, capacity_factor=-1.0),
                                 r"capacity_factor must be >= 0, got -1\.0"),
    "nan_capacity_factor": (dict(num_experts=8, topk=2, capacity_factor=float("nan")),
                            r"capacity_factor must be a finite real number, got nan"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_raises_on_construction(case):
    fields, pattern = CONFIG_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        MoEConfig(**fields)


# ------------------------------------------------------------- moe without shard_map

CONFIG = MoEConfig(num_experts=E, topk=2, dtype=jnp.float32)
SIGMOID_BIAS = MoEConfig(num_experts=E, topk=2, score_function="sigmoid", use_expert_bias=True, dtype=jnp.float32)
X = spec((T, H))

# name: (x, params, config, pattern)
LAYER_CASES = {
    "gate_wrong_hidden": (X, params_spec(gate=(H + 1, E)), CONFIG, rf"params\.gate.*{H + 1}, {E}"),
    "gate_wrong_experts": (X, params_spec(gate=(H, E - 1)), CONFIG, rf"params\.gate.*{H}, {E - 1}"),
    "up_not_fused_for_swiglu": (X, params_spec(up_width=F), CONFIG, rf"params\.up.*{E}, {H}, {F}\]"),
    "up_wrong_hidden": (X, MoEParams(spec((H, E)), spec((E, H - 1, 2 * F)), spec((E, F, H))), CONFIG,
                        rf"params\.up.*{E}, {H - 1}, {2 * F}"),
    "up_wrong_experts": (X, MoEParams(spec((H, E)), spec((E - 2, H, 2 * F)), spec((E, F, H))), CONFIG,
                         rf"params\.up.*{E - 2}, {H}, {2 * F}"),
    "down_wrong_hidden": (X, MoEParams(spec((H, E)), spec((E, H, 2 * F)), spec((E, F, H + 3))), CONFIG,
                          rf"params\.down.*{E}, {F}, {H + 3}"),
    "down_wrong_experts": (X, MoEParams(spec((H, E)), spec((E, H, 2 * F)), spec((E + 1, F, H))), CONFIG,
                           rf"params\.down.*{E + 1}, {F}, {H}"),
    "up_and_down_disagree_on_ffn": (X, MoEParams(spec((H, E)), spec((E, H, 2 * F)), spec((E, F + 1, H))), CONFIG,
                                    rf"params\.up.*{2 * F}"),
    "expert_bias_missing": (X, params_spec(), SIGMOID_BIAS, r"use_expert_bias.*expert_bias.*None"),
    "expert_bias_without_use_expert_bias": (X, params_spec(bias=spec((E,))), CONFIG,
                                            r"expert_bias.*use_expert_bias.*False"),
    "expert_bias_wrong_shape": (X, params_spec(bias=spec((E + 1,))), SIGMOID_BIAS, rf"expert_bias.*{E + 1}"),
    "expert_bias_not_float32": (X, params_spec(bias=spec((E,), jnp.bfloat16)), SIGMOID_BIAS,
                                r"expert_bias.*bfloat16"),
    "x_rank_1": (spec((H,)), params_spec(), CONFIG, rf"x.*\({H},\)"),
    "x_rank_4": (spec((2, 2, 4, H)), params_spec(), CONFIG, rf"x.*\(2, 2, 4, {H}\)"),
}


def test_a_wrong_hidden_size_in_x_is_reported_against_the_params_hidden_size():
    # The params agree among themselves on H; x is what is wrong, so the message blames x.
    with pytest.raises(ValueError) as raised:
        trace(spec((T, H + 2)), params_spec(), CONFIG)
    message = str(raised.value)
    assert message.startswith(f"x's hidden size (its last dimension) is {H + 2}, but params are for hidden {H} "
                              f"(params.gate [{H}, {E}], params.down [{E}, {F}, {H}])"), message


def test_jit_tracing_the_config_says_to_make_it_static():
    # jax.jit(moe)(x, params, config) traces config like an array: the message says how to make it static.
    x = jnp.zeros((T, H), jnp.bfloat16)
    params = moe_lib.init_params(jax.random.key(0), CONFIG, hidden=H, ffn=F)
    with pytest.raises(TypeError) as raised:
        jax.jit(moe_lib.moe)(x, params, CONFIG)
    message = str(raised.value)
    assert message.startswith("config must be an oxmoe.moe.MoEConfig, got DynamicJaxprTracer; "), message
    assert "static_argnames='config'" in message and "functools.partial(moe, config=config)" in message, message
    y, _ = jax.jit(moe_lib.moe, static_argnames="config")(x, params, config=CONFIG)
    assert y.shape == x.shape


@pytest.mark.parametrize("case", LAYER_CASES)
def test_bad_arguments_raise_while_tracing(case):
    x, params, config, pattern = LAYER_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        trace(x, params, config)


def test_padding_past_int32_rows_names_align_size_and_the_sizes():
    # 16 tokens' 32 copies, each of 8 experts padded to a multiple of 2^30: 8 * 2^30 rows.
    config = MoEConfig(num_experts=E, topk=2, align_size=2**30, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"the dispatch would hold 8589934592 rows, more than 2\*\*31 - 1.*"
                                         r"16 tokens per shard, topk=2, 8 experts per shard, align_size=1073741824"):
        trace(X, params_spec(), config)


@pytest.mark.parametrize("rate", [float("nan"), -float("inf")])
def test_update_expert_bias_refuses_a_rate_that_is_not_finite(rate):
    with pytest.raises(ValueError, match=rf"rate must be a finite real number, got {rate}"):
        moe_lib.update_expert_bias(jnp.zeros(E), jnp.arange(E, dtype=jnp.int32), rate)


def test_integer_tokens_raise_a_type_error():
    with pytest.raises(TypeError, match=r"x.*int32"):
        trace(spec((T, H), jnp.int32), params_spec(), CONFIG)


def test_an_expert_axis_outside_shard_map_is_named():
    with pytest.raises(ValueError, match=r"'expert'.*shard_map"):
        trace(X, params_spec(), CONFIG, expert_axis="expert")


# ---------------------------------------------------------------- inside shard_map


def mesh_of(shape, names):
    count = 1
    for s in shape:
        count *= s
    return jax.make_mesh(shape, names, devices=devices.mesh_devices(count))


def expert_split_inputs(mesh, tokens, experts):
    """Abstract x [tokens, H] and params with `experts` experts' weights, placed as the layer's
    shard_map splits them."""
    split, whole = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P())
    return spec((tokens, H), sharding=split), MoEParams(
        spec((H, E), sharding=whole), spec((experts, H, 2 * F), sharding=split),
        spec((experts, F, H), sharding=split))


def expert_parallel(mesh):
    return jax.shard_map(functools.partial(moe_lib.moe, config=CONFIG, expert_axis="expert"), mesh=mesh,
                         in_specs=(P("expert"), MoEParams(P(), P("expert"), P("expert"), None)),
                         out_specs=(P("expert"), P()))


def test_num_experts_not_divisible_by_the_expert_axis_inside_shard_map():
    # 9 experts' weights split over 3 shards (3 each), but the config has 8 experts.
    mesh = mesh_of((3,), ("expert",))
    with pytest.raises(ValueError, match=r"num_experts \(8\).*'expert'.*\(3\)"):
        jax.eval_shape(expert_parallel(mesh), *expert_split_inputs(mesh, 3 * T, 9))


def test_local_experts_that_do_not_match_the_expert_axis_inside_shard_map():
    # 8 experts over 4 shards: 2 each, but the weights given hold 16 (4 per shard).
    mesh = mesh_of((4,), ("expert",))
    with pytest.raises(ValueError, match=r"params\.down.*2 \(num_experts 8 / expert_axis size 4\).*\[4, 8, 32\]"):
        jax.eval_shape(expert_parallel(mesh), *expert_split_inputs(mesh, 4 * T, 16))


# One token per shard and 2 experts per shard over 4 shards. The all_to_all exchange's receive
# buffer (ragged_all_to_all's is the same, but a CPU mesh refuses that exchange) has 4 slots of
# one token, whose 8 copies for the 2 local experts are dispatched in 2 * align_size rows; the
# ring dispatches the 4 gathered tokens' 8 copies alike.
# exchange: (align_size, pattern)
PAST_INT32_ROWS = {
    "all_to_all": (2**30, r"the dispatch of the exchange's receive buffer \(4 slots of 1 tokens\) would hold "
                          r"2147483648 rows"),
    "ring": (2**30, r"the dispatch of the expert axis's 4 gathered tokens would hold 2147483648 rows"),
}


@pytest.mark.parametrize("exchange", PAST_INT32_ROWS)
def test_an_exchange_past_int32_rows_names_align_size_and_the_sizes(exchange):
    align_size, pattern = PAST_INT32_ROWS[exchange]
    mesh = mesh_of((4,), ("expert",))
    config = MoEConfig(num_experts=E, topk=2, align_size=align_size, dtype=jnp.float32, exchange=exchange)
    layer = jax.shard_map(functools.partial(moe_lib.moe, config=config, expert_axis="expert"), mesh=mesh,
                          in_specs=(P("expert"), MoEParams(P(), P("expert"), P("expert"), None)),
                          out_specs=(P("expert"), P()))
    with pytest.raises(ValueError, match=pattern + r", more than 2\*\*31 - 1.*1 tokens per shard, topk=2, "
                                         rf"2 experts per shard, align_size={align_size}"):
        jax.eval_shape(layer, *expert_split_inputs(mesh, 4, E))


def test_shard_map_moe_names_the_axes_when_the_batch_does_not_divide():
    mesh = mesh_of((2, 4), ("data", "expert"))
    with pytest.raises(ValueError, match=r"\(6\).*8 token shards.*data=2, expert=4"):
        jax.eval_shape(functools.partial(moe_lib.shard_map_moe, config=CONFIG, mesh=mesh, expert_axis="expert",
                                         data_axes=("data",)), spec((6, 4, H)), params_spec())


def test_shard_map_moe_names_the_expert_axis_when_num_experts_does_not_divide():
    mesh = mesh_of((3,), ("expert",))
    with pytest.raises(ValueError, match=r"num_experts \(8\).*'expert'.*\(3\)"):
        jax.eval_shape(functools.partial(moe_lib.shard_map_moe, config=CONFIG, mesh=mesh, expert_axis="expert"),
                       spec((3 * T, H)), params_spec())


@pytest.mark.parametrize("data_axes, pattern", [
    (("expert",), r"expert_axis 'expert' is also in data_axes \('expert',\)"),
    (("data", "data"), r"data_axes \('data', 'data'\) names an axis twice"),
], ids=["expert_axis_in_data_axes", "data_axis_twice"])
def test_shard_map_moe_refuses_an_axis_named_twice(data_axes, pattern):
    mesh = mesh_of((2, 4), ("data", "expert"))
    with pytest.raises(ValueError, match=pattern):
        jax.eval_shape(functools.partial(moe_lib.shard_map_moe, config=CONFIG, mesh=mesh, expert_axis="expert",
                                         data_axes=data_axes), spec((8, H)), params_spec())


def test_ragged_all_to_all_on_a_cpu_mesh_is_refused_while_tracing():
    # XLA:CPU has no ragged all-to-all: without this check the layer fails when it runs.
    mesh = jax.make_mesh((2,), ("expert",), devices=devices.cpu_devices()[:2])
    config = MoEConfig(num_experts=E, topk=2, dtype=jnp.float32, exchange="ragged_all_to_all")
    with pytest.raises(ValueError, match=r"exchange 'ragged_all_to_all' is not implemented on CPU.*"
                                         r"use exchange 'auto', 'all_to_all' or 'ring'"):
        jax.eval_shape(functools.partial(moe_lib.shard_map_moe, config=config, mesh=mesh, expert_axis="expert"),
                       spec((2 * T, H)), params_spec())


def test_shard_map_moe_names_an_axis_the_mesh_lacks():
    mesh = mesh_of((2, 4), ("data", "expert"))
    with pytest.raises(ValueError, match=r"'model'.*\('data', 'expert'\)"):
        jax.eval_shape(functools.partial(moe_lib.shard_map_moe, config=CONFIG, mesh=mesh, expert_axis="model"),
                       spec((8, H)), params_spec())
