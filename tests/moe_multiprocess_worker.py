"""One of the two processes of test_moe_multiprocess.py: the MoE layer on a mesh of four CPU
devices, two in each process, with the processes' collectives over gloo.

    python moe_multiprocess_worker.py PROCESS_ID PORT SEED [gpu]

Both processes draw the same data from SEED, build global arrays of it, run the layer's
forward and gradients under jit + shard_map (experts over 4 devices; then 2 data x 2 expert
shards, the expert weights split over the data axis too), gather the results and check them
against the dense reference computed locally on the whole data. Prints one line per case with the largest relative error; exits non-zero
(with the assertion) on a mismatch. The environment must give each process two host devices
(XLA_FLAGS=--xla_force_host_platform_device_count=2) and JAX_PLATFORMS=cpu.

With `gpu` (JAX_PLATFORMS=cuda): one GPU per process (local device id = process id), as a job
across nodes runs, and the experts over the two GPUs (GPU_CASES).
"""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_checks as checks  # noqa: E402
import moe_reference as ref  # noqa: E402
from oxmoe import moe as moe_lib  # noqa: E402
from oxmoe.moe import MoEConfig, MoEParams  # noqa: E402

NUM_PROCESSES = 2

# (name, mesh shape, axis names, data_axes, weight_axes, config fields, x shape): the experts over
# all four devices; two data shards of two expert shards (each process holds one data shard),
# each expert shard's experts split over the data axis too (gathered across processes).
CASES = [
    ("expert4", (4,), ("expert",), (), (),
     dict(num_experts=8, topk=2, dtype=jnp.float32, exchange="all_to_all"), (64, 64)),
    ("data2_expert2_sharded_weights", (2, 2), ("data", "expert"), ("data",), ("data",),
     dict(num_experts=16, topk=4, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5,
          use_expert_bias=True, dtype=jnp.bfloat16, exchange="ring", align_size=128), (8, 8, 64)),
]


# One GPU per process: the experts over both, Qwen3's routing and widths at 4096 tokens in all.
GPU_CASES = [
    ("gpu_expert2", (2,), ("expert",), (), (),
     dict(num_experts=128, topk=8, dtype=jnp.bfloat16, exchange="all_to_all"), (4096, 2048)),
]


def global_array(mesh, spec, value):
    """A global jax.Array of the (host, identical in every process) value, placed by spec."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def run_case(name, shape, names, data_axes, weight_axes, fields, x_shape, seed):
    rng = np.random.default_rng(seed)
    config = MoEConfig(**fields, aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF)
    with jax.default_device(jax.local_devices()[0]):
        x, params, y_weight = checks.draw_inputs(rng, config, x_shape, 32, make=MoEParams)
        expected = jax.jit(ref.value_and_grads, static_argnums=2)(x, params, config, y_weight)
    mesh = jax.make_mesh(shape, names, devices=jax.devices())
    tokens, experts = P((*data_axes, "expert")), P(("expert", *weight_axes))
    specs = MoEParams(gate=P(), up=experts, down=experts,
                      expert_bias=None if params.expert_bias is None else P())
    x_g, w_g = global_array(mesh, tokens, x), global_array(mesh, tokens, y_weight)
    params_g = jax.tree.map(lambda s, v: global_array(mesh, s, v), specs, params)
    layer = jax.shard_map(
        lambda x, p: moe_lib.moe(x, p, config, expert_axis="expert", data_axes=data_axes, weight_axes=weight_axes),
        mesh=mesh,
        in_specs=(tokens, specs), out_specs=(tokens, P()))

    @jax.jit
    def value_and_grads(x, params, y_weight):
        def loss(x, params):
            y, aux = layer(x, params)
            return ref.total_loss(y, aux, y_weight), (y, aux)

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
        return out, grads

    got = multihost_utils.process_allgather(value_and_grads(x_g, params_g, w_g), tiled=True)
    with jax.default_device(jax.local_devices()[0]):
        got = jax.tree.map(jnp.asarray, got)
        errors = checks.compare(got, expected, config, context=f"{name}, process {jax.process_index()}, seed={seed}")
    print(f"process {jax.process_index()} {name}: max relative error {max(errors.values()):.3g} "
          f"({', '.join(f'{k} {v:.2g}' for k, v in errors.items())})", flush=True)


def main():
    process_id, port, seed = (int(a) for a in sys.argv[1:4])
    gpu = sys.argv[4:] == ["gpu"]
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=NUM_PROCESSES,
                               process_id=process_id, local_device_ids=[process_id] if gpu else None)
    local = 1 if gpu else 2
    assert (jax.process_count() == NUM_PROCESSES and jax.local_device_count() == local
            and jax.device_count() == NUM_PROCESSES * local), (
        f"{jax.process_count()} processes, {jax.device_count()} devices, {jax.local_device_count()} local")
    for case in GPU_CASES if gpu else CASES:
        run_case(*case, seed=seed)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
