"""oxmoe FFI targets as JAX primitives that work under jit, vmap and sharding.

Each operand and result of a primitive has a :class:`Layout`: rows of tokens,
independent of each other (the router's), a whole array the same on every
token shard, a sum over the tokens, or dispatched rows in expert-major order,
where any row may hold any token (the permutation's and the grouped GEMM's).
The layouts give every transformation rule:

- batching: a vmapped axis folds into the token axis when every result and
  every mapped operand is rows of tokens, so the FFI call sees one larger
  ``[tokens, ...]`` matrix; other batchings run the call per batch element;
- sharding: operands split along tokens run shard by shard with no
  communication, and a result that sums over tokens is summed across the token
  shards with ``psum``; a primitive with dispatched rows sees all tokens
  (inside ``shard_map`` each shard permutes its own).

Each primitive is an outer JAX primitive (abstract evaluation and the batching
rule) lowered through a ``custom_partitioning`` function around
``jax.ffi.ffi_call``. The outer primitive exists because ``custom_partitioning``
has no batching rule of its own.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import dispatch  # apply_primitive and the registry of lowering-needs-devices primitives
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from oxmoe import _cuda, _library

ResultSpecs = Callable[..., Sequence[jax.ShapeDtypeStruct]]


def _needs_nvrtc(lowering):
    """A CUDA lowering: NVRTC must be loadable (the kernels compile at first run),
    else a Python error that says where it was looked for."""

    def lower_for_cuda(ctx, *args, **params):
        _cuda.load_nvrtc()
        return lowering(ctx, *args, **params)

    return lower_for_cuda


def _varying_axes(aval) -> frozenset:
    """The manual (shard_map) mesh axes an abstract value varies over."""
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def vary_alike(*arrays):
    """``arrays``, each made to vary over every manual mesh axis any of them
    varies over (inside ``shard_map``; unchanged elsewhere). A primitive whose
    operands vary alike has results and gradients of the same type: the
    gradient of an operand that was replicated is then summed over the axes
    by JAX, not handed back with a type that does not match."""
    axes = frozenset().union(*(_varying_axes(jax.typeof(x)) for x in arrays))
    if not axes:
        return arrays
    out = []
    for x in arrays:
        missing = tuple(sorted(axes - _varying_axes(jax.typeof(x))))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return tuple(out)


class Layout(enum.Enum):
    """How an operand or result of a primitive relates to the token rows."""

    ROWS = "rows"
    """``[tokens, ...]`` (e.g. ``[T, E]`` or ``[T, H]``): one row per token; split along tokens."""
    WHOLE = "whole"
    """Not per token (``[experts]`` or a scalar): the same on every token shard."""
    SUM_OVER_ROWS = "sum_over_rows"
    """A result that sums over all tokens: summed across token shards."""
    DISPATCHED = "dispatched"
    """Rows in expert-major order, where any row may hold any token: a
    primitive with such an operand or result sees all tokens (token-split
    inputs are gathered); inside ``shard_map`` each shard permutes its own."""


class FfiPrimitive:
    """The FFI target ``target`` as a JAX primitive.

    Args:
      target: the handler's exported name, also the FFI target name.
      operands: the :class:`Layout` of each operand; trailing operands may be
        omitted by a call (optional arguments).
      results: the layout of each result.
      result_specs: ``(*operand avals, **params) -> [ShapeDtypeStruct]``, the
        global shapes and dtypes of the results; a spec's sharding, if given, is
        the result's type sharding (otherwise derived from the operands').
      shape_params: the names of params that only shape the results; every
        other param is passed to the handler as an FFI attribute.
      workspace: ``(*operand avals, **params) -> bytes`` for a target that takes a
        workspace (``uint8[bytes]``, its last result, which the handler's
        kernels use during the call; see :func:`oxmoe._library.workspace_bytes`),
        computed from each shard's operands. The primitive's results do not
        include it.
    """

    def __init__(self, target: str, *, operands: Sequence[Layout], results: Sequence[Layout],
                 result_specs: ResultSpecs, shape_params: Sequence[str] = (),
                 workspace: Callable[..., int] | None = None):
        self.target = _library.register(target)
        self.operands = tuple(operands)
        self.results = tuple(results)
        self.result_specs = result_specs
        self.shape_params = frozenset(shape_params)
        self.workspace = workspace
        self._splits_tokens = Layout.DISPATCHED not in self.operands + self.results

        self._primitive = Primitive(target)
        self._primitive.multiple_results = True
        self._primitive.def_impl(functools.partial(dispatch.apply_primitive, self._primitive))
        self._primitive.def_abstract_eval(self._abstract_eval)
        batching.primitive_batchers[self._primitive] = self._batch
        self._partitioned = self._make_partitioned()
        lowering = mlir.lower_fun(self._lower, multiple_results=True)
        mlir.register_lowering(self._primitive, lowering)
        mlir.register_lowering(self._primitive, _needs_nvrtc(lowering), platform="cuda")
        dispatch.prim_requires_devices_during_lowering.add(self._primitive)

    def __call__(self, *operands: jax.Array, **params: Any) -> list[jax.Array]:
        """Binds the primitive; ``params`` are hashable (numpy scalars, str)."""
        return self._primitive.bind(*operands, **params)

    # -- abstract evaluation and lowering --------------------------------------

    def _abstract_eval(self, *avals, **params):
        specs = self.result_specs(*avals, **params)
        rows = [a.sharding for a, layout in zip(avals, self.operands) if layout is Layout.ROWS]
        # Results are the operand avals' kind: inside shard_map they vary over the
        # manual mesh axes the operands vary over (the widest operand's).
        base = max(avals, key=lambda a: len(_varying_axes(a)))
        return [base.update(shape=s.shape, dtype=s.dtype, weak_type=False, sharding=s.sharding or self._type_sharding(
                    layout, (rows or [base.sharding])[0], len(s.shape)))
                for s, layout in zip(specs, self.results)]

    @staticmethod
    def _type_sharding(layout: Layout, rows_sharding, ndim: int):
        """The sharding in a result's type (what explicit-sharding meshes use):
        per-token results split like the per-token operands, the rest replicated."""
        if rows_sharding is None:
            return None
        token_axes = rows_sharding.spec[0] if rows_sharding.spec else None
        return FfiPrimitive._sharding(rows_sharding.mesh, layout, token_axes, ndim)

    def _lower(self, *operands, **params):
        return self._partitioned(tuple(sorted(params.items())), *operands)

    def _call_ffi(self, params: dict[str, Any], result_specs, *operands):
        attrs = {k: v for k, v in params.items() if k not in self.shape_params}
        if self.workspace is None:
            return jax.ffi.ffi_call(self.target, list(result_specs))(*operands, **attrs)
        workspace = self.workspace(*(jax.typeof(x) for x in operands), **params)
        specs = [*result_specs, jax.ShapeDtypeStruct((workspace,), jnp.uint8)]
        return jax.ffi.ffi_call(self.target, specs)(*operands, **attrs)[:-1]

    # -- sharding ---------------------------------------------------------------

    def _make_partitioned(self):
        def unpartitioned(params, *operands):
            specs = self.result_specs(*(jax.typeof(x) for x in operands), **dict(params))
            return tuple(self._call_ffi(dict(params), specs, *operands))

        partitioned = custom_partitioning(unpartitioned, static_argnums=(0,))
        partitioned.def_partition(
            partition=self._partition,
            infer_sharding_from_operands=self._infer_result_shardings,
            sharding_rule=self._sharding_rule,
        )
        return partitioned

    def _token_axes(self, mesh, arg_shapes, result_shapes) -> tuple[str, ...]:
        """The mesh axes the token rows are split over (empty: not split)."""
        if not self._splits_tokens:
            return ()
        rows = [a for a, layout in zip(arg_shapes, self.operands) if layout is Layout.ROWS]
        if not rows:  # e.g. a backward whose only per-token value is its result
            rows = [r for r, layout in zip(result_shapes, self.results) if layout is Layout.ROWS]
        sharding = rows[0].sharding if rows else None
        if not isinstance(sharding, NamedSharding) or not sharding.spec:
            return ()
        axes = sharding.spec[0]
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        num_shards = math.prod(mesh.shape[a] for a in axes)
        return axes if rows[0].shape[0] % num_shards == 0 else ()

    @staticmethod
    def _sharding(mesh, layout: Layout, token_axes, ndim: int) -> NamedSharding:
        """Per-token arrays split over ``token_axes`` (none: not split), the rest
        replicated; the spec names every dimension, as types require."""
        split = token_axes if layout is Layout.ROWS and token_axes else None
        return NamedSharding(mesh, PartitionSpec(*([split] + [None] * (ndim - 1))[:ndim]))

    def _result_shardings(self, mesh, token_axes, result_shapes):
        return tuple(self._sharding(mesh, layout, token_axes, len(r.shape))
                     for layout, r in zip(self.results, result_shapes))

    def _infer_result_shardings(self, params, mesh, arg_shapes, result_shapes):
        del params
        token_axes = self._token_axes(mesh, arg_shapes, result_shapes)
        return self._result_shardings(mesh, token_axes, result_shapes)

    def _partition(self, params, mesh, arg_shapes, result_shapes):
        token_axes = self._token_axes(mesh, arg_shapes, result_shapes)
        arg_shardings = tuple(self._sharding(mesh, layout, token_axes, len(a.shape))
                              for layout, a in zip(self.operands, arg_shapes))
        result_shardings = self._result_shardings(mesh, token_axes, result_shapes)
        local_specs = [jax.ShapeDtypeStruct(s.shard_shape(r.shape), r.dtype)
                       for s, r in zip(result_shardings, result_shapes)]

        def per_shard(*operands):
            outs = self._call_ffi(dict(params), local_specs, *operands)
            return tuple(jax.lax.psum(out, token_axes) if layout is Layout.SUM_OVER_ROWS and token_axes
                         else out for out, layout in zip(outs, self.results))

        return mesh, per_shard, result_shardings, arg_shardings

    def _sharding_rule(self, params, mesh, operand_types, result_types):
        """Shardy's view: ``t`` (the token rows) may be split when the primitive
        splits tokens; every other dimension is whole."""
        del params, mesh
        whole = []

        def factors(layout, ir_type):
            names = []
            for dim in range(len(ir_type.shape)):
                if dim == 0 and layout is Layout.ROWS:
                    names.append("t")
                else:
                    whole.append(f"d{len(whole)}")
                    names.append(whole[-1])
            return " ".join(names)

        operands = [factors(l, t) for l, t in zip(self.operands, operand_types)]
        results = [factors(l, t) for l, t in zip(self.results, result_types)]
        uses_t = any(f.startswith("t") for f in operands + results)
        reductions = ("t",) if Layout.SUM_OVER_ROWS in self.results and uses_t else ()
        if uses_t and not self._splits_tokens:
            whole.append("t")
        rule = f"{', '.join(operands)} -> {', '.join(results)}"
        # Shardy wants them in the order the factors first appear in the rule.
        order = list(dict.fromkeys(" ".join(operands + results).split()))
        need_replication = tuple(sorted(whole, key=order.index))
        return rule, {"need_replication_factors": need_replication, "reduction_factors": reductions}

    # -- batching ---------------------------------------------------------------

    def _batch(self, args, dims, **params):
        mapped = [d is not None for d in dims]
        folds_into_rows = (
            all(r is Layout.ROWS for r in self.results)
            and all(l is Layout.ROWS for l, m in zip(self.operands, mapped) if m))
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        if folds_into_rows:
            # Each batch element's rows, the same for every per-token operand and result,
            # are named: reshaping with -1 cannot infer them from an empty batch.
            folded, rows = [], None
            for x, d, layout in zip(args, dims, self.operands):
                if layout is Layout.ROWS:
                    x = jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
                    rows = x.shape[1]
                    x = x.reshape(size * rows, *x.shape[2:])
                folded.append(x)
            outs = self(*folded, **params)
            return [o.reshape(size, rows, *o.shape[1:]) for o in outs], [0] * len(outs)

        moved = [jnp.moveaxis(x, d, 0) for x, d in zip(args, dims) if d is not None]

        def one_element(slices):
            it = iter(slices)
            return tuple(self(*(next(it) if m else x for x, m in zip(args, mapped)), **params))

        outs = jax.lax.map(one_element, tuple(moved))
        return list(outs), [0] * len(outs)
