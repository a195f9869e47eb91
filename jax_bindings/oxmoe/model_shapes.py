"""Real MoE models' routing and layer sizes: the shapes tests and benchmarks share.

Each :class:`RouterConfig` holds the arguments of :func:`oxmoe.router.topk` a
model uses (the expert bias is drawn by the caller when ``use_expert_bias``);
each :class:`LayerShape` the sizes of one of its MoE layers and the tokens of
the step the benchmarks take, from which :meth:`LayerShape.up_gemm` and
:meth:`LayerShape.down_gemm` give its expert GEMMs. Plain data, importing
nothing from the layer: a layer's configuration is
``MoEConfig(**router.moe_kwargs(), ...)``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["RouterConfig", "LayerShape", "GemmShape", "MIXTRAL", "QWEN3_MOE", "QWEN3_MOE_PRE_SOFTMAX",
           "DEEPSEEK_V3", "LLAMA4", "ROUTER_CONFIGS", "MIXTRAL_LAYER", "QWEN3_30B_A3B_LAYER", "DEEPSEEK_V3_LAYER",
           "LAYER_SHAPES", "DEEPSEEK_V3_EXPERT_PARALLEL", "EXPERT_GEMMS"]


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

    def moe_kwargs(self) -> dict:
        """The routing fields of :class:`oxmoe.moe.MoEConfig`: ``MoEConfig(**moe_kwargs(), ...)``
        with the rest (losses, activation, dtype, ...)."""
        return dict(num_experts=self.num_experts, topk=self.topk, use_expert_bias=self.use_expert_bias,
                    **self.topk_kwargs())


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One expert GEMM after dispatch: ``M`` rows in ``groups`` groups, ``[M, K] x [G, K, N]``."""

    name: str
    m: int
    k: int
    n: int
    groups: int


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A model's MoE layer: hidden size H, an expert's FFN size F, its routing, and the tokens
    of one device's step in the benchmarks."""

    name: str
    tokens: int
    hidden: int
    ffn: int
    router: RouterConfig

    @property
    def num_experts(self) -> int:
        """E, the router's."""
        return self.router.num_experts

    @property
    def topk(self) -> int:
        """k, the router's."""
        return self.router.topk

    def _gemm(self, projection: str, k: int, n: int, expert_parallel: int) -> GemmShape:
        """``[M, k] x [G, k, n]`` on one rank of ``expert_parallel``: its ``E / ep`` experts and
        an even share, ``M = T k / ep``, of the step's token copies."""
        ep = "" if expert_parallel == 1 else f" ep={expert_parallel}"
        return GemmShape(f"{self.name}{ep} {projection}", m=self.tokens * self.topk // expert_parallel, k=k, n=n,
                         groups=self.num_experts // expert_parallel)

    def up_gemm(self, expert_parallel: int = 1) -> GemmShape:
        """The up projection ``[T k / ep, H] x [E / ep, H, F]`` on one rank of ``expert_parallel``
        (a gated activation's fused ``[E, H, 2F]`` weight is twice as wide)."""
        return self._gemm("up", self.hidden, self.ffn, expert_parallel)

    def down_gemm(self, expert_parallel: int = 1) -> GemmShape:
        """The down projection ``[T k / ep, F] x [E / ep, F, H]`` on one rank of ``expert_parallel``."""
        return self._gemm("down", self.ffn, self.hidden, expert_parallel)


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

MIXTRAL_LAYER = LayerShape("mixtral", tokens=32768, hidden=1024, ffn=4096, router=MIXTRAL)
QWEN3_30B_A3B_LAYER = LayerShape("qwen3_30b_a3b", tokens=16384, hidden=2048, ffn=768, router=QWEN3_MOE)
DEEPSEEK_V3_LAYER = LayerShape("deepseek_v3", tokens=32768, hidden=7168, ffn=2048, router=DEEPSEEK_V3)
#: Mixtral 8x7B's own sizes (``MIXTRAL_LAYER`` keeps its routing at a fraction of its width).
MIXTRAL_8X7B_LAYER = LayerShape("mixtral_8x7b", tokens=32768, hidden=4096, ffn=14336, router=MIXTRAL)

LAYER_SHAPES = (MIXTRAL_LAYER, QWEN3_30B_A3B_LAYER, DEEPSEEK_V3_LAYER)

#: DeepSeek-V3's expert parallelism in :data:`EXPERT_GEMMS`: one rank of this many.
DEEPSEEK_V3_EXPERT_PARALLEL = 8
#: The expert GEMMs the grouped GEMM's benchmark and tests take: Mixtral's and Qwen3's up
#: projections, DeepSeek-V3's up and down projections on one expert-parallel rank.
EXPERT_GEMMS = (MIXTRAL_LAYER.up_gemm(), QWEN3_30B_A3B_LAYER.up_gemm(),
                DEEPSEEK_V3_LAYER.up_gemm(DEEPSEEK_V3_EXPERT_PARALLEL),
                DEEPSEEK_V3_LAYER.down_gemm(DEEPSEEK_V3_EXPERT_PARALLEL))
