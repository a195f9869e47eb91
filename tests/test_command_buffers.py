"""oxmoe's CUDA handlers inside XLA's command buffers (CUDA graphs), on a GPU.

The CUDA handlers report themselves command-buffer compatible, so XLA records their
execute stage into CUDA graphs and replays it: the graph must hold everything a call
does (its kernels' memory is the call's workspace result, assigned by XLA, never memory
allocated during the call), and nothing else (the kernels are loaded at XLA's initialize
stage, not while XLA captures). Each test compiles one program twice, with command
buffers around every sequence of at least one command (``xla_gpu_graph_min_graph_size``
1) and with command buffers off, then runs both on fresh inputs, new buffers each time,
so that XLA records the graphs again, and checks every output bit for bit.

Marked `gpu`; skipped when jax has no GPU device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import devices
from oxmoe import grouped_gemm, permutation, router
from oxmoe.fp8 import BlockScaling
from oxmoe.moe import MoEConfig, init_params, moe

GPUS = devices.gpu_devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPUS, reason=devices.NO_GPU_REASON)]

IN_GRAPHS = {"xla_gpu_graph_min_graph_size": 1}
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
CALLS = 3


def assert_same_with_and_without_graphs(fn, draw_args):
    """``fn`` compiled both ways gives the same bytes on ``CALLS`` fresh argument sets."""
    example = draw_args(0)
    in_graphs = jax.jit(fn).lower(*example).compile(IN_GRAPHS)
    no_graphs = jax.jit(fn).lower(*example).compile(NO_GRAPHS)
    for call in range(CALLS):
        args = draw_args(call + 1)
        got, want = jax.tree.leaves(in_graphs(*args)), jax.tree.leaves(no_graphs(*args))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            g, w = np.atleast_1d(np.asarray(g)), np.atleast_1d(np.asarray(w))
            differing = int(np.sum(g.view(np.uint8) != w.view(np.uint8)))
            assert differing == 0, f"call {call}, output {i}: {differing} bytes differ in a CUDA graph"


def layer_step(config):
    def loss(x, params):
        y, aux = moe(x, params, config)
        weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
        return jnp.sum(y.astype(jnp.float32) * weights) + aux.load_balancing_loss + aux.z_loss
    return jax.value_and_grad(loss, argnums=(0, 1))


@pytest.mark.parametrize("name, config, hidden, ffn", [
    ("mixtral-like, aligned", MoEConfig(num_experts=8, topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                                        align_size=16), 256, 256),
    ("two token chunks", MoEConfig(num_experts=16, topk=4, aux_loss_coeff=1e-2, token_chunks=2), 256, 128),
    ("fp8", MoEConfig(num_experts=8, topk=2, aux_loss_coeff=1e-2, fp8=BlockScaling()), 512, 256),
])
def test_layer_step_in_cuda_graphs_is_the_step_without(name, config, hidden, ffn):
    params = init_params(jax.random.key(0), config, hidden, ffn, dtype=jnp.bfloat16)
    tokens = 4096
    assert_same_with_and_without_graphs(
        layer_step(config),
        lambda seed: (jax.random.normal(jax.random.key(seed), (tokens, hidden), jnp.bfloat16), params))


def test_primitives_with_a_workspace_in_cuda_graphs():
    """The calls that take a workspace, alone: the aux loss, the dispatch, the grouped
    products (one and two chunks of rows), and a product with no rows (nothing to launch)."""
    t, e, h, n = 2048, 8, 128, 256

    def fn(x, logits, w):
        probs, routing_map = router.topk(logits, 2)
        counts = jnp.sum(routing_map, axis=0, dtype=jnp.int32)
        loss = router.aux_loss(jax.nn.softmax(logits), counts, total_num_tokens=t, topk=2, coeff=1e-2)
        d = permutation.dispatch(x, routing_map, probs=probs, topk=2)
        out = grouped_gemm.ragged_dot(d.tokens, w, d.group_sizes)
        # The rows in two chunks of t: each group's rows in the first, then in the second.
        ends = jnp.cumsum(d.group_sizes)
        first = jnp.clip(ends, 0, t) - jnp.clip(ends - d.group_sizes, 0, t)
        sizes = jnp.stack([first, d.group_sizes - first])
        grad_w = grouped_gemm.transposed_ragged_dot((d.tokens[:t], d.tokens[t:]), (out[:t], out[t:]), sizes,
                                                    num_groups=e)
        empty = grouped_gemm.ragged_dot(d.tokens[:0], w, jnp.zeros_like(d.group_sizes))
        return loss, out, grad_w, empty, d.row_id_map

    def draw(seed):
        keys = jax.random.split(jax.random.key(seed), 3)
        return (jax.random.normal(keys[0], (t, h), jnp.bfloat16), jax.random.normal(keys[1], (t, e), jnp.float32),
                jax.random.normal(keys[2], (e, h, n), jnp.bfloat16))

    assert_same_with_and_without_graphs(fn, draw)
