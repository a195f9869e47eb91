"""The benchmark's GPU clock sampling (oxmoe.bench.timing.ClockSampler): nvidia-smi's samples
read into each GPU's median SM clock and power and the share of samples the power cap held, and
nothing sampled where there is no nvidia-smi."""

import shutil

import pytest

from oxmoe.bench import timing

# nvidia-smi --query-gpu=index,clocks.max.sm,power.limit --format=csv,noheader,nounits
LIMITS = "0, 1980, 700.00\n1, 1980, 700.00\n"
# ... --query-gpu=index,clocks.sm,power.draw,clocks_event_reasons.active: GPU 0 at its power
# cap in three samples of four, GPU 1 idle, one row a GPU could not fill.
SAMPLES = """0, 1530, 689.51, 0x0000000000000004
1, 345, 74.02, 0x0000000000000001
0, 1980, 310.20, 0x0000000000000000
0, 1455, 691.03, 0x0000000000000004
1, 345, 73.90, 0x0000000000000001
0, 1500, 690.00, 0x0000000000000005
0, [N/A], [N/A], [N/A]
"""


def test_samples_read_into_each_gpus_medians_and_power_capped_share():
    gpu0, gpu1 = timing.gpu_clocks(LIMITS, SAMPLES)
    assert gpu0 == timing.GpuClocks(index=0, sm_mhz=1515.0, max_sm_mhz=1980.0, power_w=(689.51 + 690.0) / 2,
                                    power_limit_w=700.0, power_capped=0.75, samples=4)
    assert gpu1 == timing.GpuClocks(index=1, sm_mhz=345.0, max_sm_mhz=1980.0, power_w=(74.02 + 73.90) / 2,
                                    power_limit_w=700.0, power_capped=0.0, samples=2)
    assert gpu0.describe() == "GPU 0: SM clock 1515 of 1980 MHz, 690 of 700 W, power-capped in 75% of 4 samples"


def test_only_busy_gpus_are_described():
    sampler = timing.ClockSampler()
    sampler.result = timing.gpu_clocks(LIMITS, SAMPLES)
    assert sampler.describe() == "GPU 0: SM clock 1515 of 1980 MHz, 690 of 700 W, power-capped in 75% of 4 samples"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_nvidia_smi_nothing_is_sampled():
    with timing.ClockSampler() as sampler:
        pass
    assert sampler.result == [] and sampler.describe() == ""
