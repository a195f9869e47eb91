"""Which devices the tests run on.

The suite runs on a CPU-only machine (JAX_PLATFORMS=cpu, or unset) and on a GPU
machine (JAX_PLATFORMS=cuda,cpu). Either way conftest.py forces eight host (CPU)
devices, so the CPU backend always has eight devices, while the default backend
(where every plain call runs) may be a single GPU:

- `mesh_devices(n)`: the devices a test mesh of n devices is built from: the default
  backend's when it has n, else the host CPU devices (so the sharding tests run on
  CPU on a one-GPU machine instead of failing);
- `gpu_devices()`: the GPUs, or [] when there is no GPU backend (the GPU tests skip).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

NO_GPU_REASON = (
    "no GPU backend: jax.devices('gpu') has no device (run on a GPU machine with "
    "JAX_PLATFORMS=cuda,cpu to check oxmoe's CUDA kernels)"
)

# A dry run of the GPU tests' own logic on a CPU-only machine: with this set to "cpu",
# the GPU tests run with the last host CPU device standing in for the GPU (so they
# compare oxmoe's CPU implementation with itself). It checks nothing about CUDA.
GPU_STAND_IN_ENV = "OXMOE_TEST_GPU_STAND_IN"


def gpu_devices() -> list:
    """The GPU devices, [] when there is no GPU backend (or the CPU stand-in, see above)."""
    if os.environ.get(GPU_STAND_IN_ENV) == "cpu":
        return [jax.devices("cpu")[-1]]
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:  # "Unknown backend: 'gpu' requested, but no platforms ..."
        return []


def gpu_platform() -> str:
    """The platform name the GPU tests run on ("gpu", or "cpu" for the stand-in)."""
    return "cpu" if os.environ.get(GPU_STAND_IN_ENV) == "cpu" else "gpu"


def cpu_devices() -> list:
    try:
        return list(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return []


def choose_mesh_devices(default_devices: Sequence, cpu_devices: Sequence, count: int) -> list:
    """The first `count` devices of the default backend if it has that many, else of the CPU
    backend; raises RuntimeError (saying why) when neither has enough."""
    if len(default_devices) >= count:
        return list(default_devices[:count])
    if len(cpu_devices) >= count:
        return list(cpu_devices[:count])
    raise RuntimeError(
        f"a test mesh needs {count} devices, but the default backend has {len(default_devices)} and the CPU "
        f"backend {len(cpu_devices)}: conftest.py forces 8 host devices through XLA_FLAGS, which only works "
        "when jax is first imported after it (and with 'cpu' in JAX_PLATFORMS)"
    )


def mesh_devices(count: int) -> list:
    """The devices a test mesh of `count` devices is built from (see `choose_mesh_devices`)."""
    return choose_mesh_devices(jax.devices(), cpu_devices(), count)
