"""Peers' checkpoint layouts (param_layout, issue 20): oxmoe.flax.MoEBlock and oxmoe.nnx.MoE create
their parameters with MaxText's RoutedMoE / RoutedAndSharedMoE and TransformerEngine's _MoEBlock
names and shapes, and a parameter tree built here from those projects' documented names (not
imported from them) goes into the module unchanged: its output, its gradient and each weight's
gradient (at the peer's names) match the dense reference (moe_reference.py) of the same weights
in oxmoe's fused layout. Layouts a peer cannot express are refused by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", minversion="0.12", reason="oxmoe.flax and oxmoe.nnx need the oxmoe[flax] extra")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import moe_checks as checks  # noqa: E402
import moe_reference as ref  # noqa: E402
from oxmoe.flax import MoEBlock  # noqa: E402
from oxmoe.moe import MoEConfig, MoEParams  # noqa: E402
from oxmoe.nnx import MoE  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
H, F, FS, E, T = 32, 16, 24, 8, 64


def normal(rng, shape, fan_in, dtype=F32):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.sqrt(fan_in)).astype(dtype)


# Each peer's tree, from its documentation and source (see docs/migration.md):
# MaxText (src/MaxText/layers/moe.py): RoutedMoE holds a GateLogit named "gate" whose "kernel" is
#   [emb, E], and "wi_0", "wi_1" [E, emb, mlp] (activation of wi_0 times wi_1) and "wo" [E, mlp, emb];
#   RoutedAndSharedMoE holds that block as "MoeBlock_0" and an MlpBlock "shared_experts" of width
#   shared_experts * moe_mlp_dim: DenseGeneral "wi_0", "wi_1" (kernel [emb, mlp]) and "wo" (kernel
#   [mlp, emb]).
# TransformerEngine (transformer_engine/jax/flax/moe.py, _MoEBlock): "gate_kernel" [H, E], "wi"
#   [E, H, 2F] split in halves (gate first), "wo" [E, F, H].
def maxtext_tree(rng, shared: bool, dtype=F32) -> dict:
    routed = {"gate": {"kernel": normal(rng, (H, E), H, dtype)}, "wi_0": normal(rng, (E, H, F), H, dtype),
              "wi_1": normal(rng, (E, H, F), H, dtype), "wo": normal(rng, (E, F, H), F, dtype)}
    if not shared:
        return routed
    return {"MoeBlock_0": routed,
            "shared_experts": {"wi_0": {"kernel": normal(rng, (H, FS), H, dtype)},
                               "wi_1": {"kernel": normal(rng, (H, FS), H, dtype)},
                               "wo": {"kernel": normal(rng, (FS, H), FS, dtype)}}}


def maxtext_params(tree) -> MoEParams:
    """oxmoe's fused layout of a MaxText tree, written out here."""
    routed = tree.get("MoeBlock_0", tree)
    shared = {}
    if "shared_experts" in tree:
        s = tree["shared_experts"]
        shared = dict(shared_up=jnp.concatenate([s["wi_0"]["kernel"], s["wi_1"]["kernel"]], -1),
                      shared_down=s["wo"]["kernel"])
    return MoEParams(gate=routed["gate"]["kernel"], up=jnp.concatenate([routed["wi_0"], routed["wi_1"]], -1),
                     down=routed["wo"], **shared)


def te_tree(rng, shared: bool, dtype=F32) -> dict:
    assert not shared
    return {"gate_kernel": normal(rng, (H, E), H, dtype), "wi": normal(rng, (E, H, 2 * F), H, dtype),
            "wo": normal(rng, (E, F, H), F, dtype)}


def te_params(tree) -> MoEParams:
    return MoEParams(gate=tree["gate_kernel"], up=tree["wi"], down=tree["wo"])


PEERS = {"maxtext": (maxtext_tree, maxtext_params), "transformer_engine": (te_tree, te_params)}
# (layout, shared experts, dtype)
CASES = {
    "maxtext-routed-f32": ("maxtext", False, F32),
    "maxtext-routed_and_shared-f32": ("maxtext", True, F32),
    "maxtext-routed_and_shared-bf16": ("maxtext", True, BF16),
    "transformer_engine-f32": ("transformer_engine", False, F32),
    "transformer_engine-bf16": ("transformer_engine", False, BF16),
}


def config_of(shared: bool, dtype) -> MoEConfig:
    return MoEConfig(num_experts=E, topk=2, dtype=dtype, shared_ffn=FS if shared else None,
                     aux_loss_coeff=checks.AUX_LOSS_COEFF, z_loss_coeff=checks.Z_LOSS_COEFF)


