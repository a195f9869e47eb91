"""Builds the Rust library with cargo and ships it inside the `oxmoe` package.

The library is loaded with ctypes, not imported as an extension module, so one
build serves every Python version; the wheel is still platform-specific.
"""

import os
import pathlib
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = pathlib.Path(__file__).resolve().parent


class BuildWithNativeLibrary(build_py):
    def run(self):
        super().run()
        subprocess.run(["cargo", "build", "--release", "--lib"], cwd=ROOT, check=True)
        target_dir = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        package_dir = pathlib.Path(self.build_lib) / "oxmoe"
        package_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target_dir / "release" / "liboxmoe.so", package_dir / "liboxmoe.so")


class NativeDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithNativeLibrary}, distclass=NativeDistribution)
