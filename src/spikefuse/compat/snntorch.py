"""snnTorch 1.0's ``Leaky`` and ``Synaptic`` neurons on spikefuse's fused kernels, over whole sequences.

``Leaky(beta, threshold, spike_grad, reset_mechanism, learn_beta, ...)`` takes snnTorch's constructor arguments,
but **its call convention is multi-step**: ``forward(x_seq, mem=None)`` takes ``[T, ...]`` input and returns
``(spk_seq, mem_last)``, all T steps fused in one call. It gives exactly what this loop over snnTorch's
single-step ``Leaky`` gives::

    lif = snntorch.Leaky(beta=0.9)
    spk = []
    for t in range(T):
        s, mem = lif(x_seq[t], mem)
        spk.append(s)
    spk_seq, mem_last = torch.stack(spk), mem

(spikes and membrane potentials bit for bit in float32/float64, gradients up to rounding; the spikes are
float32 whatever the input dtype, as in snnTorch). snnTorch's own
single-step call is :meth:`Leaky.step` ``(x, mem) -> (spk, mem)``. As in snnTorch, ``mem`` is the pre-reset
membrane potential (``mem > threshold`` spikes, and the reset is applied at the next step); when ``mem`` is not
given, the state kept from the previous call is used (zeros at first, or when the input shape changes), and
:meth:`reset_mem` zeros it. With ``init_hidden=True`` ``forward(x_seq)`` returns only ``spk_seq`` (and
``(spk_seq, mem)`` with ``output=True``), like snnTorch.

``beta`` is clamped to ``[0, 1]`` in every call (a learnable ``beta`` gets its gradient through the clamp). A
per-neuron ``beta`` must broadcast against the neuron shape ``x_seq.shape[2:]`` (or ``x_seq.shape[1:]`` for
``[T, N]`` input), i.e. it may not vary along the batch dimension.

Surrogates (``spike_grad``): snnTorch's ``surrogate.atan(alpha)`` (the default), ``fast_sigmoid(slope)`` and
``sigmoid(slope)`` are recognised by inspecting their closures; spikefuse surrogates are accepted as well.
``surrogate_disable=True`` is supported (zero gradient through the spikes, as snnTorch's bypass).

Not supported (clear errors): ``reset_delay=False``, ``learn_threshold``, a per-neuron ``threshold``,
``inhibition``, ``state_quant``, other snnTorch surrogates (``triangular``, ``heaviside``,
``straight_through_estimator``, ``spike_rate_escape``, ``SFS``, ``SSO``, ``LSO``, custom functions).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .. import params as P
from ..functional import spiking_neuron
from ..neuron_functional import neuron
from ..neurons import CUBA_LIF_MODELS
from ..surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Surrogate, resolve

__all__ = ["Leaky", "Synaptic", "to_surrogate"]

_RESETS = {"subtract": P.SOFT, "zero": P.HARD, "none": P.NONE}
# snnTorch's surrogate factories return closures ``<factory>.<locals>.inner`` over their one parameter.
_SNNTORCH_SURROGATES = {
    "atan": ("alpha", ATan),
    "fast_sigmoid": ("slope", FastSigmoid),
    # snnTorch: slope * exp(-slope*u) / (exp(-slope*u) + 1)^2, the derivative of sigmoid(slope*u) (which
    # snnTorch evaluates as inf/inf = NaN once slope*u < -88 in float32; spikefuse returns 0 there).
    "sigmoid": ("slope", Sigmoid),
}
_SUPPORTED = (
    "snntorch.surrogate.atan(alpha), fast_sigmoid(slope) or sigmoid(slope), or a spikefuse.surrogate instance "
    "(ATan, FastSigmoid, Sigmoid, Triangle, Rectangle)"
)


def _refuse_unsupported(learn_threshold, inhibition, state_quant) -> None:
    """The snnTorch options neither neuron here supports."""
    if learn_threshold:
        raise NotImplementedError("learn_threshold=True is not supported: the threshold is a fixed number here")
    if inhibition:
        raise NotImplementedError("inhibition=True is not supported")
    if state_quant:
        raise NotImplementedError("state_quant is not supported")


def _surrogate_of(spike_grad, surrogate_disable: bool) -> Surrogate:
    """The surrogate a neuron runs with, validated now: snnTorch replaces ``spike_grad`` by a bypass without
    gradient when ``surrogate_disable``."""
    return Rectangle(width=1.0, height=0.0) if surrogate_disable else to_surrogate(spike_grad)


def _float_tensor(value) -> torch.Tensor:
    """``value`` as snnTorch keeps a parameter: a tensor, in the default float dtype unless already floating."""
    t = torch.as_tensor(value)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def _threshold_buffer(threshold) -> torch.Tensor:
    """The fixed threshold as a 0-d tensor of the default float dtype (one number for every neuron)."""
    t = torch.as_tensor(threshold)
    if t.numel() != 1 or t.dtype == torch.bool:
        raise ValueError(f"threshold must be a single number, got {threshold!r}")
    return t.to(torch.get_default_dtype()).reshape(())


def to_surrogate(spike_grad) -> Surrogate:
    """The spikefuse surrogate with the derivative of an snnTorch ``spike_grad`` (``None``: snnTorch's atan())."""
    if spike_grad is None:
        return ATan(2.0)
    if isinstance(spike_grad, (Surrogate, str)):
        return resolve(spike_grad)
    qualname = getattr(spike_grad, "__qualname__", "")
    module = getattr(spike_grad, "__module__", "") or ""
    factory, _, rest = qualname.partition(".<locals>.")
    code = getattr(spike_grad, "__code__", None)
    if module.startswith("snntorch") and rest == "inner" and factory in _SNNTORCH_SURROGATES and code is not None:
        name, cls = _SNNTORCH_SURROGATES[factory]
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in (spike_grad.__closure__ or ()))))
        value = cells.get(name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"spike_grad snntorch.surrogate.{factory}({name}={value!r}): only a finite positive number is supported"
            )
        return cls(float(value))
    raise ValueError(f"unsupported spike_grad {spike_grad!r}: use {_SUPPORTED}")


