"""The exchange of tokens between expert shards: its plan, made on the device
from every shard's counts, the collectives that move the rows there and back,
the buffers' sizes, and the cost model behind ``exchange="auto"``.

A token goes to each shard that owns any of its experts once, with its
routing weights for that shard's experts beside it (DeepEP's layout), and is
expanded into its expert rows on arrival; on the way back each shard returns
one row per token: the weighted sum of its experts' outputs. So the rows on
the wire are the (token, destination shard) pairs, not the (token, expert)
copies, which with top-k routing are up to ``min(k, experts per shard)``
times more.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from oxmoe import permutation
from oxmoe._checks import MAX_ROWS
from oxmoe._primitive import _varying_axes
from oxmoe._pytree import pytree_dataclass
from oxmoe.moe.config import Axes, MoEConfig

SLOT_STEP = 1.1
"""Each slot size of the all_to_all is at most this factor above the next smaller one."""


@pytree_dataclass(("token_rows", "send_sizes", "recv_sizes", "return_offsets", "slot_choice"),
                  ("axis", "shards", "slot_rows", "method"))
class Exchange:
    """How this shard's tokens travel to the shards that own their experts,
    and back. Made on the device by :func:`oxmoe.moe.dispatch`.

    This shard's ``T`` tokens are first laid out one row per (token,
    destination shard), shard-major (``token_rows``). Shard ``j``'s block of
    rows lands in ``j``'s receive buffer of ``shards`` slots of ``T`` rows,
    in slot ``me``; the rest of each slot is padding. Where the all_to_all
    has one static slot size ``S`` (:attr:`in_slots`), this shard's layout is
    already its slots, ``j``'s block from row ``j * S``, and crosses as it is;
    otherwise the blocks follow each other and are copied into the slots.

    With ``method="all_to_all"`` the rows cross in one ``jax.lax.all_to_all``
    of ``shards`` slots of ``slot_rows[slot_choice]`` rows: the smallest of
    the static sizes ``slot_rows`` that holds the largest block any shard
    sends any other, chosen on the device (``jax.lax.switch``) from every
    shard's counts, so no token is dropped and the padding on the wire is at
    most ``SLOT_STEP`` times the largest block. With
    ``"ragged_all_to_all"`` each block crosses alone
    (``jax.lax.ragged_all_to_all``).
    """

    token_rows: permutation.RowIdMap
    """This shard's tokens → one row per (token, destination shard)."""
    send_sizes: jax.Array
    """``[n]`` int32: rows (tokens) this shard sends to each shard."""
    recv_sizes: jax.Array
    """``[n]`` int32: rows this shard receives from each shard."""
    return_offsets: jax.Array
    """``[n]`` int32: where this shard's block starts in each shard's layout."""
    slot_choice: jax.Array
    """int32 scalar: the index in ``slot_rows`` of the all_to_all's slot size."""
    axis: str
    """The ``shard_map`` axis the experts are split over."""
    shards: int
    """``n``, the size of that axis."""
    slot_rows: tuple[int, ...]
    """The slot sizes the all_to_all may use, ascending; the last is ``T``."""
    method: str
    """``"all_to_all"`` or ``"ragged_all_to_all"``: the collective that moves the rows."""

    @property
    def tokens(self) -> int:
        """``T``: this shard's tokens, the rows of one receive slot."""
        return self.slot_rows[-1]

    @property
    def in_slots(self) -> bool:
        """Whether ``token_rows``' layout is the all_to_all's slots (one static slot size)."""
        return lays_out_in_slots(self.method, self.slot_rows)

    @property
    def send_offsets(self) -> jax.Array:
        """``[n]`` int32: where the rows for each shard start in ``token_rows``' layout: at
        their slots (:attr:`in_slots`), else one block after another."""
        if self.in_slots:
            return jnp.arange(self.shards, dtype=jnp.int32) * self.slot_rows[0]
        return _exclusive_cumsum(self.send_sizes)

    def scatter_tokens(self, *xs):
        """``[T, X]`` rows of this shard's tokens (one array or several, each
        its own ``X``) → ``[n * T, X]``: each token's row in the receive buffer
        of every shard it is routed to (the transpose of :meth:`gather_tokens`)."""
        return self.to_experts(*(rows_of(x, self.token_rows) for x in xs))

    def gather_tokens(self, rows, weights=None):
        """``[n * T, X]`` receive buffer rows → ``[T, X]``: each token's rows
        back from every shard it went to, summed (in ``rows``' dtype).

        With ``weights`` (``[n * T, El]`` per received row and local expert,
        sent back in the same collective), also returns them as ``[T, n * El]``
        for this shard's tokens and every expert, zero where a token did not
        go to a shard."""
        if weights is None:
            (back,) = self.from_experts(rows)
            return permutation.combine_fwd(back, self.token_rows)
        # The way back is dispatch's transpose: the rows summed, the weights picked per (token, shard).
        back, back_weights = self.from_experts(rows, weights)
        grad_tokens, picked = permutation.dispatch_bwd(back, self.token_rows, back_weights)
        return grad_tokens, picked.reshape(picked.shape[0], -1)

    def to_experts(self, *arrays, fills=None):
        """``[R, X]`` arrays in ``token_rows``' layout → ``[n * T, X]``: slot
        ``s`` holds what shard ``s`` sent, then its array's fill (``fills``,
        default 0)."""
        fills = fills or (0,) * len(arrays)
        if any(_is_byte_float(rows) for rows in arrays):  # collectives move bytes, not float8 values
            moved = self.to_experts(*(_as_bytes(rows) for rows in arrays), fills=fills)
            return tuple(_from_bytes(rows, like) for rows, like in zip(moved, arrays))
        if self.method == "ragged_all_to_all":
            me = jax.lax.axis_index(self.axis)
            landing = jnp.full((self.shards,), me * self.tokens, jnp.int32)
            return tuple(jax.lax.ragged_all_to_all(
                rows, _varying_like(jnp.full((self.shards * self.tokens, rows.shape[1]), fill, rows.dtype), rows),
                self.send_offsets, self.send_sizes, landing, self.recv_sizes, axis_name=self.axis)
                for rows, fill in zip(arrays, fills))

        if self.in_slots:
            (size,) = self.slot_rows
            return tuple(self._received(jax.lax.all_to_all(rows.reshape(self.shards, size, -1), self.axis, 0, 0),
                                        fill) for rows, fill in zip(arrays, fills))

        def send(size):
            index = self.send_offsets[:, None] + jnp.arange(size, dtype=jnp.int32)
            valid = (jnp.arange(size) < self.send_sizes[:, None])[..., None]
            out = []
            for rows, fill in zip(arrays, fills):
                slots = jnp.where(valid, rows[jnp.clip(index, 0, rows.shape[0] - 1)], fill)
                out.append(self._received(jax.lax.all_to_all(slots, self.axis, 0, 0), fill))
            return tuple(out)

        return self._switch(send)

    def _received(self, slots, fill):
        """``[n, S, X]`` received slots → the ``[n * T, X]`` receive buffer (``fill`` past ``S``)."""
        padded = jnp.pad(slots, ((0, 0), (0, self.tokens - slots.shape[1]), (0, 0)), constant_values=fill)
        return padded.reshape(self.shards * self.tokens, slots.shape[2])

    def from_experts(self, *arrays):
        """The inverse of :meth:`to_experts`: ``[n * T, X]`` arrays → ``[R, X]``
        in ``token_rows``' layout, zero past the rows sent."""
        num_rows = self.token_rows.source_tokens.shape[0]
        if self.method == "ragged_all_to_all":
            slots = jnp.arange(self.shards, dtype=jnp.int32) * self.tokens
            return tuple(jax.lax.ragged_all_to_all(
                rows, _varying_like(jnp.zeros((num_rows, rows.shape[1]), rows.dtype), rows),
                slots, self.recv_sizes, self.return_offsets, self.send_sizes, axis_name=self.axis)
                for rows in arrays)

        def send_back(size):
            return tuple(jax.lax.all_to_all(rows.reshape(self.shards, self.tokens, -1)[:, :size], self.axis, 0, 0)
                         for rows in arrays)

        if self.in_slots:
            return tuple(back.reshape(num_rows, -1) for back in send_back(self.slot_rows[0]))

        row = jnp.arange(num_rows, dtype=jnp.int32)
        ends = jnp.cumsum(self.send_sizes)
        shard = jnp.minimum(jnp.searchsorted(ends, row, side="right"), self.shards - 1).astype(jnp.int32)
        index = jnp.clip(shard * self.tokens + row - self.send_offsets[shard], 0, self.shards * self.tokens - 1)
        sent = (row < ends[-1])[:, None]
        # Each branch pads its slots to T, so that every branch returns the same shape.
        padded = self._switch(lambda size: tuple(self._received(back, 0) for back in send_back(size)))
        return tuple(jnp.where(sent, returned[index], 0) for returned in padded)

    def _switch(self, transfer):
        """``transfer(size)`` for the chosen slot size; every shard chooses alike."""
        if len(self.slot_rows) == 1:
            return transfer(self.slot_rows[0])
        return jax.lax.switch(self.slot_choice, [functools.partial(transfer, size) for size in self.slot_rows])


