"""Finds NVRTC, which the CUDA kernels are compiled with at first use.

oxmoe's library loads NVRTC by its soname (``libnvrtc.so.13``); this module
finds the file the way a pip user has it (the ``nvidia-cuda-nvrtc`` wheel that
JAX's CUDA install brings) or in a CUDA toolkit, and loads it globally so that
the library's lookup finds it.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import pathlib
import sys

#: Environment variable naming the NVRTC library file to use.
NVRTC_ENV_VAR = "OXMOE_NVRTC"


def _candidates() -> list[str]:
    """Where NVRTC is looked for, in order (glob patterns)."""
    wheels = [os.path.join(entry, "nvidia", sub, "lib", "libnvrtc.so.*")
              for entry in sys.path if entry
              for sub in ("cu13", "cuda_nvrtc")]
    toolkits = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda",
                *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    return wheels + [os.path.join(root, lib, "libnvrtc.so.*")
                     for root in toolkits if root
                     for lib in ("lib64", "targets/x86_64-linux/lib")]


def find_nvrtc() -> pathlib.Path:
    """The NVRTC library file: ``$OXMOE_NVRTC``, a pip wheel, or a CUDA toolkit."""
    override = os.environ.get(NVRTC_ENV_VAR)
    if override:
        if not os.path.isfile(override):
            raise RuntimeError(f"{NVRTC_ENV_VAR}={override!r} is not a file")
        return pathlib.Path(override)
    patterns = _candidates()
    for pattern in patterns:
        # The versioned library (libnvrtc.so.13), not its builtins or alternates.
        found = sorted(p for p in glob.glob(pattern)
                       if "builtins" not in p and ".alt." not in p)
        if found:
            return pathlib.Path(found[0])
    raise RuntimeError(
        "oxmoe needs NVRTC to compile its CUDA kernels and found none. Install it with "
        "`pip install nvidia-cuda-nvrtc` (JAX's CUDA install brings it), install a CUDA "
        f"toolkit, or set {NVRTC_ENV_VAR} to libnvrtc.so. Looked in: " + ", ".join(patterns))


@functools.cache
def load_nvrtc() -> pathlib.Path:
    """Loads NVRTC (and its builtins, beside it) globally; returns its path."""
    path = find_nvrtc()
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path
