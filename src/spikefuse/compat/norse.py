"""Norse 1.1's ``LIF`` (current-based) and ``LSNN`` (adaptive) neurons as spikefuse neuron models
(:class:`~spikefuse.neurons.NeuronModel`, run by the engine's generated kernels), and its recurrent modules
``LIFRecurrent`` and ``LSNNRecurrent`` on spikefuse's fused recurrent layer (:func:`spikefuse.recurrent`): the same
definitions, the recurrent current of the previous spikes joining the input where Norse adds it.

Norse applies the reset of a spike in the step that fires it and returns post-reset states; the models below apply
the reset at the start of the next step, with Norse's operations in Norse's order, and hand out the post-reset
states after the last step (their ``handoff``), so the spikes and the returned states equal Norse's bit for bit in
float32 (``tests/compat/test_norse.py``), and Norse's states continue a sequence when passed back. Parameters come from Norse's records with :func:`lif_params` / :func:`lsnn_params`, which form
``dt * tau_inv`` as Norse does (a float32 product). Norse's default spike function ``"super"`` is, in 1.1, the
gradient ``1 / (|u| + 1)^2`` whatever its ``alpha``: :class:`spikefuse.surrogate.FastSigmoid` with slope 1.

LIF (``lif_feed_forward_step``)::

    i = i + x;  v = v + dt/tau_mem ((v_leak - v) + i);  i = i - dt/tau_syn i;  z = H(v - v_th);  v = v_reset where z

LSNN (``lsnn_feed_forward_step``; the threshold ``b`` relaxes to ``v_th`` and jumps by ``beta`` on a spike; the
input reaches the current after the spike test)::

    v = v + dt/tau_mem ((v_leak - v) + i);  i = i - dt/tau_syn i;  b = b + dt/tau_adapt (v_th - b);
    z = H(v - b);  v = v_reset where z;  b = b + beta z;  i = i + x
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..neurons import NeuronModel
from ..ops import check_backend_name
from ..recurrent_functional import recurrent
from ..surrogate import FastSigmoid
from ..validation import check_memory_mode

__all__ = [
    "NORSE_LIF",
    "NORSE_LSNN",
    "lif_params",
    "lsnn_params",
    "SUPERSPIKE",
    "LIFRecurrent",
    "LSNNRecurrent",
    "LIFState",
    "LSNNState",
]

#: Norse 1.1's "super" spike gradient (alpha unused there).
SUPERSPIKE = FastSigmoid(1.0)

NORSE_LIF = NeuronModel(
    name="norse_lif",
    states=("v", "i"),
    params=("dt_mem", "neg_dt_syn", "v_leak", "v_th", "v_reset"),
    step=(
        ("v", "(1 - s)*v + s*v_reset"),
        ("i", "i + x"),
        ("v", "v + dt_mem*((v_leak - v) + i)"),
        ("i", "i + neg_dt_syn*i"),
    ),
    fire="v - v_th",
    strict=True,
    handoff=(("v", "(1 - s)*v + s*v_reset"),),
)

NORSE_LSNN = NeuronModel(
    name="norse_lsnn",
    states=("v", "i", "b"),
    params=("dt_mem", "neg_dt_syn", "dt_adapt", "v_leak", "v_th", "v_reset", "beta"),
    step=(
        ("v", "(1 - s)*v + s*v_reset"),
        ("b", "b + s*beta"),
        ("v", "v + dt_mem*((v_leak - v) + i)"),
        ("i", "i + neg_dt_syn*i"),
        ("b", "b + dt_adapt*(v_th - b)"),
        ("i", "i + x"),
    ),
    fire="v - b",
    strict=True,
    handoff=(("v", "(1 - s)*v + s*v_reset"), ("b", "b + s*beta")),
)


def _scalar(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32).reshape(())


def lif_params(p=None, dt: float = 0.001) -> dict:
    """The parameters of :data:`NORSE_LIF` from a ``norse.torch.LIFParameters`` (default: Norse's defaults)."""
    if p is None:
        from norse.torch import LIFParameters

        p = LIFParameters()
    return {
        "dt_mem": dt * _scalar(p.tau_mem_inv),
        "neg_dt_syn": -dt * _scalar(p.tau_syn_inv),
        "v_leak": _scalar(p.v_leak),
        "v_th": _scalar(p.v_th),
        "v_reset": _scalar(p.v_reset),
    }


def lsnn_params(p=None, dt: float = 0.001) -> dict:
    """The parameters of :data:`NORSE_LSNN` from a ``norse.torch.LSNNParameters`` (default: Norse's defaults)."""
    if p is None:
        from norse.torch import LSNNParameters

        p = LSNNParameters()
    return {
        "dt_mem": dt * _scalar(p.tau_mem_inv),
        "neg_dt_syn": -dt * _scalar(p.tau_syn_inv),
        "dt_adapt": dt * _scalar(p.tau_adapt_inv),
        "v_leak": _scalar(p.v_leak),
        "v_th": _scalar(p.v_th),
        "v_reset": _scalar(p.v_reset),
        "beta": _scalar(p.beta),
    }


class LIFState(NamedTuple):
    """Norse's ``LIFState``: the last spikes, the membrane, the synaptic current."""

    z: torch.Tensor
    v: torch.Tensor
    i: torch.Tensor


class LSNNState(NamedTuple):
    """Norse's ``LSNNState``: the last spikes, the membrane, the synaptic current, the (absolute) threshold."""

    z: torch.Tensor
    v: torch.Tensor
    i: torch.Tensor
    b: torch.Tensor


class _Recurrent(nn.Module):
    """What :class:`LIFRecurrent` and :class:`LSNNRecurrent` share: Norse's weights (``input_weights`` ``[H, I]``,
    ``recurrent_weights`` ``[H, H]``, drawn as Norse draws them, no bias; without ``autapses`` the recurrent diagonal
    zeroed once and its gradient zeroed by a hook, as in Norse) and the fused recurrent layer over ``[T, B, I]``."""

    MODEL: NeuronModel
    STATE: type

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        p,
        input_weights=None,
        recurrent_weights=None,
        autapses: bool = False,
        dt: float = 0.001,
        *,
        backend: str = "auto",
        memory: str = "potential",
    ):
        super().__init__()
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        self.p, self.dt, self.autapses = p, dt, bool(autapses)
        check_backend_name(backend)  # refused now, not at the first call
        check_memory_mode(memory)
        self.backend, self.memory = backend, memory
        scale = torch.sqrt(2.0 / torch.as_tensor(self.hidden_size))  # Norse's: a float32 scale from the hidden size
        self.input_weights = (
            input_weights
            if input_weights is not None
            else nn.Parameter(torch.randn(self.hidden_size, self.input_size) * scale)
        )
        self.recurrent_weights = (
            recurrent_weights
            if recurrent_weights is not None
            else nn.Parameter(torch.randn(self.hidden_size, self.hidden_size) * scale)
        )
        if not self.autapses:
            with torch.no_grad():
                self.recurrent_weights.fill_diagonal_(0.0)
            self.recurrent_weights.requires_grad = True
            self.recurrent_weights.register_hook(lambda g: g.clone().fill_diagonal_(0.0))

    def initial_state(self, x: torch.Tensor):
        raise NotImplementedError

    def forward(self, input_tensor: torch.Tensor, state=None):
        """All T steps of ``input_tensor`` ``[T, B, input_size]``: ``(spikes [T, B, hidden_size], state)``."""
        if input_tensor.ndim != 3 or input_tensor.shape[2] != self.input_size:
            raise ValueError(
                f"{type(self).__name__} takes [T, B, {self.input_size}] inputs, got {tuple(input_tensor.shape)}"
            )
        state = self.initial_state(input_tensor) if state is None else state
        current = torch.nn.functional.linear(input_tensor, self.input_weights)
        names = self.MODEL.states
        params = {k: v.to(current.device) for k, v in self.params().items()}  # Norse's records stay on the CPU
        spikes, final = recurrent(
            current,
            self.MODEL,
            self.recurrent_weights,
            None,
            surrogate=SUPERSPIKE,
            detach_reset=True,
            backend=self.backend,
            memory=self.memory,
            return_state=True,
            state=(*(getattr(state, k).expand(current.shape[1:]) for k in names), state.z.to(current.dtype)),
            **params,
        )
        return spikes, self.STATE(z=final[-1].to(state.z.dtype), **dict(zip(names, final)))


