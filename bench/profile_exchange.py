"""Times the collectives the expert-parallel MoE layer uses, alone, over every
device JAX sees, at the DeepSeek-V3 sizes per device (8192 tokens, top-8,
H = 7168, bf16): what the interconnect gives each of them.

    NCCL_DEBUG=INFO python3 bench/profile_exchange.py    # NCCL's transports too
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from profile_moe import seconds  # bench/ is the script's directory

from oxmoe.bench.moe import EP_TOKENS
from oxmoe.model_shapes import DEEPSEEK_V3_LAYER

TOPK, HIDDEN = DEEPSEEK_V3_LAYER.topk, DEEPSEEK_V3_LAYER.hidden


def main():
    devices = jax.devices()
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = EP_TOKENS * TOPK
    share = rows // n

    def sharded(fn, out_specs=P("x")):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_specs))

    def ragged(x):
        me = jax.lax.axis_index("x")
        out = jax.lax.pcast(jnp.zeros((n * rows, HIDDEN), x.dtype), ("x",), to="varying")
        offsets = jnp.arange(n, dtype=jnp.int32) * share
        sizes = jnp.full((n,), share, jnp.int32)
        return jax.lax.ragged_all_to_all(x, out, offsets, sizes, jnp.full((n,), me * rows, jnp.int32),
                                         sizes, axis_name="x")

    tests = {
        "all_gather (tokens)": (sharded(lambda x: jax.lax.all_gather(x, "x", tiled=True)), (EP_TOKENS, HIDDEN)),
        "psum_scatter (ring's partial outputs)": (
            sharded(lambda x: jax.lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True)), (n * EP_TOKENS, HIDDEN)),
        "all_to_all (dispatched rows, equal shares)": (
            sharded(lambda x: jax.lax.all_to_all(x.reshape(n, share, HIDDEN), "x", 0, 0).reshape(rows, HIDDEN)),
            (rows, HIDDEN)),
        "ragged_all_to_all (dispatched rows, equal shares)": (sharded(ragged), (rows, HIDDEN)),
    }
    print(f"{n} devices: {[d.device_kind for d in devices]}")
    for name, (fn, local_shape) in tests.items():
        x = jax.device_put(jnp.ones((n * local_shape[0], *local_shape[1:]), jnp.bfloat16),
                           NamedSharding(mesh, P("x")))
        sent = local_shape[0] * HIDDEN * 2 * (n - 1) / n  # bytes a device sends to the others
        try:
            t = seconds(fn, x)
        except Exception as e:  # noqa: BLE001 - e.g. ragged_all_to_all on XLA:CPU
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        print(f"{name}: {t * 1e3:.2f} ms, {sent / 1e6:.0f} MB to the other devices each, {sent / t / 1e9:.1f} GB/s")
        del x
    y = jnp.ones((share, HIDDEN), jnp.bfloat16, device=devices[0])
    t = seconds(lambda y: jax.device_put(y, devices[-1]), y)
    print(f"device_put {devices[0]} -> {devices[-1]}: {t * 1e3:.2f} ms for {y.nbytes / 1e6:.0f} MB, "
          f"{y.nbytes / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
