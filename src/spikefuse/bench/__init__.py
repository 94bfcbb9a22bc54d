"""Benchmarks behind ``spikefuse bench <name>``; each module provides ``add_parser(subparsers)`` and ``run(args)``
(see :mod:`spikefuse.cli`) and writes a markdown table + CSV under ``benchmarks/results/``.

- :mod:`spikefuse.bench.train`: whole-network training, spikefuse neurons vs SpikingJelly 2.0 (the temporal-fusion
  paper's Table 1 on this machine).
"""
