"""Gradients by central differences in float64: the reference the hand-written VJPs
are checked against, independent of any JAX transformation."""

import numpy as np


def central_difference_jacobian(fn, x: np.ndarray, eps: float = 1e-3) -> np.ndarray:
    """d fn(x) / d x by central differences in float64: [fn's output size, x.size]."""
    columns = []
    for i in range(x.size):
        step = np.zeros(x.size)
        step[i] = eps
        up, down = fn(x + step.reshape(x.shape)), fn(x - step.reshape(x.shape))
        columns.append((np.ravel(up) - np.ravel(down)) / (2 * eps))
    return np.stack(columns, axis=1)


def vjp_by_finite_differences(fn, x, cotangent):
    """cotangent · d fn(x) / d x, shaped like x."""
    return (np.ravel(cotangent) @ central_difference_jacobian(fn, x)).reshape(x.shape)
