"""Frozen dataclasses registered as pytrees: the small typed results of oxmoe's steps."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import jax

_T = typing.TypeVar("_T")


@typing.dataclass_transform(frozen_default=True)
def pytree_dataclass(data: tuple[str, ...], meta: tuple[str, ...] = ()) -> Callable[[type[_T]], type[_T]]:
    """A frozen dataclass registered as a pytree with these data and static fields."""
    def register(cls: type[_T]) -> type[_T]:
        return jax.tree_util.register_dataclass(
            dataclasses.dataclass(frozen=True)(cls), data_fields=list(data), meta_fields=list(meta))
    return register
