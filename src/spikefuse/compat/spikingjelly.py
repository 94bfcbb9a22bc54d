"""SpikingJelly 2.0 neurons (``spikingjelly.activation_based.neuron``) on spikefuse's fused kernels.

Replace ``from spikingjelly.activation_based import neuron`` by ``from spikefuse.compat import spikingjelly as
neuron`` and ``neuron.LIFNode(...)``, ``neuron.ParametricLIFNode(...)``, ``neuron.IFNode(...)`` keep their
constructor arguments, step modes and state: ``self.v`` is SpikingJelly's post-reset potential, the same value
bit for bit (float32 and float64 inputs), carried between calls until :meth:`reset`.

- ``step_mode='m'``: ``forward(x_seq)`` on ``[T, N, *]`` runs all T steps in one fused call.
- ``step_mode='s'``: ``forward(x)`` on ``[N, *]`` runs one step (a ``T=1`` call from the stored ``self.v``).
- ``spikingjelly.activation_based.functional.reset_net`` / ``detach_net`` / ``set_step_mode`` work on these
  modules (they call ``reset()`` / ``detach()`` / set ``step_mode``). SpikingJelly logs a warning for each module
  that is not its own ``MemoryModule``; the modules here are plain ``torch.nn.Module`` so that spikefuse does not
  import SpikingJelly.
- ``surrogate_function`` takes SpikingJelly surrogate objects (``Sigmoid``, ``ATan``, ``PiecewiseQuadratic``,
  ``Rect``, with ``spiking=True``) or spikefuse surrogates (:mod:`spikefuse.surrogate`).
- Extra keyword arguments of ours: ``backend`` (``"auto"``, ``"cpu"``, ``"triton"``, ``"reference"``; the legacy
  SpikingJelly values ``"torch"`` and ``"cupy"`` mean ``"auto"``) and ``memory`` (``"potential"``/``"recompute"``).

Not supported (clear errors): surrogates other than the four above, ``spiking=False`` surrogates, surrogates with
tensor parameters. ``store_v_seq=True`` is supported but runs T single-step calls in multi-step mode (it is a
monitoring option, as in SpikingJelly). Half-precision inputs are computed with a float32 state here, while
SpikingJelly keeps the state in the input dtype, so results differ there by rounding.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ..functional import run_lif
from ..neurons.lif import SPIKINGJELLY_MODELS, lif_params, lif_spec
from ..neurons.spec import NeuronSpec
from ..ops import check_backend_name
from ..ops.engine import step as one_step
from ..surrogate import ATan, Rectangle, Sigmoid, Surrogate, Triangle, resolve
from ..validation import check_memory_mode, leak_tensor

__all__ = ["LIFNode", "ParametricLIFNode", "IFNode", "to_surrogate", "use_spikingjelly_neurons"]

_SJ_MODULE = "spikingjelly.activation_based.surrogate"
_SJ_SURROGATES = {
    "Sigmoid": lambda a: Sigmoid(a),
    "ATan": lambda a: ATan(a),
    "PiecewiseQuadratic": lambda a: Triangle(a),
    # SpikingJelly's Rect: alpha inside |x| < 0.5/alpha.
    "Rect": lambda a: Rectangle(width=1.0 / a, height=a),
}
_SUPPORTED = (
    "spikingjelly.activation_based.surrogate.Sigmoid/ATan/PiecewiseQuadratic/Rect (spiking=True, float alpha) "
    "or a spikefuse.surrogate instance (Sigmoid, ATan, Triangle, Rectangle, FastSigmoid)"
)


def to_surrogate(surrogate_function) -> Surrogate:
    """The spikefuse surrogate with the same derivative as a SpikingJelly (or spikefuse) surrogate object."""
    if isinstance(surrogate_function, (Surrogate, str)):
        return resolve(surrogate_function)
    cls = type(surrogate_function)
    if cls.__module__ == _SJ_MODULE and cls.__name__ in _SJ_SURROGATES:
        if not getattr(surrogate_function, "spiking", True):
            raise ValueError(
                f"surrogate_function {surrogate_function!r} has spiking=False (a smooth activation, no spikes): "
                "spikefuse neurons always emit Heaviside spikes; use spiking=True"
            )
        alpha = getattr(surrogate_function, "alpha", None)
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(
                f"surrogate_function {surrogate_function!r} has alpha={alpha!r}: only a finite positive number is "
                "supported (no tensor / learnable alpha)"
            )
        return _SJ_SURROGATES[cls.__name__](float(alpha))
    raise ValueError(f"unsupported surrogate_function {surrogate_function!r}: use {_SUPPORTED}")


def use_spikingjelly_neurons(model: nn.Module) -> int:
    """Swap every spikefuse LIF of ``model`` for SpikingJelly 2.0's multi-step ``LIFNode`` with the same dynamics
    (the inverse of this module: SpikingJelly's own neurons, for side-by-side runs); returns how many.

    Mapping of Eq. (1): ``tau = 1/(1-decay)``, ``decay_input=False``, ``v_threshold = threshold``, ``v_reset``
    (SpikingJelly decays toward ``v_reset``, Eq. (1) toward 0: they agree for ``v_reset = 0``), sigmoid surrogate
    alpha -> ``surrogate.Sigmoid(alpha)``, rectangle (width w, height h = 1/w) -> ``surrogate.Rect(alpha=h)``.
    SpikingJelly neurons keep state between calls: reset them after each batch. Raises ``ImportError`` without
    SpikingJelly and ``ValueError`` for a neuron it has no equal of.
    """
    try:
        from spikingjelly.activation_based import neuron as sj_neuron
        from spikingjelly.activation_based import surrogate as sj_surrogate
    except ImportError as err:
        raise ImportError(
            f"SpikingJelly is not installed ({err}); install it with `pip install spikingjelly --no-deps`"
        ) from None
    from ..models import replace_neurons

    def factory(lif) -> nn.Module:
        if not isinstance(lif.decay, float):
            raise ValueError("SpikingJelly's LIFNode has no learnable per-channel decay")
        if lif.decay >= 1.0:
            raise ValueError("decay=1 (IF) has no LIFNode tau; use SpikingJelly's IFNode")
        sg = lif.surrogate
        if isinstance(sg, Sigmoid):
            sj_sg = sj_surrogate.Sigmoid(alpha=sg.alpha)
        elif isinstance(sg, Rectangle) and abs(sg.width * sg.height - 1.0) < 1e-12:
            sj_sg = sj_surrogate.Rect(alpha=sg.height)
        else:
            raise ValueError(f"no SpikingJelly surrogate equal to {sg}")
        if lif.v_reset not in (None, 0.0):
            raise ValueError("SpikingJelly's LIFNode decays toward v_reset; it equals Eq. (1) only for v_reset = 0")
        return sj_neuron.LIFNode(
            tau=1.0 / (1.0 - lif.decay),
            decay_input=False,
            v_threshold=lif.threshold,
            v_reset=lif.v_reset,
            surrogate_function=sj_sg,
            detach_reset=lif.detach_reset,
            step_mode="m",
        )

    return replace_neurons(model, factory)


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    return float(value)


class _BaseNode(nn.Module):
    """What SpikingJelly's ``BaseNode`` does for the three neurons: state ``v``, step modes, reset, detach."""

    _charge: str  # a charge of spikefuse.neurons.SPIKINGJELLY_MODELS

    def __init__(
        self,
        v_threshold: float,
        v_reset: float | None,
        surrogate_function,
        detach_reset: bool,
        step_mode: str,
        store_v_seq: bool,
        backend: str,
        memory: str,
    ):
        super().__init__()
        self.v_threshold = _number(v_threshold, "v_threshold")
        self.v_reset = None if v_reset is None else _number(v_reset, "v_reset (None = soft reset)")
        if not isinstance(detach_reset, bool):
            raise TypeError(f"detach_reset must be a bool, got {detach_reset!r}")
        self.detach_reset = detach_reset
        surrogate_function = Sigmoid(4.0) if surrogate_function is None else surrogate_function
        to_surrogate(surrogate_function)  # fail early on an unsupported surrogate
        # A SpikingJelly surrogate is an nn.Module and becomes a child module, as in SpikingJelly.
        self.surrogate_function = surrogate_function
        self.step_mode = step_mode
        self.store_v_seq = bool(store_v_seq)
        if backend in ("torch", "cupy"):  # SpikingJelly < 2.0 names: same results, pick the fused kernel
            backend = "auto"
        check_backend_name(backend)  # refused now, not at the first call
        check_memory_mode(memory)
        self.backend = backend
        self.memory = memory
        self.v = self._reset_value
        self.v_seq = None

    # -- SpikingJelly's attributes ------------------------------------------------------------------------------

    @property
    def step_mode(self) -> str:
        return self._step_mode

    @step_mode.setter
    def step_mode(self, value: str):
        if value not in ("s", "m"):
            raise ValueError(f"step_mode can only be ('s', 'm'), but got {value!r}")
        self._step_mode = value

    def supported_step_mode(self):
        return ("s", "m")

    @property
    def _reset_value(self) -> float:
        return 0.0 if self.v_reset is None else self.v_reset

    def reset(self):
        """Forget the state: ``v`` back to ``v_reset`` (0 for soft reset), as ``functional.reset_net`` expects."""
        self.v = self._reset_value
        self.v_seq = None

    def detach(self):
        """Cut the state from the graph of earlier steps (``functional.detach_net``; truncated BPTT)."""
        if isinstance(self.v, torch.Tensor):
            self.v = self.v.detach()
        if isinstance(self.v_seq, torch.Tensor):
            self.v_seq = self.v_seq.detach()

    def extra_repr(self):
        return (
            f"v_threshold={self.v_threshold}, v_reset={self.v_reset}, detach_reset={self.detach_reset}, "
            f"step_mode={self.step_mode}, backend={self.backend!r}"
        )

    # -- computation --------------------------------------------------------------------------------------------

    def _leak(self):
        raise NotImplementedError

    def neuron(self) -> NeuronSpec:
        """The definition of these neurons (:data:`spikefuse.neurons.SPIKINGJELLY_MODELS`) with their constants
        (made again only when a setting changed: a step loop asks at every step)."""
        hard = self.v_reset is not None
        settings = (
            hard,
            self._charge,
            self.v_threshold,
            self._reset_value,
            self.surrogate_function,
            self.detach_reset,
            self.backend,
            self.memory,
        )
        made = self.__dict__.get("_neuron_made")
        if made is None or made[0] != settings:
            made = (
                settings,
                lif_spec(
                    SPIKINGJELLY_MODELS[("hard" if hard else "soft", self._charge)],
                    float(self.v_threshold),
                    self._reset_value,
                    hard,
                    to_surrogate(self.surrogate_function),
                    bool(self.detach_reset),
                    backend=self.backend,
                    memory=self.memory,
                ),
            )
            self.__dict__["_neuron_made"] = made
        return made[1]

    def _state_for(self, x_ref: torch.Tensor) -> torch.Tensor:
        """SpikingJelly's ``materialize_states``: a float fills a new tensor; a tensor of another shape restarts."""
        v = self.v
        if isinstance(v, torch.Tensor):
            if v.shape != x_ref.shape:
                return torch.full_like(x_ref, self._reset_value)
            if v.device != x_ref.device:
                v = v.to(device=x_ref.device)
            return v
        return torch.full_like(x_ref, float(v))

    def _run(self, x_seq: torch.Tensor, v: torch.Tensor):
        return run_lif(x_seq, self._leak(), self.neuron(), v_init=v)

    def single_step_forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.ndim > 0 and one_step.takes(self.backend, x):
            # one step in one autograd node (spikefuse.ops.engine.step): the fused kernels' step, launched alone
            neuron = self.neuron()
            params = lif_params(neuron, leak_tensor(self._leak(), x, "decay"))
            spikes, v = one_step.step(neuron, x, params, [self._state_for(x)])
            spikes = spikes.unsqueeze(0)
        else:
            spikes, v = self._run(x.unsqueeze(0), self._state_for(x))
        self.v = v
        if self.store_v_seq:
            step = v.unsqueeze(0)
            seq = self.v_seq
            if seq is None or seq.shape[1:] != step.shape[1:] or seq.device != step.device or seq.dtype != step.dtype:
                self.v_seq = step.clone()
            else:
                self.v_seq = torch.cat((seq, step))
        return spikes[0]

    def multi_step_forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        if x_seq.ndim == 0:
            raise ValueError("step_mode='m' needs an input of shape [T, N, *], got a 0-dim tensor")
        v = self._state_for(x_seq[0])
        if not self.store_v_seq:
            spikes, self.v = self._run(x_seq, v)
            return spikes
        # Every post-reset potential is wanted: one fused call per step (monitoring only, like SpikingJelly).
        spikes, voltages = [], []
        for x_t in x_seq.unbind(0):
            s, v = self._run(x_t.unsqueeze(0), v)
            spikes.append(s[0])
            voltages.append(v)
        self.v = v
        self.v_seq = torch.stack(voltages)
        return torch.stack(spikes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step_mode == "s":
            return self.single_step_forward(x)
        return self.multi_step_forward(x)


class LIFNode(_BaseNode):
    """SpikingJelly's ``LIFNode``: ``H = V + (X - (V - V_reset)) / tau`` (``decay_input=True``) or
    ``H = V - (V - V_reset) / tau + X``; spikes ``H >= v_threshold``; hard reset to ``v_reset`` or soft reset
    (``v_reset=None``). ``tau`` is a plain number (SpikingJelly asserts ``tau > 1``)."""

    def __init__(
        self,
        tau: float = 2.0,
        decay_input: bool = True,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function=None,
        detach_reset: bool = False,
        step_mode: str = "s",
        store_v_seq: bool = False,
        *,
        backend: str = "auto",
        memory: str = "potential",
    ):
        tau = _number(tau, "tau")
        if tau <= 1.0:
            raise ValueError(f"tau must be > 1 (as in SpikingJelly), got {tau}")
        super().__init__(
            v_threshold, v_reset, surrogate_function, detach_reset, step_mode, store_v_seq, backend, memory
        )
        self.tau = tau
        self.decay_input = bool(decay_input)

    @property
    def _charge(self) -> int:
        return "div_input" if self.decay_input else "div"

    def _leak(self):
        return float(self.tau)

    def extra_repr(self):
        return super().extra_repr() + f", tau={self.tau}, decay_input={self.decay_input}"


class ParametricLIFNode(_BaseNode):
    """SpikingJelly's ``ParametricLIFNode`` (PLIF): ``LIFNode`` with ``1/tau = sigmoid(w)``, ``w`` a learnable
    scalar ``nn.Parameter`` initialised to ``-log(init_tau - 1)``."""

    def __init__(
        self,
        init_tau: float = 2.0,
        decay_input: bool = True,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function=None,
        detach_reset: bool = False,
        step_mode: str = "s",
        store_v_seq: bool = False,
        *,
        backend: str = "auto",
        memory: str = "potential",
    ):
        init_tau = _number(init_tau, "init_tau")
        if init_tau <= 1.0:
            raise ValueError(f"init_tau must be > 1 (as in SpikingJelly), got {init_tau}")
        super().__init__(
            v_threshold, v_reset, surrogate_function, detach_reset, step_mode, store_v_seq, backend, memory
        )
        self.decay_input = bool(decay_input)
        self.w = nn.Parameter(torch.as_tensor(-math.log(init_tau - 1.0)))

    @property
    def _charge(self) -> int:
        return "mul_input" if self.decay_input else "mul"

    def _leak(self):
        if self.w.ndim != 0:
            raise ValueError(f"w must be a scalar parameter (as in SpikingJelly), got shape {tuple(self.w.shape)}")
        return torch.sigmoid(self.w)

    def extra_repr(self):
        with torch.no_grad():
            tau = 1.0 / self.w.sigmoid()
        return super().extra_repr() + f", tau={tau}, decay_input={self.decay_input}"


class IFNode(_BaseNode):
    """SpikingJelly's ``IFNode``: ``H = V + X``."""

    _charge = "if"

    def __init__(
        self,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function=None,
        detach_reset: bool = False,
        step_mode: str = "s",
        store_v_seq: bool = False,
        *,
        backend: str = "auto",
        memory: str = "potential",
    ):
        super().__init__(
            v_threshold, v_reset, surrogate_function, detach_reset, step_mode, store_v_seq, backend, memory
        )

    def _leak(self):
        return 1.0


def drop_in_for(module: nn.Module) -> nn.Module:
    """The drop-in for SpikingJelly neuron ``module``: its settings, step mode, parameters (the same ``state_dict``,
    loaded strictly) and train/eval mode; the state starts reset. Raises ValueError naming what has no drop-in, and
    the drop-ins' own errors for settings they refuse (an unsupported surrogate function)."""
    drop_ins = {"LIFNode": LIFNode, "ParametricLIFNode": ParametricLIFNode, "IFNode": IFNode}
    name = type(module).__name__
    if name not in drop_ins or not type(module).__module__.startswith("spikingjelly"):
        raise ValueError(f"SpikingJelly's {name} has no spikefuse drop-in")
    kw = dict(
        v_threshold=module.v_threshold,
        v_reset=module.v_reset,
        surrogate_function=module.surrogate_function,
        detach_reset=module.detach_reset,
        step_mode=module.step_mode,
        store_v_seq=getattr(module, "store_v_seq", False),
    )
    if name == "LIFNode":
        kw.update(tau=module.tau, decay_input=module.decay_input)
    elif name == "ParametricLIFNode":
        kw.update(decay_input=module.decay_input)  # its tau is the parameter w, loaded below
    new = drop_ins[name](**kw)
    new.load_state_dict(module.state_dict(), strict=True)
    return new.train(module.training)
