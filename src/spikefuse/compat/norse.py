"""Norse 1.1's ``LIF`` (current-based) and ``LSNN`` (adaptive) neurons as spikefuse neuron models
(:class:`~spikefuse.neurons.NeuronModel`, run by the engine's generated kernels); its feed-forward modules ``LIF``,
``LIFCell``, ``LSNN`` and ``LSNNCell`` on them; and its recurrent modules ``LIFRecurrent`` and ``LSNNRecurrent`` on
spikefuse's fused recurrent layer (:func:`spikefuse.recurrent`): the same definitions, the recurrent current of the
previous spikes joining the input where Norse adds it. The modules take Norse's parameter records and return its
state records (Norse's own classes where Norse is importable). Its leaky integrators ``LI`` and ``LICell`` (no
spikes: they return the membrane) are plain torch operations in Norse's order.

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

from ..neuron_functional import neuron
from ..neurons import NeuronModel, neuron_spec
from ..ops import check_backend_name
from ..ops.numerics import compute_dtype
from ..ops.engine import step as one_step
from ..recurrent_functional import recurrent
from ..surrogate import FastSigmoid
from ..validation import check_memory_mode

__all__ = [
    "NORSE_LIF",
    "NORSE_LSNN",
    "lif_params",
    "lsnn_params",
    "SUPERSPIKE",
    "LIF",
    "LIFCell",
    "LSNN",
    "LSNNCell",
    "LIFRecurrent",
    "LSNNRecurrent",
    "LIFRecurrentCell",
    "LSNNRecurrentCell",
    "LIFState",
    "LSNNState",
    "LIFFeedForwardState",
    "LSNNFeedForwardState",
    "LI",
    "LICell",
    "LIState",
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


def _check_method(p) -> None:
    method = getattr(p, "method", "super")
    if method != "super":
        raise NotImplementedError(
            f"Norse's spike function method={method!r}: spikefuse's Norse neurons run Norse's default 'super' only "
            "(the gradient 1 / (|u| + 1)^2); leave method at its default"
        )


def lif_params(p=None, dt: float = 0.001) -> dict:
    """The parameters of :data:`NORSE_LIF` from a ``norse.torch.LIFParameters`` (default: Norse's defaults)."""
    if p is None:
        from norse.torch import LIFParameters

        p = LIFParameters()
    _check_method(p)
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
    _check_method(p)
    return {
        "dt_mem": dt * _scalar(p.tau_mem_inv),
        "neg_dt_syn": -dt * _scalar(p.tau_syn_inv),
        "dt_adapt": dt * _scalar(p.tau_adapt_inv),
        "v_leak": _scalar(p.v_leak),
        "v_th": _scalar(p.v_th),
        "v_reset": _scalar(p.v_reset),
        "beta": _scalar(p.beta),
    }


def _norse_state(name: str, fields: tuple[str, ...], doc: str) -> type:
    """Norse's state record ``name`` where Norse is importable (its users test ``isinstance(state, LIFState)`` and
    pass its records), else a NamedTuple of the same fields."""
    try:
        import norse.torch as norse
    except ImportError:
        record = NamedTuple(name, [(f, torch.Tensor) for f in fields])
        record.__doc__ = doc
        return record
    return getattr(norse, name)


LIFState = _norse_state(
    "LIFState", ("z", "v", "i"), "Norse's ``LIFState``: the last spikes, membrane, synaptic current."
)
LSNNState = _norse_state(
    "LSNNState", ("z", "v", "i", "b"), "Norse's ``LSNNState``: the last spikes, membrane, current, threshold."
)
LIFFeedForwardState = _norse_state(
    "LIFFeedForwardState", ("v", "i"), "Norse's ``LIFFeedForwardState``: the membrane, the synaptic current."
)
LSNNFeedForwardState = _norse_state(
    "LSNNFeedForwardState", ("v", "i", "b"), "Norse's ``LSNNFeedForwardState``: membrane, current, threshold."
)


def _learnable(p) -> bool:
    """Whether a tensor of Norse's parameter record ``p`` requires grad (a learnable ``tau_mem_inv``): then the
    parameters are formed from it at every call, as Norse does."""
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in (p or ()))


def _step_params(module: nn.Module, x: torch.Tensor) -> list:
    """The parameters of ``module`` (a Norse neuron: its ``params()`` in its ``MODEL``'s order) as ``[1]`` tensors of
    the compute dtype of ``x``, for :func:`spikefuse.ops.engine.step.step`. Where a tensor of Norse's record
    requires grad (a learnable ``tau_mem_inv``), formed from it at every call, its gradient flowing back as Norse's
    does; else made once per dtype (a step loop asks at every step), from the record as it was at the first step."""
    cdt = compute_dtype(x.dtype)
    if _learnable(module.p):
        values = module.params()
        return [values[k].reshape(1).to(cdt) for k in module.MODEL.params]
    made = module.__dict__.setdefault("_step_params_by_dtype", {})
    if cdt not in made:
        values = module.params()
        made[cdt] = [torch.tensor([float(values[k])], dtype=cdt) for k in module.MODEL.params]
    return made[cdt]