class Leaky(nn.Module):
    """snnTorch's first-order leaky integrate-and-fire neuron, multi-step (see the module docstring).

    ``mem[t] = beta.clamp(0, 1) * mem[t-1] + x[t] - R[t] * threshold`` with the detached reset
    ``R[t] = (mem[t-1] > threshold)`` for ``reset_mechanism="subtract"``; ``"zero"`` zeroes ``mem[t-1]`` where
    ``R[t]`` instead, ``"none"`` never resets. ``spk[t] = (mem[t] > threshold) * graded_spikes_factor``.

    Extra keyword arguments of ours: ``backend`` (``"auto"``, ``"cpu"``, ``"triton"``, ``"reference"``) and
    ``memory`` (``"potential"`` or ``"recompute"``).
    """

    def __init__(
        self,
        beta,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable: bool = False,
        init_hidden: bool = False,
        inhibition: bool = False,
        learn_beta: bool = False,
        learn_threshold: bool = False,
        reset_mechanism: str = "subtract",
        state_quant=False,
        output: bool = False,
        graded_spikes_factor=1.0,
        learn_graded_spikes_factor: bool = False,
        reset_delay: bool = True,
        *,
        backend: str = "auto",
        memory: str = "potential",
    ):
        super().__init__()
        if not reset_delay:
            raise NotImplementedError(
                "reset_delay=False (snnTorch resets in the same step, through the undetached spike) is not "
                "supported: use the default reset_delay=True"
            )
        _refuse_unsupported(learn_threshold, inhibition, state_quant)
        if reset_mechanism not in _RESETS:
            raise ValueError(f"reset_mechanism must be one of {sorted(_RESETS)}, got {reset_mechanism!r}")
        threshold_t = _threshold_buffer(threshold)
        self.surrogate_disable = bool(surrogate_disable)
        self._surrogate = _surrogate_of(spike_grad, self.surrogate_disable)
        self.spike_grad = spike_grad
        self.init_hidden = bool(init_hidden)
        self.output = bool(output)
        self.reset_mechanism = reset_mechanism
        self.reset_delay = True
        self.learn_beta = bool(learn_beta)
        beta = _float_tensor(beta)
        if learn_beta:
            self.beta = nn.Parameter(beta)
        else:
            self.register_buffer("beta", beta)
        self.register_buffer("threshold", threshold_t)
        factor = _float_tensor(graded_spikes_factor)
        if learn_graded_spikes_factor:
            self.graded_spikes_factor = nn.Parameter(factor)
        else:
            self.register_buffer("graded_spikes_factor", factor)
        self.learn_graded_spikes_factor = bool(learn_graded_spikes_factor)
        self.backend = backend
        self.memory = memory
        self.register_buffer("mem", torch.zeros(0), False)

    # -- snnTorch's state API -----------------------------------------------------------------------------------

    def reset_mem(self):
        """Zero the stored membrane potential (snnTorch's ``reset_mem``)."""
        self.mem = torch.zeros_like(self.mem, device=self.mem.device)
        return self.mem

    init_leaky = reset_mem

    def detach_hidden(self):
        """Cut the stored state from the graph of earlier calls (truncated BPTT)."""
        self.mem = self.mem.detach()

    # -- computation --------------------------------------------------------------------------------------------

    def spec(self) -> P.NeuronSpec:
        return P.NeuronSpec(
            threshold=float(self.threshold),
            v_reset=0.0,
            reset=_RESETS[self.reset_mechanism],
            surrogate=self._surrogate,
            detach_reset=True,  # snnTorch always detaches the reset (mem_reset(...).detach())
            dynamics=P.SNNTORCH,
        )

    def _leak_and_view(self, x_seq: torch.Tensor):
        """``beta.clamp(0, 1)`` as a scalar or per-neuron leak, and the view of ``x_seq`` it applies to."""
        leak = self.beta.clamp(0, 1)
        if leak.numel() == 1:
            return leak.reshape(()), x_seq
        neuron_shape = x_seq.shape[2:] if x_seq.ndim >= 3 else x_seq.shape[1:]
        extra = leak.ndim - len(neuron_shape)  # leading dims of beta beyond the neuron shape: must all be 1
        try:
            fits = torch.broadcast_shapes(leak.shape[max(0, extra) :], neuron_shape) == neuron_shape
        except RuntimeError:
            fits = False
        if not fits or (extra > 0 and any(d != 1 for d in leak.shape[:extra])):
            raise ValueError(
                f"a per-neuron beta of shape {tuple(leak.shape)} must broadcast against the neuron shape "
                f"{tuple(neuron_shape)} of the input {tuple(x_seq.shape)} (it may not vary along time or batch)"
            )
        leak = leak.reshape(leak.shape[max(0, extra) :])
        leak = leak.expand(neuron_shape).reshape(-1)
        view = x_seq.reshape(*x_seq.shape[:2], -1) if x_seq.ndim >= 3 else x_seq
        return leak, view

    def _initial_mem(self, x0: torch.Tensor, mem):
        if mem is not None:
            self.mem = mem
        if self.mem.shape != x0.shape:
            self.mem = torch.zeros_like(x0, device=self.mem.device)
        return self.mem

    def _run(self, x_seq: torch.Tensor, mem):
        if self.init_hidden and mem is not None:
            raise TypeError("`mem` should not be passed as an argument while `init_hidden=True`")
        if x_seq.ndim == 0:
            raise ValueError("x_seq must have a time dimension first: shape [T, ...]")
        mem0 = self._initial_mem(x_seq[0], mem)
        leak, view = self._leak_and_view(x_seq)
        v_init = mem0.reshape(view.shape[1:])
        spikes, state = spiking_neuron(view, leak, self.spec(), v_init=v_init, backend=self.backend, memory=self.memory)
        # snnTorch's surrogates return ``(u > 0).float()``: float32 spikes whatever the input dtype.
        spikes = spikes.reshape(x_seq.shape).float()
        if self.learn_graded_spikes_factor or not bool(self.graded_spikes_factor == 1):
            spikes = spikes * self.graded_spikes_factor
        self.mem = state.reshape(x_seq.shape[1:])
        return spikes, self.mem

    def forward(self, x_seq: torch.Tensor, mem: torch.Tensor | None = None):
        """All T steps of ``x_seq`` (``[T, ...]``) from ``mem`` (pre-reset, ``x_seq.shape[1:]``); returns
        ``(spk_seq, mem_last)`` (``spk_seq`` alone with ``init_hidden=True`` unless ``output=True``)."""
        spikes, mem = self._run(x_seq, mem)
        if self.init_hidden and not self.output:
            return spikes
        return spikes, mem

    def step(self, x: torch.Tensor, mem: torch.Tensor | None = None):
        """One time step, snnTorch's ``Leaky.forward(input_, mem) -> (spk, mem)``."""
        spikes, mem = self._run(x.unsqueeze(0), mem)
        if self.init_hidden and not self.output:
            return spikes[0]
        return spikes[0], mem

    def extra_repr(self):
        return f"reset_mechanism={self.reset_mechanism!r}, backend={self.backend!r}"


