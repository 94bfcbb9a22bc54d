"""Ready-made spiking networks for ``[T, B, C, H, W]`` inputs, returning ``[T, B, num_classes]``.

Every model is built from ordinary layers wrapped in :class:`spikefuse.nn.SeqToBatch` (conv, BatchNorm over the
T*B samples, pooling, linear) and multi-step :class:`spikefuse.nn.LIF` neurons. The last layer is a plain linear
readout (no neuron), so the output is a real-valued score per time step; the training loop averages it over T.

The neuron of every layer is described by one record, ``neuron=``: a :class:`~spikefuse.nn.NeuronFactory` of any
engine neuron (:class:`~spikefuse.nn.LIF`, :class:`~spikefuse.nn.CubaLIF`, :class:`~spikefuse.nn.ALIF`, a user's
model; :func:`cell_neuron` gives ``spikefuse train --cell``'s). ``build_model(..., neuron_backend=
"reference")`` builds the same network on the serial PyTorch reference (for A/B checks against the fused kernels);
:func:`set_neuron_backend` switches an existing model, keeping its weights.

``build_model(..., memory="lean")`` builds the memory-lean form (:func:`spikefuse.nn.to_lean`: BatchNorm fused
with the neurons, recompute in backward, spike inputs saved as bits); ``memory="fused"`` (the default) the plain
form with the fused neuron kernels.

Registry names (see :data:`MODELS`): ``resnet18``, ``resnet34``, ``resnet50`` (SpikingJelly's Spiking-ResNets),
``resnet-tiny`` (width 16, one BasicBlock per stage; the CLI default), ``sew_resnet18``, ``sew_resnet34``,
``sew_resnet_tiny`` (SEW-ResNets, connect function ``cnf``: :mod:`spikefuse.models.sew_resnet`), ``spikformer``,
``spikformer_tiny`` (SpikingJelly's zoo Spikformer: :mod:`spikefuse.models.spikformer`), ``sdt``, ``sdt_tiny``
(its Spike-driven Transformer v1: :mod:`spikefuse.models.spike_driven_transformer`), ``qkformer``,
``qkformer_tiny`` (its QKFormer: :mod:`spikefuse.models.qkformer`), ``liang-small``, ``liang-medium``,
``liang-large`` (the memory-lean BPTT paper's CIFAR-10 nets, Table I), ``srnn`` (recurrent LIF or ALIF layers with a
leaky-integrator readout, for sequences ``[T, B, F]``: :mod:`spikefuse.models.srnn`), ``mlp`` (a feed-forward
spiking MLP for event frames: :mod:`spikefuse.models.mlp`).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..nn import ALIF, LIF, CubaLIF, EngineNeuron, NeuronFactory, to_lean
from ..surrogate import Rectangle

__all__ = [
    "NeuronFactory",
    "PAPER_NEURON",
    "LIANG_NEURON",
    "CUBA_LIF_NEURON",
    "ALIF_NEURON",
    "CELLS",
    "cell_neuron",
    "MODELS",
    "MEMORY_FORMS",
    "build_model",
    "model_names",
    "set_neuron_backend",
    "replace_neurons",
    "neuron_layers",
]


#: The temporal-fusion paper's neuron (Table 1): k = 0.2, threshold 0.3, V_rest 0, sigmoid surrogate alpha 4 (a bare
#: :class:`~spikefuse.nn.LIF`).
PAPER_NEURON = NeuronFactory(LIF)
#: The memory-lean BPTT paper's neuron (Table I): alpha = 0.25 decay, th_f = 0.25, rectangle window (-0.25, 0.75).
LIANG_NEURON = NeuronFactory(LIF, {"decay": 0.25, "threshold": 0.25, "surrogate": Rectangle(width=1.0, height=1.0)})


#: ``--cell cubalif`` of the feed-forward models: synaptic and membrane decays of 0.5 (time constants of about 1.4
#: steps, for the few steps of image classification), threshold 1 (BatchNorm's unit scale), the default surrogate.
CUBA_LIF_NEURON = NeuronFactory(CubaLIF, {"alpha": 0.5, "beta": 0.5, "threshold": 1.0})
#: ``--cell alif`` of the feed-forward models: membrane decay 0.5, baseline threshold 1 (BatchNorm's unit scale),
#: each spike raising it by 0.2, the raise decaying by 0.9 a step (it outlasts the few steps of an image), the default
#: surrogate (:data:`spikefuse.surrogate.DEFAULT`, the paper's Sigmoid(4), as every native neuron's).
ALIF_NEURON = NeuronFactory(ALIF, {"decay": 0.5, "rho": 0.9, "b0": 1.0, "beta": 0.2})
#: The neurons ``spikefuse train --cell`` names: the model's LIF, :data:`CUBA_LIF_NEURON`, :data:`ALIF_NEURON`
#: (the srnn model's recurrent layers of those neurons: :data:`spikefuse.models.srnn.CELLS`).
CELLS = ("lif", "cubalif", "alif")


def cell_neuron(cell: str) -> NeuronFactory | None:
    """The ``neuron=`` of a model for ``cell`` (one of :data:`CELLS`): None for "lif" (the model's own LIF)."""
    if cell not in CELLS:
        raise ValueError(f"unknown cell {cell!r}: use one of {', '.join(CELLS)}")
    return {"lif": None, "cubalif": CUBA_LIF_NEURON, "alif": ALIF_NEURON}[cell]


def neuron_layers(model: nn.Module) -> list[tuple[str, LIF]]:
    """All spikefuse neuron modules of ``model`` with their qualified names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LIF)]


def set_neuron_backend(model: nn.Module, backend: str) -> nn.Module:
    """Switch every spikefuse neuron of ``model`` (the LIF family's and the engine's, recurrent layers included) to
    ``backend`` in place (weights unchanged); returns ``model``."""
    for m in model.modules():
        if isinstance(m, EngineNeuron):
            m.backend = backend
    return model


def replace_neurons(model: nn.Module, factory: Callable[[LIF], nn.Module]) -> int:
    """Replace every spikefuse neuron module by ``factory(old_module)`` in place; returns how many were replaced.

    Used to run the same network with another library's neurons (e.g. SpikingJelly's ``LIFNode``).
    """
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LIF):
                setattr(module, child_name, factory(child))
                count += 1
    return count


# Registry -------------------------------------------------------------------------------------------------------

from .liang import LiangNet, liang_large, liang_medium, liang_small  # noqa: E402
from .mlp import SpikingMLP, mlp  # noqa: E402
from .resnet import SpikingResNet, resnet_tiny, spiking_resnet18, spiking_resnet34, spiking_resnet50  # noqa: E402
from .sew_resnet import SEWResNet, sew_resnet18, sew_resnet34, sew_resnet_tiny  # noqa: E402
from .qkformer import QKFormer, qkformer, qkformer_10_384, qkformer_tiny  # noqa: E402
from .spike_driven_transformer import SpikeDrivenTransformer, sdt, sdt_8_384, sdt_tiny  # noqa: E402
from .spikformer import Spikformer, spikformer, spikformer_cifar10, spikformer_tiny  # noqa: E402
from .srnn import SRNN, srnn  # noqa: E402

#: name -> builder(in_channels, num_classes, neuron=..., neuron_backend=None, **kw)
MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet-tiny": resnet_tiny,
    "resnet18": spiking_resnet18,
    "resnet34": spiking_resnet34,
    "resnet50": spiking_resnet50,
    "sew_resnet_tiny": sew_resnet_tiny,
    "sew_resnet18": sew_resnet18,
    "sew_resnet34": sew_resnet34,
    "spikformer_tiny": spikformer_tiny,
    "spikformer": spikformer,
    "sdt_tiny": sdt_tiny,
    "sdt": sdt,
    "qkformer_tiny": qkformer_tiny,
    "qkformer": qkformer,
    "liang-small": liang_small,
    "liang-medium": liang_medium,
    "liang-large": liang_large,
    "srnn": srnn,
    "mlp": mlp,
}

#: The recurrent models: they take ``memory`` themselves (their layers' memory modes) and sequences ``[T, B, F]``.
RECURRENT_MODELS = ("srnn",)

#: The models whose linear layers take ``sparse=False | True | "auto"`` (:class:`spikefuse.nn.SpikeLinear`'s;
#: ``spikefuse train --sparse``).
SPARSE_MODELS = ("mlp", "srnn")


#: The ``memory`` forms of :func:`build_model`.
MEMORY_FORMS = ("fused", "lean")


def model_names() -> list[str]:
    """The names :func:`build_model` takes."""
    return list(MODELS)


def check_memory_form(memory: str) -> str:
    if memory not in MEMORY_FORMS:
        raise ValueError(
            f"unknown memory form {memory!r}: use 'fused' (nn.BatchNorm + fused neurons that save their potentials) "
            f"or 'lean' (BatchNorm fused with the neurons, recomputed in backward, spike inputs saved as bits)"
        )
    return memory


def build_model(
    name: str,
    in_channels: int,
    num_classes: int,
    neuron: NeuronFactory | None = None,
    neuron_backend: str | None = None,
    memory: str = "fused",
    **kw,
) -> nn.Module:
    """Build the registered model ``name``. ``neuron=None`` uses the model's paper defaults
    (:data:`PAPER_NEURON` for the ResNets, :data:`LIANG_NEURON` for the ``liang-*`` nets, SpikingJelly's for the
    spiking transformers: :data:`~spikefuse.models.spikformer.SPIKFORMER_NEURON` and its kin); a
    :class:`NeuronFactory` builds every neuron of a feed-forward model from it (the recurrent ``srnn`` takes
    ``cell=`` instead); ``neuron_backend``
    overrides ``neuron.backend``; ``memory="lean"`` builds the memory-lean form (:func:`spikefuse.nn.to_lean`),
    same outputs and gradients as ``"fused"``. Extra keywords go to the builder (e.g. ``stem="cifar"`` for the
    ResNets)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")
    check_memory_form(memory)
    if neuron is not None and not isinstance(neuron, NeuronFactory):
        raise TypeError(
            f"neuron= is a spikefuse.nn.NeuronFactory (the neuron of every layer, e.g. NeuronFactory(LIF, "
            f'{{"decay": 0.5}})), got {type(neuron).__name__}'
        )
    if name in RECURRENT_MODELS:
        return MODELS[name](in_channels, num_classes, neuron=neuron, neuron_backend=neuron_backend, memory=memory, **kw)
    model = MODELS[name](in_channels, num_classes, neuron=neuron, neuron_backend=neuron_backend, **kw)
    if memory == "lean":
        to_lean(model)
    return model


__all__ += ["SpikingResNet", "LiangNet", "resnet_tiny", "spiking_resnet18", "spiking_resnet34", "spiking_resnet50"]
__all__ += ["liang_small", "liang_medium", "liang_large", "SRNN", "srnn", "RECURRENT_MODELS"]
__all__ += ["SEWResNet", "sew_resnet18", "sew_resnet34", "sew_resnet_tiny"]
__all__ += ["Spikformer", "spikformer", "spikformer_cifar10", "spikformer_tiny"]
__all__ += ["SpikingMLP", "mlp", "SPARSE_MODELS"]
__all__ += ["SpikeDrivenTransformer", "sdt", "sdt_tiny", "sdt_8_384"]
__all__ += ["QKFormer", "qkformer", "qkformer_tiny", "qkformer_10_384"]
