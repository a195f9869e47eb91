"""Router configurations of real MoE models: the shapes tests and benchmarks share.

Each :class:`RouterConfig` holds the arguments of :func:`oxmoe.router.topk` a
model uses (the expert bias is drawn by the caller when ``use_expert_bias``).
"""

from __future__ import annotations

import dataclasses

from oxmoe.moe import MoEConfig


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """A model's routing: experts, top-k and the options of :func:`oxmoe.router.topk`."""

    name: str
    num_experts: int
    topk: int
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    use_expert_bias: bool = False

    def topk_kwargs(self) -> dict:
        """Keyword arguments of `oxmoe.router.topk` (and the reference) other than expert_bias."""
        return dict(
            score_function=self.score_function,
            use_pre_softmax=self.use_pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
        )

    def moe_config(self, **fields) -> MoEConfig:
        """The :class:`oxmoe.moe.MoEConfig` of this routing, with ``fields`` for the rest (losses,
        activation, dtype, ...)."""
        return MoEConfig(num_experts=self.num_experts, topk=self.topk, use_expert_bias=self.use_expert_bias,
                         **self.topk_kwargs(), **fields)


MIXTRAL = RouterConfig("mixtral", num_experts=8, topk=2)
QWEN3_MOE = RouterConfig("qwen3_moe", num_experts=128, topk=8)
QWEN3_MOE_PRE_SOFTMAX = RouterConfig("qwen3_moe_pre_softmax", num_experts=128, topk=8, use_pre_softmax=True)
DEEPSEEK_V3 = RouterConfig(
    "deepseek_v3",
    num_experts=256,
    topk=8,
    score_function="sigmoid",
    num_groups=8,
    group_topk=4,
    scaling_factor=2.5,
    use_expert_bias=True,
)
LLAMA4 = RouterConfig("llama4", num_experts=128, topk=1, score_function="sigmoid")

ROUTER_CONFIGS = (MIXTRAL, QWEN3_MOE, QWEN3_MOE_PRE_SOFTMAX, DEEPSEEK_V3, LLAMA4)
