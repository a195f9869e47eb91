"""oxmoe's benchmarks: each kernel family timed against plain JAX and the device's ceiling.

    python -m oxmoe.bench [--smoke] [--out DIR] [--only NAME] [--list]

:mod:`oxmoe.bench.timing` holds what every benchmark shares for timing (device
work from Python, the copy ceiling, byte counts, random inputs);
:mod:`oxmoe.bench.cases` a case, its check against plain JAX (:mod:`oxmoe.reference`,
at the models' sizes of :mod:`oxmoe.model_shapes`) and running it;
:mod:`oxmoe.bench.router`, :mod:`oxmoe.bench.permutation`,
:mod:`oxmoe.bench.grouped_gemm` and :mod:`oxmoe.bench.moe` (the whole layer's
training step, and expert parallelism where there are several devices) the
families' cases and goals; :mod:`oxmoe.bench.chart` the chart of a run's results
(matplotlib); its progress on stderr is :mod:`oxmoe._progress` (rich).
"""