class _FeedForward(nn.Module):
    """What Norse's feed-forward neurons share: Norse's parameter record ``p`` and ``dt``, and a call of
    :func:`spikefuse.neuron` over the steps of ``forward``'s input: ``[T, ...]`` for ``LIF``/``LSNN``, one step
    ``[...]`` for the ``*Cell`` modules (``CELL``). States start as Norse's do (``v`` at ``v_leak``, ``i`` at 0, ``b``
    at ``v_th``) and are returned as Norse's records; a sparse input runs as its dense values (the spikes sparse where
    Norse's are)."""

    MODEL: NeuronModel
    STATE: type
    CELL = False
    SPARSE_SPIKES = False  # a sparse input gives sparse spikes (Norse's LIF; its LSNN gives dense ones)

    def __init__(self, p=None, dt: float = 0.001, record_states: bool = False, *, backend="auto", memory="potential"):
        super().__init__()
        if record_states:
            raise NotImplementedError("record_states=True is not supported: the states of the last step are returned")
        check_backend_name(backend)  # refused now, not at the first call
        check_memory_mode(memory)
        self.p, self.dt, self.backend, self.memory = p, dt, backend, memory
        self._params = self.params()  # checks p (its spike function) now

    def initial_state(self, x: torch.Tensor):
        shape, dtype = x.shape[1:], torch.promote_types(x.dtype, torch.float32)
        filled = {"v": self._params["v_leak"], "b": self._params.get("v_th")}
        return self.STATE(
            **{
                k: _filled(shape, filled[k], dtype, x.device)
                if k in filled
                else torch.zeros(shape, dtype=dtype, device=x.device)
                for k in self.MODEL.states
            }
        )

    def forward(self, input_tensor: torch.Tensor, state=None):
        """``(spikes, state)``: Norse's call."""
        sparse = input_tensor.is_sparse
        x = input_tensor.to_dense() if sparse else input_tensor
        x = x.unsqueeze(0) if self.CELL else x
        if x.ndim < 2:
            raise ValueError(f"{type(self).__name__} takes [T, ...] inputs (T steps), got shape {tuple(x.shape)}")
        state = self.initial_state(x) if state is None else state
        init = tuple(getattr(state, k).to(x.device).expand(x.shape[1:]) for k in self.MODEL.states)
        if self.CELL and one_step.takes(self.backend, x):  # one step in one autograd node (spikefuse.ops.engine.step)
            spikes, *final = one_step.step(neuron_spec(self.MODEL, SUPERSPIKE), x[0], _step_params(self, x), init)
            spikes = spikes.to_sparse() if sparse and self.SPARSE_SPIKES else spikes
            return spikes, self.STATE(**dict(zip(self.MODEL.states, final)))
        # (the values made at construction would hold a learnable tensor's first value and a graph a backward freed)
        values = self.params() if _learnable(self.p) else self._params
        params = {k: v.to(x.device) for k, v in values.items()}
        spikes, final = neuron(
            x,
            self.MODEL,
            surrogate=SUPERSPIKE,
            state=init,
            return_state=True,
            backend=self.backend,
            memory=self.memory,
            **params,
        )
        spikes = spikes[0] if self.CELL else spikes
        spikes = spikes.to_sparse() if sparse and self.SPARSE_SPIKES else spikes
        return spikes, self.STATE(**dict(zip(self.MODEL.states, final)))

    def extra_repr(self) -> str:
        return f"dt={self.dt}, backend={self.backend!r}, memory={self.memory!r}"


class LIF(_FeedForward):
    """Norse 1.1's ``LIF`` (:data:`NORSE_LIF`): ``forward(x [T, ...], state=None) -> (z [T, ...],
    LIFFeedForwardState)``, all T steps in one fused call; Norse's spikes and states bit for bit (float32)."""

    MODEL, STATE = NORSE_LIF, LIFFeedForwardState
    SPARSE_SPIKES = True

    def params(self) -> dict:
        return lif_params(self.p, self.dt)


class LIFCell(LIF):
    """Norse 1.1's ``LIFCell``: :class:`LIF` one step a call, ``forward(x, state=None) -> (z, LIFFeedForwardState)``."""

    CELL = True


