"""Expert weights sharded over the data axes too (weight_axes, FSDP): the memory they take per
device in the compiled training step, on the host's eight CPU devices, and the errors for
weight axes that cannot split them. (The values against the dense reference:
test_moe_values.py, test_expert_weights_sharded_over_the_data_axis_match_the_dense_reference.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import compiled_steps
import devices
from oxmoe import model_shapes, moe
from oxmoe.moe import MoEConfig

# (data shards, expert shards): both splits of the eight devices the issue names.
MESHES = {"expert2_data4": (4, 2), "expert4_data2": (2, 4)}


def step_memory(config: MoEConfig, mesh, hidden: int, ffn: int, tokens: int, weight_axes: tuple[str, ...]):
    """XLA's memory analysis of the compiled training step, its inputs abstract."""
    x = compiled_steps.abstract(mesh, (mesh.size * tokens, hidden), jnp.bfloat16, P(("data", "expert")))
    params = compiled_steps.abstract_params(config, mesh, hidden, ffn, weight_axes)
    return compiled_steps.compiled_step(config, mesh, x, params, data_axes=("data",),
                                        weight_axes=weight_axes).memory_analysis()


@pytest.mark.parametrize("mesh_name", MESHES)
def test_expert_weight_memory_per_device_divides_by_the_data_shards(mesh_name):
    # DeepSeek-V3's routing and widths, 256 tokens per device (the weights dominate).
    data, ep = MESHES[mesh_name]
    shape = model_shapes.DEEPSEEK_V3_LAYER
    config = MoEConfig(**shape.router.moe_kwargs(), exchange="ring")  # the weights do not depend on it
    mesh = jax.make_mesh((data, ep), ("data", "expert"), devices=devices.cpu_devices()[:data * ep],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    replicated = step_memory(config, mesh, shape.hidden, shape.ffn, 256, ())
    sharded = step_memory(config, mesh, shape.hidden, shape.ffn, 256, ("data",))
    # A device's experts' up [El, H, 2F] and down [El, F, H] in bf16, whole or a data shard's part.
    weights = (config.num_experts // ep) * 3 * shape.hidden * shape.ffn * 2
    saved = weights - weights // data
    context = f"{mesh_name}: expert weights {weights} bytes per device replicated"
    # The arguments (x, the params) and the outputs (their gradients) each hold the weights once.
    assert replicated.argument_size_in_bytes - sharded.argument_size_in_bytes == saved, context
    assert replicated.output_size_in_bytes - sharded.output_size_in_bytes == saved, context


def test_expert_weights_spec_splits_the_experts_over_the_expert_then_the_weight_axes():
    assert moe.expert_weights_spec("expert", ("data",)) == P(("expert", "data"))
    assert moe.expert_weights_spec("expert") == P(("expert",))
    assert moe.expert_weights_spec(weight_axes=("data", "fsdp")) == P(("data", "fsdp"))
    assert moe.expert_weights_spec() == P(None)


def test_weight_axes_outside_the_data_axes_are_named():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=devices.cpu_devices()[:8])
    config = MoEConfig(num_experts=8, topk=2)
    params = moe.init_params(jax.random.key(0), config, 64, 32)
    with pytest.raises(ValueError, match=r"weight_axes \('expert',\) must be data axes \(data_axes \('data',\)\); "
                                         r"\['expert'\] are not"):
        moe.shard_map_moe(jnp.zeros((16, 64)), params, config, mesh=mesh, expert_axis="expert", data_axes=("data",),
                          weight_axes=("expert",))


def auto_mesh():
    """2 data x 4 expert shards whose arrays shard_map may reshard."""
    return jax.make_mesh((2, 4), ("data", "expert"), devices=devices.cpu_devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_experts_per_shard_the_weight_axes_do_not_divide_are_named():
    # 12 experts over 4 expert shards: 3 a shard, which 2 data shards cannot split.
    mesh = auto_mesh()
    config = MoEConfig(num_experts=12, topk=2)
    params = moe.init_params(jax.random.key(0), config, 64, 32)
    message = r"the 3 experts of a shard of expert_axis must divide by the 2 shards of weight_axes \('data',\)"
    with pytest.raises(ValueError, match=message):
        moe.shard_map_moe(jnp.zeros((16, 64)), params, config, mesh=mesh, expert_axis="expert", data_axes=("data",),
                          weight_axes=("data",))
    # The same check where moe is called inside the caller's own shard_map.
    layer = jax.shard_map(lambda x, p: moe.moe(x, p, config, expert_axis="expert", data_axes=("data",),
                                               weight_axes=("data",))[0],
                          mesh=mesh, in_specs=(P(("data", "expert")), P()), out_specs=P(("data", "expert")))
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(layer, jnp.zeros((16, 64)), params)


def test_a_weight_shard_of_the_wrong_size_names_the_experts_it_must_hold():
    # 16 experts over 4 expert shards and 2 data shards: up and down hold 2 experts each.
    mesh = auto_mesh()
    config = MoEConfig(num_experts=16, topk=2)
    params = moe.init_params(jax.random.key(0), config, 64, 32)
    layer = jax.shard_map(lambda x, p: moe.moe(x, p, config, expert_axis="expert", data_axes=("data",),
                                               weight_axes=("data",))[0],
                          mesh=mesh, in_specs=(P(("data", "expert")), P()), out_specs=P(("data", "expert")))
    message = (r"params\.down must have shape \[local experts, ffn, hidden\] = \[2 \(num_experts 16 / expert_axis "
               r"size 4 / weight_axes size 2\), F, 64\], got \[16, 32, 64\]")
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(layer, jnp.zeros((16, 64)), params)
