"""Drop-in replacements for the neuron modules of the peer libraries, backed by spikefuse's fused kernels.

- :mod:`spikefuse.compat.spikingjelly`: ``LIFNode``, ``ParametricLIFNode``, ``IFNode`` (SpikingJelly 2.0)
- :mod:`spikefuse.compat.snntorch`: ``Leaky``, ``Synaptic``, ``RLeaky``, ``RSynaptic``, ``Lapicque``, ``Alpha``,
  ``StateLeaky``, ``LinearLeaky`` (snnTorch 1.0)
- :mod:`spikefuse.compat.norse`: ``LIF``, ``LIFCell``, ``LSNN``, ``LSNNCell``, ``LIFRecurrent``, ``LSNNRecurrent``,
  ``LIFRecurrentCell``, ``LSNNRecurrentCell``, ``LI``, ``LICell`` and Norse's neurons as definitions (Norse 1.1)
- :func:`fuse`: a model written for the step loop (an ``nn.Sequential`` of layers and neurons) run over whole
  sequences, each neuron fused over time

Each layer reproduces the peer's spikes and membrane potentials bit for bit in float32 (the definitions of
:mod:`spikefuse.neurons` keep the peers' order of floating-point operations) and its gradients up to rounding.
The peers themselves are not needed: their surrogate objects are recognised by class name and module when given.
``tests/compat`` checks every claim against the installed peers. The submodules are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from torch import nn

__all__ = ["spikingjelly", "snntorch", "norse", "Swapped", "use_spikefuse_neurons", "fuse", "FusedSteps"]

_SUBMODULES = ("spikingjelly", "snntorch", "norse")
#: The neuron base class of each peer whose neurons :func:`use_spikefuse_neurons` replaces.
_NEURON_BASES = {
    "snntorch": ("snntorch", "SpikingNeuron"),
    "spikingjelly": ("spikingjelly.activation_based.neuron", "BaseNode"),
}


class Swapped(NamedTuple):
    """What :func:`use_spikefuse_neurons` did: the replaced neurons' names, and each neuron kept with the reason."""

    replaced: list[str]
    kept: dict[str, str]


def use_spikefuse_neurons(model: nn.Module) -> Swapped:
    """Replace, in place, every snnTorch and SpikingJelly neuron of ``model`` that has a drop-in
    (:func:`spikefuse.compat.snntorch.drop_in_for`, :func:`spikefuse.compat.spikingjelly.drop_in_for`): the same
    settings, step mode and ``state_dict`` keys and values, so the model gives the peer's spikes and loads its
    checkpoints. Returns the names replaced and, for each peer neuron kept, why (no drop-in, or a setting the
    drop-in refuses). The inverse of :func:`spikefuse.compat.spikingjelly.use_spikingjelly_neurons`."""
    bases = []
    for package, (module_name, class_name) in _NEURON_BASES.items():
        try:
            bases.append((package, getattr(importlib.import_module(module_name), class_name)))
        except ImportError:  # a model cannot hold neurons of a library that is not installed
            continue
    if any(isinstance(model, base) for _, base in bases):
        raise ValueError("model is itself a neuron: make its drop-in with spikefuse.compat.<library>.drop_in_for")
    swapped = Swapped([], {})
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            package = next((p for p, base in bases if isinstance(child, base)), None)
            if package is None or not type(child).__module__.startswith(package):  # spikefuse's drop-ins too
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            try:
                setattr(parent, child_name, importlib.import_module(f"{__name__}.{package}").drop_in_for(child))
            except (ValueError, TypeError, NotImplementedError) as err:
                swapped.kept[name] = str(err)
            else:
                swapped.replaced.append(name)
    return swapped


from .fuse import FusedSteps, fuse  # noqa: E402  (it uses use_spikefuse_neurons)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