class LSNN(_FeedForward):
    """Norse 1.1's ``LSNN`` (:data:`NORSE_LSNN`): ``forward(x [T, ...], state=None) -> (z [T, ...],
    LSNNFeedForwardState)``, all T steps in one fused call; Norse's spikes and states bit for bit (float32)."""

    MODEL, STATE = NORSE_LSNN, LSNNFeedForwardState

    def params(self) -> dict:
        return lsnn_params(self.p, self.dt)


class LSNNCell(LSNN):
    """Norse 1.1's ``LSNNCell``: :class:`LSNN` one step a call, ``forward(x, state=None) -> (z,
    LSNNFeedForwardState)``."""

    CELL = True


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

    SPARSE_SPIKES = False  # a sparse input gives sparse spikes (Norse's LIFRecurrent; its LSNNRecurrent dense ones)
    CELL = False  # one step a call, [B, input_size] (Norse's *RecurrentCell modules)

    def forward(self, input_tensor: torch.Tensor, state=None):
        """All T steps of ``input_tensor`` ``[T, B, input_size]``: ``(spikes [T, B, hidden_size], state)`` (one step
        ``[B, input_size]`` a call for the ``*Cell`` modules). A sparse input runs as its dense values;
        ``[T, input_size]`` (no batch, as Norse takes it) as a batch of one, whose states equal Norse's up to the
        rounding of the vector products Norse computes there."""
        sparse = input_tensor.is_sparse
        input_tensor = input_tensor.to_dense() if sparse else input_tensor
        if input_tensor.ndim + self.CELL not in (2, 3) or input_tensor.shape[-1] != self.input_size:
            steps = "" if self.CELL else "T, "
            raise ValueError(
                f"{type(self).__name__} takes [{steps}B, {self.input_size}] or [{steps}{self.input_size}] inputs, "
                f"got {tuple(input_tensor.shape)}"
            )
        if self.CELL and one_step.takes(self.backend, input_tensor):
            state = self.initial_state(input_tensor.unsqueeze(0)) if state is None else state
            spikes, state = self._step(input_tensor, state)
            return (spikes.to_sparse() if sparse and self.SPARSE_SPIKES else spikes), state
        input_tensor = input_tensor.unsqueeze(0) if self.CELL else input_tensor
        unbatched = input_tensor.ndim == 2
        input_tensor = input_tensor.unsqueeze(1) if unbatched else input_tensor
        state = self.initial_state(input_tensor) if state is None else state
        current = torch.nn.functional.linear(input_tensor, self.input_weights)
        spikes, final = self._fused(current, state)
        spikes = spikes[0] if self.CELL else spikes
        state = self.STATE(z=final[-1].to(state.z.dtype), **dict(zip(self.MODEL.states, final)))
        if unbatched:
            spikes, state = spikes.select(-2, 0), self.STATE(*(v[0] for v in state))
        return (spikes.to_sparse() if sparse and self.SPARSE_SPIKES else spikes), state

    def _step(self, x: torch.Tensor, state) -> tuple:
        """One step of Norse's recurrent cell, ``x`` ``[B, I]`` or ``[I]`` (Norse's vector products then), in one
        autograd node after the two products (:mod:`spikefuse.ops.engine.step`): the input's current and the
        recurrent current of the previous spikes join the synaptic current as Norse adds them, ``(i + W_in x) +
        W_rec z``; the reset detached as in Norse's step, the spikes' gradient flowing on through the next step's
        recurrent current. ``(spikes, state)``; no view of a state in the graph where it has the step's shape."""
        current = torch.nn.functional.linear(x, self.input_weights)
        z = state.z.to_dense() if state.z.is_sparse else state.z
        shape, device = current.shape, current.device
        states = [getattr(state, k) for k in self.MODEL.states]
        spikes, *final = one_step.step(
            neuron_spec(self.MODEL, SUPERSPIKE, detach_reset=True),
            current,
            _step_params(self, current),
            [v if v.shape == shape and v.device == device else v.to(device).expand(shape) for v in states],
            x_rec=torch.nn.functional.linear(z.to(current.dtype), self.recurrent_weights),
        )
        return spikes, self.STATE(z=spikes.to(state.z.dtype), **dict(zip(self.MODEL.states, final)))

    def _fused(self, current: torch.Tensor, state) -> tuple:
        """All steps of ``current`` ``[T, B, H]`` in the fused recurrent layer: ``(spikes, (*states, spikes))``."""
        names = self.MODEL.states
        params = {k: v.to(current.device) for k, v in self.params().items()}  # Norse's records stay on the CPU
        return recurrent(
            current,
            self.MODEL,
            self.recurrent_weights,
            None,
            surrogate=SUPERSPIKE,
            detach_reset=True,
            backend=self.backend,
            memory=self.memory,
            return_state=True,
            state=(
                *(getattr(state, k).expand(current.shape[1:]) for k in names),
                (state.z.to_dense() if state.z.is_sparse else state.z).to(current.dtype).expand(current.shape[1:]),
            ),
            **params,
        )


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
    SPARSE_SPIKES = True

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


