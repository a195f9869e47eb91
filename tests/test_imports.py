"""The core library stays free of the tools' dependencies: importing oxmoe, its plain-JAX
references and its model shapes loads none of rich, matplotlib or optax (the benchmark's
progress and chart, the training job's optimiser); the model shapes import nothing at all
from oxmoe."""

import ast
import os
import pathlib
import subprocess
import sys

import oxmoe
from oxmoe import _library

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ("rich", "matplotlib", "optax")
MODULES = ("oxmoe", "oxmoe.reference", "oxmoe.reference.router", "oxmoe.reference.permutation",
           "oxmoe.reference.grouped_gemm", "oxmoe.reference.moe", "oxmoe.model_shapes")


def test_importing_oxmoe_and_its_references_loads_no_tool():
    # A fresh interpreter: this one has imported whatever other tests needed.
    code = (f"import importlib, sys\n"
            f"for name in {MODULES!r}: importlib.import_module(name)\n"
            f"print(' '.join(m for m in {TOOLS!r} if m in sys.modules))")
    # The package and library this process imported: from the source tree or installed.
    env = dict(os.environ, OXMOE_LIBRARY=str(_library.library_path().resolve()))
    package_root = str(pathlib.Path(oxmoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"importing {', '.join(MODULES)} loads {result.stdout.strip()}"


def test_model_shapes_import_nothing_from_the_layer():
    # Plain data that tests, benchmarks and scripts share: no oxmoe import, not even a lazy one.
    source = (ROOT / "jax_bindings" / "oxmoe" / "model_shapes.py").read_text()
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(source))
                for alias in getattr(node, "names", []) if isinstance(node, ast.Import)}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "dataclasses"}, f"oxmoe/model_shapes.py imports {sorted(imported)}"
