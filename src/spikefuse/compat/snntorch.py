"""snnTorch 1.0's ``Leaky``, ``Synaptic``, ``RLeaky``, ``RSynaptic``, ``Lapicque`` and ``Alpha`` on spikefuse's neuron engine, called as snnTorch's
are, with a fused call over whole sequences beside; and its ``StateLeaky`` and ``LinearLeaky``.

Each module takes snnTorch's constructor arguments and keeps its tensors under snnTorch's names (its saved
``state_dict`` loads, strict), and ``forward`` is snnTorch's one step::

    lif = spikefuse.compat.snntorch.RLeaky(beta=0.9, linear_features=256)
    spk, mem = lif.reset_mem()                      # or nothing: zeros at the first call, as in snnTorch
    for t in range(T):
        spk, mem = lif(cur[t], spk, mem)

giving snnTorch's spikes and states bit for bit (float32; gradients up to rounding). As in snnTorch, states not
given continue from the module's own (kept between calls; zeros at first or when the input's shape changes),
``reset_mem()`` zeros them, ``init_hidden=True`` keeps them inside and returns the spikes only (``output=True``: the
states too), and the spikes are float32 whatever the input's dtype. Parameters keep their float32 values with a
float16/bfloat16 input, as snnTorch's do: ``Leaky`` gives snnTorch's spikes and membranes bit for bit there too;
snnTorch keeps ``Synaptic``'s current in the input's dtype, rounded every step, where the drop-in keeps it float32.
The fused path is one method, ``sequence(x_seq, *state)``: all T steps of ``x_seq`` ``[T, ...]`` in one call, the
spikes ``[T, ...]`` and the final states returned (``(spk_seq, mem)``, ``(spk_seq, syn, mem)``), the same values as
the loop above.

Where snnTorch is importable the drop-ins have snnTorch's classes as second bases (its constructor is not run),
so snnTorch's own utilities treat them as its neurons: ``snntorch.utils.reset(net)``,
``snntorch.Leaky.reset_hidden()`` and ``detach_hidden()``. Setting ``reset_mechanism`` after construction does what it does in snnTorch, which picks its
state update in the constructor: it changes only the reset in the step of a spike of ``reset_delay=False`` (mixtures
no neuron definition holds are refused by name).

A state kept from a batch whose backward has run (a training loop without ``reset_mem()`` between batches) makes
the next backward fail with an error that says to reset it; :func:`spikefuse.nn.reset_states` resets every neuron
of a network.

``reset_delay=False`` (the membrane reset in the step of its spike) runs snnTorch's arithmetic of it, with its
gradient through the spike (:data:`~spikefuse.neurons.SNNTORCH_NO_DELAY_MODELS`,
:data:`~spikefuse.neurons.SYNAPTIC_NO_DELAY_MODELS`); snnTorch 1.0's ``RSynaptic`` computes that reset into a
variable it then drops, so its ``reset_delay=False`` gives the delayed reset's spikes and states, and so does ours.

``RLeaky`` and ``RSynaptic`` take snnTorch's recurrent convolution (``conv2d_channels``, ``kernel_size``: an
``nn.Conv2d`` of the previous spikes, inputs ``[B, C, H, W]`` per step); no layer fuses it over time, so their
``sequence`` runs the steps one call each. ``StateLeaky`` and ``LinearLeaky`` take whole sequences, as snnTorch's.
With a recurrent ``nn.Linear`` they take ``sparse=True`` (ours): the fused layer's recurrent current summed from the
weight rows of the neurons that spiked (:func:`spikefuse.recurrent`'s ``sparse``), the same spikes as snnTorch's
except at threshold ties; the one-step path keeps snnTorch's product.

``sequence`` takes time first, ``[T, B, ...]``: a batch-first input given the states of a step, or one step of the
loop's shape, is refused by the sizes of its states (:func:`spikefuse.data.time_major` collates time first).

Not supported (clear errors): ``inhibition``, ``state_quant``, and surrogates :func:`to_surrogate` does not know.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings

import torch
from torch import nn

from ..neuron_functional import neuron
from ..ops import check_backend_name
from ..ops.engine import step as one_step
from ..ops.engine.reference import _Fire
from ..neurons import (
    ALPHA_MODELS,
    CUBA_LIF_MODELS,
    LAPICQUE_MODELS,
    LIF_MODELS,
    RLEAKY_ZERO,
    SNNTORCH_NO_DELAY_MODELS,
    SYNAPTIC_NO_DELAY_MODELS,
    neuron_spec,
)
from ..recurrent_functional import recurrent
from ..surrogate import ATan, FastSigmoid, Rectangle, Sigmoid, Surrogate, resolve
from ..validation import check_memory_mode

__all__ = [
    "Leaky",
    "Synaptic",
    "RLeaky",
    "RSynaptic",
    "Lapicque",
    "Alpha",
    "StateLeaky",
    "LinearLeaky",
    "to_surrogate",
]

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


def _surrogate_of(spike_grad, surrogate_disable: bool) -> Surrogate:
    """The surrogate a neuron runs with, validated now: snnTorch replaces ``spike_grad`` by a bypass without
    gradient when ``surrogate_disable``."""
    return Rectangle(width=1.0, height=0.0) if surrogate_disable else to_surrogate(spike_grad)


def _float_tensor(value) -> torch.Tensor:
    """``value`` as snnTorch keeps a parameter: a tensor, in the default float dtype unless already floating."""
    t = torch.as_tensor(value)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


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


_RESET_VALUES = {"subtract": 0, "zero": 1, "none": 2}  # snnTorch's reset_mechanism_val

# the engine's states by snnTorch's names; others (r) start at 0
_KEPT = {"v": "mem", "i": "syn", "syn_exc": "syn_exc", "syn_inh": "syn_inh"}


def _engine_states(model, states: dict, shape, dtype=None) -> tuple:
    """``model``'s initial states ``shape`` from snnTorch's kept ``states`` (in ``dtype``, if given); ``r``, the reset
    signal of the ``reset_delay=False`` models, is 0 (their first step sees the kept membrane as it is)."""
    kept = {k: states[name].reshape(shape) for k, name in _KEPT.items() if k in model.states}
    if dtype is not None:
        kept = {k: v.to(dtype) for k, v in kept.items()}
    return tuple(kept[k] if k in kept else torch.zeros_like(kept["v"]) for k in model.states)


def _refuse_unsupported(inhibition, state_quant) -> None:
    if inhibition:
        raise NotImplementedError("inhibition=True is not supported")
    if state_quant:
        raise NotImplementedError("state_quant is not supported")


def _checked_reset(mechanism: str) -> str:
    if mechanism not in _RESET_VALUES:
        raise ValueError(f"reset_mechanism must be one of {sorted(_RESET_VALUES)}, got {mechanism!r}")
    return mechanism


def _peer_class(name: str) -> tuple:
    """snnTorch's class ``name``, as a second base of its drop-in, where snnTorch is importable: snnTorch's own
    utilities find neurons by ``isinstance`` and ``SpikingNeuron.instances`` (``snntorch.utils.reset(net)``, the
    classes' ``reset_hidden``/``detach_hidden``), and with the drop-ins among them they reset those too. The drop-in's
    own methods come first; snnTorch's constructor is not run."""
    try:
        import snntorch
    except ImportError:
        return ()
    return (getattr(snntorch, name),)


def _kept_states(model, final, shape) -> dict:
    """snnTorch's kept states of ``shape`` from ``model``'s final ones: tensors of their own, not views, since
    snnTorch's ``detach_hidden`` detaches them in place (which torch refuses for a view)."""
    return {_KEPT[k]: v.reshape(shape).clone() for k, v in zip(model.states, final) if k in _KEPT}


class _SpikingNeuron(nn.Module):
    """What snnTorch's neurons share (its ``SpikingNeuron``): the threshold, graded spikes factor and reset mechanism
    under snnTorch's names (buffers, or parameters to learn), the surrogate, the states kept between calls
    (``STATES``, snnTorch's order of ``forward``'s arguments; ``forward`` returns the spikes and ``RETURNED``), and
    the calls: ``forward`` one step, :meth:`sequence` all steps of a sequence."""

    STATES: tuple[str, ...] = ()
    RETURNED: tuple[str, ...] = ()
    NO_DELAY: tuple[str, ...] = ()  # the reset mechanisms whose reset_delay=False has a reset in the step of a spike

    def __init__(
        self,
        threshold,
        spike_grad,
        surrogate_disable,
        init_hidden,
        inhibition,
        learn_threshold,
        reset_mechanism,
        state_quant,
        output,
        graded_spikes_factor,
        learn_graded_spikes_factor,
        backend,
        memory,
    ):
        nn.Module.__init__(self)  # not super(): snnTorch's class may follow in the MRO (_peer_class), unconstructed
        _refuse_unsupported(inhibition, state_quant)
        self._made_with = self._reset_mechanism = _checked_reset(reset_mechanism)
        self.surrogate_disable = bool(surrogate_disable)
        self._surrogate = _surrogate_of(spike_grad, self.surrogate_disable)
        self.spike_grad = spike_grad
        self.init_hidden = bool(init_hidden)
        self.output = bool(output)
        check_backend_name(backend)  # refused now, not at the first call
        check_memory_mode(memory)
        self.backend = backend
        self.memory = memory
        self._keep("threshold", threshold, learn_threshold)
        self._keep("graded_spikes_factor", graded_spikes_factor, learn_graded_spikes_factor)
        self.register_buffer("reset_mechanism_val", torch.as_tensor(_RESET_VALUES[reset_mechanism]))
        for name in self.STATES:
            self.register_buffer(name, torch.zeros(0), persistent=False)
        peer = next((c for c in type(self).__mro__ if c.__module__.startswith("snntorch")), None)
        if peer is not None:  # as snnTorch's constructor does: its utilities walk this list
            peer.instances.append(self)

    @property
    def reset_mechanism(self) -> str:
        return self._reset_mechanism

    @reset_mechanism.setter
    def reset_mechanism(self, value: str) -> None:
        """As snnTorch's setter: checked, ``reset_mechanism_val`` follows, and the dynamics change as snnTorch's do
        (:meth:`_mechanism`)."""
        self._reset_mechanism = _checked_reset(value)
        self.reset_mechanism_val = torch.as_tensor(_RESET_VALUES[value], device=self.reset_mechanism_val.device)

    def _mechanism(self) -> tuple[str, bool]:
        """``(reset mechanism, delayed)`` of the dynamics snnTorch runs. snnTorch picks its state update, and with it
        the delayed reset, in the constructor: a ``reset_mechanism`` set later changes only the reset in the step of
        a spike of ``reset_delay=False``, which then runs with the constructor's state update. Where that mixture is
        none of the neuron's definitions (a zero reset made, another set), it is refused rather than run otherwise.
        """
        made, now = self._made_with, self._reset_mechanism
        if self.reset_delay or now not in self.NO_DELAY:
            return made, True
        # after a zero reset in the step the membrane never starts a step above threshold: no delayed reset is left
        if now == made or (made, now) == ("subtract", "zero"):
            return now, False
        raise NotImplementedError(
            f"{type(self).__name__} made with reset_mechanism={made!r} and set to {now!r} with reset_delay=False: "
            f"snnTorch then runs the {made!r} state update with a {now!r} reset in the step of a spike, which "
            f"spikefuse does not define; make the neuron with reset_mechanism={now!r}"
        )

    def _keep(self, name: str, value, learn: bool) -> None:
        """A number of snnTorch's as it keeps it: a tensor (float32 for a Python number), learnable or a buffer."""
        t = _float_tensor(value)
        if learn:
            setattr(self, name, nn.Parameter(t))
        else:
            self.register_buffer(name, t)

    # -- snnTorch's state API -----------------------------------------------------------------------------------

    def reset_mem(self):
        """Zero the kept states (snnTorch's ``reset_mem``); returns them."""
        for name in self.STATES:
            setattr(self, name, torch.zeros_like(getattr(self, name)))
        states = tuple(getattr(self, name) for name in self.STATES)
        return states[0] if len(states) == 1 else states

    def detach_hidden(self) -> None:
        """Cut the kept states from the graph of earlier calls (truncated BPTT)."""
        for name in self.STATES:
            setattr(self, name, getattr(self, name).detach())

    # -- calls --------------------------------------------------------------------------------------------------

    def _states(self, step: torch.Tensor, given) -> list:
        """Keep the ``given`` states (None: the kept one); a kept state of another shape than a step's input becomes
        zeros, as snnTorch initializes its states lazily."""
        if len(given) > len(self.STATES):
            raise TypeError(
                f"{type(self).__name__} takes the input and at most {len(self.STATES)} states "
                f"({', '.join(self.STATES)}), got {len(given)}"
            )
        if self.init_hidden and any(g is not None for g in given):
            raise TypeError(f"with init_hidden=True {type(self).__name__} keeps its states: pass the input only")
        kept = self._buffers
        for name, g in zip(self.STATES, given):
            if g is not None:
                self._set_state(name, g)
        for name in self.STATES:
            if kept[name].shape != step.shape:
                kept[name] = torch.zeros_like(step, device=kept[name].device)
        return [kept[name] for name in self.STATES]

    def _set_state(self, name: str, value) -> None:
        """Keep state ``name`` (a buffer, written as ``nn.Module.__setattr__`` would, at a tenth of its cost: this
        runs at every step of a loop)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: the state {name} must be a tensor, got {type(value).__name__}")
        self._buffers[name] = value

    def _sequence(self, x_seq: torch.Tensor, given) -> torch.Tensor:
        if not isinstance(x_seq, torch.Tensor) or x_seq.ndim < 2:
            raise ValueError(f"{type(self).__name__}: x_seq must be a tensor [T, ...] of T steps of inputs")
        states = self._states(x_seq[0], given)
        spikes, final = self._run(x_seq, dict(zip(self.STATES, states)))
        for name, value in final.items():
            setattr(self, name, value)
        return spikes

    def _step(self, x: torch.Tensor, given) -> torch.Tensor:
        """One step as snnTorch's users call it: one autograd node (:mod:`spikefuse.ops.engine.step`) where that
        path takes the call, else the fused call of one step."""
        if not one_step.takes(self.backend, x):
            return self._sequence(x.unsqueeze(0), given)[0]
        states = dict(zip(self.STATES, self._states(x, given)))
        spikes, final = self._run_step(x, states)
        for name, value in final.items():
            self._set_state(name, value)
        return spikes

    def forward(self, input_: torch.Tensor, *state):
        """One time step: snnTorch's ``forward(input_, *states)``."""
        if not isinstance(input_, torch.Tensor) or input_.ndim == 0:
            raise ValueError(f"{type(self).__name__}: the input must be a tensor of at least one dimension")
        spk = self._step(input_, state)
        if self.init_hidden and not self.output:
            return spk
        return (spk, *(getattr(self, name) for name in self.RETURNED))

    def sequence(self, x_seq: torch.Tensor, *state, record: bool = False):
        """All T steps of ``x_seq`` ``[T, ...]`` in one fused call, from ``state`` (the states ``forward`` takes; the
        kept ones where not given): ``(spikes [T, ...], *final states)``, what T calls of ``forward`` give.

        ``record=True``: every step's states instead of the final ones, ``(spikes [T, ...], *states [T, ...])``,
        with their gradients (a loss on the membranes of every step). The fused kernels hand out the last step's
        states only, so this runs the steps one call each (each one autograd node, see :meth:`forward`)."""
        self._check_layout(x_seq, state)
        if not record:
            spikes = self._sequence(x_seq, state)
            return (spikes, *(getattr(self, name) for name in self.RETURNED))
        rows = []
        for t, x_t in enumerate(x_seq.unbind(0)):
            spk = self._step(x_t, state if t == 0 else ())
            rows.append((spk, *(getattr(self, name) for name in self.RETURNED)))
        return tuple(torch.stack(column) for column in zip(*rows))

    def _check_layout(self, x_seq, given) -> None:
        """Refuse an ``x_seq`` whose states show it is not ``[T, B, ...]`` (a step of a loop zeroes states of another
        shape, as snnTorch's does; here they would be dropped silently): a state given, or kept from the steps of a
        loop, of one step's shape ``[B, ...]`` where ``x_seq`` is that step itself, or is batch-first ``[B, T,
        ...]``. Without such a state the sizes cannot tell time from batch."""
        name = type(self).__name__
        if not isinstance(x_seq, torch.Tensor) or x_seq.ndim < 2:
            raise ValueError(f"{name}: x_seq must be a tensor [T, ...] of T steps of inputs")
        step, shape = x_seq.shape[1:], tuple(x_seq.shape)
        kept = [self._buffers[k] for k in self.STATES[len(given) :]]
        for i, (state, g) in enumerate(zip(self.STATES, [*given, *kept])):
            if not isinstance(g, torch.Tensor) or g.numel() == 0 or g.shape == step:
                continue
            if g.shape == x_seq.shape:
                raise ValueError(
                    f"{name}.sequence takes the steps [T, ...] of a sequence, got {shape}: the shape of one step, "
                    f"as the state {state} is; call forward(x) for one step, or sequence(x.unsqueeze(0))"
                )
            if i >= len(given):  # a kept state of another batch: zeroed, as a step of the loop zeroes it
                continue
            if g.shape == (shape[0], *shape[2:]):
                raise ValueError(
                    f"{name}.sequence takes time first, [T, B, ...]; x_seq {shape} looks batch-first [B, T, ...]: the "
                    f"state {state} given is {tuple(g.shape)}, a step of batch {shape[0]}. Pass x.transpose(0, 1), "
                    "or collate the DataLoader's [T, ...] samples with spikefuse.data.time_major"
                )
            raise ValueError(
                f"{name}.sequence: the state {state} given is {tuple(g.shape)}, not the shape of a step "
                f"{tuple(step)} of x_seq {shape} [T, ...]"
            )

    def _clamped(self, name: str) -> torch.Tensor:
        """snnTorch's ``<name>.clamp(0, 1)`` of a decay: made at each call for a parameter (its gradient goes through
        the clamp), once per tensor and version for a buffer in eager mode (a step of a loop asks at every step)."""
        value = getattr(self, name)
        if isinstance(value, nn.Parameter) or torch.compiler.is_compiling():  # (a compiled graph clamps in it)
            return value.clamp(0, 1)
        key = (name, id(value), value._version)
        made = self.__dict__.setdefault("_clamped_made", {})
        if made.get(name, (None,))[0] != key:
            made[name] = (key, value.clamp(0, 1))
        return made[name][1]

    def _dynamics(self) -> tuple:
        """``(model, detach_reset, {engine parameter: (snnTorch's name, value)})``: the neuron definition of the
        dynamics snnTorch runs, with its parameters."""
        raise NotImplementedError

    def _run(self, x_seq, states):
        """The steps of ``x_seq`` ``[T, ...]`` from snnTorch's ``states``: ``(spikes, final states by name)``."""
        model, detach_reset, params = self._dynamics()
        view = _neuron_view(x_seq)
        spikes, final = neuron(
            view,
            model,
            surrogate=self._surrogate,
            detach_reset=detach_reset,
            state=_engine_states(model, states, view.shape[1:]),
            return_state=True,
            backend=self.backend,
            memory=self.memory,
            **{p: _per_neuron(value, x_seq, name) for p, (name, value) in params.items()},
        )
        return self._graded(spikes.reshape(x_seq.shape)), _kept_states(model, final, x_seq.shape[1:])

    def _run_step(self, x, states):
        """One step of ``x`` from snnTorch's ``states``: ``(spikes, new states by name)``."""
        model, detach_reset, params = self._dynamics()
        out = one_step.step(
            neuron_spec(model, self._surrogate, detach_reset),
            x,
            _step_params(model, params, x),
            _engine_states(model, states, x.shape),
        )
        return self._graded(out[0]), {_KEPT[k]: v for k, v in zip(model.states, out[1:]) if k in _KEPT}

    def _graded(self, spikes: torch.Tensor) -> torch.Tensor:
        """snnTorch's spikes: float32 whatever the input's dtype, times the graded spikes factor."""
        if spikes.dtype != torch.float32:
            spikes = spikes.float()
        factor = self.graded_spikes_factor
        # a factor of 1 is skipped in eager mode (a pass less); a compiled graph multiplies, the same values,
        # rather than break on reading the factor
        if torch.compiler.is_compiling() or isinstance(factor, nn.Parameter) or not self._unit_factor(factor):
            spikes = spikes * factor
        return spikes

    def _unit_factor(self, factor: torch.Tensor) -> bool:
        """Whether ``factor`` is 1: read once per tensor and version (a read is a host sync, per step of a loop)."""
        key = (id(factor), factor._version)
        if self.__dict__.get("_unit_factor_of", (None,))[0] != key:
            self.__dict__["_unit_factor_of"] = (key, bool(factor == 1))
        return self.__dict__["_unit_factor_of"][1]

    def extra_repr(self) -> str:
        return f"reset_mechanism={self.reset_mechanism!r}, backend={self.backend!r}, memory={self.memory!r}"


def _per_neuron(value: torch.Tensor, x_seq: torch.Tensor, name: str) -> torch.Tensor:
    """A parameter as the engine takes it for the view ``[T, B, N]`` (or ``[T, N]``) of ``x_seq``: one value, or one
    per neuron (broadcast to the neuron shape ``x_seq.shape[2:]``, ``[1:]`` for ``[T, N]``; not along the batch)."""
    value = value.to(torch.promote_types(value.dtype, x_seq.dtype))  # snnTorch's float32 beta stays so for half input
    if value.numel() == 1:
        return value.reshape(())
    neurons = x_seq.shape[2:] if x_seq.ndim >= 3 else x_seq.shape[1:]
    extra = value.ndim - len(neurons)
    try:
        fits = torch.broadcast_shapes(value.shape[max(0, extra) :], neurons) == neurons
    except RuntimeError:
        fits = False
    if not fits or (extra > 0 and any(d != 1 for d in value.shape[:extra])):
        raise ValueError(
            f"a per-neuron {name} of shape {tuple(value.shape)} must broadcast against the neuron shape "
            f"{tuple(neurons)} of the input {tuple(x_seq.shape)} (it may not vary along time or batch)"
        )
    return value.reshape(value.shape[max(0, extra) :]).expand(neurons).reshape(-1)


def _neuron_view(x_seq: torch.Tensor) -> torch.Tensor:
    """``x_seq`` as ``[T, B, N]`` (``[T, N]`` as it is): the neurons flattened after the batch."""
    return x_seq if x_seq.ndim == 2 else x_seq.reshape(*x_seq.shape[:2], -1)


def _step_params(model, params: dict, x: torch.Tensor) -> list:
    """``model``'s parameters in its order for one step of ``x`` (its default where ``params`` has none): one value,
    or one per neuron shaped to broadcast against ``x`` (checked as :func:`_per_neuron` checks)."""
    out = []
    for p in model.params:
        if p not in params:
            out.append(_default(model, p, torch.promote_types(x.dtype, torch.float32), x.device))
            continue
        name, value = params[p]
        if value.ndim == 0 and value.dtype == torch.promote_types(value.dtype, x.dtype):  # one value, as it is
            out.append(value)
            continue
        value = _per_neuron(value, x.unsqueeze(0), name)
        out.append(value if value.ndim == 0 else value.reshape(x.shape[1:] if x.ndim >= 2 else x.shape))
    return out


@functools.cache
def _default(model, param: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``model``'s default value of ``param`` as a tensor, made once."""
    return torch.tensor(dict(model.defaults)[param], dtype=dtype, device=device)


class Leaky(_SpikingNeuron, *_peer_class("Leaky")):
    """snnTorch's first-order leaky integrate-and-fire neuron: ``mem[t] = beta.clamp(0, 1) * mem[t-1] + x[t] - R[t] *
    threshold`` with the detached reset ``R[t] = (mem[t-1] > threshold)`` ("subtract"; "zero" zeroes ``mem[t-1]``
    where ``R[t]``, "none" never resets), ``spk[t] = (mem[t] > threshold) * graded_spikes_factor``. ``forward(input_,
    mem=None) -> (spk, mem)``; see the module docstring. Extra keyword arguments of ours: ``backend`` and
    ``memory`` (as :func:`spikefuse.neuron`)."""

    STATES = RETURNED = ("mem",)
    NO_DELAY = ("subtract", "zero")
    _MODELS = {
        "subtract": LIF_MODELS[("snntorch", "soft")],
        "zero": LIF_MODELS[("snntorch", "hard")],
        "none": LIF_MODELS[("snntorch", "none")],
    }

    def __init__(
        self,
        beta,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        init_hidden=False,
        inhibition=False,
        learn_beta=False,
        learn_threshold=False,
        reset_mechanism="subtract",
        state_quant=False,
        output=False,
        graded_spikes_factor=1.0,
        learn_graded_spikes_factor=False,
        reset_delay=True,
        *,
        backend="auto",
        memory="potential",
    ):
        super().__init__(
            threshold,
            spike_grad,
            surrogate_disable,
            init_hidden,
            inhibition,
            learn_threshold,
            reset_mechanism,
            state_quant,
            output,
            graded_spikes_factor,
            learn_graded_spikes_factor,
            backend,
            memory,
        )
        self.reset_delay = bool(reset_delay)
        self._keep("beta", beta, learn_beta)

    init_leaky = _SpikingNeuron.reset_mem

    def _dynamics(self):
        mechanism, delayed = self._mechanism()
        model = self._MODELS[mechanism] if delayed else SNNTORCH_NO_DELAY_MODELS[("leaky", mechanism)]
        # snnTorch detaches the delayed reset; the in-step one keeps the spike's gradient
        return model, delayed, {"decay": ("beta", self._clamped("beta")), "threshold": ("threshold", self.threshold)}


class Lapicque(_SpikingNeuron, *_peer_class("Lapicque")):
    """snnTorch's Lapicque neuron, a leaky integrator written as an RC circuit: ``mem[t] = x[t] * R * (1 / (R * C)) *
    time_step + (1 - time_step / (R * C)) * mem[t-1] - R[t] * threshold`` with the detached reset ``R[t] =
    (mem[t-1] > threshold)`` ("subtract"; "zero" zeroes the whole membrane of a step after a spike; "none"), in
    snnTorch's order of operations (:data:`~spikefuse.neurons.LAPICQUE_MODELS`). As in snnTorch, ``beta`` or two of
    ``beta``, ``R`` and ``C`` are given and the missing ones derived (the buffers ``beta``, ``R``, ``C`` and
    ``time_step``, snnTorch's values), and the step reads ``R``, ``C`` and ``time_step``, not ``beta``.
    ``forward(input_, mem=None) -> (spk, mem)``, ``sequence(x_seq, mem=None) -> (spk_seq, mem)``.
    ``learn_beta=True`` is refused: snnTorch's step does not read beta (its ``C`` derived from a learnable beta holds
    the graph of that derivation, which a second backward cannot run through)."""

    STATES = RETURNED = ("mem",)
    reset_delay = True  # snnTorch's Lapicque has only the reset of the step after a spike

    def __init__(
        self,
        beta=False,
        R=False,
        C=False,
        time_step=1,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        init_hidden=False,
        inhibition=False,
        learn_beta=False,
        learn_threshold=False,
        reset_mechanism="subtract",
        state_quant=False,
        output=False,
        *,
        backend="auto",
        memory="potential",
    ):
        if learn_beta:
            raise NotImplementedError(
                "learn_beta=True is not supported: snnTorch's Lapicque does not read beta in its step (R, C and "
                "time_step are fixed); use Leaky(learn_beta=True) for a learnable decay"
            )
        super().__init__(
            threshold,
            spike_grad,
            surrogate_disable,
            init_hidden,
            inhibition,
            learn_threshold,
            reset_mechanism,
            state_quant,
            output,
            1.0,
            False,
            backend,
            memory,
        )
        for name, value in zip(("beta", "time_step", "R", "C"), _lapicque_constants(beta, R, C, time_step)):
            self.register_buffer(name, value)

    init_lapicque = _SpikingNeuron.reset_mem

    def _dynamics(self):
        params = {p: (p, getattr(self, p)) for p in ("R", "C", "time_step", "threshold")}
        return LAPICQUE_MODELS[self._mechanism()[0]], True, params  # snnTorch's reset is detached


class Alpha(_SpikingNeuron, *_peer_class("Alpha")):
    """snnTorch's Alpha neuron: an excitatory and an inhibitory current of the same input, ``syn_exc[t] =
    alpha.clamp(0, 1) * syn_exc[t-1] + x[t]``, ``syn_inh[t] = beta.clamp(0, 1) * syn_inh[t-1] - x[t]``, and the
    membrane ``mem[t] = tau * (syn_exc[t] + syn_inh[t])`` with ``tau = log(alpha) / (log(beta) - log(alpha)) + 1``,
    ``spk[t] = (mem[t] > threshold)``; snnTorch's detached reset of the step after a spike ("zero", its default:
    all three states of that step zeroed; "subtract"; "none"), in its order of operations
    (:data:`~spikefuse.neurons.ALPHA_MODELS`). ``forward(input_, syn_exc=None, syn_inh=None, mem=None) -> (spk,
    syn_exc, syn_inh, mem)``, ``sequence(x_seq, ...) -> (spk_seq, syn_exc, syn_inh, mem)``. As snnTorch, ``alpha``
    is kept clamped and must exceed ``beta``, and ``beta`` may not be 1. ``learn_alpha=True`` is refused: snnTorch's
    Alpha cannot be made with it (its constructor assigns the clamped alpha, a plain tensor, over the parameter)."""

    STATES = RETURNED = ("syn_exc", "syn_inh", "mem")
    reset_delay = True  # snnTorch's Alpha has only the reset of the step after a spike

    def __init__(
        self,
        alpha,
        beta,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        init_hidden=False,
        inhibition=False,
        learn_alpha=False,
        learn_beta=False,
        learn_threshold=False,
        reset_mechanism="zero",
        state_quant=False,
        output=False,
        *,
        backend="auto",
        memory="potential",
    ):
        if learn_alpha:
            raise NotImplementedError(
                "learn_alpha=True is not supported: snnTorch's Alpha cannot be made with it (its constructor assigns "
                "the clamped alpha over the parameter, a TypeError), so there are no dynamics of it to match"
            )
        super().__init__(
            threshold,
            spike_grad,
            surrogate_disable,
            init_hidden,
            inhibition,
            learn_threshold,
            reset_mechanism,
            state_quant,
            output,
            1.0,
            False,
            backend,
            memory,
        )
        self._keep("beta", beta, learn_beta)
        self._keep("alpha", _float_tensor(alpha).clamp(0, 1), False)  # snnTorch keeps it clamped
        if (self.alpha <= self.beta).any():
            raise ValueError("alpha must be greater than beta.")
        if (self.beta == 1).any():
            raise ValueError(
                "beta cannot be '1' otherwise ZeroDivisionError occurs: tau_alpha = log(alpha)/log(beta) - "
                "log(alpha) + 1"
            )

    init_alpha = _SpikingNeuron.reset_mem

    def _dynamics(self):
        alpha, beta = self._clamped("alpha"), self._clamped("beta")
        tau = torch.log(alpha) / (torch.log(beta) - torch.log(alpha)) + 1  # snnTorch's, in torch (see ALPHA_MODELS)
        params = {"alpha": alpha, "beta": beta, "tau": tau, "threshold": self.threshold}
        return ALPHA_MODELS[self._mechanism()[0]], True, {k: (k, v) for k, v in params.items()}  # (detached reset)


def _lapicque_constants(beta, R, C, time_step) -> tuple:
    """``(beta, time_step, R, C)`` as snnTorch's Lapicque derives them, with its tensor operations (its cases on the
    truth of the arguments; the values of a saved ``state_dict`` replace them when loaded)."""
    time_step = torch.as_tensor(time_step)
    beta = torch.as_tensor(beta)
    if not beta and not (R and C):
        raise ValueError("Either beta or 2 of beta, R and C must be specified as an input argument.")
    if beta and R and C:
        raise ValueError("give beta, or two of beta, R and C, not all three (snnTorch's Lapicque then makes no R, C)")
    if not beta:
        return torch.exp(torch.ones(1) * (-time_step / (R * C))), time_step, torch.as_tensor(R), torch.as_tensor(C)
    if not (R or C):
        R = torch.as_tensor(1)
        return beta, time_step, R, time_step / (R * torch.log(1 / beta))
    if R:
        return beta, time_step, torch.as_tensor(R), time_step / (R * torch.log(1 / beta))
    C = torch.as_tensor(C)
    return beta, time_step, time_step / (C * torch.log(1 / beta)), C


class Synaptic(_SpikingNeuron, *_peer_class("Synaptic")):
    """snnTorch's second-order (current-based) LIF neuron: ``syn[t] = alpha.clamp(0, 1) * syn[t-1] + x[t]``,
    ``mem[t] = beta.clamp(0, 1) * mem[t-1] + syn[t] - R[t] * threshold`` with the detached reset ``R[t] = (mem[t-1] >
    threshold)`` ("subtract"; "zero" zeroes the membrane of a step after a spike; "none"), ``spk[t] = (mem[t] >
    threshold)``, in snnTorch's order of operations. ``forward(input_, syn=None, mem=None) -> (spk, syn, mem)``.
    ``reset_delay=False``: the membrane reset in the step of its spike (``reset_mechanism="zero"`` with it is what
    snnTorch's NIR import builds for a CubaLIF node)."""

    STATES = RETURNED = ("syn", "mem")
    NO_DELAY = tuple(SYNAPTIC_NO_DELAY_MODELS)

    def __init__(
        self,
        alpha,
        beta,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        init_hidden=False,
        inhibition=False,
        learn_alpha=False,
        learn_beta=False,
        learn_threshold=False,
        reset_mechanism="subtract",
        state_quant=False,
        output=False,
        reset_delay=True,
        *,
        backend="auto",
        memory="potential",
    ):
        super().__init__(
            threshold,
            spike_grad,
            surrogate_disable,
            init_hidden,
            inhibition,
            learn_threshold,
            reset_mechanism,
            state_quant,
            output,
            1.0,
            False,
            backend,
            memory,
        )
        self.reset_delay = bool(reset_delay)
        self._keep("beta", beta, learn_beta)
        self._keep("alpha", alpha, learn_alpha)

    init_synaptic = _SpikingNeuron.reset_mem

    @property
    def model(self):
        """The neuron definition of the dynamics snnTorch runs (:meth:`_mechanism`)."""
        mechanism, delayed = self._mechanism()
        return CUBA_LIF_MODELS[mechanism] if delayed else SYNAPTIC_NO_DELAY_MODELS[mechanism]

    def _dynamics(self):
        model = self.model
        # snnTorch detaches the delayed reset; the in-step one keeps the spike's gradient
        return (
            model,
            model in CUBA_LIF_MODELS.values(),
            {
                "alpha": ("alpha", self._clamped("alpha")),
                "beta": ("beta", self._clamped("beta")),
                "threshold": ("threshold", self.threshold),
            },
        )


def _pair(kernel_size) -> tuple[int, int]:
    """A kernel size as ``nn.Conv2d`` reads it: one int for both sides, or two."""
    return (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)


def _check_recurrent_conv(channels, kernel_size) -> None:
    """snnTorch's arguments of a recurrent ``nn.Conv2d``: both given, and an odd kernel (snnTorch pads
    ``kernel_size // 2``, so an even kernel's current has another shape than the spikes, which snnTorch fails to add
    at the first call)."""
    if channels is None or kernel_size is None:
        raise TypeError("conv2d_channels and kernel_size must both be given for a recurrent nn.Conv2d")
    if not isinstance(channels, int) or channels < 1:
        raise ValueError(f"conv2d_channels must be a positive int (the spikes' channels), got {channels!r}")
    sizes = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
    if len(sizes) not in (1, 2) or any(not isinstance(k, int) or k < 1 or k % 2 == 0 for k in sizes):
        raise ValueError(
            f"kernel_size must be an odd positive int or two (snnTorch pads kernel_size // 2 to keep the spikes' "
            f"shape), got {kernel_size!r}"
        )


def _check_sparse(sparse, linear: bool, backend: str) -> None:
    """``sparse`` of a recurrent drop-in: False, or True where the sparse recurrent product runs (a recurrent
    ``nn.Linear``, the CPU backend or the reference)."""
    if sparse is not True and sparse is not False:
        raise ValueError(f"sparse must be True or False, got {sparse!r}")
    if sparse and not linear:
        raise ValueError(
            "sparse=True sums the recurrent nn.Linear's weight rows of the neurons that spiked: it takes "
            "linear_features, not V (one to one: nothing to skip) or conv2d_channels (a convolution)"
        )
    if sparse and backend not in ("auto", "cpu", "reference"):
        raise ValueError(f"sparse=True runs on the CPU backend (or the reference), got backend={backend!r}")


class RecurrentOneToOne(nn.Module):
    """snnTorch's one-to-one recurrent connection: each neuron's own spike times ``V`` (the module holds ``V`` as
    snnTorch's does, so a saved ``recurrent.V`` loads)."""

    def __init__(self, V):
        super().__init__()
        self.V = V

    def forward(self, x):
        return x * self.V


class _Recurrent(_SpikingNeuron):
    """What ``RLeaky`` and ``RSynaptic`` share: the recurrent connection under snnTorch's names (an ``nn.Linear``
    or ``nn.Conv2d`` ``recurrent``, or ``V`` and :class:`RecurrentOneToOne`), and the fused recurrent layer
    (:func:`spikefuse.recurrent`) over steps of ``[..., N]`` inputs (a convolution's steps run one call each)."""

    MODELS: dict = {}  # by reset mechanism
    NO_DELAY_MODELS: dict = {}  # by reset mechanism, those of reset_delay=False where it changes anything

    def __init__(
        self,
        V,
        all_to_all,
        linear_features,
        conv2d_channels,
        kernel_size,
        learn_recurrent,
        reset_delay,
        sparse,
        **common,
    ):
        convolution = conv2d_channels is not None or kernel_size is not None
        _check_sparse(sparse, all_to_all and not convolution, common["backend"])
        if all_to_all and linear_features is not None and convolution:
            raise TypeError(
                "linear_features cannot be given with conv2d_channels or kernel_size: the recurrent connection is "
                "an nn.Linear or an nn.Conv2d"
            )
        if all_to_all and linear_features is not None and (not isinstance(linear_features, int) or linear_features < 1):
            raise ValueError(f"linear_features must be a positive int (the number of neurons), got {linear_features!r}")
        if all_to_all and convolution:
            _check_recurrent_conv(conv2d_channels, kernel_size)
        elif all_to_all and not linear_features:
            raise TypeError(
                "all_to_all=True needs linear_features (the number of neurons) for the recurrent nn.Linear, or "
                "conv2d_channels and kernel_size for a recurrent nn.Conv2d"
            )
        if not all_to_all and (linear_features is not None or convolution):
            raise TypeError("all_to_all=False takes V, not linear_features, conv2d_channels or kernel_size")
        super().__init__(graded_spikes_factor=1.0, learn_graded_spikes_factor=False, **common)  # not an option here
        self.all_to_all = bool(all_to_all)
        self.learn_recurrent = bool(learn_recurrent)
        self.linear_features, self.conv2d_channels, self.kernel_size = linear_features, conv2d_channels, kernel_size
        self.reset_delay = bool(reset_delay)
        self.sparse = sparse
        if self.all_to_all and convolution:
            sizes = _pair(kernel_size)
            # snnTorch's: "same" padding of the odd kernel, the spikes' shape kept
            self.recurrent = nn.Conv2d(conv2d_channels, conv2d_channels, sizes, padding=(sizes[0] // 2, sizes[1] // 2))
        elif self.all_to_all:
            self.recurrent = nn.Linear(linear_features, linear_features)
        else:
            self._keep("V", V, learn_recurrent)
            self.recurrent = RecurrentOneToOne(self.V)
        if not learn_recurrent:
            for p in self.recurrent.parameters():
                p.requires_grad = False

    def _weights(self, neurons: int):
        """The recurrent weight ``[N, N]`` or ``[N]`` and bias of the fused layer."""
        if self.all_to_all:
            return self.recurrent.weight, self.recurrent.bias
        if self.V.numel() == 1:
            return self.V.reshape(1).expand(neurons), None
        if self.V.shape[-1:] != (neurons,) or any(d != 1 for d in self.V.shape[:-1]):
            raise ValueError(f"V of shape {tuple(self.V.shape)}: one value, or one per neuron ({neurons})")
        return self.V.reshape(neurons), None

    def _dynamics(self):
        mechanism, delayed = self._mechanism()
        model = (self.MODELS if delayed else self.NO_DELAY_MODELS)[mechanism]
        params = {
            name: (attr, self._clamped(attr) if attr != "threshold" else self.threshold) for name, attr in self.PARAMS
        }
        return model, delayed, params  # snnTorch's in-step reset keeps the spike's gradient

    def _run(self, x_seq, states):
        if self.conv2d_channels is not None:
            return self._run_steps(x_seq, states)
        if x_seq.ndim < 2:
            raise ValueError(f"{type(self).__name__}: the input must hold the neurons in its last dimension")
        neurons = x_seq.shape[-1]
        view = x_seq.reshape(x_seq.shape[0], math.prod(x_seq.shape[1:-1]), neurons)  # (-1 is ambiguous for 0 neurons)
        weight, bias = self._weights(neurons)
        return self._fused(x_seq, view, view, weight, bias, states["spk"].reshape(view.shape[1:]), states)

    def _fused(self, x_seq, view, neurons_of, weight, bias, fed_back, states):
        """The fused recurrent layer over ``view`` ``[T, B, N]`` of ``x_seq``, its first step's recurrent current
        ``weight`` and ``bias`` of the ``fed_back`` spikes, the parameters per neuron of ``neurons_of`` (a view of
        ``x_seq``): ``(spikes of x_seq's shape, final states by name)``."""
        model, detach_reset, params = self._dynamics()
        state = (*_engine_states(model, states, view.shape[1:], view.dtype), fed_back.to(view.dtype))
        spikes, final = recurrent(
            view,
            model,
            weight.to(view.dtype),
            None if bias is None else bias.to(view.dtype),
            surrogate=self._surrogate,
            detach_reset=detach_reset,
            state=state,
            return_state=True,
            backend=self.backend,
            memory=self.memory,
            sparse=self.sparse,
            **{p: _per_neuron(value, neurons_of, name) for p, (name, value) in params.items()},
        )
        spikes = self._graded(spikes.reshape(x_seq.shape))
        return spikes, {"spk": spikes[-1], **_kept_states(model, final, x_seq.shape[1:])}

    def _run_steps(self, x_seq, states):
        """A recurrent convolution's steps, one call each: no layer fuses a convolution of the previous spikes over
        time."""
        spikes = []
        for x in x_seq.unbind(0):
            spk, states = (self._run_step if one_step.takes(self.backend, x) else self._run_conv_step)(x, states)
            spikes.append(spk)
        return torch.stack(spikes), states

    def _run_conv_step(self, x, states):
        """One step of a recurrent convolution where the step path does not take it (compiled, another backend, a
        large layer): the fused layer over one step, fed the convolution's current of the kept spikes as its
        previous spikes through a one-to-one weight of ones (``1 * current`` is exact), so that the current joins
        the membrane where snnTorch adds it."""
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__} with conv2d_channels: the input must be [B, C, H, W] per step")
        view = x.reshape(1, x.shape[0], -1)
        current = self.recurrent(states["spk"]).reshape(view.shape[1:])
        ones = torch.ones(view.shape[2], dtype=view.dtype, device=view.device)
        spikes, final = self._fused(x.unsqueeze(0), view, x.unsqueeze(0), ones, None, current, states)
        return spikes[0], final

    def _run_step(self, x, states):
        if not self.all_to_all:
            self._weights(x.shape[-1])  # the fused layer's checks of V against the neurons
        model, detach_reset, params = self._dynamics()
        out = one_step.step(
            neuron_spec(model, self._surrogate, detach_reset),
            x,
            _step_params(model, params, x),
            _engine_states(model, states, x.shape),
            x_rec=self.recurrent(states["spk"]),  # snnTorch's call: the recurrent current of the kept spikes
        )
        spikes = self._graded(out[0])
        return spikes, {"spk": spikes, **{_KEPT[k]: v for k, v in zip(model.states, out[1:]) if k in _KEPT}}


class RLeaky(_Recurrent, *_peer_class("RLeaky")):
    """snnTorch's recurrent leaky integrate-and-fire neuron: :class:`Leaky`'s membrane plus the recurrent current of
    the previous spikes, ``mem[t] = ((beta.clamp(0, 1) * mem[t-1] + x[t]) + recurrent(spk[t-1])) - R[t] * threshold``
    ("zero": the whole membrane of a step after a spike is 0), with ``recurrent`` an ``nn.Linear(N, N)``
    (``all_to_all``, ``linear_features=N``) or ``V * spk`` (``all_to_all=False``). ``forward(input_, spk=None,
    mem=None) -> (spk, mem)``, ``sequence(x_seq, spk=None, mem=None) -> (spk_seq, mem)``."""

    STATES, RETURNED = ("spk", "mem"), ("mem",)
    MODELS = {
        "subtract": LIF_MODELS[("snntorch", "soft")],
        "zero": RLEAKY_ZERO,
        "none": LIF_MODELS[("snntorch", "none")],
    }
    NO_DELAY_MODELS = {k: SNNTORCH_NO_DELAY_MODELS[("rleaky", k)] for k in ("subtract", "zero")}
    NO_DELAY = tuple(NO_DELAY_MODELS)
    PARAMS = (("decay", "beta"), ("threshold", "threshold"))

    def __init__(
        self,
        beta,
        V=1.0,
        all_to_all=True,
        linear_features=None,
        conv2d_channels=None,
        kernel_size=None,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        init_hidden=False,
        inhibition=False,
        learn_beta=False,
        learn_threshold=False,
        learn_recurrent=True,
        reset_mechanism="subtract",
        state_quant=False,
        output=False,
        reset_delay=True,
        *,
        backend="auto",
        memory="potential",
        sparse=False,
    ):
        super().__init__(
            V,
            all_to_all,
            linear_features,
            conv2d_channels,
            kernel_size,
            learn_recurrent,
            reset_delay,
            sparse,
            threshold=threshold,
            spike_grad=spike_grad,
            surrogate_disable=surrogate_disable,
            init_hidden=init_hidden,
            inhibition=inhibition,
            learn_threshold=learn_threshold,
            reset_mechanism=reset_mechanism,
            state_quant=state_quant,
            output=output,
            backend=backend,
            memory=memory,
        )
        self._keep("beta", beta, learn_beta)

    init_rleaky = _SpikingNeuron.reset_mem


class RSynaptic(_Recurrent, *_peer_class("RSynaptic")):
    """snnTorch's recurrent current-based LIF neuron: :class:`Synaptic` with the recurrent current added to the
    synaptic current, ``syn[t] = (alpha.clamp(0, 1) * syn[t-1] + x[t]) + recurrent(spk[t-1])``. ``forward(input_,
    spk=None, syn=None, mem=None) -> (spk, syn, mem)``, ``sequence(x_seq, spk=None, syn=None, mem=None) -> (spk_seq,
    syn, mem)``. :meth:`reset_mem` zeros the kept spikes too (snnTorch's ``utils.reset`` leaves them).
    ``reset_delay=False`` gives the delayed reset's spikes and states, as snnTorch 1.0's (whose in-step reset is
    computed into a local variable and dropped)."""

    STATES, RETURNED = ("spk", "syn", "mem"), ("syn", "mem")
    MODELS = {k: CUBA_LIF_MODELS[k] for k in ("subtract", "zero", "none")}
    PARAMS = (("alpha", "alpha"), ("beta", "beta"), ("threshold", "threshold"))

    def __init__(
        self,
        alpha,
        beta,
        V=1.0,
        all_to_all=True,
        linear_features=None,
        conv2d_channels=None,
        kernel_size=None,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        init_hidden=False,
        inhibition=False,
        learn_alpha=False,
        learn_beta=False,
        learn_threshold=False,
        learn_recurrent=True,
        reset_mechanism="subtract",
        state_quant=False,
        output=False,
        reset_delay=True,
        *,
        backend="auto",
        memory="potential",
        sparse=False,
    ):
        super().__init__(
            V,
            all_to_all,
            linear_features,
            conv2d_channels,
            kernel_size,
            learn_recurrent,
            reset_delay,
            sparse,
            threshold=threshold,
            spike_grad=spike_grad,
            surrogate_disable=surrogate_disable,
            init_hidden=init_hidden,
            inhibition=inhibition,
            learn_threshold=learn_threshold,
            reset_mechanism=reset_mechanism,
            state_quant=state_quant,
            output=output,
            backend=backend,
            memory=memory,
        )
        self._keep("beta", beta, learn_beta)
        self._keep("alpha", alpha, learn_alpha)

    init_rsynaptic = _SpikingNeuron.reset_mem


def _filtered_membrane(x: torch.Tensor, tau: torch.Tensor, truncation) -> torch.Tensor:
    """snnTorch's ``StateLeaky`` membrane of ``x`` ``[T, B, C]``, in its operations: each channel's input convolved
    causally with ``exp(-t / tau)`` (the last ``truncation`` taps, or all T), by a depthwise ``conv1d``."""
    steps, _, channels = x.shape
    x = x.permute(1, 2, 0)
    size = steps if truncation is None else min(truncation, steps)
    taps = torch.arange(size, device=x.device).view(1, 1, size)
    if tau.shape in ((), (1,)):
        kernel = torch.exp(-taps / tau.to(x.device)).expand(channels, 1, size)
    else:
        kernel = torch.exp(-taps / tau.to(x.device).view(channels, 1, 1))
    padded = nn.functional.pad(x, (size - 1, 0))
    return nn.functional.conv1d(padded, torch.flip(kernel, dims=[-1]), groups=channels).permute(2, 0, 1)


def _check_sequence(x, name: str, features: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} takes a whole sequence [T, B, {features}], got {got}")


class _DecayRecursion(torch.autograd.Function):
    """``v[t] = decay * v[t-1] + x[t]`` from ``v[-1] = 0`` over ``x`` ``[T, B, C]`` (``decay`` one value or one per
    channel): one node for all T steps, the backward the same recursion reversed."""

    @staticmethod
    def forward(ctx, x, decay):
        v = torch.empty_like(x)
        previous = torch.zeros_like(x[0])
        for t in range(x.shape[0]):
            previous = v[t] = decay * previous + x[t]
        ctx.save_for_backward(v, decay)
        return v

    @staticmethod
    def backward(ctx, grad_v):
        v, decay = ctx.saved_tensors
        grad_x = torch.empty_like(grad_v)
        carried = torch.zeros_like(grad_v[0])
        for t in range(grad_v.shape[0] - 1, -1, -1):
            carried = grad_x[t] = grad_v[t] + decay * carried
        grad_decay = None
        if ctx.needs_input_grad[1]:  # d v[t] / d decay = v[t-1] + decay * d v[t-1] / d decay
            per_channel = (grad_x[1:] * v[:-1]).sum((0, 1))
            grad_decay = per_channel.sum().reshape(decay.shape) if decay.numel() == 1 else per_channel
        return grad_x, grad_decay


def _recursive_membrane(x: torch.Tensor, tau: torch.Tensor, truncation) -> torch.Tensor:
    """The membrane of :func:`_filtered_membrane` by the recursion ``v[t] = d * v[t-1] + x[t]``, ``d = exp(-1 /
    tau)``, O(T) per neuron instead of O(T^2); a kernel of K taps also takes ``d**K * x[t-K]`` back out. The same
    values up to rounding (``d**t`` is not ``exp(-t / tau)`` to the last bit)."""
    decay = torch.exp(-1 / tau.to(x.device)).reshape(-1)
    if truncation is not None and truncation < x.shape[0]:
        dropped = torch.nn.functional.pad(x[:-truncation], (0, 0, 0, 0, truncation, 0))
        x = x - decay**truncation * dropped
    return _DecayRecursion.apply(x, decay)


# snnTorch's class (a Module) as the only base where importable: every method of the drop-in is in its own body
class StateLeaky(*(_peer_class("StateLeaky") or (nn.Module,))):
    """snnTorch's ``StateLeaky``: a whole sequence ``[T, B, C]`` in one call, its membrane the input filtered causally
    by ``exp(-t / tau)`` per channel (``tau = 1 / (1 - beta + 1e-12)``, kept as snnTorch keeps it), with no reset,
    and the spikes ``(mem > threshold) * graded_spikes_factor**2`` (snnTorch scales twice): ``forward(input_) -> (spk, mem)``, or ``mem`` with
    ``output=False``, each ``[T, B, C]``. ``kernel_truncation_steps=K``: the last K taps only.

    By default the membrane is snnTorch's, computed as snnTorch computes it (a depthwise ``conv1d`` of T taps,
    O(T^2) per neuron), so spikes and membranes are its bit for bit. ``recursive=True`` (ours) computes it by the
    recursion ``mem[t] = d * mem[t-1] + x[t]`` with ``d = exp(-1 / tau)``, O(T) per neuron: the membranes equal up
    to rounding, the spikes snnTorch's except where a membrane is within rounding of the threshold."""

    def __init__(
        self,
        beta,
        channels,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        learn_beta=False,
        learn_threshold=False,
        state_quant=False,
        output=True,
        graded_spikes_factor=1.0,
        learn_graded_spikes_factor=False,
        kernel_truncation_steps=None,
        *,
        recursive=False,
    ):
        nn.Module.__init__(self)  # not super(): snnTorch's class may follow in the MRO (_peer_class), unconstructed
        _refuse_unsupported(False, state_quant)
        if kernel_truncation_steps is not None and (
            not isinstance(kernel_truncation_steps, int) or kernel_truncation_steps < 1
        ):
            raise ValueError(f"kernel_truncation_steps must be None or a positive int, got {kernel_truncation_steps!r}")
        if not output and (
            spike_grad is not None
            or surrogate_disable
            or learn_threshold
            or learn_graded_spikes_factor
            or bool((torch.as_tensor(graded_spikes_factor) != 1).any())
        ):
            warnings.warn(
                "StateLeaky: spike-related settings are unused when output=False (no spikes emitted).", UserWarning
            )
        self.surrogate_disable = bool(surrogate_disable)
        self._surrogate = _surrogate_of(spike_grad, self.surrogate_disable)
        self.spike_grad = spike_grad
        self.output = bool(output)
        self.kernel_truncation_steps = kernel_truncation_steps
        self.recursive = bool(recursive)
        self._keep("threshold", threshold, learn_threshold)
        self._keep("graded_spikes_factor", graded_spikes_factor, learn_graded_spikes_factor)
        self.register_buffer("reset_mechanism_val", torch.as_tensor(_RESET_VALUES["subtract"]))  # (unused: no reset)
        beta = _float_tensor(beta)
        if beta.shape not in ((channels,), (), (1,)):
            raise ValueError(f"Beta shape {beta.shape} must be either ({channels},) or (1,)")
        # snnTorch keeps beta too, unread (the property below shadows it): in the state_dict, as a parameter with
        # learn_beta; written into the module's tables, as the property hides the name from register_buffer
        (self._parameters if learn_beta else self._buffers)["beta"] = nn.Parameter(beta) if learn_beta else beta
        self._keep("tau", 1 / (1 - beta + 1e-12), learn_beta)
        peer = next((c for c in type(self).__mro__ if c.__module__.startswith("snntorch")), None)
        if peer is not None:  # as snnTorch's constructor does
            peer.instances.append(self)

    _keep = _SpikingNeuron._keep

    @property
    def beta(self) -> torch.Tensor:
        return (self.tau - 1) / self.tau

    def _membrane(self, x: torch.Tensor) -> torch.Tensor:
        _check_sequence(x, "StateLeaky", "C")
        membrane = _recursive_membrane if self.recursive else _filtered_membrane
        return membrane(x, self.tau, self.kernel_truncation_steps)

    def _fire(self, mem: torch.Tensor) -> torch.Tensor:
        """snnTorch's spikes: its ``fire`` scales by the graded spikes factor and its ``forward`` again (a factor
        of 0.5 gives spikes of 0.25)."""
        spikes = _Fire.apply(mem - self.threshold, self._surrogate, True) * self.graded_spikes_factor
        return spikes * self.graded_spikes_factor

    def forward(self, input_: torch.Tensor):
        mem = self._membrane(input_)
        if not self.output:
            return mem
        self.spk = self._fire(mem)  # kept, as snnTorch keeps it
        return self.spk, mem

    def extra_repr(self) -> str:
        return f"kernel_truncation_steps={self.kernel_truncation_steps}, recursive={self.recursive}"


class LinearLeaky(StateLeaky, *_peer_class("LinearLeaky")):
    """snnTorch's ``LinearLeaky``: an ``nn.Linear(in_features, out_features)`` at each step of ``[T, B, in_features]``,
    then :class:`StateLeaky`'s membrane and spikes over the ``out_features`` channels; ``forward(input_) -> (spk,
    mem)`` (``mem`` with ``output=False``), kept as ``spk`` and ``mem`` as snnTorch keeps them. ``recursive=True``
    as :class:`StateLeaky`'s."""

    def __init__(
        self,
        beta,
        in_features,
        out_features,
        bias=True,
        device=None,
        dtype=None,
        threshold=1.0,
        spike_grad=None,
        surrogate_disable=False,
        learn_beta=False,
        learn_threshold=False,
        state_quant=False,
        output=True,
        graded_spikes_factor=1.0,
        learn_graded_spikes_factor=False,
        kernel_truncation_steps=None,
        *,
        recursive=False,
    ):
        super().__init__(
            beta,
            out_features,
            threshold,
            spike_grad,
            surrogate_disable,
            learn_beta,
            learn_threshold,
            state_quant,
            output,
            graded_spikes_factor,
            learn_graded_spikes_factor,
            kernel_truncation_steps,
            recursive=recursive,
        )
        self.linear = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, input_: torch.Tensor):
        _check_sequence(input_, "LinearLeaky", "in_features")
        steps, batch, _ = input_.shape
        current = self.linear(input_.reshape(-1, self.linear.in_features))
        self.mem = self._membrane(current.reshape(steps, batch, self.linear.out_features))
        if not self.output:
            return self.mem
        self.spk = self._fire(self.mem)
        return self.spk, self.mem


#: snnTorch's state functions by the reset mechanism its constructor picked them for.
_STATE_FUNCTIONS = {"_base_sub": "subtract", "_base_zero": "zero", "_base_int": "none"}


def _state_leaky_drop_in(module: nn.Module) -> nn.Module:
    """:func:`drop_in_for` of snnTorch's ``StateLeaky`` / ``LinearLeaky``: made from the peer's settings and its
    unread ``beta`` entry (``beta`` itself is a property of ``tau``), then its ``state_dict`` loaded, ``tau``
    included, so the filter is the peer's exactly."""
    learn = lambda attr: isinstance(getattr(module, attr), nn.Parameter)  # noqa: E731
    kw = dict(
        beta=module._parameters.get("beta", module._buffers.get("beta")),
        threshold=module.threshold,
        spike_grad=module.spike_grad,
        surrogate_disable=module.surrogate_disable,
        learn_beta=learn("tau"),
        learn_threshold=learn("threshold"),
        state_quant=module.state_quant,
        output=module.output,
        graded_spikes_factor=module.graded_spikes_factor,
        learn_graded_spikes_factor=learn("graded_spikes_factor"),
        kernel_truncation_steps=module.kernel_truncation_steps,
    )
    with warnings.catch_warnings():  # output=False's unused spike settings: the peer warned when it was made
        warnings.simplefilter("ignore", UserWarning)
        new = _made_state_leaky(module, kw)
    new.load_state_dict(module.state_dict(), strict=True)
    return new.train(module.training)


def _made_state_leaky(module: nn.Module, kw: dict) -> nn.Module:
    if type(module).__name__ == "LinearLeaky":
        linear = module.linear
        features = dict(in_features=linear.in_features, out_features=linear.out_features, bias=linear.bias is not None)
        return LinearLeaky(**features, **kw)
    return StateLeaky(channels=module.tau.numel(), **kw)


def drop_in_for(module: nn.Module) -> nn.Module:
    """The drop-in for snnTorch neuron ``module``: its settings, parameters and buffers (the same ``state_dict``,
    loaded strictly), its reset mechanism as made and as set, its train/eval mode; the states start anew. Raises
    ValueError naming what has no drop-in, and the drop-ins' own errors for settings they refuse."""
    drop_ins = {
        "Leaky": Leaky,
        "Synaptic": Synaptic,
        "RLeaky": RLeaky,
        "RSynaptic": RSynaptic,
        "Lapicque": Lapicque,
        "Alpha": Alpha,
    }
    name = type(module).__name__
    if name in ("StateLeaky", "LinearLeaky") and type(module).__module__.startswith("snntorch"):
        return _state_leaky_drop_in(module)
    if name not in drop_ins or not type(module).__module__.startswith("snntorch"):
        raise ValueError(f"snnTorch's {name} has no spikefuse drop-in")
    learn = lambda attr: isinstance(getattr(module, attr), nn.Parameter)  # noqa: E731
    state_function = getattr(getattr(module, "state_function", None), "__name__", "")
    kw = dict(
        threshold=module.threshold,
        spike_grad=module.spike_grad,
        surrogate_disable=module.surrogate_disable,
        init_hidden=module.init_hidden,
        inhibition=module.inhibition,
        learn_threshold=learn("threshold"),
        reset_mechanism=_STATE_FUNCTIONS.get(state_function, module.reset_mechanism),
        state_quant=module.state_quant,
        output=module.output,
        beta=module.beta,
        learn_beta=learn("beta"),
    )
    if name not in ("Lapicque", "Alpha"):  # (they have no reset_delay)
        kw.update(reset_delay=module.reset_delay)
    if name in ("Synaptic", "RSynaptic", "Alpha"):
        kw.update(alpha=module.alpha, learn_alpha=learn("alpha"))
    if name == "Leaky":
        kw.update(
            graded_spikes_factor=module.graded_spikes_factor,
            learn_graded_spikes_factor=learn("graded_spikes_factor"),
        )
    if name in ("RLeaky", "RSynaptic"):
        kw.update(
            all_to_all=module.all_to_all,
            linear_features=module.linear_features,
            conv2d_channels=module.conv2d_channels,
            kernel_size=module.kernel_size,
            learn_recurrent=module.learn_recurrent,
        )
        if not module.all_to_all:
            kw.update(V=module.V, linear_features=None)
    new = drop_ins[name](**kw)
    if name == "Lapicque":  # R, C and time_step as the peer derived them: their shapes follow its arguments
        for attr in ("time_step", "R", "C"):
            new.register_buffer(attr, getattr(module, attr).clone())
    new.reset_mechanism = module.reset_mechanism
    new.load_state_dict(module.state_dict(), strict=True)
    return new.train(module.training)
