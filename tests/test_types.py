"""The package's public modules type-check clean under mypy (its configuration in
pyproject.toml: every module but the benchmark), and the package says it is typed (py.typed)."""

import pathlib
import subprocess
import sys

import pytest

import oxmoe

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_public_modules_type_check_clean():
    pytest.importorskip("mypy", reason="the type check needs mypy (the test extra installs it)")
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_the_package_is_marked_typed():
    assert (pathlib.Path(oxmoe.__file__).parent / "py.typed").is_file()
