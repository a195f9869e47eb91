"""The benchmark's nvcc probes (``bench/*.cu``) still build with the command their header gives.

Some include the library's kernels (``kernels/*.cu``), so a kernel's changed signature breaks
them without any other test noticing: ``bench/row_copy_bulk.cu`` stopped building when
``gather_rows`` took an addend, and nobody knew until the probe was next needed. CI has no
nvcc, so the builds run where there is one: on a GPU machine, through ``scripts/gpu-check``.
"""

import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBES = sorted((ROOT / "bench").glob("*.cu"))


def build_command(probe: pathlib.Path) -> list[str]:
    """The probe's one documented build command (a ``//   nvcc ...`` comment line)."""
    commands = [line.removeprefix("//").strip() for line in probe.read_text().splitlines()
                if re.match(r"//\s+nvcc\s", line)]
    assert len(commands) == 1, f"{probe.name} documents {len(commands)} nvcc commands, not one"
    return shlex.split(commands[0])


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_documents_a_build_of_itself(probe):
    command = build_command(probe)
    assert f"bench/{probe.name}" in command
    assert command[command.index("-o") + 1] == probe.stem


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (a CUDA toolkit)")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_builds(probe, tmp_path):
    command = build_command(probe)
    command[command.index("-o") + 1] = str(tmp_path / probe.stem)
    built = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, f"{shlex.join(command)} failed:\n{built.stderr[-4000:]}"
    assert (tmp_path / probe.stem).stat().st_size > 0
