"""Argument checks shared by the public functions: they run while tracing and
raise errors that name the argument and the value expected."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core  # trace_state_clean: JAX has no public way to ask

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The most rows of a dispatch or an exchange buffer: the handlers index rows with int32.
MAX_ROWS = 2**31 - 1


def check_array(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")


def check_float_dtype(name: str, x) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_float_matrix(name: str, x) -> int:
    """Checks ``x`` is a float ``[..., tokens, experts]`` array; returns the expert count."""
    check_array(name, x)
    if x.ndim < 2:
        raise ValueError(f"{name} must have rank >= 2 ([..., tokens, num_experts]), "
                         f"got shape {tuple(x.shape)}")
    check_float_dtype(name, x)
    return x.shape[-1]


def check_count(name: str, value, low: int, high: int | None = None, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bounds = f"{low} <= {name}" + (f" <= {high}" if high is not None else "")
        raise ValueError(f"{name} must satisfy {bounds}{why}, got {value}")
    return value


def check_real(name: str, value, low: float | None = None) -> float:
    """``value`` as a float: a finite real number (NaN and infinities are
    refused: no option means them), ``>= low`` when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """``value`` as a bool: ``True`` or ``False`` (NumPy's too), not a number that means one."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def called_eagerly() -> bool:
    """Whether no transformation (``jit``, ``vmap``, ``grad``, ``eval_shape``, ...)
    is tracing the call. Only then may a check read array values on the host:
    under a transformation, a constant array must behave like a traced one."""
    return jax_core.trace_state_clean()
