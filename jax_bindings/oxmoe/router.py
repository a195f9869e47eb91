"""Router primitives: top-k expert selection and the load-balancing loss.

Every function takes ``[..., E]`` arrays (any leading dims count as tokens),
computes in float32 whatever the input dtype, is differentiable, and works
under ``jit``, ``vmap`` and with inputs sharded along the tokens (each shard
routes its own tokens; the loss is summed across shards).

Ties between equal scores go to the lower expert index; NaN ranks lowest.

Below the public functions, a primitive level for composing layers (the MoE
layer's forward and backward use it): each operation's forward and backward as
plain functions of ``[T, E]`` arrays and a static configuration
(:class:`TopkConfig`, :class:`AuxLossConfig`), with no argument checks and no
custom VJP. The public functions check their arguments and define their
gradients with them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from oxmoe import _library
from oxmoe._checks import FLOAT_DTYPES, check_bool, check_count, check_float_matrix, check_real
from oxmoe._primitive import FfiPrimitive, Layout

__all__ = ["topk", "aux_loss_scores", "aux_loss", "TopkConfig", "AuxLossConfig", "topk_config", "topk_fwd",
           "topk_bwd", "aux_loss_scores_fwd", "aux_loss_scores_bwd", "aux_loss_fwd", "aux_loss_bwd"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")

ROWS, WHOLE, SUM_OVER_ROWS = Layout.ROWS, Layout.WHOLE, Layout.SUM_OVER_ROWS


def _like(x, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)


_topk_fwd_p = FfiPrimitive(
    "oxmoe_topk_fwd", operands=(ROWS, WHOLE), results=(ROWS, ROWS),
    result_specs=lambda logits, *bias, **_: [_like(logits), _like(logits, jnp.bool_)])
_topk_bwd_p = FfiPrimitive(
    "oxmoe_topk_bwd", operands=(ROWS, ROWS, ROWS), results=(ROWS,),
    result_specs=lambda grad, logits, routing_map, **_: [_like(logits)])
_scores_fwd_p = FfiPrimitive(
    "oxmoe_aux_loss_scores_fwd", operands=(ROWS,), results=(ROWS, ROWS),
    result_specs=lambda logits, **_: [_like(logits, jnp.bool_), _like(logits, jnp.float32)])
_scores_bwd_p = FfiPrimitive(
    "oxmoe_aux_loss_scores_bwd", operands=(ROWS, ROWS), results=(ROWS,),
    result_specs=lambda grad, logits, **_: [_like(logits)])
_aux_loss_fwd_p = FfiPrimitive(
    "oxmoe_aux_loss_fwd", operands=(ROWS, WHOLE), results=(SUM_OVER_ROWS,),
    result_specs=lambda probs, counts, **_: [jax.ShapeDtypeStruct((), jnp.float32)],
    workspace=lambda *_, **__: _library.workspace_bytes("oxmoe_aux_loss_fwd"))
_aux_loss_bwd_p = FfiPrimitive(
    "oxmoe_aux_loss_bwd", operands=(WHOLE, WHOLE), results=(ROWS,),
    result_specs=lambda grad, counts, *, probs_type, **_: [probs_type],
    shape_params=("probs_type",))


# -- argument checks ----------------------------------------------------------

def _check_score_function(score_function) -> str:
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    return score_function


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """A checked top-k routing configuration (see :func:`topk`), made by
    :func:`topk_config`: what :func:`topk_fwd` and :func:`topk_bwd` take."""

    num_experts: int
    topk: int
    score_function: str
    use_pre_softmax: bool
    num_groups: int
    """1 without group-limited routing."""
    group_topk: int
    """1 without group-limited routing."""
    scaling_factor: float
    """1.0 when not given."""

    def _fwd_attrs(self) -> dict:
        return dict(self._bwd_attrs(), num_groups=np.int64(self.num_groups),
                    group_topk=np.int64(self.group_topk))

    def _bwd_attrs(self) -> dict:
        return dict(topk=np.int64(self.topk), score_function=self.score_function,
                    use_pre_softmax=np.bool_(self.use_pre_softmax),
                    scaling_factor=np.float32(self.scaling_factor))


def topk_config(num_experts, topk, *, score_function="softmax", use_pre_softmax=False, num_groups=None,
                group_topk=None, scaling_factor=None, use_expert_bias=False) -> TopkConfig:
    """The routing options of :func:`topk` for ``num_experts`` experts, checked
    as :func:`topk` checks them (``use_expert_bias``: whether an expert bias
    will be given); raises ``ValueError`` naming the option."""
    e = num_experts
    topk = check_count("topk", topk, 1, e, f" (the number of experts is {e})")
    score_function = _check_score_function(score_function)
    use_pre_softmax = check_bool("use_pre_softmax", use_pre_softmax)
    if use_pre_softmax and score_function != "softmax":
        raise ValueError("use_pre_softmax=True applies to score_function='softmax' only, "
                         f"got score_function={score_function!r}")
    if use_expert_bias and score_function != "sigmoid":
        raise ValueError("expert_bias applies to score_function='sigmoid' only, "
                         f"got score_function={score_function!r}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk go together: give both or neither, got "
                         f"num_groups={num_groups!r}, group_topk={group_topk!r}")
    if num_groups is None:
        num_groups = group_topk = 1
    else:
        num_groups = check_count("num_groups", num_groups, 1, e)
        if e % num_groups:
            raise ValueError(f"num_groups must divide the number of experts ({e}), got {num_groups}")
        group_topk = check_count("group_topk", group_topk, 1, min(num_groups, topk),
                                  f" (num_groups is {num_groups}, topk is {topk}: each selected "
                                  "group's score sums its best topk // group_topk experts)")
        selectable = group_topk * (e // num_groups)
        if topk > selectable:
            raise ValueError(f"topk must be <= group_topk * num_experts / num_groups = {selectable} "
                             f"(the experts in the best groups), got {topk}")
    scaling = 1.0 if scaling_factor is None else check_real("scaling_factor", scaling_factor)
    return TopkConfig(e, topk, score_function, use_pre_softmax, num_groups, group_topk, scaling)


# -- topk ---------------------------------------------------------------------

def topk(logits, topk, *, score_function="softmax", use_pre_softmax=False, num_groups=None,
         group_topk=None, scaling_factor=None, expert_bias=None):
    """Selects ``topk`` experts per token and their routing weights.

    Args:
      logits: ``[..., E]`` float32, bfloat16 or float16 router logits.
      topk: experts per token, ``1 <= topk <= E``.
      score_function: ``"softmax"`` or ``"sigmoid"``.
      use_pre_softmax: softmax only. ``True``: select the top-k of
        ``softmax(logits)`` and weight by those scores; ``False`` (default):
        select the top-k logits and weight by a softmax over those k.
      num_groups, group_topk: group-limited routing (DeepSeek-V3): the experts
        form ``num_groups`` consecutive groups, a group ranks by the sum of its
        best ``topk // group_topk`` selection scores, and only experts of the
        best ``group_topk`` groups can be selected. Give both or neither.
      scaling_factor: multiplies the weights (default 1); finite.
      expert_bias: ``[E]`` float32, sigmoid only: added to ``sigmoid(logits)``
        to choose the experts (aux-loss-free balancing) but not to the weights,
        which are the sigmoid scores of the selection normalised to sum 1
        (when ``topk > 1``). Receives a zero gradient.

    Sigmoid scores are normalised in float32 with each multiplied by ``e**-c``,
    ``c`` the smallest of 0 and the largest logit normalised together, which
    cancels: where every logit is far below zero (below about -88 a sigmoid
    is 0 in float32) the weights are still the scores' shares, not 0 / 0.

    Returns:
      ``(probs, routing_map)``: ``probs [..., E]`` in the logits' dtype, zero
      off the selected experts; ``routing_map [..., E]`` bool.
    """
    e = check_float_matrix("logits", logits)
    if expert_bias is not None:
        if getattr(expert_bias, "shape", None) != (e,):
            raise ValueError(f"expert_bias must have shape ({e},), got {getattr(expert_bias, 'shape', expert_bias)}")
        if expert_bias.dtype != jnp.float32:
            raise TypeError(f"expert_bias must be float32, got {expert_bias.dtype}")
    config = topk_config(e, topk, score_function=score_function, use_pre_softmax=use_pre_softmax,
                         num_groups=num_groups, group_topk=group_topk, scaling_factor=scaling_factor,
                         use_expert_bias=expert_bias is not None)
    probs, routing_map = _topk(logits.reshape(-1, e), expert_bias, config)
    return probs.reshape(logits.shape), routing_map.reshape(logits.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _topk(logits, expert_bias, config):
    return topk_fwd(logits, expert_bias, config)


def _topk_vjp_fwd(logits, expert_bias, config):
    probs, routing_map = topk_fwd(logits, expert_bias, config)
    return (probs, routing_map), (logits, routing_map, expert_bias)


def _topk_vjp_bwd(config, residuals, cotangents):
    logits, routing_map, expert_bias = residuals
    grad_logits = topk_bwd(cotangents[0], logits, routing_map, config)
    return grad_logits, None if expert_bias is None else jnp.zeros_like(expert_bias)


_topk.defvjp(_topk_vjp_fwd, _topk_vjp_bwd)


# -- aux_loss_scores ----------------------------------------------------------

def aux_loss_scores(logits, topk, *, score_function="softmax"):
    """Dense per-token scores and routing of the load-balancing loss.

    Args:
      logits: ``[..., E]`` float32, bfloat16 or float16 router logits.
      topk: experts per token, ``1 <= topk <= E``.
      score_function: ``"softmax"`` (scores = softmax(logits)) or
        ``"sigmoid"`` (scores = sigmoid(logits) normalised to sum 1 per token,
        as :func:`topk` normalises them).

    Returns:
      ``(routing_map, scores)``: ``routing_map [..., E]`` bool, the plain
      top-k of the scores (no groups, no bias); ``scores [..., E]`` float32,
      differentiable.
    """
    e = check_float_matrix("logits", logits)
    topk = check_count("topk", topk, 1, e, f" (the number of experts is {e})")
    score_function = _check_score_function(score_function)
    routing_map, scores = _scores(logits.reshape(-1, e), topk, score_function)
    return routing_map.reshape(logits.shape), scores.reshape(logits.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scores(logits, topk, score_function):
    return aux_loss_scores_fwd(logits, topk, score_function)


def _scores_vjp_fwd(logits, topk, score_function):
    return aux_loss_scores_fwd(logits, topk, score_function), logits


def _scores_vjp_bwd(topk, score_function, logits, cotangents):
    return (aux_loss_scores_bwd(cotangents[1], logits, score_function),)


_scores.defvjp(_scores_vjp_fwd, _scores_vjp_bwd)


# -- aux_loss -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AuxLossConfig:
    """A load-balancing loss configuration (see :func:`aux_loss`, which checks
    it): what :func:`aux_loss_fwd` and :func:`aux_loss_bwd` take."""

    total_num_tokens: int
    topk: int
    coeff: float

    def _attrs(self) -> dict:
        return dict(total_num_tokens=np.int64(self.total_num_tokens), topk=np.int64(self.topk),
                    coeff=np.float32(self.coeff))


def aux_loss(probs, tokens_per_expert, *, total_num_tokens, topk, coeff):
    """The switch load-balancing loss.

    ``coeff * E / (topk * total_num_tokens**2) * sum_e P_e * tokens_per_expert[e]``
    where ``P_e = sum_t probs[t, e]`` over every token (all leading dims).

    Args:
      probs: ``[..., E]`` float32, bfloat16 or float16 routing probabilities
        (e.g. the scores of :func:`aux_loss_scores`).
      tokens_per_expert: ``[E]`` int32 or float token counts; a constant (it
        receives no gradient).
      total_num_tokens: the number of tokens the counts were taken over
        (across all data-parallel shards), ``>= 1``.
      topk: experts per token, ``1 <= topk <= E``.
      coeff: the loss coefficient, finite.

    Returns:
      The loss, a float32 scalar, differentiable in ``probs``.
    """
    e = check_float_matrix("probs", probs)
    if getattr(tokens_per_expert, "shape", None) != (e,):
        raise ValueError(f"tokens_per_expert must have shape ({e},), "
                         f"got {getattr(tokens_per_expert, 'shape', tokens_per_expert)}")
    if tokens_per_expert.dtype not in (jnp.int32, *FLOAT_DTYPES):
        raise TypeError("tokens_per_expert must be int32, float32, bfloat16 or float16, "
                        f"got {tokens_per_expert.dtype}")
    config = AuxLossConfig(
        total_num_tokens=check_count("total_num_tokens", total_num_tokens, 1),
        topk=check_count("topk", topk, 1, e, f" (the number of experts is {e})"),
        coeff=check_real("coeff", coeff))
    probs = probs.reshape(-1, e)
    return _aux_loss(probs, jax.lax.stop_gradient(tokens_per_expert), config,
                     jax.ShapeDtypeStruct(probs.shape, probs.dtype, sharding=jax.typeof(probs).sharding))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _aux_loss(probs, tokens_per_expert, config, probs_type):
    return aux_loss_fwd(probs, tokens_per_expert, config)


def _aux_loss_vjp_fwd(probs, tokens_per_expert, config, probs_type):
    return aux_loss_fwd(probs, tokens_per_expert, config), tokens_per_expert


def _aux_loss_vjp_bwd(config, probs_type, tokens_per_expert, grad_loss):
    # The gradient has no per-token operand to take its sharding from: it takes
    # the primal's (in its type, for explicit-sharding meshes).
    return aux_loss_bwd(grad_loss, tokens_per_expert, config, probs_type), None


_aux_loss.defvjp(_aux_loss_vjp_fwd, _aux_loss_vjp_bwd)


# -- primitive level: no checks, no custom VJP; for composing layers ------------

def topk_fwd(logits, expert_bias, config: TopkConfig) -> tuple[jax.Array, jax.Array]:
    """:func:`topk` of ``[T, E]`` logits, unchecked and not differentiable.

    ``expert_bias`` is ``[E]`` float32 or None. Returns ``(probs, routing_map)``,
    both ``[T, E]``: ``probs`` in the logits' dtype, ``routing_map`` bool.
    """
    bias = () if expert_bias is None else (expert_bias,)
    probs, routing_map = _topk_fwd_p(logits, *bias, **config._fwd_attrs())
    return probs, routing_map


def topk_bwd(grad_probs, logits, routing_map, config: TopkConfig) -> jax.Array:
    """The gradient of :func:`topk_fwd`'s ``probs`` in the logits, the
    selection ``routing_map`` held fixed: ``[T, E]`` in the logits' dtype
    (``grad_probs`` is cast to it)."""
    (grad_logits,) = _topk_bwd_p(grad_probs.astype(logits.dtype), logits, routing_map, **config._bwd_attrs())
    return grad_logits


def aux_loss_scores_fwd(logits, topk: int, score_function: str) -> tuple[jax.Array, jax.Array]:
    """:func:`aux_loss_scores` of ``[T, E]`` logits, unchecked and not
    differentiable: ``(routing_map, scores)``, bool and float32 ``[T, E]``."""
    routing_map, scores = _scores_fwd_p(logits, topk=np.int64(topk), score_function=score_function)
    return routing_map, scores


def aux_loss_scores_bwd(grad_scores, logits, score_function: str) -> jax.Array:
    """The gradient of :func:`aux_loss_scores_fwd`'s ``scores`` in the logits:
    ``[T, E]`` in the logits' dtype (``grad_scores`` is cast to float32)."""
    (grad_logits,) = _scores_bwd_p(grad_scores.astype(jnp.float32), logits, score_function=score_function)
    return grad_logits


def aux_loss_fwd(probs, tokens_per_expert, config: AuxLossConfig) -> jax.Array:
    """:func:`aux_loss` of ``[T, E]`` probs, unchecked and not differentiable:
    a float32 scalar."""
    (loss,) = _aux_loss_fwd_p(probs, tokens_per_expert, **config._attrs())
    return loss


def aux_loss_bwd(grad_loss, tokens_per_expert, config: AuxLossConfig, probs_type: jax.ShapeDtypeStruct) -> jax.Array:
    """The gradient of :func:`aux_loss_fwd` in the probs, of shape, dtype and
    sharding ``probs_type`` (``grad_loss`` is cast to float32)."""
    (grad_probs,) = _aux_loss_bwd_p(grad_loss.astype(jnp.float32), tokens_per_expert, probs_type=probs_type,
                                    **config._attrs())
    return grad_probs
