"""The MoE layer oxmoe.moe.moe on GPUs, against the dense reference (moe_reference.py) run on a
GPU (float32 accumulation, precision HIGHEST). Every test here is marked `gpu` and skipped
when jax has no GPU device.

- One GPU, bfloat16, the expert widths and routings of real models at 2048 tokens: Mixtral
  (H=1024, F=4096, 8 experts, softmax top-2), Qwen3-30B-A3B (H=2048, F=768, 128 experts,
  softmax top-8), DeepSeek-V3's routing (256 experts in 8 groups, sigmoid top-8 with expert
  bias and scaling) at reduced widths; y, the losses, the counts and the gradients.
- One GPU, float32 (small): float32 products throughout, the router's included.
- One GPU, DeepSeek-V3's routing with a shared expert (MoEConfig.shared_ffn): bfloat16, and
  float32 with the shared expert's sigmoid gate.
- Two and four GPUs (skipped when jax sees fewer): experts split over them inside
  jax.shard_map with each exchange ("all_to_all", "ring", "ragged_all_to_all", and "auto"),
  all_to_all and the ring with the tokens in 2 and 4 chunks (MoEConfig.token_chunks: the
  chunked weight-gradient kernels), and 2 data x 2 expert shards; the results gathered onto
  the first GPU and checked there.

With OXMOE_TEST_GPU_STAND_IN=cpu (devices.py) the one-GPU tests run on a CPU device at a
sixteenth of the tokens and widths, which checks the tests' own logic only.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import devices
import moe_checks as checks
import moe_reference as ref
from oxmoe import model_shapes
from oxmoe import moe as moe_lib
from oxmoe.model_shapes import MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER
from oxmoe.moe import MoEConfig, MoEParams

GPUS = devices.gpu_devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)]

STAND_IN = os.environ.get(devices.GPU_STAND_IN_ENV) == "cpu"
BF16 = jnp.bfloat16


def scaled(tokens: int, hidden: int, ffn: int) -> tuple[int, int, int]:
    """(T, H, F) to run: as given, or the stand-in's sixteenth."""
    return (tokens // 16, hidden // 16, ffn // 16) if STAND_IN else (tokens, hidden, ffn)


def config_of(router: model_shapes.RouterConfig, **kwargs) -> MoEConfig:
    """The MoEConfig of a model's routing, bfloat16, with both losses."""
    return MoEConfig(**router.moe_kwargs(), **{**dict(aux_loss_coeff=checks.AUX_LOSS_COEFF,
                                                      z_loss_coeff=checks.Z_LOSS_COEFF, dtype=BF16), **kwargs})


@functools.partial(jax.jit, static_argnames=("config", "hidden", "ffn"))
def draw_weights(key, *, config: MoEConfig, hidden: int, ffn: int) -> MoEParams:
    """bfloat16 weights of the layer's scale (moe_checks.draw_params' distribution), drawn on
    the key's device: 128 experts' weights are 600M elements, too many to draw on the host."""
    e, width = config.num_experts, 2 * ffn if config.glu else ffn
    k_gate, k_up, k_down, k_bias = jax.random.split(key, 4)

    def normal(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(BF16)

    bias = jax.random.normal(k_bias, (e,), jnp.float32) * 0.05 if config.use_expert_bias else None
    return MoEParams(gate=normal(k_gate, (hidden, e), hidden), up=normal(k_up, (e, hidden, width), hidden),
                     down=normal(k_down, (e, ffn, hidden), ffn), expert_bias=bias)


def draw_inputs(rng, seed, config, tokens, hidden, ffn, device):
    """(x [T, H] bfloat16, params, y_weight) on `device`; tokens without near-ties (drawn on the
    host against the drawn router weight)."""
    params = draw_weights(jax.device_put(jax.random.key(seed), device), config=config, hidden=hidden, ffn=ffn)
    x = checks.draw_tokens(rng, (tokens, hidden), np.asarray(params.gate.astype(jnp.float32)), config,
                        None if params.expert_bias is None else np.asarray(params.expert_bias))
    y_weight = (rng.standard_normal((tokens, hidden)) * checks.Y_WEIGHT_SCALE).astype(np.float32)
    return jax.device_put(jnp.asarray(x, BF16), device), params, jax.device_put(y_weight, device)


reference = jax.jit(ref.value_and_grads, static_argnums=2)


def describe(name, config, tokens, hidden, ffn, seed) -> str:
    return (f"{name}: T={tokens}, H={hidden}, F={ffn}, E={config.num_experts}, topk={config.topk}, "
            f"{config.score_function}, exchange={config.exchange}, seed={seed}")


# ----------------------------------------------------------------------- one GPU

# (name, routing, T, H, F, align_size)
ONE_GPU_CASES = [
    ("mixtral", model_shapes.MIXTRAL, 2048, MIXTRAL_LAYER.hidden, MIXTRAL_LAYER.ffn, None),
    ("qwen3_30b_a3b", model_shapes.QWEN3_MOE, 2048, QWEN3_30B_A3B_LAYER.hidden, QWEN3_30B_A3B_LAYER.ffn, 128),
    ("deepseek_v3_routing", model_shapes.DEEPSEEK_V3, 2048, 1024, 256, None),
]


@pytest.mark.parametrize("case", ONE_GPU_CASES, ids=[c[0] for c in ONE_GPU_CASES])
def test_model_layer_on_one_gpu_matches_the_dense_reference(case, gpu, seed, rng):
    name, router, tokens, hidden, ffn, align = case
    tokens, hidden, ffn = scaled(tokens, hidden, ffn)
    config = config_of(router, align_size=align)
    x, params, y_weight = draw_inputs(rng, seed, config, tokens, hidden, ffn, gpu)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: moe_lib.moe(x, p, config), x, p, w))(
        x, params, y_weight)
    for leaf in jax.tree.leaves(got):
        assert leaf.devices() == {gpu}, f"an output is on {leaf.devices()}, expected {gpu}"
    expected = reference(x, params, config, y_weight)
    checks.compare(got, expected, config, context=describe(name, config, tokens, hidden, ffn, seed))


