"""What the tests of the zoo transformers (Spike-driven Transformer, QKFormer) share: the head's input, where
spikefuse's model and the zoo's can be compared bit for bit, and gradients compared to rounding."""

import torch

from spikefuse.nn import LIF, NeuronFactory
from spikefuse.surrogate import Sigmoid


def head_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """The inputs of ``model.head``, one per call from now on (the zoo's head reads the mean over T of ours)."""
    seen = []
    model.head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    return seen


def assert_gradients_close(grads: dict, reference: dict) -> None:
    """Each gradient within 1e-5 of its largest element, or of 1e-6 of the largest gradient of all: a gradient that
    is 0 up to rounding (a conv bias before BatchNorm, which removes the mean) is rounding noise."""
    assert grads.keys() == reference.keys()
    noise = 1e-6 * max(float(g.abs().max()) for g in reference.values())
    for name, g in grads.items():
        err, scale = float((g - reference[name]).abs().max()), float(reference[name].abs().max())
        assert err <= max(1e-5 * scale, noise), f"{name}: max abs diff {err:.3e}, scale {scale:.3e}"


def assert_same_neurons_give_the_zoo_models_outputs(make_zoo, ours_from, image, from_spikingjelly_state_dict) -> None:
    """The zoo built by ``make_zoo(**neuron)`` with spikefuse's SpikingJelly ``LIFNode`` (``decay_input=False``:
    spikefuse's LIF with decay 1/2) against ``ours_from(zoo, neuron=...)`` on ``image()``: the same head input bit for
    bit, outputs and gradients (input and parameters, mapped by ``from_spikingjelly_state_dict``) to rounding."""
    from spikefuse.compat.spikingjelly import LIFNode  # after the caller's importorskip of SpikingJelly

    neuron = dict(tau=2.0, decay_input=False, v_threshold=1.0, detach_reset=True, surrogate_function=Sigmoid(4.0))
    zoo = make_zoo(spiking_neuron=LIFNode, **neuron)
    ours = ours_from(
        zoo, neuron=NeuronFactory(LIF, dict(decay=0.5, threshold=1.0, surrogate=Sigmoid(4.0), detach_reset=True))
    )
    zoo_head, ours_head = head_inputs(zoo), head_inputs(ours)
    xz, xo = image().requires_grad_(), image().requires_grad_()
    yz, yo = zoo(xz), ours(xo).mean(0)
    assert torch.equal(ours_head[0].mean(0), zoo_head[0])
    torch.testing.assert_close(yo, yz, rtol=1e-6, atol=1e-6)
    yz.square().sum().backward()
    yo.square().sum().backward()
    assert_gradients_close({"input": xo.grad}, {"input": xz.grad})
    zoo_grads = from_spikingjelly_state_dict({n: p.grad for n, p in zoo.named_parameters()})
    assert_gradients_close({n: p.grad for n, p in ours.named_parameters()}, zoo_grads)
