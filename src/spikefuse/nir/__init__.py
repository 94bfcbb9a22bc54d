"""Export spikefuse networks to NIR (the Neuromorphic Intermediate Representation) and load NIR graphs.

- :func:`export` ``(model, sample_input, dt)`` -> ``nir.NIRGraph``: traces the network on a sample input.
- :func:`load` ``(graph_or_path, dt, lif_form=...)`` -> :class:`NIRNetwork`: spiking neurons on the fused kernels.
- :func:`fold_batchnorm` ``(model, sample_input)``: folds BatchNorm (no NIR node) into the layer before it.

Write and read files with ``nir.write(path, graph)`` / ``nir.read(path)``; :func:`load` also takes a path.
The parameter mappings, what is rejected and why, and what matches the peers bit for bit: ``docs/nir.md``.
Needs the ``nir`` package (``pip install nir``).
"""

from __future__ import annotations

try:
    import nir  # noqa: F401  (absolute import: the NIR package, not this module)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("spikefuse.nir needs the nir package: pip install nir") from error

from ._export import export, fold_batchnorm
from ._load import LIF_FORMS, NIRNetwork, load
from .modules import (
    CubaLeakyIntegrator,
    CubaLIFNode,
    EulerLIF,
    Integrator,
    LeakyIntegrator,
    Scale,
    SumPool2d,
    Threshold,
)

__all__ = [
    "export",
    "load",
    "fold_batchnorm",
    "NIRNetwork",
    "LIF_FORMS",
    "EulerLIF",
    "CubaLIFNode",
    "CubaLeakyIntegrator",
    "Integrator",
    "LeakyIntegrator",
    "Scale",
    "SumPool2d",
    "Threshold",
]