def test_float32_layer_on_one_gpu_matches_the_dense_reference_at_float32_precision(gpu, seed, rng):
    # config.dtype float32 means float32 products throughout, the router's too: XLA's default
    # precision for a float32 matmul on a GPU is TF32 (10 mantissa bits), whose logits would
    # miss the float32 tolerance and could choose other experts than float32 ones.
    tokens, hidden, ffn = scaled(512, 256, 512)
    config = config_of(model_shapes.MIXTRAL, dtype=jnp.float32)
    params = jax.device_put(checks.draw_params(rng, config, hidden, ffn, glu=True, make=MoEParams), gpu)
    x = checks.draw_tokens(rng, (tokens, hidden), np.asarray(params.gate), config)
    y_weight = (rng.standard_normal((tokens, hidden)) * checks.Y_WEIGHT_SCALE).astype(np.float32)
    x, y_weight = jax.device_put((x, y_weight), gpu)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: moe_lib.moe(x, p, config), x, p, w))(
        x, params, y_weight)
    checks.compare(got, reference(x, params, config, y_weight), config,
                context=describe("mixtral_float32", config, tokens, hidden, ffn, seed))


# DeepSeek-V3's routing with its one shared expert (reduced widths): bfloat16, and float32 with
# Qwen2-MoE's sigmoid gate on it (its float32 products must not run in TF32 either).
SHARED_CASES = {"deepseek_v3_shared_bf16": (BF16, False), "deepseek_v3_shared_gate_f32": (jnp.float32, True)}


@pytest.mark.parametrize("case", SHARED_CASES)
def test_shared_experts_on_one_gpu_match_the_dense_reference(case, gpu, seed, rng):
    dtype, gate = SHARED_CASES[case]
    tokens, hidden, ffn = scaled(1024, 512, 256)
    config = config_of(model_shapes.DEEPSEEK_V3, dtype=dtype, shared_ffn=ffn, shared_gate=gate)
    params = jax.device_put(checks.draw_params(rng, config, hidden, ffn, glu=True, make=MoEParams, dtype=dtype), gpu)
    x = checks.draw_tokens(rng, (tokens, hidden), np.asarray(params.gate.astype(jnp.float32)), config,
                           np.asarray(params.expert_bias))
    y_weight = (rng.standard_normal((tokens, hidden)) * checks.Y_WEIGHT_SCALE).astype(np.float32)
    x, y_weight = jax.device_put((jnp.asarray(x, dtype), y_weight), gpu)
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(lambda x, p: moe_lib.moe(x, p, config), x, p, w))(
        x, params, y_weight)
    checks.compare(got, reference(x, params, config, y_weight), config,
                   context=describe(case, config, tokens, hidden, ffn, seed))


