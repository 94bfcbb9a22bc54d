"""What the tests of the zoo transformers (Spike-driven Transformer, QKFormer) share: the head's input, where
spikefuse's model and the zoo's can be compared bit for bit, and gradients compared to rounding."""

import torch


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
