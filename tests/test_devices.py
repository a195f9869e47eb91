"""The test suite's own device choices (devices.py): the sharding tests' meshes come from the
default backend when it has enough devices, else from the eight host CPU devices, which is
what lets them run on a one-GPU machine. Fake devices stand in for a GPU machine here."""

import dataclasses

import jax
import pytest

import devices


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    platform: str
    id: int


def fake(platform, count):
    return [FakeDevice(platform, i) for i in range(count)]


def test_a_default_backend_with_enough_devices_gives_the_mesh():
    gpus, cpus = fake("gpu", 8), fake("cpu", 8)
    assert devices.choose_mesh_devices(gpus, cpus, 8) == gpus
    assert devices.choose_mesh_devices(gpus, cpus, 4) == gpus[:4]


@pytest.mark.parametrize("num_gpus", [1, 2, 4])
def test_a_default_backend_with_too_few_devices_gives_the_host_cpu_devices(num_gpus):
    # One H200 (or a few), JAX_PLATFORMS=cuda,cpu: the mesh is built on the eight host devices.
    cpus = fake("cpu", 8)
    assert devices.choose_mesh_devices(fake("gpu", num_gpus), cpus, 8) == cpus


def test_too_few_devices_anywhere_raises_saying_why():
    with pytest.raises(RuntimeError, match=r"needs 8 devices.*default backend has 1.*CPU backend 1.*XLA_FLAGS"):
        devices.choose_mesh_devices(fake("gpu", 1), fake("cpu", 1), 8)


def test_this_session_can_build_an_eight_device_mesh():
    mesh_devices = devices.mesh_devices(8)
    assert len(set(mesh_devices)) == 8
    assert len({d.platform for d in mesh_devices}) == 1, mesh_devices
    if jax.device_count() < 8:
        assert all(d.platform == "cpu" for d in mesh_devices), mesh_devices


def test_gpu_devices_is_empty_or_gpus():
    gpus = devices.gpu_devices()
    expected = {"cpu"} if devices.gpu_platform() == "cpu" else {"gpu", "cuda", "rocm"}
    assert all(d.platform in expected for d in gpus), gpus
