"""oxmoe's benchmarks: each kernel family timed against plain JAX and the device's ceiling.

    python -m oxmoe.bench [--smoke] [--json PATH] [--only NAME] [--list]

:mod:`oxmoe.bench.timing` holds what every benchmark shares (timing device work
from Python, the copy ceiling, byte counts); :mod:`oxmoe.bench.router` the
router cases.
"""
