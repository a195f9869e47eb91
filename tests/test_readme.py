"""Every ```python block of README.md runs as written: each in a fresh Python process
(nothing from one block reaches the next), on the CPU split into 8 devices, as the
README says a snippet that needs several devices is run on a machine without them."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import oxmoe

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> dict[str, str]:
    """Each block, named by the README section it sits in (and its line)."""
    text = README.read_text()
    blocks = {}
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^#+ (.*)$", text[:match.start()], re.M)
        section = re.sub(r"\W+", "_", headings[-1] if headings else "top").strip("_").lower()
        blocks[f"{section}_line{line}"] = match.group(1)
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_its_snippets():
    assert len(BLOCKS) >= 4, list(BLOCKS)


@pytest.mark.parametrize("name", BLOCKS)
def test_a_readme_snippet_runs_as_written(name, tmp_path):
    code = BLOCKS[name]
    if re.search(r"\b(flax|nnx)\b", code):
        pytest.importorskip("flax", reason="the snippet needs the oxmoe[flax] extra")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    # The oxmoe these tests import (the checkout's or the installed one), first on the snippet's path too.
    package_root = str(pathlib.Path(oxmoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"README snippet {name} failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"
