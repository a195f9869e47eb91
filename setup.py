"""Builds the Rust library with setuptools-rust and ships it inside the `oxmoe` package.

Why setuptools-rust (not maturin): liboxmoe.so is a plain cdylib that Python loads
with ctypes and hands to JAX as FFI capsules, with no PyO3 and no cffi.
setuptools-rust builds exactly that (`Binding.NoBinding`), and keeps setuptools'
package layout (`jax_bindings/`) and metadata from pyproject.toml; maturin's modes
for a library without PyO3 (cffi, uniffi) generate Python bindings oxmoe does not use.

The library is no extension module, so it keeps its plain name (`oxmoe/liboxmoe.so`,
what `oxmoe._library` loads) and the wheel is tagged `py3-none-<platform>`: one build
serves every Python 3. It is stripped (16 MB with line tables, about 1.2 MB without).
"""

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools_rust import Binding, RustExtension, Strip

LIBRARY = "liboxmoe"


class BuildExtPlainName(build_ext):
    def get_ext_filename(self, fullname):
        # Not `liboxmoe.cpython-311-x86_64-linux-gnu.so`: no Python version is involved.
        if fullname.split(".")[-1] == LIBRARY:
            return fullname.replace(".", "/") + ".so"
        return super().get_ext_filename(fullname)


class BdistWheelAnyPython3(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    rust_extensions=[
        RustExtension(
            f"oxmoe.{LIBRARY}",
            path="Cargo.toml",
            binding=Binding.NoBinding,
            # Release also for editable installs (setuptools-rust would build those
            # in debug, whose CPU implementations are many times slower).
            debug=False,
            strip=Strip.All,
        )
    ],
    cmdclass={"build_ext": BuildExtPlainName, "bdist_wheel": BdistWheelAnyPython3},
)