class LIFRecurrentCell(LIFRecurrent):
    """Norse 1.1's ``LIFRecurrentCell``: :class:`LIFRecurrent` one step a call, ``forward(x [B, I], state=None) ->
    (z [B, H], LIFState)``; the same weights as Norse draws them."""

    CELL = True


class LSNNRecurrentCell(LSNNRecurrent):
    """Norse 1.1's ``LSNNRecurrentCell``: :class:`LSNNRecurrent` one step a call, ``forward(x [B, I], state=None) ->
    (z [B, H], LSNNState)``; the same weights as Norse draws them."""

    CELL = True


LIState = _norse_state("LIState", ("v", "i"), "Norse's ``LIState``: the membrane, the input current.")


class LICell(nn.Module):
    """Norse 1.1's ``LICell``, a leaky integrator: one step a call, ``forward(x, state=None) -> (v, LIState)``, the
    membrane and state of Norse's ``li_feed_forward_step``, bit for bit (float32), with its gradients::

        i = i + x;  v = v + dt*tau_mem_inv*((v_leak - v) + i);  i = i + -dt*tau_syn_inv*i

    Plain torch operations in Norse's order, not a :class:`~spikefuse.neurons.NeuronModel`: a definition there
    always fires, and the engine's fused call hands out the last step's states where an integrator's output is its
    membrane at every step; the step is a linear recurrence of four element-wise operations. ``p``: Norse's
    ``LIParameters`` (its defaults when None; tensors, learnable ones too, each read at every call as Norse reads
    them); the state starts as Norse's (``v`` at ``v_leak``, ``i`` at 0); any shape, ``[F]`` without a batch
    too."""

    STEPS = False  # LI: the input is [T, ...] and every step's membrane is returned

    def __init__(self, p=None, dt: float = 0.001, record_states: bool = False):
        super().__init__()
        if p is None:
            from norse.torch import LIParameters

            p = LIParameters()
        if record_states and not self.STEPS:
            raise TypeError("record_states is an argument of LI, not of LICell")
        self.p, self.dt, self.record_states = p, dt, bool(record_states)

    def initial_state(self, x: torch.Tensor):
        """Norse's initial state: for a cell ``v`` the 0-d ``v_leak`` (broadcast by the first step) and ``i`` zeros
        of the input's dtype; for ``LI`` float32 ones of a step's shape. ``v`` requires a gradient, as Norse's."""
        if self.STEPS:
            v = torch.full(x.shape[1:], float(self.p.v_leak), device=x.device, dtype=torch.float32)
            i = torch.zeros(x.shape[1:], device=x.device, dtype=torch.float32)
        else:
            v, i = self.p.v_leak.detach(), torch.zeros(x.shape, device=x.device, dtype=x.dtype)
        v.requires_grad = True
        return LIState(v=v, i=i)

    def forward(self, input_tensor: torch.Tensor, state=None):
        x = input_tensor.to_dense() if input_tensor.is_sparse else input_tensor
        if self.STEPS and x.ndim < 1:
            raise ValueError(f"LI takes [T, ...] inputs (T steps), got shape {tuple(x.shape)}")
        state = self.initial_state(x) if state is None else state
        p = self.p
        dt_mem, neg_dt_syn = self.dt * p.tau_mem_inv, -self.dt * p.tau_syn_inv  # Norse's products, once a call
        v, i = state.v, state.i
        vs, currents = [], []
        for x_t in x.unbind(0) if self.STEPS else (x,):
            i = i + x_t
            v = v + dt_mem * ((p.v_leak - v) + i)
            i = i + neg_dt_syn * i
            vs.append(v)
            currents.append(i)
        if not self.STEPS:
            return v, LIState(v=v, i=i)
        if self.record_states:
            return torch.stack(vs), LIState(v=torch.stack(vs), i=torch.stack(currents))
        return torch.stack(vs), LIState(v=v, i=i)

    def extra_repr(self) -> str:
        return f"p={self.p}, dt={self.dt}"


class LI(LICell):
    """Norse 1.1's ``LI``: :class:`LICell` over the outer dimension, ``forward(x [T, ...], state=None) -> (v [T, ...],
    LIState)``, every step's membrane (``[T, F]`` without a batch too); ``record_states=True`` returns every step's
    states stacked, as Norse's. Norse's values bit for bit: its loop, in torch's operations (see :class:`LICell`)."""

    STEPS = True
