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
- :func:`combine`: the rows back to their tokens, weighted and summed.

:func:`moe` wraps them in one ``custom_vjp`` whose backward runs the same
steps in reverse from saved residuals (:class:`Residuals`): the gradients
cross the same exchanges the activations did, in the other direction. Both
directions call the primitive level of :mod:`oxmoe.router` and
:mod:`oxmoe.permutation`, so :func:`route`, :func:`dispatch` and
:func:`combine` are not differentiable on their own: differentiate :func:`moe`.

Token exchange between expert shards (``MoEConfig.exchange``):

- ``"ragged_all_to_all"``: each shard sends each other shard exactly the rows
  of its experts (``jax.lax.ragged_all_to_all``), with sizes and offsets
  computed on the device from every shard's per-expert counts; not on a CPU
  mesh (refused when the layer is traced);
- ``"all_to_all"``: the same rows in fixed-size slots (``jax.lax.all_to_all``),
  which every platform has (XLA:CPU has no ragged collective);
- ``"auto"`` (default): ``"all_to_all"``, the faster of the two wherever it
  was measured: on two NVLink-connected H200s with jax 0.11.2, XLA's
  ragged_all_to_all moved the DeepSeek-V3 rows of a device at 2.6 GB/s, the
  dense all_to_all at 312 GB/s (``bench/profile_exchange.py``);
- ``"ring"``: no exchange of routed rows: every shard gathers all tokens of the
  expert axis, computes its own experts' share, and the partial outputs are
  summed and scattered back (a reduce-scatter).

Both exchanges receive into a buffer sized for the worst case (every token of
every shard routed to this shard's experts, plus alignment padding), so no
token is ever dropped and the result does not depend on the exchange.
"""

from oxmoe.moe.config import MoEAux, MoEConfig, MoEParams, init_params, update_expert_bias
from oxmoe.moe.exchange import Exchange
from oxmoe.moe.layer import (ExpertInput, ExpertOutput, Residuals, Routing, combine, dispatch, expert_ffn, moe, route,
                             shard_map_moe)

__all__ = ["MoEConfig", "MoEParams", "MoEAux", "Routing", "ExpertInput", "ExpertOutput", "Exchange", "Residuals",
           "init_params", "moe", "shard_map_moe", "route", "dispatch", "expert_ffn", "combine",
           "update_expert_bias"]