def _filled(shape, value: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.full(shape, float(value))`` as Norse fills its initial states, from the tensor ``value`` without
    reading it on the host (a graph break under ``torch.compile``)."""
    return value.to(dtype=dtype, device=device).expand(shape).clone()


class LIFRecurrent(_Recurrent):
    """Norse 1.1's ``LIFRecurrent`` on the fused recurrent layer: the current jumps by the input and the recurrent
    current of the previous spikes, ``i = (i + W_in x[t]) + W_rec z[t-1]``, then Norse's LIF step
    (:data:`NORSE_LIF`, its reset detached as in Norse's recurrent step). Spikes and states Norse's bit for bit
    (float32); ``forward(x [T, B, I], state=None) -> (z [T, B, H], LIFState)``."""

    MODEL, STATE = NORSE_LIF, LIFState

    def __init__(self, input_size: int, hidden_size: int, p=None, **kwargs):
        super().__init__(input_size, hidden_size, p, **kwargs)

    def params(self) -> dict:
        return lif_params(self.p, self.dt)

    def initial_state(self, x):
        shape = (*x.shape[1:-1], self.hidden_size)
        v_leak = lif_params(self.p, self.dt)["v_leak"]
        return LIFState(
            z=x.new_zeros(shape),
            v=_filled(shape, v_leak, torch.get_default_dtype(), x.device),
            i=torch.zeros(shape, device=x.device),
        )


class LSNNRecurrent(_Recurrent):
    """Norse 1.1's ``LSNNRecurrent`` on the fused recurrent layer (:data:`NORSE_LSNN`): the input and the recurrent
    current of the previous spikes reach the current after the spike test, ``i = (i + W_in x[t]) + W_rec z[t-1]``;
    reset and threshold jump detached as in Norse's recurrent step. Spikes and states Norse's bit for bit (float32);
    ``forward(x [T, B, I], state=None) -> (z [T, B, H], LSNNState)``."""

    MODEL, STATE = NORSE_LSNN, LSNNState

    def __init__(self, input_size: int, hidden_size: int, p=None, **kwargs):
        super().__init__(input_size, hidden_size, p, **kwargs)

    def params(self) -> dict:
        return lsnn_params(self.p, self.dt)

    def initial_state(self, x):
        shape = (*x.shape[1:-1], self.hidden_size)
        params = lsnn_params(self.p, self.dt)
        zeros = lambda: torch.zeros(shape, dtype=x.dtype, device=x.device)  # noqa: E731
        return LSNNState(
            z=zeros(),
            v=_filled(shape, params["v_leak"], x.dtype, x.device),
            i=zeros(),
            b=_filled(shape, params["v_th"], x.dtype, x.device),
        )
