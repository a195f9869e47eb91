"""The MoE layer with the FP8 recipe (MoEConfig(fp8=oxmoe.fp8.BlockScaling())), on the host's
CPU devices, on fresh random data:

- its dispatch quantizes each token once, before the permutation: the same values and
  scales as quantizing the dispatched rows; its expert FFN is, up to float32 summation
  order, the composition of the plain-JAX FP8 products (oxmoe.reference.fp8) on them;
- the whole layer (y, both losses, the counts, the gradients of x, gate, up and down) against
  the float64 dense reference and against the same layer without FP8, within FP8's error
  (documented below), on one device and inside shard_map with 2 and 4 expert shards, each
  exchange the CPU runs, with alignment, token chunks, data shards, power-of-two scales,
  float32 and bfloat16 compute;
- with align_size=128 (each expert's rows whole 128-row blocks) its output, losses and gradients
  of x and gate are the unaligned layer's bit for bit, and only the weight gradients round
  otherwise;
- its training step holds the FP8 products only (four grouped and two weight-gradient
  products a chunk), none of the 16-bit ones;
- the errors for sizes FP8 cannot block and for a recipe that is not one.

FP8's error. float8_e4m3fn keeps 3 mantissa bits: each quantized value is off by up to 2^-4
of itself (about 2.5% on average over a block's spread of magnitudes), each product of two
quantized operands by about 3.5%, and the layer chains two such products forward and two
backward: on these draws the result is off the float64 reference by 6-7% of its norm
(measured: y 6.4%, d x 6.4-6.6%, d gate 6.1-6.7%, d up 6.4%, d down 6.3%), where the layer
without FP8 is off by 3e-7 (float32) or 0.3% (bfloat16). The bound is 10% of the norm, and
every element within 10% of the largest |reference| element: a wrong scale, block or
transposition puts the error near 100%. The router is not quantized: the losses and the
counts are the reference's to float32 precision.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import devices
import moe_checks as checks
import moe_reference as ref
from oxmoe import fp8, model_shapes, moe
from oxmoe.moe import MoEConfig, MoEParams
from oxmoe.moe.exchange import rows_of
from oxmoe.reference import fp8 as fp8_reference

F32, BF16 = jnp.float32, jnp.bfloat16
# (relative error of the norm, and per element the slack as a share of the largest reference
# element). The per-element bound is a tail bound over up to 10^6 elements, each a sum of
# quantized products: with square gradient blocks the worst element of d up was 0.056-0.087 of
# the largest over eight draws and 0.102 in one (seed 495621042, which failed a test run at 0.10),
# so it has room above what was seen; the norm's 0.10 holds the bulk of the error.
FP8_TOLERANCE = (0.10, 0.15)
HIDDEN, FFN, TOKENS = 256, 128, 512
ROUTINGS = {
    "softmax_top2": dict(num_experts=8, topk=2),
    "sigmoid_groups": dict(num_experts=16, topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                           scaling_factor=2.5, use_expert_bias=True),
}


def config_of(routing: str, **kwargs) -> MoEConfig:
    fields = dict(ROUTINGS[routing], aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF,
                  fp8=fp8.BlockScaling())
    return MoEConfig(**{**fields, **kwargs})


def swiglu(u, dtype):
    """The layer's activation: float32, rounded to the compute dtype."""
    gate, up = jnp.split(u.astype(F32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(dtype)


def test_expert_ffn_is_the_fp8_reference_products(seed, rng):
    config = config_of("softmax_top2", dtype=F32)
    x, params, _ = checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams)
    routing = moe.route(x, params, config)
    dispatched = moe.dispatch(x, routing, config)
    got = moe.expert_ffn(dispatched, params, config)
    sizes = dispatched.group_sizes
    # The tokens are quantized once, then permuted: the same as quantizing the dispatched rows.
    plain_rows = moe.dispatch(x, routing, dataclasses.replace(config, fp8=None)).rows
    rows_q = fp8.quantize(jnp.pad(plain_rows, ((0, dispatched.rows.shape[0] - plain_rows.shape[0]), (0, 0))),
                          fp8.ACTIVATION_BLOCK)
    np.testing.assert_array_equal(np.asarray(dispatched.rows.values, np.float32), np.asarray(rows_q.values, np.float32))
    np.testing.assert_array_equal(dispatched.rows.scales, rows_q.scales)
    up = fp8_reference.ragged_dot(rows_q, fp8.quantize(params.up, fp8.WEIGHT_BLOCK), sizes,
                                  preferred_element_type=F32)
    hidden_q = fp8.quantize(swiglu(up, F32), fp8.ACTIVATION_BLOCK)
    rows = fp8_reference.ragged_dot(hidden_q, fp8.quantize(params.down, fp8.WEIGHT_BLOCK), sizes,
                                    preferred_element_type=F32)
    context = f"sizes={np.asarray(sizes).tolist()}, seed={seed}"
    assert dispatched.rows.shape[0] % 128 == 0, dispatched.rows.shape  # the FP8 weight gradient's blocks
    # Hopper's FP8 tensor cores sum each 128-block of products with about 14 bits (oxmoe.fp8).
    checks.assert_close(got.up_rows, up, F32, what="up rows", context=context, tolerance=(2e-3, 2e-3))
    # An up row that differs in its last bits may round an activation to the neighbouring FP8
    # value (up to 2^-3 of it): a few in a million on the CPU (float32 sums), about 0.5% of them
    # on Hopper's tensor cores (14-bit block sums: 3.6e-3 of the norm on an H200, and single
    # elements up to 0.024 of the largest |row| off).
    checks.assert_close(got.rows, rows, F32, what="rows", context=context, tolerance=(1e-2, 5e-2))
    # Its weights as the forward takes them, bit for bit the layer's (which also quantizes
    # the backward's layout, from the same read), and only that layout written.
    eqns = list(_equations(jax.make_jaxpr(moe.expert_ffn, static_argnums=2)(dispatched, params, config).jaxpr))
    orientations = [e.params["orientation"] for e in eqns if e.primitive.name == "oxmoe_fp8_quantize"]
    assert orientations == ["transposed", "transposed"], orientations  # up, down
    # The hidden rows are quantized by the activation that computes them.
    assert [e.primitive.name for e in eqns if "activation" in e.primitive.name] == ["oxmoe_fp8_activation"]
    both_ways = fp8.quantize_with_transpose(params.up, fp8.WEIGHT_BLOCK)[1]
    forward = fp8.quantize(params.up, fp8.WEIGHT_BLOCK, transpose=True)
    np.testing.assert_array_equal(np.asarray(forward.values.view(jnp.uint8)),
                                  np.asarray(both_ways.values.view(jnp.uint8)))
    np.testing.assert_array_equal(forward.scales, both_ways.scales)


def test_float8_rows_follow_the_row_map_byte_for_byte(rng):
    """The dispatched rows' FP8 values are their tokens' bytes, every bit pattern kept (NaNs
    included), and zero bytes on rows of no token, as gathered four bytes a word."""
    config = config_of("softmax_top2", dtype=F32, align_size=128)
    x, params, _ = checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams)
    row_map = moe.dispatch(x, moe.route(x, params, config), config).row_id_map
    bits = rng.integers(0, 256, (TOKENS, HIDDEN), dtype=np.uint8)
    got = jax.jit(rows_of)(jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float8_e4m3fn), row_map)
    source = np.asarray(row_map.source_tokens)
    assert (source < 0).any(), "the draw has rows of no token (each expert's padded to 128)"
    want = np.where((source >= 0)[:, None], bits[np.maximum(source, 0)], 0)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)), want)


