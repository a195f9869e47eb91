"""The exchange of dispatched rows between expert shards: its plan, made on
the device from every shard's counts, the two collectives that move the rows
there and back, and the row buffers' sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oxmoe import permutation
from oxmoe._checks import MAX_ROWS
from oxmoe._primitive import _varying_axes
from oxmoe.moe.config import Axes, MoEConfig, pytree_dataclass


@pytree_dataclass(("send_sizes", "send_offsets", "recv_sizes", "return_offsets", "chunk_sizes", "group_sizes"),
                  ("axis", "shards", "capacity", "method"))
class Exchange:
    """How this shard's dispatched rows travel to the shards that own their
    experts, and back. Made on the device by :func:`dispatch`.

    Rows for shard ``j`` are the contiguous block of its experts in the
    expert-major dispatch layout. They land in ``j``'s receive buffer in slot
    ``me`` of ``shards`` slots of ``capacity`` rows each, where a local chunk
    sort groups them by local expert.
    """

    send_sizes: jax.Array
    """``[n]`` int32: rows this shard sends to each shard."""
    send_offsets: jax.Array
    """``[n]`` int32: where those rows start in the dispatched rows."""
    recv_sizes: jax.Array
    """``[n]`` int32: rows this shard receives from each shard."""
    return_offsets: jax.Array
    """``[n]`` int32: where this shard's block starts in each shard's dispatched rows."""
    chunk_sizes: jax.Array
    """``[n * (El + 1)]`` int32: per slot, the rows of each local expert, then the unused rest."""
    group_sizes: jax.Array
    """``[El]`` int32: the received rows of each local expert (the grouped GEMM's sizes)."""
    axis: str
    """The ``shard_map`` axis the experts are split over."""
    shards: int
    """``n``, the size of that axis."""
    capacity: int
    """The rows of one slot: the most one shard can send another."""
    method: str
    """``"all_to_all"`` or ``"ragged_all_to_all"``: the collective that moves the rows."""

    @property
    def local_experts(self) -> int:
        """``El``, the experts this shard owns."""
        return self.group_sizes.shape[0]

    def _sorted_chunks(self):
        """Chunk order by local expert, then by source slot; the unused rests last."""
        n, el = self.shards, self.local_experts
        order = [s * (el + 1) + e for e in range(el) for s in range(n)] + [s * (el + 1) + el for s in range(n)]
        return jnp.asarray(order, jnp.int32)

    def to_experts(self, rows):
        """``[R, H]`` dispatched rows → ``[n * capacity, H]`` rows of this shard's
        experts, grouped by local expert, then zero rows."""
        received = self._transfer(rows, back=False)
        return permutation.permute_chunks(received, self.chunk_sizes, self._sorted_chunks(), inverse=False)

    def from_experts(self, rows, num_rows: int):
        """The inverse of :meth:`to_experts`: ``[n * capacity, H]`` → ``[num_rows, H]``."""
        slots = permutation.permute_chunks(rows, self.chunk_sizes, self._sorted_chunks(), inverse=True)
        return self._transfer(slots, back=True, num_rows=num_rows)

    def _transfer(self, rows, *, back: bool, num_rows: int | None = None):
        transfer = self._ragged if self.method == "ragged_all_to_all" else self._slotted
        return transfer(rows, back=back, num_rows=num_rows)

    def _ragged(self, rows, *, back: bool, num_rows):
        me = jax.lax.axis_index(self.axis)
        if not back:
            out = jnp.zeros((self.shards * self.capacity, rows.shape[1]), rows.dtype)
            offsets = jnp.full((self.shards,), me * self.capacity, jnp.int32)
            args = (self.send_offsets, self.send_sizes, offsets, self.recv_sizes)
        else:
            out = jnp.zeros((num_rows, rows.shape[1]), rows.dtype)
            slots = jnp.arange(self.shards, dtype=jnp.int32) * self.capacity
            args = (slots, self.recv_sizes, self.return_offsets, self.send_sizes)
        # The receive buffer starts as zeros that vary like the rows sent into it.
        axes = tuple(_varying_axes(jax.typeof(rows)))
        out = jax.lax.pcast(out, axes, to="varying") if axes else out
        return jax.lax.ragged_all_to_all(rows, out, *args, axis_name=self.axis)

    def _slotted(self, rows, *, back: bool, num_rows):
        n, cap, h = self.shards, self.capacity, rows.shape[1]
        if not back:
            index = self.send_offsets[:, None] + jnp.arange(cap, dtype=jnp.int32)
            valid = jnp.arange(cap) < self.send_sizes[:, None]
            slots = jnp.where(valid[..., None], rows[jnp.clip(index, 0, rows.shape[0] - 1)], 0)
            return jax.lax.all_to_all(slots, self.axis, 0, 0).reshape(n * cap, h)
        returned = jax.lax.all_to_all(rows.reshape(n, cap, h), self.axis, 0, 0).reshape(n * cap, h)
        row = jnp.arange(num_rows, dtype=jnp.int32)
        ends = jnp.cumsum(self.send_sizes)
        shard = jnp.minimum(jnp.searchsorted(ends, row, side="right"), n - 1).astype(jnp.int32)
        index = shard * cap + row - self.send_offsets[shard]
        return jnp.where((row < ends[-1])[:, None], returned[jnp.clip(index, 0, n * cap - 1)], 0)


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def exchange_method(config: MoEConfig, axes: Axes) -> str | None:
    """The collective that moves the rows (``"ring"``: none); None without expert shards."""
    if axes.expert_shards == 1:
        return None
    # Inside shard_map the mesh is abstract, but it knows its devices' platform.
    device = jax.sharding.get_abstract_mesh().abstract_device
    if config.exchange == "ragged_all_to_all" and getattr(device, "platform", None) == "cpu":
        raise ValueError("exchange 'ragged_all_to_all' is not implemented on CPU (XLA:CPU has no ragged all-to-all; "
                         "the layer would fail when it runs): use exchange 'auto', 'all_to_all' or 'ring' on a CPU mesh")
    return "all_to_all" if config.exchange == "auto" else config.exchange


def plan_exchange(group_sizes, config: MoEConfig, axes: Axes, num_tokens: int, method: str) -> Exchange:
    """The :class:`Exchange` of a dispatch of ``num_tokens`` tokens whose
    expert blocks hold ``group_sizes`` rows, from every shard's blocks."""
    n, e = axes.expert_shards, config.num_experts
    el = e // n
    me = jax.lax.axis_index(axes.expert_axis)
    # blocks[s, j, l]: rows shard s sends to shard j for j's local expert l.
    blocks = jax.lax.all_gather(group_sizes, axes.expert_axis).reshape(n, n, el)
    per_pair = blocks.sum(-1)
    mine = blocks[:, me, :]
    capacity = dispatch_rows(config, num_tokens, el)  # all of a shard's tokens sent to one shard's experts
    chunks = jnp.concatenate([mine, capacity - mine.sum(-1, keepdims=True)], axis=1).reshape(-1)
    return Exchange(
        send_sizes=per_pair[me], send_offsets=_exclusive_cumsum(per_pair[me]), recv_sizes=per_pair[:, me],
        return_offsets=_exclusive_cumsum(per_pair, axis=1)[:, me], chunk_sizes=chunks.astype(jnp.int32),
        group_sizes=mine.sum(0), axis=axes.expert_axis, shards=n, capacity=capacity, method=method)


def dispatch_rows(config: MoEConfig, num_tokens: int, num_experts: int) -> int:
    """The rows of a dispatch of ``num_tokens`` tokens to ``num_experts`` of the
    experts: each token reaches at most ``min(topk, num_experts)`` of them, each
    expert's block padded to ``align_size``. With a shard's ``El`` experts, the
    most rows one shard can send another."""
    return permutation.padded_rows(num_tokens * min(config.topk, num_experts), num_experts, config.align_size)


def check_rows(config: MoEConfig, axes: Axes, num_tokens: int, method: str | None) -> None:
    """The layer's largest buffer of rows (which holds at least as many as the
    others) must fit int32 row indices."""
    n, el = axes.expert_shards, config.num_experts // axes.expert_shards
    if method is None:
        what, rows = "the dispatch", dispatch_rows(config, num_tokens, el)
    elif method == "ring":
        what, rows = (f"the dispatch of the expert axis's {n * num_tokens} gathered tokens",
                      dispatch_rows(config, n * num_tokens, el))
    else:
        capacity = dispatch_rows(config, num_tokens, el)
        what, rows = f"the exchange's receive buffer ({n} slots of {capacity} rows)", n * capacity
    if rows > MAX_ROWS:
        raise ValueError(f"{what} would hold {rows} rows, more than 2**31 - 1 (row indices are int32): {num_tokens} "
                         f"tokens per shard, topk={config.topk}, {el} experts per shard, align_size={config.align_size}")