def linen_layer(config, layout, x):
    block = MoEBlock(config=config, ffn=F, param_layout=layout)
    created = nn.meta.unbox(block.init(jax.random.key(0), x))["params"]
    return created, lambda x, tree: block.apply({"params": tree}, x)


def nnx_layer(config, layout, x):
    module = MoE(config, H, F, rngs=nnx.Rngs(0), param_layout=layout)
    graphdef, state, rest = nnx.split(module, nnx.Param, ...)

    def layer(x, tree):
        nnx.replace_by_pure_dict(state, tree)
        return nnx.merge(graphdef, state, rest)(x)

    return nnx.to_pure_dict(state), layer


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
@pytest.mark.parametrize("case", CASES)
def test_a_peer_checkpoint_loads_unchanged_and_matches_the_reference(case, front_end, cpu, seed, rng):
    layout, shared, dtype = CASES[case]
    make_tree, to_params = PEERS[layout]
    config = config_of(shared, dtype)
    tree = jax.device_put(make_tree(rng, shared, dtype), cpu)
    params = to_params(tree)
    x = jax.device_put(jnp.asarray(checks.draw_tokens(rng, (T, H), params.gate, config)), cpu)
    y_weight = jnp.asarray((rng.standard_normal((T, H)) * checks.Y_WEIGHT_SCALE).astype(np.float32))
    created, layer = (linen_layer if front_end == "linen" else nnx_layer)(config, layout, x)
    # The module's own parameters have the peer's names and shapes.
    assert jax.tree.map(jnp.shape, created) == jax.tree.map(jnp.shape, tree), f"{case}, {front_end}"

    def value_and_grads(x, tree, y_weight):
        return ref.layer_value_and_grads(layer, x, tree, y_weight)

    (y, aux), (dx, dtree) = jax.jit(value_and_grads)(x, tree, y_weight)
    assert jax.tree.structure(dtree) == jax.tree.structure(tree)
    expected = jax.jit(ref.value_and_grads, static_argnums=2)(x, params, config, y_weight)
    # The peer's gradients, put in oxmoe's fused layout as the weights were.
    checks.compare(((y, aux), (dx, to_params(dtree))), expected, config, context=f"{case}, {front_end}, seed={seed}")


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_layouts_a_peer_cannot_express_are_refused(front_end):
    x = jnp.zeros((T, H))
    refusals = [
        ("maxtext", MoEConfig(num_experts=E, topk=2, activation="gelu"),
         r"param_layout 'maxtext' \(MaxText's RoutedMoE\) holds gated experts: activation must be 'swiglu' or "
         r"'geglu', got 'gelu'"),
        ("maxtext", MoEConfig(num_experts=E, topk=2, shared_ffn=FS, shared_gate=True),
         r"MaxText's shared experts have no gate"),
        ("transformer_engine", MoEConfig(num_experts=E, topk=2, shared_ffn=FS),
         r"TransformerEngine's _MoEBlock has no shared experts"),
        ("keras", MoEConfig(num_experts=E, topk=2), r"param_layout must be one of \('oxmoe', 'maxtext', "
                                                    r"'transformer_engine'\), got 'keras'"),
    ]
    for layout, config, message in refusals:
        with pytest.raises(ValueError, match=message):
            if front_end == "linen":
                MoEBlock(config=config, ffn=F, param_layout=layout).init(jax.random.key(0), x)
            else:
                MoE(config, H, F, rngs=nnx.Rngs(0), param_layout=layout)


def test_maxtext_layout_keeps_the_logical_axes_of_its_weights():
    config = config_of(True, F32)
    boxed = MoEBlock(config=config, ffn=F, param_layout="maxtext").init(jax.random.key(0), jnp.zeros((T, H)))
    names = jax.tree.map(lambda box: box.names, boxed["params"], is_leaf=lambda v: isinstance(v, nn.Partitioned))
    assert names == {"MoeBlock_0": {"gate": {"kernel": ("embed", None)}, "wi_0": ("exp", "embed", "mlp"),
                                    "wi_1": ("exp", "embed", "mlp"), "wo": ("exp", "mlp", "embed")},
                     "shared_experts": {"wi_0": {"kernel": ("embed", "mlp")}, "wi_1": {"kernel": ("embed", "mlp")},
                                        "wo": {"kernel": ("mlp", "embed")}}}
