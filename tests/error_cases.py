"""The two checks of a table of bad-argument cases (function, array arguments, error
type, pattern its message must match): the error on concrete arrays, and the same
error while tracing, from shapes and dtypes alone (before anything runs)."""

import jax
import pytest


def check_raises(case) -> None:
    fn, args, error, pattern = case
    with pytest.raises(error, match=pattern):
        fn(*args)


def check_raises_while_tracing(case) -> None:
    fn, args, error, pattern = case
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    with pytest.raises(error, match=pattern):
        jax.eval_shape(fn, *abstract)
