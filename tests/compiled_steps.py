"""The MoE layer's training step (gradients of x and every parameter of
`sum(y²) + load_balancing_loss`: y is used, as a model uses it) compiled for a mesh from
abstract inputs, so that nothing is allocated: what the HLO-bytes and memory tests read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oxmoe import moe
from oxmoe.moe import MoEConfig, MoEParams


def abstract(mesh, shape, dtype, spec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_params(config: MoEConfig, mesh, hidden: int, ffn: int, weight_axes: tuple[str, ...] = ()) -> MoEParams:
    """bf16 expert weights split over "expert" (and each shard's experts over `weight_axes`),
    a float32 gate and expert bias whole."""
    e, experts = config.num_experts, P(("expert", *weight_axes))
    up_width = 2 * ffn if config.glu else ffn
    return MoEParams(abstract(mesh, (hidden, e), jnp.float32, P()),
                     abstract(mesh, (e, hidden, up_width), jnp.bfloat16, experts),
                     abstract(mesh, (e, ffn, hidden), jnp.bfloat16, experts),
                     abstract(mesh, (e,), jnp.float32, P()) if config.use_expert_bias else None)


def compiled_step(config: MoEConfig, mesh, x, params, *, data_axes: tuple[str, ...] = (),
                  weight_axes: tuple[str, ...] = ()):
    """The step of `moe.shard_map_moe` over `mesh` (experts over "expert"), compiled."""
    def loss(x, params):
        y, aux = moe.shard_map_moe(x, params, config, mesh=mesh, expert_axis="expert", data_axes=data_axes,
                                   weight_axes=weight_axes)
        return jnp.sum(jnp.square(y.astype(jnp.float32))) + aux.load_balancing_loss

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()
