"""What the MoE layer keeps for its backward (its custom VJP's residuals, oxmoe.moe.Residuals),
at real models' sizes on one device, against what a dense SwiGLU MLP with the same activated
parameters keeps (issue 19's goal, SonicMoE's bar): that MLP's input [T, H] and its up
projection's output [T, 2 k F], the activation recomputed from it.

The layer keeps its input (the router's), each row's up projection [T k, 2F] (the same
elements as the MLP's), and the routing's bookkeeping: the routing map [T, E] (bool), the
dispatch's row maps ([T, E] and [T k] int32) and each row's weight [T k] (float32). It keeps
neither the dispatched rows nor their outputs ([T k, H] each): the backward permutes the
tokens again and takes the routing weights' gradient from values it computes anyway. Nor the
router's float32 logits [T, E]: the backward computes them again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import model_shapes
from oxmoe.moe import MoEConfig, init_params
from oxmoe.moe.config import mesh_axes
from oxmoe.moe.layer import _layer_fwd

CASES = {
    "mixtral": model_shapes.MIXTRAL_LAYER,
    "qwen3_30b_a3b": model_shapes.QWEN3_30B_A3B_LAYER,
    "deepseek_v3_one_gpu": model_shapes.DEEPSEEK_V3_LAYER,
}


def nbytes(tree) -> int:
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", CASES)
def test_the_layer_keeps_about_what_a_dense_swiglu_mlp_keeps(case):
    shape = CASES[case]
    config = MoEConfig(**shape.router.moe_kwargs(), aux_loss_coeff=1e-3, z_loss_coeff=1e-3)
    t, h, f, k, e = shape.tokens, shape.hidden, shape.ffn, config.topk, config.num_experts
    x = jax.ShapeDtypeStruct((t, h), jnp.bfloat16)
    params = jax.eval_shape(lambda key: init_params(key, config, h, f, jnp.bfloat16), jax.random.key(0))
    residuals = jax.eval_shape(lambda x, p: _layer_fwd(config, mesh_axes(config, None, ()), x, p, None)[1], x, params)
    (chunk,) = residuals.chunks
    # The layer's input is the router's and the dispatch's: one array, counted once.
    assert chunk.tokens.shape == residuals.tokens.shape == (t, h)
    kept = nbytes(residuals) - nbytes(residuals.params) - nbytes(chunk.tokens)
    dense = (t * h + t * 2 * k * f) * 2  # bf16 input and up projection
    bookkeeping = t * e * (1 + 4) + t * k * (4 + 4)  # routing map, dest rows; source tokens, row weights
    context = f"{case}: kept {kept / 1e6:.1f} MB, dense SwiGLU MLP {dense / 1e6:.1f} MB"
    assert chunk.up_rows.shape == (t * k, 2 * f), context
    assert kept <= dense + bookkeeping + 4096, context  # and a few scalars: the losses, the counts
    # The bookkeeping's share: 2% at Qwen3 (E = 128), 4% at DeepSeek-V3's 256 experts, under 0.1% at Mixtral.
    assert bookkeeping / dense < 0.05, context
