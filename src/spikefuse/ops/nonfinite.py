"""The neurons' refusal of NaN and inf: the public :class:`NonFiniteError`, the reference's own check, and the
error a kernel's flag raises, saying where the value was first."""

from __future__ import annotations

import torch


class NonFiniteError(ValueError):
    """A NaN or an inf reached spiking neurons (their input, a state, a recurrent current): they refuse it, as a
    NaN membrane would stay silent and an infinite one fire at every step, leaving no NaN in the spikes.
    ``where``: what held it, and the first step and neuron where known."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(
            f"spikefuse: {where}; the neurons refuse it: a NaN membrane would stay silent and an infinite one fire "
            "at every later step, leaving no NaN for a training loop's check to see. Find where it comes from (a "
            "diverged loss, a division by zero, a corrupt sample) or clean it first (torch.nan_to_num)"
        )


def check_inputs_finite(x2: torch.Tensor, init, others=(), otherwise: str | None = None) -> None:
    """:func:`refuse_non_finite` where the input ``x2``, a state of ``init`` or a tensor of ``others`` (what
    ``otherwise`` names) holds a NaN or an inf: the reference's check, a pass of its own (the fused kernels flag it
    as they read it). Not while torch.compile traces or a torch.func transform runs, where a value cannot decide
    control flow."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return
    if not all(bool(torch.isfinite(t).all()) for t in (x2, *init, *others)):
        refuse_non_finite(x2, init, otherwise=otherwise)


def refuse_flagged(flags: torch.Tensor, x2: torch.Tensor, init, otherwise: str | None = None) -> None:
    """:func:`refuse_non_finite` where a kernel's ``flags`` (per block or per neuron) are not all 0 and reading them
    costs nothing: CPU tensors (the numba kernels, Triton's interpreter). On a GPU that read would wait for the
    kernel (a host sync per call, which also breaks CUDA graph capture), so there the neurons' spikes carry it
    instead: a neuron that read a NaN or an inf spikes NaN from then on, so the loss becomes NaN, which a training
    loop's check sees."""
    if flags.device.type == "cpu" and bool(flags.ne(0).any()):
        refuse_non_finite(x2, init, otherwise=otherwise)


def refuse_non_finite(x2: torch.Tensor, init, otherwise: str | None = None) -> None:
    """Raise the error of a neuron that read a NaN or an inf (a kernel's flag said so): from the input ``x2``
    (``[T, ...]``) or an initial state in ``init``, saying where first; ``otherwise``: what else it can have come from
    when both are finite."""
    bad = ~torch.isfinite(x2.reshape(x2.shape[0], -1))
    if bad.any():
        t, n = (int(i) for i in bad.nonzero()[0])
        where = f"the input holds NaN or inf (first at step {t}, neuron {n} of {bad.shape[1]})"
    elif any(not bool(torch.isfinite(v).all()) for v in init):
        where = "an initial state (v_init, or a state passed back) holds NaN or inf"
    else:
        where = otherwise or "the input holds NaN or inf"
    raise NonFiniteError(where)
