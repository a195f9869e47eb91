"""The router benchmark: oxmoe's router primitives against plain JAX and the copy ceiling.

Cases (T tokens, bf16 logits unless named f32):

- ``<model> <dtype> topk fwd|bwd``: :func:`oxmoe.router.topk` (probs and
  routing map; the backward takes d probs to d logits);
- ``<model> <dtype> scores fwd|bwd``: :func:`oxmoe.router.aux_loss_scores`;
- ``aux_loss E=<E> <dtype> fwd|bwd``: :func:`oxmoe.router.aux_loss` on
  ``[T, E]`` probs and int32 token counts (the backward gives d probs).

Each case also runs :func:`oxmoe.reference.router.topk`,
:func:`oxmoe.reference.router.aux_loss_scores` or :func:`oxmoe.reference.router.aux_loss`:
the same semantics in plain JAX (float32 arithmetic, ``lax.top_k``, scatter), written
independently of oxmoe; a backward is ``jax.vjp`` of that forward. Before anything is timed the two are compared on
every input set of the case, and a case whose outputs disagree is reported as
failed, not timed. A timed backward contains the backward only: its jit takes
the ``jax.vjp`` function (the forward's residuals) and the cotangent, and its
jaxpr is checked to hold no forward primitive.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe import reference, router
from oxmoe.model_shapes import DEEPSEEK_V3, MIXTRAL, QWEN3_MOE, RouterConfig
from oxmoe.bench import timing
from oxmoe.bench.cases import Case, Family, Goals, Inputs, apply_vjp, rel_err

#: Tokens per case in the full run, and in the smoke run.
TOKENS, SMOKE_TOKENS = 65536, 512
#: Experts of the load-balancing loss cases, its top-k and coefficient.
AUX_LOSS_EXPERTS, AUX_LOSS_TOPK, AUX_LOSS_COEFF = (256, 1024, 2048), 8, 1e-2

#: Goals of the issue: time within this factor of the byte floor ...
MAX_X_FLOOR = 2.0
#: ... and at least this much faster than plain JAX (routing cases).
MIN_SPEEDUP = 15.0
GOALS = Goals(max_x_floor=MAX_X_FLOOR, min_speedup=MIN_SPEEDUP,
              floor_text=f"time <= {MAX_X_FLOOR:g}x byte floor (bytes / copy bandwidth)",
              speedup_text=f">= {MIN_SPEEDUP:g}x faster than plain JAX (routing cases)",
              floor_column=f"<={MAX_X_FLOOR:g}x floor")

#: Largest fraction of tokens whose routing may differ from plain JAX's (near-ties
#: of float32 scores computed in a different order).
MAX_ROUTING_MISMATCH = 1e-3
#: Largest ||oxmoe - plain|| / ||plain|| of a value, by the dtype it is stored in.
MAX_REL_ERR = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float32): 1e-4}
#: The scalar loss sums T * E products in float32, in whatever order.
MAX_LOSS_REL_ERR = 1e-3


MODELS = (DEEPSEEK_V3, QWEN3_MOE, MIXTRAL)


# -- comparisons (on the device, one input set at a time) -----------------------

def _rows_agree(a, b):
    return jnp.all(a == b, axis=-1)


def _routing_mismatch(a, b):
    """The fraction of tokens (rows) whose routing maps differ."""
    return 1.0 - jnp.mean(_rows_agree(a, b).astype(jnp.float32))


@jax.jit
def _compare_topk_fwd(ox, plain, context):
    del context
    agree = _rows_agree(ox[1], plain[1])
    return dict(routing_mismatch=_routing_mismatch(ox[1], plain[1]),
                probs_rel_err=rel_err(ox[0], plain[0], agree))


@jax.jit
def _compare_topk_bwd(ox, plain, maps):
    """``maps``: the routing maps of oxmoe's and plain JAX's forwards."""
    return dict(routing_mismatch=_routing_mismatch(*maps),
                grad_rel_err=rel_err(ox, plain, _rows_agree(*maps)))


@jax.jit
def _compare_scores_fwd(ox, plain, context):
    del context
    return dict(routing_mismatch=_routing_mismatch(ox[0], plain[0]),
                scores_rel_err=rel_err(ox[1], plain[1]))


@jax.jit
def _compare_grads(ox, plain, context):
    del context
    return dict(grad_rel_err=rel_err(ox, plain))


@jax.jit
def _compare_losses(ox, plain, context):
    del context
    return dict(loss_rel_err=jnp.abs(ox - plain) / jnp.maximum(jnp.abs(plain), 1e-30))


# -- cases ----------------------------------------------------------------------

def _expert_bias(random: timing.RandomArrays, config: RouterConfig):
    return random.normal((config.num_experts,), jnp.float32, scale=0.1) if config.use_expert_bias else None


def _oxmoe_topk(config: RouterConfig):
    return lambda logits, bias: router.topk(logits, config.topk, expert_bias=bias, **config.topk_kwargs())


def _plain_topk(config: RouterConfig):
    return lambda logits, bias: reference.router.topk(logits, config.topk, expert_bias=bias, **config.topk_kwargs())


def _value_limit(what: str, dtype) -> dict[str, float]:
    return {f"{what}_rel_err": MAX_REL_ERR[jnp.dtype(dtype)]}


def _info(op: str, direction: str, dtype, tokens: int, num_experts: int, topk: int, model: str) -> dict:
    return dict(op=op, direction=direction, dtype=jnp.dtype(dtype).name, tokens=tokens,
                num_experts=num_experts, topk=topk, model=model)


_DTYPE_NAMES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}


def _name(model: str, dtype, op: str, direction: str) -> str:
    return f"{model} {_DTYPE_NAMES[jnp.dtype(dtype)]} {op} {direction}"


def topk_fwd_case(config: RouterConfig, tokens: int, dtype) -> Case:
    t, e, d = tokens, config.num_experts, jnp.dtype(dtype).itemsize
    bias_bytes = 4 * e if config.use_expert_bias else 0

    def draw(random):
        return random.normal((t, e), dtype), _expert_bias(random, config)

    return Case(
        name=_name(config.name, dtype, "topk", "fwd"),
        bytes=t * e * d + bias_bytes + t * e * (d + 1),  # logits, bias -> probs, routing map
        draw=draw, prepare=None, oxmoe=_oxmoe_topk(config), plain=_plain_topk(config),
        compare=_compare_topk_fwd,
        limits=dict(routing_mismatch=MAX_ROUTING_MISMATCH, **_value_limit("probs", dtype)),
        primitive="oxmoe_topk_fwd",
        info=_info("topk", "fwd", dtype, t, e, config.topk, config.name))


def topk_bwd_case(config: RouterConfig, tokens: int, dtype) -> Case:
    t, e, d = tokens, config.num_experts, jnp.dtype(dtype).itemsize

    def draw(random):
        return random.normal((t, e), dtype), _expert_bias(random, config), random.normal((t, e), dtype)

    def prepare(logits, bias, grad_probs):
        _, ox_vjp, ox_map = jax.vjp(lambda x: _oxmoe_topk(config)(x, bias), logits, has_aux=True)
        _, plain_vjp, plain_map = jax.vjp(lambda x: _plain_topk(config)(x, bias), logits, has_aux=True)
        return Inputs((ox_vjp, grad_probs), (plain_vjp, grad_probs), context=(ox_map, plain_map))

    return Case(
        name=_name(config.name, dtype, "topk", "bwd"),
        bytes=t * e * (d + d + 1) + t * e * d,  # d probs, logits, routing map -> d logits
        draw=draw, prepare=prepare, oxmoe=apply_vjp, plain=apply_vjp,
        compare=_compare_topk_bwd,
        limits=dict(routing_mismatch=MAX_ROUTING_MISMATCH, **_value_limit("grad", dtype)),
        primitive="oxmoe_topk_bwd", excluded=("oxmoe_topk_fwd", "top_k", "exp", "logistic"),
        info=_info("topk", "bwd", dtype, t, e, config.topk, config.name))


def scores_fwd_case(config: RouterConfig, tokens: int, dtype) -> Case:
    t, e, d = tokens, config.num_experts, jnp.dtype(dtype).itemsize

    def draw(random):
        return (random.normal((t, e), dtype),)

    return Case(
        name=_name(config.name, dtype, "scores", "fwd"),
        bytes=t * e * d + t * e * (1 + 4),  # logits -> routing map, f32 scores
        draw=draw, prepare=None,
        oxmoe=lambda x: router.aux_loss_scores(x, config.topk, score_function=config.score_function),
        plain=lambda x: reference.router.aux_loss_scores(x, config.topk, score_function=config.score_function),
        compare=_compare_scores_fwd,
        limits=dict(routing_mismatch=MAX_ROUTING_MISMATCH, **_value_limit("scores", jnp.float32)),
        primitive="oxmoe_aux_loss_scores_fwd",
        info=_info("scores", "fwd", dtype, t, e, config.topk, config.name))


def scores_bwd_case(config: RouterConfig, tokens: int, dtype) -> Case:
    t, e, d = tokens, config.num_experts, jnp.dtype(dtype).itemsize

    def draw(random):
        return random.normal((t, e), dtype), random.normal((t, e), jnp.float32)

    def prepare(logits, grad_scores):
        _, ox_vjp = jax.vjp(
            lambda x: router.aux_loss_scores(x, config.topk, score_function=config.score_function)[1], logits)
        _, plain_vjp = jax.vjp(
            lambda x: reference.router.aux_loss_scores(x, config.topk, score_function=config.score_function)[1],
            logits)
        return Inputs((ox_vjp, grad_scores), (plain_vjp, grad_scores))

    return Case(
        name=_name(config.name, dtype, "scores", "bwd"),
        bytes=t * e * (4 + d) + t * e * d,  # f32 d scores, logits -> d logits
        draw=draw, prepare=prepare, oxmoe=apply_vjp, plain=apply_vjp,
        compare=_compare_grads, limits=_value_limit("grad", dtype),
        primitive="oxmoe_aux_loss_scores_bwd",
        excluded=("oxmoe_aux_loss_scores_fwd", "top_k", "exp", "logistic"),
        info=_info("scores", "bwd", dtype, t, e, config.topk, config.name))


def _aux_loss_inputs(random: timing.RandomArrays, tokens: int, num_experts: int, dtype):
    """Softmax probs ``[T, E]`` and int32 token counts of a plausible top-k routing."""
    mean_count = tokens * AUX_LOSS_TOPK // num_experts
    return (random.probabilities((tokens, num_experts), dtype),
            random.integers(0, 2 * mean_count + 1, (num_experts,), jnp.int32))


def _aux_loss_fns(tokens: int):
    kwargs = dict(total_num_tokens=tokens, topk=AUX_LOSS_TOPK, coeff=AUX_LOSS_COEFF)
    return (lambda p, counts: router.aux_loss(p, counts, **kwargs),
            lambda p, counts: reference.router.aux_loss(p, counts, **kwargs))


def aux_loss_fwd_case(num_experts: int, tokens: int, dtype) -> Case:
    t, e, d = tokens, num_experts, jnp.dtype(dtype).itemsize
    oxmoe_fn, plain_fn = _aux_loss_fns(t)

    return Case(
        name=f"aux_loss E={e} {_DTYPE_NAMES[jnp.dtype(dtype)]} fwd",
        bytes=t * e * d + 4 * e + 4,  # probs, counts -> loss
        draw=lambda random: _aux_loss_inputs(random, t, e, dtype), prepare=None, oxmoe=oxmoe_fn, plain=plain_fn,
        compare=_compare_losses, limits=dict(loss_rel_err=MAX_LOSS_REL_ERR),
        primitive="oxmoe_aux_loss_fwd", speedup_goal=False,
        info=_info("aux_loss", "fwd", dtype, t, e, AUX_LOSS_TOPK, "aux_loss"))


def aux_loss_bwd_case(num_experts: int, tokens: int, dtype) -> Case:
    t, e, d = tokens, num_experts, jnp.dtype(dtype).itemsize
    oxmoe_fn, plain_fn = _aux_loss_fns(t)

    def draw(random):
        return *_aux_loss_inputs(random, t, e, dtype), random.normal((), jnp.float32)

    def prepare(probs, counts, grad_loss):
        _, ox_vjp = jax.vjp(lambda p: oxmoe_fn(p, counts), probs)
        _, plain_vjp = jax.vjp(lambda p: plain_fn(p, counts), probs)
        return Inputs((ox_vjp, grad_loss), (plain_vjp, grad_loss))

    return Case(
        name=f"aux_loss E={e} {_DTYPE_NAMES[jnp.dtype(dtype)]} bwd",
        bytes=4 + 4 * e + t * e * d,  # d loss, counts -> d probs
        draw=draw, prepare=prepare, oxmoe=apply_vjp, plain=apply_vjp,
        compare=_compare_grads, limits=_value_limit("grad", dtype),
        primitive="oxmoe_aux_loss_bwd", excluded=("oxmoe_aux_loss_fwd", "reduce_sum"),
        speedup_goal=False,
        info=_info("aux_loss", "bwd", dtype, t, e, AUX_LOSS_TOPK, "aux_loss"))


def cases(tokens: int) -> list[Case]:
    """Every router case at ``tokens`` tokens, in the order they run."""
    out = []
    for config in MODELS:
        dtypes = (jnp.bfloat16, jnp.float32) if config is DEEPSEEK_V3 else (jnp.bfloat16,)
        for dtype in dtypes:
            out += [topk_fwd_case(config, tokens, dtype), topk_bwd_case(config, tokens, dtype)]
        out += [scores_fwd_case(config, tokens, jnp.bfloat16), scores_bwd_case(config, tokens, jnp.bfloat16)]
    for num_experts in AUX_LOSS_EXPERTS:
        for dtype in (jnp.bfloat16, jnp.float32):
            out += [aux_loss_fwd_case(num_experts, tokens, dtype), aux_loss_bwd_case(num_experts, tokens, dtype)]
    return out


FAMILY = Family(name="router", goals=GOALS,
                cases=lambda smoke: cases(SMOKE_TOKENS if smoke else TOKENS),
                sizes=lambda smoke: f"T={SMOKE_TOKENS if smoke else TOKENS}")
