"""How oxmoe finds NVRTC (oxmoe._cuda.find_nvrtc), on any machine: $OXMOE_NVRTC first, then
the pip wheel layout under sys.path, then a CUDA toolkit ($CUDA_HOME, ...); when nothing is
found, an error that says where it looked and how to install NVRTC.

Every test builds its own fake layout under tmp_path and points sys.path and the
environment at it, so the machine's real NVRTC (a GPU machine has one) never interferes,
except where noted."""

import glob
import pathlib
import sys

import pytest

from oxmoe import _cuda


def touch(path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def wheel_layout(site: pathlib.Path, sub: str = "cu13") -> pathlib.Path:
    """What the nvidia-cuda-nvrtc wheel installs (CUDA 13: nvidia/cu13/lib); returns the library."""
    lib = site / "nvidia" / sub / "lib"
    for name in ("libnvrtc-builtins.so.13.0", "libnvrtc-builtins.alt.so.13.0", "libnvrtc.alt.so.13"):
        touch(lib / name)
    return touch(lib / "libnvrtc.so.13")


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """No $OXMOE_NVRTC, $CUDA_HOME or $CUDA_PATH; sys.path is one empty site-packages under tmp_path."""
    for var in (_cuda.NVRTC_ENV_VAR, "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site)])
    return site


# -- $OXMOE_NVRTC ---------------------------------------------------------------------


def test_oxmoe_nvrtc_naming_a_missing_file_raises_naming_the_variable(isolated, monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "libnvrtc.so.13"
    monkeypatch.setenv("OXMOE_NVRTC", str(missing))
    with pytest.raises(RuntimeError, match="OXMOE_NVRTC") as raised:
        _cuda.find_nvrtc()
    assert str(missing) in str(raised.value), f"the error does not name the path: {raised.value}"


def test_oxmoe_nvrtc_naming_a_directory_raises(isolated, monkeypatch, tmp_path):
    monkeypatch.setenv("OXMOE_NVRTC", str(tmp_path))
    with pytest.raises(RuntimeError, match="OXMOE_NVRTC"):
        _cuda.find_nvrtc()


def test_oxmoe_nvrtc_naming_a_file_returns_it(isolated, monkeypatch, tmp_path):
    library = touch(tmp_path / "custom" / "libnvrtc.so.13.0.88")
    monkeypatch.setenv("OXMOE_NVRTC", str(library))
    assert _cuda.find_nvrtc() == library


def test_oxmoe_nvrtc_wins_over_a_wheel(isolated, monkeypatch, tmp_path):
    wheel_layout(isolated)
    library = touch(tmp_path / "custom" / "libnvrtc.so.13")
    monkeypatch.setenv("OXMOE_NVRTC", str(library))
    assert _cuda.find_nvrtc() == library


def test_oxmoe_nvrtc_wins_over_the_environment_of_this_machine(monkeypatch, tmp_path):
    # sys.path and the toolkit variables as they are (a GPU machine has a real NVRTC).
    library = touch(tmp_path / "libnvrtc.so.13")
    monkeypatch.setenv("OXMOE_NVRTC", str(library))
    assert _cuda.find_nvrtc() == library


# -- the pip wheel and the toolkit ------------------------------------------------------


@pytest.mark.parametrize("sub", ["cu13", "cuda_nvrtc"])
def test_the_wheel_library_is_found_on_sys_path_not_its_builtins(isolated, sub):
    library = wheel_layout(isolated, sub)
    assert _cuda.find_nvrtc() == library


def test_the_wheel_is_found_in_any_sys_path_entry(isolated, monkeypatch, tmp_path):
    other_site = tmp_path / "venv" / "site-packages"
    library = wheel_layout(other_site)
    monkeypatch.setattr(sys, "path", [str(isolated), "", str(other_site)])
    assert _cuda.find_nvrtc() == library


@pytest.mark.parametrize("lib", ["lib64", "targets/x86_64-linux/lib"])
def test_a_toolkit_in_cuda_home_is_found_when_no_wheel_is_installed(isolated, monkeypatch, tmp_path, lib):
    toolkit = tmp_path / "cuda-13.0"
    touch(toolkit / lib / "libnvrtc-builtins.so.13.0")
    library = touch(toolkit / lib / "libnvrtc.so.13")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert _cuda.find_nvrtc() == library


def test_a_toolkit_in_cuda_path_is_found_when_no_wheel_is_installed(isolated, monkeypatch, tmp_path):
    toolkit = tmp_path / "toolkit"
    library = touch(toolkit / "lib64" / "libnvrtc.so.13")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    assert _cuda.find_nvrtc() == library


def test_the_wheel_wins_over_cuda_home(isolated, monkeypatch, tmp_path):
    library = wheel_layout(isolated)
    touch(tmp_path / "cuda" / "lib64" / "libnvrtc.so.13")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert _cuda.find_nvrtc() == library


# -- nothing found ---------------------------------------------------------------------


@pytest.fixture
def only_tmp_path_exists(monkeypatch, tmp_path):
    """The file system as the lookup sees it (glob) holds nothing outside tmp_path: the
    usual toolkit locations (/usr/local/cuda*) may hold a real NVRTC on this machine."""
    real_glob = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern, **kw: real_glob(pattern, **kw)
                        if pattern.startswith(str(tmp_path)) else [])


def test_nothing_found_raises_saying_where_it_looked_and_how_to_install(isolated, only_tmp_path_exists,
                                                                         monkeypatch, tmp_path):
    cuda_home = tmp_path / "cuda-home"
    (cuda_home / "lib64").mkdir(parents=True)  # a toolkit without NVRTC
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    wheel_dir = isolated / "nvidia" / "cu13" / "lib"
    touch(wheel_dir / "libnvrtc-builtins.so.13.0")  # the builtins alone are not NVRTC
    touch(wheel_dir / "libnvrtc.alt.so.13")

    with pytest.raises(RuntimeError) as raised:
        _cuda.find_nvrtc()
    message = str(raised.value)
    assert "NVRTC" in message, message
    assert "pip install nvidia-cuda-nvrtc" in message, f"the error does not say how to install NVRTC: {message}"
    assert "OXMOE_NVRTC" in message, f"the error does not mention the override variable: {message}"
    for place in (wheel_dir, isolated / "nvidia" / "cuda_nvrtc" / "lib", cuda_home / "lib64", "/usr/local/cuda/lib64"):
        assert str(place) in message, f"the error does not list {place} among the places it looked: {message}"


def test_nothing_found_with_an_empty_environment_still_lists_the_usual_toolkit(isolated, only_tmp_path_exists,
                                                                              monkeypatch):
    monkeypatch.setattr(sys, "path", [])
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-nvrtc") as raised:
        _cuda.find_nvrtc()
    assert "/usr/local/cuda/lib64" in str(raised.value), str(raised.value)