# (data shards, expert shards or None: no shard_map, exchange, align_size, routing, dtype, extra config)
LAYER_CASES = {
    "local_softmax_f32": (None, None, "auto", None, "softmax_top2", F32, {}),
    "local_sigmoid_groups_bf16_pow2": (None, None, "auto", None, "sigmoid_groups", BF16,
                                       dict(fp8=fp8.BlockScaling(power_of_two_scales=True))),
    "ep2_all_to_all_sigmoid_groups_align_f32": (1, 2, "all_to_all", 128, "sigmoid_groups", F32, {}),
    "ep4_ring_softmax_2chunks_bf16": (1, 4, "ring", None, "softmax_top2", BF16, dict(token_chunks=2)),
    "data2_ep2_all_to_all_softmax_3chunks_f32": (2, 2, "all_to_all", None, "softmax_top2", F32,
                                                 dict(token_chunks=3)),
    "ep2_ring_sigmoid_groups_square_gradients_2chunks_bf16": (
        1, 2, "ring", None, "sigmoid_groups", BF16,
        dict(token_chunks=2, fp8=fp8.BlockScaling(square_gradient_blocks=True))),
}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_fp8_layer_matches_the_reference_within_fp8_error(case, cpu, seed, rng):
    data, ep, exchange, align, routing, dtype, extra = LAYER_CASES[case]
    config = config_of(routing, dtype=dtype, exchange=exchange, align_size=align, **extra)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    context = f"{case}, seed={seed}"
    if ep is None:
        def layer(x, p, c):
            return moe.moe(x, p, c)
        args = (x, params, y_weight)
    else:
        mesh = jax.make_mesh((data, ep), ("data", "expert"), devices=devices.cpu_devices()[:data * ep])
        tokens = P(("data", "expert"))
        specs = MoEParams(gate=P(), up=P("expert"), down=P("expert"),
                          expert_bias=P() if params.expert_bias is not None else None)

        def layer(x, p, c):
            return jax.shard_map(lambda x, p: moe.moe(x, p, c, expert_axis="expert", data_axes=("data",)),
                                 mesh=mesh, in_specs=(tokens, specs), out_specs=(tokens, P()))(x, p)
        place = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        args = (jax.device_put(x, NamedSharding(mesh, tokens)), jax.device_put(params, place),
                jax.device_put(y_weight, NamedSharding(mesh, tokens)))

    def run(c):
        return jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: layer(x, p, c), x, p, w))(*args)

    got = run(config)
    plain = dataclasses.replace(config, fp8=None, align_size=None, exchange="auto", token_chunks=1)
    expected = jax.jit(ref.value_and_grads, static_argnums=2)(x, params, plain, y_weight)
    without_fp8 = run(dataclasses.replace(config, fp8=None))
    (y, aux), (dx, dparams) = got
    for name, reference in (("the float64 reference", expected), ("the layer without FP8", without_fp8)):
        (y_ref, aux_ref), (dx_ref, dparams_ref) = reference
        where = f"{context}, against {name}"
        checks.assert_close(y, y_ref, dtype, what="y", context=where, tolerance=FP8_TOLERANCE)
        checks.assert_close(dx, dx_ref, dtype, what="d x", context=where, tolerance=FP8_TOLERANCE)
        for weight in ("gate", "up", "down"):
            checks.assert_close(getattr(dparams, weight), getattr(dparams_ref, weight), dtype, what=f"d {weight}",
                                context=where, tolerance=FP8_TOLERANCE)
        for loss in ("load_balancing_loss", "z_loss"):
            checks.assert_close(getattr(aux, loss), getattr(aux_ref, loss), F32, what=loss, context=where,
                                tolerance=checks.LOSS_TOLERANCE)
        np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert, err_msg=where)


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_aligning_experts_to_128_rows_changes_only_the_weight_gradients(routing, cpu, seed, rng):
    """MoEConfig's documented effect of align_size=128 with FP8: per-row quantization and products do not
    see the padding, so the output, the losses and the gradients of x and gate are the unaligned layer's bit
    for bit; the weight gradients' 128 x 1 blocks hold other rows, so d up and d down round differently."""
    config = config_of(routing, dtype=BF16)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    assert_only_the_weight_gradients_differ(config, dataclasses.replace(config, align_size=128), (x, params, y_weight),
                                            f"{routing}, seed={seed}")


