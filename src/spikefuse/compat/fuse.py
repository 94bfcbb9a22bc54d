"""One call to fuse a model written for the step loop: :func:`fuse`.

snnTorch's tutorials build an ``nn.Sequential`` of layers and ``init_hidden=True`` neurons and call it once per
time step; a SpikingJelly single-step model is called the same way. :func:`fuse` wraps such a model in a module
that takes the whole sequence ``[T, B, ...]`` and runs each layer over all T steps at once: a layer whose result
does not depend on the step (a linear or convolution layer, pooling, flattening, an activation) on the T*B
samples in one call, each neuron in one fused call over the T steps; other layers (a BatchNorm in training, whose
statistics are per step, or a module it does not know) one call per step, as the loop runs them. It returns what
the loop returns, stacked over time: the spikes ``[T, B, ...]``, and the states of every step where the loop's
last neuron hands them out (snnTorch's ``output=True``), with their gradients.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

__all__ = ["FusedSteps", "fuse"]

#: Layers whose result for the T*B samples of a sequence is their result per step, stacked: run in one call. In
#: training, Dropout draws a mask per element as it does per step (the same distribution, other random numbers).
_PER_SAMPLE = (
    nn.Linear,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.Dropout,
    nn.modules.conv._ConvNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.ReLU,
    nn.LeakyReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.GELU,
    nn.ELU,
    nn.SiLU,
    nn.Softmax,
    nn.LogSoftmax,
    nn.Upsample,
    nn.ZeroPad2d,
    nn.ConstantPad2d,
)
_BATCHNORM = nn.modules.batchnorm._BatchNorm


class FusedSteps(nn.Sequential):
    """A step-loop model (an ``nn.Sequential``) run over whole sequences: ``forward(x [T, B, ...])`` gives what
    ``torch.stack`` of the loop's per-step outputs gives (a tuple of stacks where the loop's output is a tuple). It
    holds the model's layers themselves, not copies, under the model's names: training it trains them, its
    ``state_dict`` is the model's, and ``snntorch.utils.reset(fused)`` finds its neurons as it finds them in the
    model (snnTorch looks at a network's direct children). The neurons keep their states between calls as in the
    loop: reset them between batches as the loop does (``snntorch.utils.reset``, SpikingJelly's
    ``functional.reset_net``, :func:`spikefuse.nn.reset_states`)."""

    def __init__(self, module: nn.Sequential):
        super().__init__(OrderedDict(module.named_children()))
        self._layers = _layers(self)

    def forward(self, x: torch.Tensor):
        if not isinstance(x, torch.Tensor) or x.ndim < 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"a fused model takes the whole sequence [T, B, ...] (T steps first), got {got}")
        out = x
        for name, layer in self._layers:
            if isinstance(out, tuple):
                raise ValueError(
                    f"layer {name!r} follows a neuron that hands out its states (output=True): in the step loop it "
                    "would receive a tuple too; only the model's last neuron may have output=True"
                )
            out = _run(layer, out)
        return out


def fuse(model: nn.Module) -> FusedSteps:
    """``model``, an ``nn.Sequential`` of layers and neurons written for the step loop (snnTorch's ``init_hidden=True``
    neurons, SpikingJelly's single-step ones, their spikefuse drop-ins), as a :class:`FusedSteps` taking whole
    sequences ``[T, B, ...]``: the same outputs as the loop, stacked over time (bit for bit in float32 where the
    layers' products give the same values for T*B samples in one call as per step), each neuron fused over T.
    snnTorch's and SpikingJelly's own neurons are replaced in ``model`` by their drop-ins first
    (:func:`~spikefuse.compat.use_spikefuse_neurons`); a neuron without one is refused by name."""
    from . import use_spikefuse_neurons

    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"fuse takes an nn.Sequential of layers and neurons, as the step loop calls it, got "
            f"{type(model).__name__}: a model with a forward of its own can call each neuron's fused form itself "
            "(snnTorch's drop-ins: .sequence(x_seq); SpikingJelly's: step_mode='m')"
        )
    swapped = use_spikefuse_neurons(model)
    if swapped.kept:
        name, why = next(iter(swapped.kept.items()))
        raise ValueError(f"cannot fuse layer {name!r}: {why}")
    return FusedSteps(model)


def _layers(module: nn.Sequential, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The layers in call order, nested ``nn.Sequential`` containers opened; each checked now (a neuron that needs
    its states passed cannot sit in a Sequential)."""
    from . import snntorch as cs

    layers = []
    for child_name, child in module.named_children():
        name = f"{prefix}{child_name}"
        if type(child) is nn.Sequential:
            layers += _layers(child, f"{name}.")
            continue
        if isinstance(child, cs._SpikingNeuron) and not child.init_hidden:
            raise ValueError(
                f"layer {name!r} ({type(child).__name__}) has init_hidden=False: in an nn.Sequential it is called "
                "with the input alone, so make it with init_hidden=True (as snnTorch's tutorials do)"
            )
        if getattr(child, "step_mode", "s") != "s":
            raise ValueError(
                f"layer {name!r} has step_mode={child.step_mode!r}: fuse takes a model written for the step loop "
                "(SpikingJelly's step_mode='s'); a multi-step model runs whole sequences already"
            )
        layers.append((name, child))
    return layers


def _reads_the_batch(layer: nn.Module) -> bool:
    """Whether a per-sample layer is set to work along the batch (dimension 0 of a step's input), where the T*B
    samples in one call would mix the steps: a softmax over it (``dim=0``, or None, which torch reads as 0 for most
    ranks), a flattening from it, an unflattening of it."""
    if isinstance(layer, (nn.Softmax, nn.LogSoftmax)):
        return layer.dim is None or layer.dim == 0
    if isinstance(layer, nn.Flatten):
        return layer.start_dim == 0
    if isinstance(layer, nn.Unflatten):
        return layer.dim == 0
    return False


def _run(layer: nn.Module, x: torch.Tensor):
    """``layer`` over all steps of ``x`` ``[T, B, ...]``, as T calls of it stacked give."""
    from . import snntorch as cs
    from . import spikingjelly as cj

    if isinstance(layer, cs._SpikingNeuron):
        if layer.output:  # the loop reads every step's states: step by step, with their gradients
            return layer.sequence(x, record=True)
        return layer.sequence(x)[0]
    if isinstance(layer, cj._BaseNode):
        return layer.multi_step_forward(x)
    per_sample = isinstance(layer, _PER_SAMPLE) and not _reads_the_batch(layer)
    if per_sample or (isinstance(layer, _BATCHNORM) and not layer.training):  # (BN's running statistics: per sample)
        return layer(x.flatten(0, 1)).unflatten(0, x.shape[:2])
    steps = [layer(x_t) for x_t in x.unbind(0)]  # a module of unknown time behaviour: as the loop calls it
    if isinstance(steps[0], tuple):
        return tuple(torch.stack(column) for column in zip(*steps))
    return torch.stack(steps)