def _is_byte_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 1


def _as_bytes(x):
    """A float8 array as uint8 (its bits), anything else as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if _is_byte_float(x) else x


def _from_bytes(x, like):
    return jax.lax.bitcast_convert_type(x, like.dtype) if x.dtype != like.dtype else x


def rows_of(x, row_map: permutation.RowIdMap, zero_unused_rows: bool = True):
    """``[T, X]`` → ``[R, X]``: each row's token's ``x`` (``row_map.source_tokens``),
    zero on rows of no token (unwritten without ``zero_unused_rows``, 16- and 32-bit
    rows): the permutation's gather (:func:`oxmoe.permutation.combine_bwd`
    without weights), which copies each row bit for bit. Float8 values travel through it as
    float32 words, four bytes each (on an H200, two such gathers took the kernel 310 us at
    DeepSeek-V3's one-GPU shape against XLA's 446, and the same at Qwen3's: 229 against 236)."""
    if not _is_byte_float(x):
        return permutation.combine_bwd(x, None, row_map, zero_unused_rows=zero_unused_rows)[0]
    tokens, width = x.shape
    assert width % 4 == 0, "float8 rows are whole 32-bit words (FP8 rows are multiples of 128)"
    words = jax.lax.bitcast_convert_type(_as_bytes(x).reshape(tokens, width // 4, 4), jnp.float32)
    rows = permutation.combine_bwd(words, None, row_map)[0]
    return _from_bytes(jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(len(rows), width), x)


def gather_over(axis: str | tuple[str, ...], *xs):
    """Each of ``xs`` all-gathered over ``axis`` (or axes; tiled, along the first
    dimension); float8 values as their bytes."""
    return tuple(_from_bytes(jax.lax.all_gather(_as_bytes(x), axis, tiled=True), x) for x in xs)


def lays_out_in_slots(method: str, slot_rows: tuple[int, ...]) -> bool:
    """Whether the rows a shard sends are laid out in the all_to_all's slots, each
    destination's from its slot's first row, rather than one block after another: where
    the all_to_all has one static slot size."""
    return method == "all_to_all" and len(slot_rows) == 1


def _varying_like(buffer, rows):
    """``buffer`` typed as varying over the axes ``rows`` varies over (a
    collective's output buffer must match its input)."""
    axes = tuple(_varying_axes(jax.typeof(rows)))
    return jax.lax.pcast(buffer, axes, to="varying") if axes else buffer


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def slot_sizes(tokens: int, shards: int, config: MoEConfig, largest: int | None = None) -> tuple[int, ...]:
    """The slot sizes of an all_to_all exchange of ``tokens`` tokens per shard,
    ascending: from ``largest`` (the most one shard can send another; default
    ``tokens``, every token to one shard) down by factors of at most
    :data:`SLOT_STEP`, in multiples of 8 rows, to half the rows a balanced
    load of uniformly random routing sends each shard (:func:`shards_per_token`);
    below that, the smallest size is used. Where that balanced block is within
    :data:`SLOT_STEP` of the largest (EP 2 with top-8 routing: nearly every
    token goes to both shards), the largest alone: one static size, so the
    exchange needs no conditional, which on a GPU costs a round trip to the
    host and keeps XLA from overlapping the exchange with other work."""
    top = tokens if largest is None else min(tokens, largest)
    balanced = tokens * shards_per_token(config, shards) / shards
    if balanced * SLOT_STEP >= top:
        return (top,)
    floor = max(1, math.ceil(balanced / 2))
    sizes = [top]
    while sizes[-1] > floor:
        smaller = -(-math.ceil(sizes[-1] / SLOT_STEP) // 8) * 8
        if smaller >= sizes[-1]:
            break
        sizes.append(smaller)
    return tuple(reversed(sizes))


def exchange_method(config: MoEConfig, axes: Axes, tokens: int, hidden: int) -> str | None:
    """The exchange of a call (``"ring"``: gather every token instead); None
    without expert shards. ``"auto"``: the ring where the all_to_all would send
    every token to every shard (:func:`sends_every_token`), else the fewer bytes
    of :func:`cost_model`."""
    if axes.expert_shards == 1:
        return None
    # Inside shard_map the mesh is abstract, but it knows its devices' platform.
    device = jax.sharding.get_abstract_mesh().abstract_device
    if config.exchange == "ragged_all_to_all" and getattr(device, "platform", None) == "cpu":
        raise ValueError("exchange 'ragged_all_to_all' is not implemented on CPU (XLA:CPU has no ragged all-to-all; "
                         "the layer would fail when it runs): use exchange 'auto', 'all_to_all' or 'ring' on a CPU mesh")
    if config.exchange != "auto":
        return config.exchange
    if sends_every_token(config, axes.expert_shards, tokens):
        return "ring"
    costs = cost_model(config, axes.expert_shards, tokens, hidden)
    return min(("ring", "all_to_all"), key=costs.__getitem__)  # ring first: it wins a tie


def sends_every_token(config: MoEConfig, shards: int, tokens: int) -> bool:
    """Whether the all_to_all's one static slot holds every token (:func:`slot_sizes`: EP 2
    with top-8 routing, where nearly every token goes to both shards). It then sends the rows
    the ring's gather sends, and besides copies them into its slots and back, and sends the
    routing weights in an exchange of their own, where the ring needs neither: ``"auto"``
    takes the ring. Measured on two H200s (2026-11-29, bench/RESULTS.md), the ring's step was
    5% faster at DeepSeek-V3's EP = 2 and 2% at Qwen3's (on 2026-11-23 2% and -5%: there
    the two are within one run's spread)."""
    slots = slot_sizes(tokens, shards, config)
    return lays_out_in_slots("all_to_all", slots) and slots[0] == tokens


def shards_per_token(config: MoEConfig, shards: int) -> float:
    """The expected number of expert shards a token goes to when its ``k``
    experts are a uniformly random choice (within ``group_topk`` of
    ``num_groups`` groups for group-limited routing)."""
    e, k, el = config.num_experts, config.topk, config.num_experts // shards
    groups, group_topk = config.num_groups, config.group_topk
    if groups is not None and group_topk is not None and el % (e // groups) == 0:
        # Whole groups per shard: the token's groups fall on at most group_topk shards.
        groups_per_shard = el // (e // groups)
        return shards * (1 - math.comb(groups - groups_per_shard, group_topk) / math.comb(groups, group_topk))
    return shards * (1 - math.comb(e - el, k) / math.comb(e, k))


def cost_model(config: MoEConfig, shards: int, tokens: int, hidden: int) -> dict[str, float]:
    """The bytes one shard sends over its links in a training step (forward
    and backward), for each exchange ``"auto"`` chooses from, with a balanced
    load of uniformly random routing.

    - ``"all_to_all"``: four exchanges of the (token, shard) pairs leaving
      the shard (:func:`shards_per_token` per token, all but the ``1 / n``
      that stay), each row padded by up to :data:`SLOT_STEP`, or with one
      static slot size (:func:`slot_sizes`) its ``n - 1`` slots whole, plus
      the routing weights out and their gradients back (float32, ``E / n`` per
      row);
    - ``"ring"``: all-gathers of the tokens and of the output's gradient,
      reduce-scatters of the output and of the tokens' gradient, each
      ``(n - 1) * T`` rows, and the weights' gather and their gradients'
      reduce-scatter (float32, ``E`` per row).

    The links' bandwidth is the same for both, so bytes decide; ``"auto"``
    picks the fewer, and the ring on a tie (its collectives need no plan),
    except where :func:`sends_every_token` (the bytes are then equal but for
    the routing weights, and the all_to_all's copies, which bytes on the
    links do not count, decide).
    """
    n, el = shards, config.num_experts // shards
    row = hidden * config.dtype.itemsize
    slots = slot_sizes(tokens, n, config)
    if lays_out_in_slots("all_to_all", slots):
        sent: float = (n - 1) * slots[0]
    else:
        sent = tokens * shards_per_token(config, n) * (n - 1) / n * SLOT_STEP
    routed = 4 * sent * row + 2 * sent * el * 4
    ring = 4 * (n - 1) * tokens * row + 2 * (n - 1) * tokens * config.num_experts * 4
    return {"all_to_all": routed, "ring": ring}


def exchange_tokens(tokens: tuple, routing_map, probs, config: MoEConfig, axes: Axes, method: str,
                    capacity: int | None = None):
    """Sends this shard's tokens to the shards of their experts (each of which
    takes at most ``capacity`` copies, so at most ``El * capacity`` tokens
    from one shard). ``tokens``: one ``[T, X]`` array per part of a token that
    travels (its row; or with FP8 its values and its scales), the last a float
    array of 16 or 32 bits.

    Returns ``(exchange, received, weights)``: the :class:`Exchange`, the
    ``[n * T, X]`` received rows of each array of ``tokens``, and ``[n * T, El]``
    float32 weights of each received row for this shard's experts, ``-1`` where
    it is not routed there (and on padding rows).
    """
    n, t, axis = axes.expert_shards, tokens[-1].shape[0], axes.expert_axis
    assert axis is not None, "an exchange needs an expert axis"
    el = config.num_experts // n
    per_shard = routing_map.reshape(t, n, el)
    goes = per_shard.any(-1)  # goes[t, j]: token t goes to shard j
    slots = slot_sizes(t, n, config, None if capacity is None else el * capacity)
    if lays_out_in_slots(method, slots):
        token_rows, sizes = _slotted_rows(goes, slots[0])
        rows = tuple(rows_of(x, token_rows) for x in tokens)
    else:
        by_shard = permutation.dispatch_fwd(tokens[-1], goes, None, num_rows=t * min(config.topk, n), align_size=None)
        token_rows, sizes = by_shard.row_id_map, by_shard.group_sizes
        rows = (*(rows_of(x, token_rows) for x in tokens[:-1]), by_shard.tokens)
    every = jax.lax.all_gather(sizes, axis)  # every[s, j]: rows shard s sends shard j
    me = jax.lax.axis_index(axis)
    choice = jnp.minimum(jnp.searchsorted(jnp.asarray(slots, jnp.int32), every.max()), len(slots) - 1)
    exchange = Exchange(token_rows=token_rows, send_sizes=sizes, recv_sizes=every[:, me],
                        return_offsets=_exclusive_cumsum(every, axis=1)[:, me], slot_choice=choice.astype(jnp.int32),
                        axis=axis, shards=n, slot_rows=slots, method=method)
    # Each row's weights for its destination's experts, scattered to the row of each (token, shard);
    # the rows past them (and the dummy row every unsent pair writes) keep -1.
    dest, num_rows = token_rows.dest_rows, token_rows.source_tokens.shape[0]
    local = jnp.where(per_shard, probs.astype(jnp.float32).reshape(t, n, el), -1.0)
    weights = jnp.full((num_rows + 1, el), -1.0, jnp.float32).at[jnp.where(dest >= 0, dest, num_rows)].set(local)
    *received, received_weights = exchange.to_experts(*rows, weights[:num_rows], fills=(0,) * len(rows) + (-1.0,))
    return exchange, tuple(received), received_weights


def _slotted_rows(goes, slot: int) -> tuple[permutation.RowIdMap, jax.Array]:
    """The layout of the (token, shard) rows in ``n`` slots of ``slot`` rows, shard ``j``'s
    tokens in order from row ``j * slot`` (``goes [T, n]``: token t goes to shard j; no shard
    gets more than ``slot``), and the rows each shard gets: what a dispatch to the shards
    gives, with each block at its slot, so that the all_to_all sends it as it is."""
    t, n = goes.shape
    sizes = jnp.sum(goes, axis=0, dtype=jnp.int32)
    dest = jnp.where(goes, jnp.arange(n, dtype=jnp.int32) * slot + _exclusive_cumsum(goes.astype(jnp.int32), 0), -1)
    token = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, n))
    # Unsent pairs aim past the rows and are dropped.
    source = jnp.full((n * slot,), -1, jnp.int32).at[jnp.where(goes, dest, n * slot)].set(token, mode="drop")
    return permutation.RowIdMap(dest, source), sizes


def dispatch_rows(config: MoEConfig, num_tokens: int, num_experts: int, capacity: int | None = None) -> int:
    """The rows of a dispatch of ``num_tokens`` tokens to ``num_experts`` of the
    experts: each token reaches at most ``min(topk, num_experts)`` of them, each
    expert at most ``capacity`` copies (:meth:`MoEConfig.expert_capacity`;
    None: no bound), each expert's block padded to ``align_size``; with
    ``config.fp8`` a multiple of 128 (the weight gradients' FP8 operands have one
    scale per 128 rows)."""
    rows = permutation.padded_rows(num_tokens * min(config.topk, num_experts), num_experts, config.align_size)
    if capacity is not None:
        rows = min(rows, permutation.padded_rows(num_experts * capacity, num_experts, config.align_size))
    return -(-rows // 128) * 128 if config.fp8 is not None else rows


def check_rows(config: MoEConfig, axes: Axes, num_tokens: int, method: str | None, capacity: int | None) -> None:
    """The largest buffer of rows of a dispatch of ``num_tokens`` tokens (which holds
    at least as many as the others) must fit int32 row indices; ``capacity`` as
    for :func:`dispatch_rows`."""
    n, el = axes.expert_shards, config.num_experts // axes.expert_shards
    if method is None:
        what, rows = "the dispatch", dispatch_rows(config, num_tokens, el, capacity)
    else:
        what = (f"the dispatch of the expert axis's {n * num_tokens} gathered tokens" if method == "ring" else
                f"the dispatch of the exchange's receive buffer ({n} slots of {num_tokens} tokens)")
        rows = dispatch_rows(config, n * num_tokens, el, capacity)
    if rows > MAX_ROWS:
        raise ValueError(f"{what} would hold {rows} rows, more than 2**31 - 1 (row indices are int32): {num_tokens} "
                         f"tokens per shard, topk={config.topk}, {el} experts per shard, align_size={config.align_size}")
