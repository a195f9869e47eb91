"""The XLA FFI bindings checked in at ffi/src/bindings.rs belong to the vendored
header: their recorded SHA-256 is the header's, and where bindgen can run
(cargo and libclang), regenerating them gives the same file."""

import glob
import hashlib
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "ffi" / "include" / "xla" / "ffi" / "api" / "c_api.h"
BINDINGS = ROOT / "ffi" / "src" / "bindings.rs"
VENDORED = ROOT / "ffi" / "include" / "xla" / "VENDORED.md"

pytestmark = pytest.mark.skipif(not HEADER.is_file(), reason="no source tree (ffi/) here")


def header_sha256() -> str:
    return hashlib.sha256(HEADER.read_bytes()).hexdigest()


def test_bindings_record_the_sha256_of_the_vendored_header():
    recorded = re.search(r"^// header-sha256: ([0-9a-f]{64})$", BINDINGS.read_text(), re.MULTILINE)
    assert recorded, f"{BINDINGS} has no '// header-sha256:' line; run scripts/ffi-bindings"
    assert recorded.group(1) == header_sha256(), (
        f"{HEADER} changed since {BINDINGS} was generated; run scripts/ffi-bindings")


def test_vendored_md_names_the_headers_sha256():
    assert header_sha256() in VENDORED.read_text(), f"update the SHA-256 in {VENDORED}"


def libclang_found() -> bool:
    """Roughly where clang-sys looks for libclang (LIBCLANG_PATH, then the usual folders), by
    its names (libclang.so, libclang-14.so.1, ...; not LLVM's C++ library libclang-cpp)."""
    folders = [os.environ.get("LIBCLANG_PATH", "")]
    folders += glob.glob("/usr/lib/llvm-*/lib") + ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/lib"]
    names = ("libclang.so", "libclang.so.*", "libclang-[0-9]*.so", "libclang-[0-9]*.so.*")
    return any(glob.glob(os.path.join(f, name)) for f in folders if f for name in names)


@pytest.mark.skipif(shutil.which("cargo") is None or not libclang_found(),
                    reason="regenerating the bindings needs cargo and libclang")
def test_regenerated_bindings_equal_the_checked_in_ones():
    run = subprocess.run([str(ROOT / "scripts" / "ffi-bindings"), "--check"],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
