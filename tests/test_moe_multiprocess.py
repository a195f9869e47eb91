"""The MoE layer across two processes (multi-controller JAX): two Python processes with two
host CPU devices each, joined by jax.distributed (coordinator on localhost) with gloo
collectives, run the expert-parallel layer on the four devices (the experts over all four; two
data shards of two expert shards with the expert weights split over the data axis too); each
checks the gathered result against the dense reference (moe_multiprocess_worker.py does the
work)."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

import devices
import oxmoe

WORKER = pathlib.Path(__file__).with_name("moe_multiprocess_worker.py")
# Both processes compile and run two cases of the layer and the reference on a 2-core machine.
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker_env(gpu: bool = False) -> dict:
    """The test's environment with two host devices per process, CPU only (or the GPUs), and
    oxmoe and the tests' helpers importable."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    env["JAX_PLATFORMS"] = "cuda" if gpu else "cpu"
    package_root = str(pathlib.Path(oxmoe.__file__).resolve().parent.parent)
    paths = [str(WORKER.parent), package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_workers(seed, *, gpu: bool) -> list[str]:
    """Runs the two worker processes; their outputs, once both exited 0."""
    port = free_port()
    extra = ["gpu"] if gpu else []
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(seed), *extra],
                                  env=worker_env(gpu), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    outputs = []
    try:
        for p in processes:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in processes:
            p.kill()
        outputs = [p.communicate()[0] for p in processes]
        raise AssertionError(f"the processes did not finish within {TIMEOUT_S} s (seed={seed}):\n"
                             + "\n".join(f"--- process {i}:\n{out[-4000:]}" for i, out in enumerate(outputs)))
    for i, (p, out) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode} (seed={seed}):\n{out[-6000:]}"
    return outputs


def assert_reported(outputs, cases, seed):
    for i, out in enumerate(outputs):
        for case in cases:
            assert re.search(rf"process {i} {case}: max relative error", out), (
                f"process {i} did not report case {case} (seed={seed}):\n{out[-4000:]}")
        print(out)


def test_expert_parallel_layer_across_two_processes_matches_the_reference(seed):
    assert_reported(run_workers(seed, gpu=False), ("expert4", "data2_expert2_sharded_weights"), seed)


@pytest.mark.gpu
def test_expert_parallel_layer_with_one_process_per_gpu_matches_the_reference(seed):
    if len(devices.gpu_devices()) < 2 or devices.gpu_platform() != "gpu":
        pytest.skip("needs 2 GPUs (one per process)")
    assert_reported(run_workers(seed, gpu=True), ("gpu_expert2",), seed)
