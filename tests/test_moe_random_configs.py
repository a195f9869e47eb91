"""The MoE layer on configurations drawn at random, against the dense plain-JAX reference
(moe_reference.py), on the host's eight CPU devices.

test_moe_values.py checks chosen combinations of the layer's options; this file draws new ones
on every run, from the same space a user configures: the routing of a real model family
(softmax top-1/2/3/8, pre-softmax, sigmoid with groups and expert bias), every activation,
float32 or bfloat16 compute (with float32 or bfloat16 weights and tokens, and
float32_gate_logits), each exchange the CPU runs, alignment, token chunks, a capacity factor,
shared experts (with or without their gate), 1, 2 or 4 data shards by 1 to 8 expert shards,
expert weights split over the data axis too, and [T, H] or [B, S, H] tokens. Every draw runs
through shard_map_moe and checks y, both losses, tokens_per_expert and every gradient for the
loss sum(y * w) + losses. A failure names the configuration and its seed; OXMOE_TEST_SEED=<seed>
replays it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
import moe_checks as checks
import moe_reference as ref
from oxmoe import moe as moe_lib
from oxmoe.moe import MoEConfig, MoEParams

F32, BF16 = jnp.float32, jnp.bfloat16

# The routings of the model families the layer serves, scaled down to experts enough for eight
# expert shards.
ROUTINGS = (
    dict(num_experts=8, topk=2),  # Mixtral
    dict(num_experts=16, topk=2),
    dict(num_experts=16, topk=1),  # Switch-style top-1
    dict(num_experts=32, topk=8),  # Qwen3-MoE
    dict(num_experts=16, topk=3, scaling_factor=0.5),
    dict(num_experts=32, topk=4, use_pre_softmax=True),
    dict(num_experts=32, topk=4, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
         use_expert_bias=True),  # DeepSeek-V3, fewer experts
    dict(num_experts=64, topk=8, score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5,
         use_expert_bias=True),
    dict(num_experts=16, topk=1, score_function="sigmoid"),  # Llama 4
)


@dataclasses.dataclass(frozen=True)
class Case:
    config: MoEConfig
    data: int
    experts: int  # expert shards
    split_weights: bool  # up and down split over the data axis too
    x_shape: tuple[int, ...]
    ffn: int
    param_dtype: object
    x_dtype: object

    def describe(self) -> str:
        return (f"{checks.describe(self.config)}; data={self.data}, expert={self.experts}, "
                f"weights split={self.split_weights}, x {jnp.dtype(self.x_dtype).name}{list(self.x_shape)}, ffn={self.ffn}, "
                f"weights {jnp.dtype(self.param_dtype).name}")


def draw_case(rng: np.random.Generator) -> Case:
    routing = ROUTINGS[rng.integers(len(ROUTINGS))]
    experts_total = routing["num_experts"]
    meshes = [(data, experts) for data in (1, 2, 4) for experts in (1, 2, 4, 8)
              if data * experts <= 8 and experts_total % experts == 0]
    data, experts = meshes[rng.integers(len(meshes))]
    dtype = (F32, BF16)[rng.integers(2)]
    fields = dict(routing, aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF,
                  activation=("swiglu", "geglu", "gelu", "silu")[rng.integers(4)], dtype=dtype,
                  exchange=("all_to_all", "ring", "auto")[rng.integers(3)],
                  align_size=(None, None, 16, 128)[rng.integers(4)], token_chunks=(1, 1, 2, 3, 4)[rng.integers(5)])
    # The reference drops each expert's copies past its room among all the tokens: what the
    # layer does over one data shard.
    if data == 1 and rng.random() < 0.3:
        fields["capacity_factor"] = (0.5, 1.0, 1.5)[rng.integers(3)]
    if rng.random() < 0.25:
        fields.update(shared_ffn=(32, 64)[rng.integers(2)], shared_gate=bool(rng.integers(2)))
    param_dtype = x_dtype = np.float32
    if dtype == BF16:
        fields["float32_gate_logits"] = bool(rng.integers(2))
        param_dtype = (np.float32, BF16)[rng.integers(2)]
        x_dtype = (np.float32, BF16)[rng.integers(2)]
    tokens = (8, 16, 24, 32)[rng.integers(4)] * data * experts
    hidden = (64, 128)[rng.integers(2)]
    x_shape = (tokens // 8, 8, hidden) if rng.random() < 0.5 else (tokens, hidden)
    split_weights = data > 1 and (experts_total // experts) % data == 0 and rng.random() < 0.3
    return Case(MoEConfig(**fields), data, experts, split_weights, x_shape, (32, 64)[rng.integers(2)], param_dtype,
                x_dtype)


# Draws a run: each about 3 s of compilation on a CPU core.
DRAWS = 6


@pytest.mark.parametrize("draw", range(DRAWS))
def test_random_configuration_matches_the_dense_reference(draw, cpu, seed):
    rng = np.random.default_rng([seed, draw])
    case = draw_case(rng)
    config = case.config
    context = f"{case.describe()}; OXMOE_TEST_SEED={seed}, draw {draw}"
    x, params, y_weight = jax.device_put(
        checks.draw_inputs(rng, config, case.x_shape, case.ffn, make=MoEParams, param_dtype=case.param_dtype,
                           x_dtype=case.x_dtype), cpu)
    mesh = jax.make_mesh((case.data, case.experts), ("data", "expert"),
                         devices=devices.choose_mesh_devices([], devices.cpu_devices(), case.data * case.experts))
    weight_axes = ("data",) if case.split_weights else ()

    def layer(x, params):
        return moe_lib.shard_map_moe(x, params, config, mesh=mesh, expert_axis="expert", data_axes=("data",),
                                     weight_axes=weight_axes)

    got = jax.jit(lambda x, p, w: ref.layer_value_and_grads(layer, x, p, w))(
        *checks.put_on_mesh(mesh, x, params, y_weight, weight_axes=weight_axes))
    checks.compare(got, checks.reference(x, params, config, y_weight), config, context=context)
