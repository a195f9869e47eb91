"""The MoE layer: route → dispatch → expert FFN → combine, as one custom VJP.

:func:`moe` is what a model calls. Inside ``jax.shard_map`` it runs with
expert parallelism (the experts split over ``expert_axis``) and data
parallelism (the tokens split over ``data_axes`` and ``expert_axis``); outside,
on one device. It is composed of four steps, each public and each returning a
small pytree:

- :func:`route` → :class:`Routing`: router logits, the top-k experts and
  weights of every token, the global token counts and the auxiliary losses;
- :func:`dispatch` → :class:`ExpertInput`: the token rows grouped by local
  expert, after the exchange between expert shards;
- :func:`expert_ffn` → :class:`ExpertOutput`: the fused gate+up grouped GEMM,
  the activation and the down grouped GEMM;
- :func:`combine`: the rows back to their tokens, weighted and summed;
- with ``MoEConfig.shared_ffn``, :func:`shared_expert_ffn` →
  :class:`SharedOutput`: a dense MLP of the shard's own tokens (the shared
  experts of DeepSeek-V3 and Qwen2-MoE, optionally scaled per token by a
  sigmoid gate), added to the combined output. It depends on no exchange, so
  XLA may run it while the routed tokens travel; its weights are replicated
  and their gradients summed over every token shard.

:func:`moe` wraps them in one ``custom_vjp`` whose backward runs the same
steps in reverse from saved residuals (:class:`Residuals`): the gradients
cross the same exchanges the activations did, in the other direction. It
keeps no dispatched row nor its output (:class:`ExpertResiduals`): about the
activations a dense SwiGLU MLP of the same activated parameters keeps. Both
directions call the primitive level of :mod:`oxmoe.router` and
:mod:`oxmoe.permutation`, so :func:`route`, :func:`dispatch` and
:func:`combine` are not differentiable on their own: differentiate :func:`moe`.

Token exchange between expert shards (``MoEConfig.exchange``;
:mod:`oxmoe.moe.exchange`):

- ``"all_to_all"``: each token goes once to each shard that owns any of its
  experts, with its weights for that shard's experts, and is expanded into
  its expert rows there; each shard sends back one row per token, its
  experts' outputs already weighted and summed (so a token routed to several
  experts of one shard crosses the wire once each way, and the returned sum
  is rounded to ``dtype`` once more than on one device). The rows cross in
  one ``jax.lax.all_to_all`` whose slot size is chosen on the device, from
  every shard's counts, among static sizes at most 1.1x apart: the bytes on
  the wire are those of the largest (source, destination) block, padded by
  at most 10%, times the shards. Every platform has it;
- ``"ragged_all_to_all"``: the same rows by ``jax.lax.ragged_all_to_all``,
  each block alone; not on a CPU mesh (refused when the layer is traced).
  On two NVLink-connected H200s with jax 0.11.2, XLA's ragged_all_to_all
  moved rows at 2.6 GB/s, a dense all_to_all at 312 GB/s
  (``bench/profile_exchange.py``), so ``"auto"`` never picks it;
- ``"ring"``: no exchange of routed rows: every shard gathers all tokens of the
  expert axis, computes its own experts' share, and the partial outputs are
  summed and scattered back (a reduce-scatter);
- ``"auto"`` (default): ``"ring"`` where the all_to_all's one slot would
  hold every token (EP 2 with top-8 routing: it would send what the ring
  sends, and copy it besides; :func:`oxmoe.moe.exchange.sends_every_token`),
  else whichever :func:`oxmoe.moe.exchange.cost_model` says sends fewer bytes
  at the call's shards, top-k, experts and hidden size (the ring on a tie).

With ``MoEConfig.token_chunks`` the shard's tokens make that trip in chunks,
each exchanged, computed and brought back on its own (forward and backward),
so that XLA may run one chunk's exchange under another chunk's expert GEMMs;
the weight gradients take every chunk's rows in one product each.

The receive buffers are sized for the worst case (every token of every shard
routed to this shard's experts, plus alignment padding), so no token is ever
dropped and the result does not depend on the exchange beyond that rounding.
The expert-row buffers' rows past their groups (about half of each with an
exchange) are left unwritten and never read (in bf16 without alignment
padding; zeroed otherwise).
"""

from oxmoe.moe.config import MoEAux, MoEConfig, MoEParams, init_params, update_expert_bias
from oxmoe.moe.exchange import Exchange
from oxmoe.moe.layer import (ExpertInput, ExpertOutput, ExpertResiduals, QuantizedExpertWeights, Residuals, Routing,
                             SharedOutput, combine, dispatch, expert_ffn, expert_weights_spec, moe,
                             quantize_expert_weights, route, shard_map_moe, shared_expert_ffn)

__all__ = ["MoEConfig", "MoEParams", "MoEAux", "Routing", "ExpertInput", "ExpertOutput", "SharedOutput", "Exchange",
           "Residuals", "ExpertResiduals", "init_params", "moe", "shard_map_moe", "route", "dispatch", "expert_ffn",
           "combine", "shared_expert_ffn", "update_expert_bias", "expert_weights_spec", "QuantizedExpertWeights",
           "quantize_expert_weights"]