# ------------------------------------------------------------------ several GPUs

# (name, mesh shape (data, expert), routing, T in all, H, F, exchange[, token_chunks])
MULTI_GPU_CASES = [
    ("ep2_ragged", (1, 2), model_shapes.QWEN3_MOE, 4096, QWEN3_30B_A3B_LAYER.hidden, QWEN3_30B_A3B_LAYER.ffn,
     "ragged_all_to_all"),
    ("ep2_auto", (1, 2), model_shapes.MIXTRAL, 4096, MIXTRAL_LAYER.hidden, MIXTRAL_LAYER.ffn, "auto"),
    ("ep2_all_to_all", (1, 2), model_shapes.DEEPSEEK_V3, 4096, 1024, 256, "all_to_all"),
    ("ep2_ring", (1, 2), model_shapes.QWEN3_MOE, 4096, QWEN3_30B_A3B_LAYER.hidden, QWEN3_30B_A3B_LAYER.ffn, "ring"),
    ("ep4_ragged", (1, 4), model_shapes.DEEPSEEK_V3, 4096, 1024, 256, "ragged_all_to_all"),
    ("ep4_auto", (1, 4), model_shapes.QWEN3_MOE, 4096, QWEN3_30B_A3B_LAYER.hidden, QWEN3_30B_A3B_LAYER.ffn, "auto"),
    ("data2_ep2_ragged", (2, 2), model_shapes.QWEN3_MOE, 4096, QWEN3_30B_A3B_LAYER.hidden, QWEN3_30B_A3B_LAYER.ffn,
     "ragged_all_to_all"),
    ("ep2_all_to_all_2chunks", (1, 2), model_shapes.QWEN3_MOE, 4096, QWEN3_30B_A3B_LAYER.hidden,
     QWEN3_30B_A3B_LAYER.ffn, "all_to_all", 2),
    ("ep2_ring_4chunks", (1, 2), model_shapes.DEEPSEEK_V3, 4096, 1024, 256, "ring", 4),
]


@pytest.mark.parametrize("case", MULTI_GPU_CASES, ids=[c[0] for c in MULTI_GPU_CASES])
def test_expert_parallel_layer_over_gpus_matches_the_dense_reference(case, seed, rng):
    name, (data, ep), router, tokens, hidden, ffn, exchange, *chunks = case
    if len(GPUS) < data * ep:
        pytest.skip(f"needs {data * ep} GPUs, jax sees {len(GPUS)}")
    tokens, hidden, ffn = scaled(tokens, hidden, ffn)
    config = config_of(router, exchange=exchange, token_chunks=chunks[0] if chunks else 1)
    first = GPUS[0]
    x, params, y_weight = draw_inputs(rng, seed, config, tokens, hidden, ffn, first)
    # Auto axes: the results' types carry no mesh sharding, so they can move onto one GPU.
    mesh = jax.make_mesh((data, ep), ("data", "expert"), devices=GPUS[:data * ep],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layer = jax.shard_map(lambda x, p: moe_lib.moe(x, p, config, expert_axis="expert", data_axes=("data",)),
                          mesh=mesh, in_specs=(P(("data", "expert")), checks.param_specs(params)),
                          out_specs=(P(("data", "expert")), P()))
    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(
        *checks.put_on_mesh(mesh, x, params, y_weight))
    got = jax.device_put(got, first)
    expected = reference(x, params, config, y_weight)
    checks.compare(got, expected, config,
                context=describe(name, config, tokens, hidden, ffn, seed) + f", data={data}, expert={ep}")
