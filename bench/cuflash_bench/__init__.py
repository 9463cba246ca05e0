"""cuflash's benchmark harness: the CPU benchmark and the GPU benchmark.

It lives outside the ``cuflash`` package (a wheel does not ship it) and runs
from a source checkout: ``python -m cuflash bench [--gpu]`` finds it in the
``bench/`` folder beside ``cuflash/``, and ``bench/bench_cpu.py`` /
``bench/bench_gpu.py`` run it directly.

Modules, each importing only those listed before it (and ``cuflash``):

* ``cpu``: the CPU benchmark (NumPy backend against naive NumPy and torch SDPA).
* ``gpu_common``: the FLOP convention, decode shapes, number formatting.
* ``gpu_check``: the float64 oracle and the pass rule a method meets before it is timed.
* ``gpu_methods``: devices, input sets, the dense methods, timing.
* ``gpu_serving_methods``: the KV-cache and varlen methods.
* ``gpu_features``, ``gpu_tiles``, ``gpu_serving``: the logit-features, tiles and serving
  sections (running and printing each).
* ``gpu_report``: header, tables, JSON and plot.
* ``gpu``: options, the grid, decode and host-time sections, and ``main``.
"""
