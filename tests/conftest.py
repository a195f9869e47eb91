"""Test setup: eight host devices for the sharding tests, XLA's code unoptimised on a
CPU-only run, the `gpu` marker, and fresh, reproducible random data.

The XLA flags must be in the environment before jax is imported anywhere, so they are
set at the very top of this file, which pytest imports before any test module. The
device count only concerns the host (CPU) platform: on a GPU machine
(JAX_PLATFORMS=cuda,cpu) the default device is the GPU and the eight CPU devices exist
beside it (see devices.py); XLA's optimisation level stays its default there.
"""

import os
import re

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
_flags = [re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")).strip(),
          _DEVICE_COUNT_FLAG]
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "--xla_backend_optimization_level" not in _flags[0]:
    # A CPU-only run is mostly XLA compiling small programs: without LLVM's optimisation of
    # XLA's own code it takes about 30% less time (oxmoe's handlers are compiled apart).
    _flags.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(_flags).strip()

import hypothesis  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# No example database: it would be written outside tests/; failures print their example anyway.
hypothesis.settings.register_profile(
    "oxmoe",
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
)
hypothesis.settings.load_profile("oxmoe")

SEED_ENV = "OXMOE_TEST_SEED"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a GPU backend (checks oxmoe's CUDA kernels); skipped when jax has no GPU device"
    )


def pytest_report_header(config):
    import jax

    import devices

    gpus = devices.gpu_devices()
    return [
        f"jax {jax.__version__}: default backend {jax.default_backend()} ({jax.device_count()} devices), "
        f"{len(devices.cpu_devices())} cpu devices, gpu: {gpus[0].device_kind if gpus else 'none (gpu tests skip)'}"
    ]


@pytest.fixture(scope="module")
def gpu():
    """The GPU that `gpu`-marked tests run on."""
    import devices

    return devices.gpu_devices()[0]


@pytest.fixture(scope="module")
def cpu():
    """A CPU device, whose results the GPU's are checked against."""
    import jax

    return jax.devices("cpu")[0]


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (os.urandom), or OXMOE_TEST_SEED to replay a failure."""
    value = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("random seed", f"replay with {SEED_ENV}={value} pytest '{item.nodeid}'"))
    return report
