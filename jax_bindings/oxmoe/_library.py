"""Finds and loads the oxmoe native library, and registers its FFI handlers."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import jax

#: Environment variable naming the library file to load instead of the one
#: installed inside the package (from a source checkout: ``target/release/liboxmoe.so``).
LIBRARY_ENV_VAR = "OXMOE_LIBRARY"
LIBRARY_NAME = "liboxmoe.so"


def library_path() -> pathlib.Path:
    """The library file oxmoe loads: ``$OXMOE_LIBRARY``, else the packaged one."""
    override = os.environ.get(LIBRARY_ENV_VAR)
    if override:
        path = pathlib.Path(override)
        if not path.is_file():
            raise ImportError(
                f"{LIBRARY_ENV_VAR}={override!r} does not name a file; build it with "
                "`cargo build --release` or unset the variable")
        return path
    path = pathlib.Path(__file__).with_name(LIBRARY_NAME)
    if not path.is_file():
        raise ImportError(
            f"the oxmoe native library is not installed at {path}; install the package "
            f"with `pip install .` or point {LIBRARY_ENV_VAR} at a built {LIBRARY_NAME}")
    return path


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded native library, checked to be the version this package expects."""
    from oxmoe import __version__

    path = library_path()
    lib = ctypes.CDLL(str(path))
    lib.oxmoe_build_id.restype = ctypes.c_char_p
    version = lib.oxmoe_build_id().decode().split("+")[0]
    if version != __version__:
        raise ImportError(
            f"{path} is oxmoe {version}, but the Python package is {__version__}: "
            "rebuild the library or reinstall the package")
    return lib


def build_id() -> str:
    """``<version>+<git commit>`` of the loaded library (``-dirty`` appended when its
    sources differed from the commit's), for reports."""
    return library().oxmoe_build_id().decode()


@functools.cache
def register(target: str) -> str:
    """Registers the handlers of ``target``: the symbol ``target`` for XLA:CPU and
    ``<target>_cuda`` for CUDA, under the one target name; returns ``target``.

    The CUDA handler runs at two stages: at XLA's initialize stage it loads (and
    at first compiles) the kernels it will launch, and at the execute stage it
    launches them. It reports itself compatible with XLA's command buffers, so
    XLA may capture the execute stage in a CUDA graph, which then holds only
    kernel launches."""
    lib = library()
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    cuda = jax.ffi.pycapsule(getattr(lib, f"{target}_cuda"))
    jax.ffi.register_ffi_target(target, {"initialize": cuda, "execute": cuda}, platform="CUDA")
    return target


def workspace_bytes(function: str, *sizes: int) -> int:
    """The bytes of a call's workspace, as the library's ``<function>_workspace_bytes``
    counts them for ``sizes``: device memory the kernels use during the call, which
    the call takes as its last result (XLA assigns it, so a CUDA graph that captures
    the call may replay it)."""
    return int(_workspace_counter(function, len(sizes))(*sizes))


@functools.cache
def _workspace_counter(function: str, num_sizes: int):
    """The library's ``<function>_workspace_bytes``, typed for ctypes once."""
    count = getattr(library(), f"{function}_workspace_bytes")
    count.restype = ctypes.c_uint64
    count.argtypes = [ctypes.c_uint64] * num_sizes
    return count