def assert_only_the_weight_gradients_differ(config: MoEConfig, other: MoEConfig, args, context: str):
    """The training step's output, losses and gradients of x and gate are the same bit for bit
    under both configurations, and the gradients of up and down differ, within FP8's error."""
    def run(c):
        return jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: moe.moe(x, p, c), x, p, w))(*args)

    (y, aux), (dx, dparams) = run(config)
    (y_other, aux_other), (dx_other, dparams_other) = run(other)
    for what, a, b in (("y", y, y_other), ("d x", dx, dx_other), ("d gate", dparams.gate, dparams_other.gate),
                       ("load-balancing loss", aux.load_balancing_loss, aux_other.load_balancing_loss),
                       ("z-loss", aux.z_loss, aux_other.z_loss)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f"{what}, {context}")
    for weight in ("up", "down"):
        checks.assert_close(getattr(dparams_other, weight), getattr(dparams, weight), BF16, what=f"d {weight}",
                            context=context, tolerance=FP8_TOLERANCE)
        assert not np.array_equal(np.asarray(getattr(dparams_other, weight), np.float32),
                                  np.asarray(getattr(dparams, weight), np.float32)), f"d {weight}, {context}"


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_square_gradient_blocks_change_only_the_weight_gradients(routing, cpu, seed, rng):
    """BlockScaling(square_gradient_blocks=True): the output, the losses and the gradients of x and
    gate are the default recipe's bit for bit (the data gradients keep their 1 x 128 blocks); the
    weight-gradient products take the output gradients in 128 x 128 blocks and the rows in 128 x 1
    ones, and their results are within FP8's error of the default's."""
    config = config_of(routing, dtype=BF16)
    square = dataclasses.replace(config, fp8=fp8.BlockScaling(square_gradient_blocks=True))
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    assert_only_the_weight_gradients_differ(config, square, (x, params, y_weight), f"{routing}, seed={seed}")
    # The products' operands by their scales: the rows' [M / 128, K], the gradients' [M / 128, N / 128].
    eqns = list(_equations(jax.make_jaxpr(lambda x, p, w: ref.layer_value_and_grads(
        lambda x, p: moe.moe(x, p, square), x, p, w))(x, params, y_weight).jaxpr))
    products = [e for e in eqns if e.primitive.name == "oxmoe_fp8_transposed_ragged_dot"]
    rhs_scales = [tuple(e.invars[3].aval.shape) for e in products]
    lhs_scales = [tuple(e.invars[1].aval.shape) for e in products]
    rows = products[0].invars[0].aval.shape[1]
    assert rhs_scales == [(rows // 128, HIDDEN // 128), (rows // 128, 2 * FFN // 128)], rhs_scales  # down, up
    assert lhs_scales == [(rows // 128, FFN), (rows // 128, HIDDEN)], lhs_scales


#: (data shards, expert shards, weight_axes, mesh axis type, routing, dtype, extra config) of the
#: layer given its weights quantized once (quantize_expert_weights): on one device, under
#: shard_map_moe with expert parallelism (on a mesh of explicit axes, which shard_map_moe
#: reshards its arguments to), and with the experts' weights split over the data axis too
#: (FSDP), where the layer gathers the quantized weights as it would gather the weights.
QUANTIZED_ONCE_CASES = {
    "local_sigmoid_groups_bf16": (1, 1, (), None, "sigmoid_groups", BF16, {}),
    "ep2_explicit_softmax_2chunks_pow2_f32": (1, 2, (), jax.sharding.AxisType.Explicit, "softmax_top2", F32,
                                              dict(token_chunks=2, fp8=fp8.BlockScaling(power_of_two_scales=True))),
    "data2_ep2_fsdp_softmax_bf16": (2, 2, ("data",), jax.sharding.AxisType.Auto, "softmax_top2", BF16,
                                    dict(exchange="all_to_all")),
}


@pytest.mark.parametrize("case", QUANTIZED_ONCE_CASES)
def test_weights_quantized_once_are_the_weights_the_layer_computes_with(case, cpu, seed, rng):
    """``fp8_weights=quantize_expert_weights(w)`` makes the layer compute with ``w``'s ``up`` and
    ``down``, bit for bit as the layer quantizing them itself, whatever ``params.up`` and
    ``params.down`` hold: given the quantization of other weights ``w2``, the output, the losses
    and every gradient are those of the layer on ``params`` with ``w2``'s ``up`` and ``down``
    (the gradients of ``up`` and ``down`` still go to ``params``). Given ``params``' own, the
    step quantizes no weight."""
    data, ep, weight_axes, axis_type, routing, dtype, extra = QUANTIZED_ONCE_CASES[case]
    config = config_of(routing, dtype=dtype, **extra)
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)
    _, other, _ = checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams)
    with_others = dataclasses.replace(params, up=other.up, down=other.down)
    if data * ep == 1:
        layer = functools.partial(moe.moe, config=config)
    else:
        mesh = jax.make_mesh((data, ep), ("data", "expert"), devices=devices.cpu_devices()[:data * ep],
                             axis_types=(axis_type,) * 2)
        layer = functools.partial(moe.shard_map_moe, config=config, mesh=mesh, expert_axis="expert",
                                  data_axes=("data",), weight_axes=weight_axes)
        x, params, with_others, other, y_weight = jax.device_put((x, params, with_others, other, y_weight),
                                                                 NamedSharding(mesh, P()))

    @jax.jit
    def step(x, params, quantized, y_weight):
        return ref.layer_value_and_grads(lambda x, p: layer(x, p, fp8_weights=quantized), x, params, y_weight)

    quantize = jax.jit(functools.partial(moe.quantize_expert_weights, config=config))
    for name, weights, quantized in (("its own weights", params, quantize(params)),
                                     ("other weights", with_others, quantize(other))):
        got = step(x, params, quantized, y_weight)
        expected = step(x, weights, None, y_weight)
        flat_got, flat_expected = jax.tree.leaves_with_path(got), jax.tree.leaves(expected)
        assert len(flat_got) == len(flat_expected)
        for (path, a), b in zip(flat_got, flat_expected):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                          err_msg=f"{jax.tree_util.keystr(path)}, given {name}, {case}, seed={seed}")
    jaxpr = jax.make_jaxpr(step)(x, params, quantize(params), y_weight)
    kinds = collections.Counter(e.params["orientation"] for e in _equations(jaxpr.jaxpr)
                                if e.primitive.name == "oxmoe_fp8_quantize")
    assert "both" not in kinds, kinds
    if weight_axes:
        # Quantized or given, the weights are gathered over the data axis in FP8, as their bytes
        # (collectives move bytes, not float8 values): each layout's values a uint8 gather of an
        # expert shard's weight shape, and no 16- or 32-bit weight gathered.
        shards = {(config.num_experts // (ep * data), *dims) for w in (params.up, params.down)
                  for dims in (w.shape[1:], w.shape[:0:-1])}
        for quantized in (None, quantize(params)):
            eqns = _equations(jax.make_jaxpr(step)(x, params, quantized, y_weight).jaxpr)
            gathered = [v.aval for e in eqns if e.primitive.name == "all_gather" for v in e.invars]
            weights = [str(a.dtype) for a in gathered if a.shape in shards]
            assert weights == ["uint8"] * 4, (weights, quantized is None)


def test_weights_quantized_under_one_recipe_serve_another_that_rounds_scales_alike(cpu, seed, rng):
    """Only power_of_two_scales decides the weights' quantization: weights quantized for the
    default recipe, given to a layer with square gradient blocks, make its step bit for bit."""
    config = config_of("softmax_top2", dtype=BF16)
    square = dataclasses.replace(config, fp8=fp8.BlockScaling(square_gradient_blocks=True))
    x, params, y_weight = jax.device_put(checks.draw_inputs(rng, config, (TOKENS, HIDDEN), FFN, make=MoEParams), cpu)

    @jax.jit
    def step(x, params, quantized, y_weight):
        return ref.layer_value_and_grads(lambda x, p: moe.moe(x, p, square, fp8_weights=quantized), x, params,
                                         y_weight)

    got = step(x, params, moe.quantize_expert_weights(params, config), y_weight)
    expected = step(x, params, None, y_weight)
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"{jax.tree_util.keystr(path)}, seed={seed}")


def test_weights_quantized_once_that_do_not_fit_the_call_are_named():
    config = config_of("softmax_top2")
    params = moe.init_params(jax.random.key(0), config, HIDDEN, FFN)
    x = jnp.zeros((8, HIDDEN))
    quantized = moe.quantize_expert_weights(params, config)
    with pytest.raises(ValueError, match=r"fp8_weights are given but config.fp8 is None"):
        moe.moe(x, params, dataclasses.replace(config, fp8=None), fp8_weights=quantized)
    with pytest.raises(TypeError, match=r"fp8_weights must be an oxmoe.moe.QuantizedExpertWeights "
                                        r"\(quantize_expert_weights' result\), got tuple"):
        moe.moe(x, params, config, fp8_weights=quantized.forward)
    powers_of_two = dataclasses.replace(config, fp8=fp8.BlockScaling(power_of_two_scales=True))
    with pytest.raises(ValueError, match=r"fp8_weights were quantized with BlockScaling\(power_of_two_scales=False, "
                                         r"square_gradient_blocks=False\), but config.fp8 is "
                                         r"BlockScaling\(power_of_two_scales=True, square_gradient_blocks=False\)"):
        moe.moe(x, params, powers_of_two, fp8_weights=quantized)
    wider = moe.quantize_expert_weights(moe.init_params(jax.random.key(0), config, HIDDEN, 2 * FFN), config)
    with pytest.raises(ValueError, match=rf"fp8_weights.up.values must be float8_e4m3fn\[8, {HIDDEN}, {2 * FFN}\], as "
                                         rf"quantize_expert_weights\(params, config\) gives for these params, got "
                                         rf"float8_e4m3fn\[8, {HIDDEN}, {4 * FFN}\]"):
        moe.moe(x, params, config, fp8_weights=wider)
    with pytest.raises(ValueError, match=r"quantize_expert_weights needs config.fp8"):
        moe.quantize_expert_weights(params, dataclasses.replace(config, fp8=None))
    with pytest.raises(ValueError, match=r"config.fp8 quantizes params.up in 128 x 128 blocks: its last two "
                                         r"dimensions must be multiples of 128, got \[8, 256, 192\]"):
        moe.quantize_expert_weights(moe.init_params(jax.random.key(0), config, HIDDEN, 96), config)


def fp8_step_jaxpr(chunks: int):
    """The jaxpr of the FP8 layer's training step (the gradients of x and the parameters)
    on 2 expert shards with ``chunks`` token chunks."""
    config = config_of("softmax_top2", dtype=BF16, token_chunks=chunks)
    mesh = jax.make_mesh((2,), ("expert",), devices=devices.cpu_devices()[:2])
    params = moe.init_params(jax.random.key(0), config, HIDDEN, FFN)
    x = jnp.zeros((TOKENS, HIDDEN), BF16)

    def loss(x, params):
        y, aux = moe.shard_map_moe(x, params, config, mesh=mesh, expert_axis="expert")
        return jnp.sum(y.astype(F32)) + aux.load_balancing_loss

    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, params)


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_fp8_step_holds_only_fp8_expert_products(chunks):
    jaxpr = str(fp8_step_jaxpr(chunks))
    counts = {name: jaxpr.count(f"{name}[") for name in
              ("oxmoe_fp8_ragged_dot", "oxmoe_fp8_transposed_ragged_dot", "oxmoe_ragged_dot",
               "oxmoe_transposed_ragged_dot")}
    assert counts == {"oxmoe_fp8_ragged_dot": 4 * chunks, "oxmoe_fp8_transposed_ragged_dot": 2,
                      "oxmoe_ragged_dot": 0, "oxmoe_transposed_ragged_dot": 0}, counts


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = item if hasattr(item, "eqns") else getattr(item, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_fp8_step_quantizes_each_tensor_from_one_read(chunks):
    # The experts' weights (the forward's products take them [E, N, K], the backward's [E, K, N])
    # are quantized both ways at once; each chunk's up-projection gradient rows (d lhs per row, the
    # up weight's gradient transposed) and weighted hidden activations (the down weight's
    # gradient, transposed) by the activation's backward that computes them; each chunk's output
    # gradient and its dispatched rows, which travelled per row, are requantized transposed from
    # their FP8 values (the rows read from their tokens); each chunk's hidden activations by the
    # activation that computes them; XLA transposes no FP8 values.
    eqns = list(_equations(fp8_step_jaxpr(chunks).jaxpr))
    kinds = collections.Counter(("requantized " if "dequantized_dtype" in e.params else "") + e.params["orientation"]
                                for e in eqns if e.primitive.name == "oxmoe_fp8_quantize")
    # Both ways: up, down. Transposed: each chunk's rows and output gradient, requantized. As they
    # are: each chunk's tokens and output gradient.
    assert kinds == {"both": 2, "requantized transposed": 2 * chunks, "as_is": 2 * chunks}, kinds
    activations = collections.Counter(e.primitive.name for e in eqns
                                      if e.primitive.name.startswith("oxmoe_") and "activation" in e.primitive.name)
    assert activations == {"oxmoe_fp8_activation": chunks, "oxmoe_fp8_activation_bwd": chunks}, activations
    # Each chunk's dispatched rows are requantized from its tokens through the dispatch's map
    # (source_rows), not from a gathered copy.
    through_maps = [e for e in eqns if e.primitive.name == "oxmoe_fp8_quantize" and len(e.invars) == 3]
    assert len(through_maps) == chunks, through_maps
    fp8_transposes = [e for e in eqns
                      if e.primitive.name == "transpose" and e.invars[0].aval.dtype == jnp.float8_e4m3fn]
    assert not fp8_transposes, fp8_transposes


def test_sizes_fp8_cannot_block_are_named():
    config = config_of("softmax_top2")
    params = moe.init_params(jax.random.key(0), config, 192, 128)
    with pytest.raises(ValueError, match=r"config.fp8 needs the hidden size and the experts' ffn to be multiples of "
                                         r"128 \(one scale per 128 of each\), got hidden 192 and ffn 128"):
        moe.moe(jnp.zeros((8, 192)), params, config)
    params = moe.init_params(jax.random.key(0), config, 128, 96)
    with pytest.raises(ValueError, match=r"got hidden 128 and ffn 96"):
        moe.moe(jnp.zeros((8, 128)), params, config)


def test_a_recipe_that_is_not_one_is_named():
    with pytest.raises(TypeError, match=r"fp8 must be None or an oxmoe.fp8.BlockScaling recipe, got True"):
        MoEConfig(num_experts=8, topk=2, fp8=True)
    with pytest.raises(ValueError, match=r"power_of_two_scales must be a bool, got 1"):
        fp8.BlockScaling(power_of_two_scales=1)
    with pytest.raises(ValueError, match=r"square_gradient_blocks must be a bool, got 'yes'"):
        fp8.BlockScaling(square_gradient_blocks="yes")


def test_tokens_and_their_gradient_cross_the_exchange_in_fp8():
    """EP 2 (one static slot): the compiled step's exchanges of token rows out to the experts
    (the tokens, and the output's gradient) carry FP8 values (uint8 [.., H]) and their
    scales (float32 [.., H / 128]): H + 4 H / 128 bytes a row, 0.52x bfloat16's at H = 7168
    and 0.53x here; the way back (the outputs, the tokens' gradient) stays in the compute dtype."""
    import compiled_steps
    from test_moe_exchange import collectives_of

    hidden = 256
    config = MoEConfig(**model_shapes.QWEN3_MOE.moe_kwargs(), exchange="all_to_all", fp8=fp8.BlockScaling())
    mesh = jax.make_mesh((2,), ("expert",), devices=devices.cpu_devices()[:2],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((512, hidden), BF16, sharding=NamedSharding(mesh, P("expert")))
    hlo = compiled_steps.compiled_step(config, mesh, x, compiled_steps.abstract_params(config, mesh, hidden, 128)
                                       ).as_text()
    found, _ = collectives_of(hlo)
    rows = [c for c in found if c.kind == "all-to-all"]
    kinds = sorted((dtype, shape[-1]) for c in rows for dtype, shape in zip(c.dtypes, c.shapes)
                   if shape[-1] in (hidden, hidden // 128))
    # Each exchange an all-to-all of one [1, S, X] operand a shard; XLA:CPU moves bfloat16 as
    # float32, so the way back's rows show as f32 [.., H].
    expected = [("u8", hidden)] * 2 + [("f32", hidden // 128)] * 2 + [("f32", hidden)] * 2
    assert kinds == sorted(expected * 2), kinds