class Synaptic(nn.Module):
    """snnTorch's second-order (current-based) LIF neuron, multi-step, on :class:`spikefuse.nn.CubaLIF`'s kernels.

    ``syn[t] = alpha.clamp(0, 1) * syn[t-1] + x[t]``, ``mem[t] = beta.clamp(0, 1) * mem[t-1] + syn[t] - R[t] *
    threshold`` with the detached reset ``R[t] = (mem[t-1] > threshold)`` (``reset_mechanism="subtract"``;
    ``"zero"`` sets the membrane of a step after a spike to 0), ``spk[t] = (mem[t] > threshold)``, in snnTorch's
    order of operations: spikes, ``syn`` and ``mem`` bit for bit what a loop over snnTorch's ``Synaptic`` gives
    (float32 spikes whatever the input dtype, as there), gradients up to rounding.

    Call convention multi-step, as :class:`Leaky`: ``forward(x_seq, syn=None, mem=None)`` takes ``[T, ...]`` and
    returns ``(spk_seq, syn_last, mem_last)`` (``spk_seq`` alone with ``init_hidden=True`` unless ``output=True``);
    states not given continue from the previous call (zeros at first, or when the input shape changes), and
    :meth:`reset_mem` zeros them. :meth:`step` is snnTorch's single-step call.

    ``reset_delay=False`` (the membrane zeroed in the step of the spike; with ``reset_mechanism="zero"`` only) is
    supported: it is what snnTorch's NIR import builds for a CubaLIF node.

    Not supported (clear errors): ``reset_mechanism="none"``, ``reset_delay=False`` with "subtract", ``learn_threshold``,
    per-neuron ``alpha``/``beta``/``threshold``, ``state_quant``, and the surrogates :func:`to_surrogate` does not
    know. Extra keyword argument of ours: ``backend`` ("auto", "cpu", "reference").
    """

    def __init__(
        self,
        alpha,
        beta,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable: bool = False,
        init_hidden: bool = False,
        inhibition: bool = False,
        learn_alpha: bool = False,
        learn_beta: bool = False,
        learn_threshold: bool = False,
        reset_mechanism: str = "subtract",
        state_quant=False,
        output: bool = False,
        reset_delay: bool = True,
        *,
        backend: str = "auto",
    ):
        super().__init__()
        _refuse_unsupported(learn_threshold, inhibition, state_quant)
        if reset_mechanism not in ("subtract", "zero"):
            raise ValueError(f"reset_mechanism must be one of ['subtract', 'zero'] here, got {reset_mechanism!r}")
        if not reset_delay and reset_mechanism != "zero":
            raise NotImplementedError("reset_delay=False is supported with reset_mechanism='zero' (what snnTorch's NIR "
                                      "import builds), not with 'subtract'")  # fmt: skip
        # reset_delay=False zeroes the membrane in the step of the spike: the "hard" CubaLIF
        self.model = CUBA_LIF_MODELS["hard" if not reset_delay else reset_mechanism]
        self.reset_delay = bool(reset_delay)
        self.surrogate_disable = bool(surrogate_disable)
        self._surrogate = _surrogate_of(spike_grad, self.surrogate_disable)
        self.spike_grad = spike_grad
        self.init_hidden = bool(init_hidden)
        self.output = bool(output)
        self.reset_mechanism = reset_mechanism
        self.backend = backend
        for name, value, learn in (("alpha", alpha, learn_alpha), ("beta", beta, learn_beta)):
            t = torch.as_tensor(value)
            if t.numel() != 1 or t.dtype == torch.bool:
                raise ValueError(f"{name} must be a single number here (per-neuron values are not supported), got {value!r}")
            t = _float_tensor(t)  # as snnTorch: a Python number becomes a float32 tensor
            if learn:
                setattr(self, name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)
        self.register_buffer("threshold", _threshold_buffer(threshold))
        self.register_buffer("syn", torch.zeros(0), False)
        self.register_buffer("mem", torch.zeros(0), False)

    def reset_mem(self):
        """Zero the stored states (snnTorch's ``reset_mem``); returns ``(syn, mem)``."""
        self.syn = torch.zeros_like(self.syn, device=self.syn.device)
        self.mem = torch.zeros_like(self.mem, device=self.mem.device)
        return self.syn, self.mem

    init_synaptic = reset_mem

    def detach_hidden(self):
        self.syn, self.mem = self.syn.detach(), self.mem.detach()

    def _run(self, x_seq: torch.Tensor, syn, mem):
        if self.init_hidden and (syn is not None or mem is not None):
            raise TypeError("`syn` and `mem` should not be passed as arguments while `init_hidden=True`")
        if not isinstance(x_seq, torch.Tensor) or x_seq.ndim == 0:
            raise ValueError("x_seq must be a tensor with a time dimension first: shape [T, ...]")
        for name, given in (("syn", syn), ("mem", mem)):
            if given is not None:
                setattr(self, name, given)
            if getattr(self, name).shape != x_seq.shape[1:]:
                setattr(self, name, torch.zeros_like(x_seq[0], device=getattr(self, name).device))
        dtype = x_seq.dtype  # snnTorch's float32 parameters meet the input in its dtype
        # snnTorch detaches the delayed reset; without the delay its in-step reset keeps the spike's gradient
        spikes, (self.syn, mem) = neuron(
            x_seq, self.model, surrogate=self._surrogate, detach_reset=self.reset_delay, state=(self.syn, self.mem),
            return_state=True, backend=self.backend, alpha=self.alpha.clamp(0, 1).to(dtype),
            beta=self.beta.clamp(0, 1).to(dtype), threshold=self.threshold.to(dtype),
        )  # fmt: skip
        if not self.reset_delay:  # snnTorch returns the membrane after the in-step reset (the same op as the model's)
            last = spikes[-1]
            mem = mem - mem * last
        self.mem = mem
        return spikes.float(), self.syn, self.mem

    def forward(self, x_seq: torch.Tensor, syn: torch.Tensor | None = None, mem: torch.Tensor | None = None):
        spikes, syn, mem = self._run(x_seq, syn, mem)
        if self.init_hidden and not self.output:
            return spikes
        return spikes, syn, mem

    def step(self, x: torch.Tensor, syn: torch.Tensor | None = None, mem: torch.Tensor | None = None):
        """One time step, snnTorch's ``Synaptic.forward(input_, syn, mem) -> (spk, syn, mem)``."""
        spikes, syn, mem = self._run(x.unsqueeze(0), syn, mem)
        if self.init_hidden and not self.output:
            return spikes[0]
        return spikes[0], syn, mem

    def extra_repr(self):
        return f"reset_mechanism={self.reset_mechanism!r}, backend={self.backend!r}"
