"""The modules a NIR graph loads into besides spikefuse's own layers (:class:`~spikefuse.nn.LIF`,
:class:`~spikefuse.nn.IF`, :class:`~spikefuse.nn.SeqToBatch`, :class:`~spikefuse.nn.Flatten`).

Each runs on time-major ``[T, B, *shape]`` input (``SumPool2d`` on ``[N, C, H, W]``, wrapped in ``SeqToBatch`` like
every per-step layer) and keeps the NIR parameters it was built from, so that :func:`spikefuse.nir.export` writes
the same node back. Parameters broadcast against the per-sample ``shape`` (a scalar, one value per channel as
``[C, 1, 1]``, or one per neuron).

:class:`EulerLIF` runs on the fused kernels. :class:`LeakyIntegrator` and :class:`Integrator` output membrane
potentials, not spikes, and are **not fused**: they are plain PyTorch loops over T (one small elementwise update
per step, differentiable by autograd), fine for the read-out layers they usually are.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..functional import run_lif
from ..neurons.lif import SPIKINGJELLY_MODELS, lif_spec
from ..neurons.spec import NeuronSpec
from ..surrogate import Sigmoid, resolve

__all__ = [
    "Scale",
    "Threshold",
    "SumPool2d",
    "LeakyIntegrator",
    "Integrator",
    "EulerLIF",
    "CubaLIFNode",
    "CubaLeakyIntegrator",
]


def _float32(values) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.float64), dtype=torch.float32)


def _float64(values) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def euler_coefficient(tau, dt: float) -> torch.Tensor:
    """``dt/tau`` in float32, computed as Norse computes ``dt * tau_mem_inv`` with ``tau_mem_inv = 1/tau``: the
    reciprocal of the float32 ``tau`` rounded to float32, times ``dt``, rounded to float32."""
    return _float32(tau).reciprocal() * dt


def _check_multistep(module: nn.Module, x: torch.Tensor) -> None:
    if x.ndim < 2:
        raise ValueError(f"{type(module).__name__} expects [T, B, ...] input, got shape {tuple(x.shape)}")


class Scale(nn.Module):
    """NIR ``Scale``: ``y = x * scale``, elementwise (``scale`` broadcasts against the per-sample shape)."""

    def __init__(self, scale):
        super().__init__()
        self.register_buffer("scale", _float32(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"shape={tuple(self.scale.shape)}"


class Threshold(nn.Module):
    """NIR ``Threshold``: ``y = (x > threshold)`` in ``x``'s dtype, stateless.

    Forward only: the Heaviside step has zero gradient and no surrogate here (spiking neurons have one).
    """

    def __init__(self, threshold):
        super().__init__()
        self.register_buffer("threshold", _float32(threshold))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > self.threshold).to(x.dtype)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.threshold.shape)}"


class SumPool2d(nn.Module):
    """NIR ``SumPool2d`` on ``[N, C, H, W]``: the sum over each window (zero padding), as ``avg_pool2d`` with
    ``divisor_override=1`` computes it (the sum divided by 1 is the sum, exactly)."""

    def __init__(self, kernel_size, stride, padding):
        super().__init__()
        self.kernel_size = tuple(int(k) for k in np.broadcast_to(kernel_size, 2))
        self.stride = tuple(int(s) for s in np.broadcast_to(stride, 2))
        self.padding = tuple(int(p) for p in np.broadcast_to(padding, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, divisor_override=1)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class LeakyIntegrator(nn.Module):
    """NIR ``LI``: ``tau dv/dt = (v_leak - v) + r*I`` by forward Euler, outputs ``v`` at every step (no spikes).

    ``v[t] = v[t-1] + a * ((v_leak - v[t-1]) + r*x[t])`` with ``a = dt/tau`` (:func:`euler_coefficient`) and
    ``v[0] = v_leak``: Norse's ``LIBoxCell`` step, bit for bit when ``r = 1``. Not fused (a loop over T).
    """

    def __init__(self, tau, r, v_leak, dt: float):
        super().__init__()
        self.tau, self.r, self.v_leak, self.dt = _float64(tau), _float64(r), _float64(v_leak), float(dt)
        self.register_buffer("coefficient", euler_coefficient(self.tau, self.dt))
        self.register_buffer("resistance", _float32(self.r))
        self.register_buffer("leak_potential", _float32(self.v_leak))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_multistep(self, x)
        v = self.leak_potential.expand(x.shape[1:])
        potentials = []
        for x_t in x.unbind(0):
            v = v + self.coefficient * ((self.leak_potential - v) + self.resistance * x_t)
            potentials.append(v)
        return torch.stack(potentials)

    def extra_repr(self) -> str:
        return f"shape={self.tau.shape}, dt={self.dt}"


class CubaLeakyIntegrator(nn.Module):
    """NIR ``CubaLI``: ``tau_syn dI/dt = -I + w_in*S``, ``tau_mem dv/dt = (v_leak - v) + r*I`` by forward Euler,
    outputs ``v`` at every step (no spikes): the current-based twin of :class:`LeakyIntegrator`, with the same
    arithmetic (Norse's box cells)::

        I[t] = I[t-1] + a_syn * ((0 - I[t-1]) + w_in*x[t])
        v[t] = v[t-1] + a_mem * ((v_leak - v[t-1]) + r*I[t])

    ``a = dt/tau`` (:func:`euler_coefficient`), ``I[0] = 0``, ``v[0] = v_leak``. Not fused (a loop over T).
    """

    def __init__(self, tau_syn, tau_mem, r, v_leak, w_in, dt: float):
        super().__init__()
        self.tau_syn, self.tau_mem = _float64(tau_syn), _float64(tau_mem)
        self.r, self.v_leak, self.w_in, self.dt = _float64(r), _float64(v_leak), _float64(w_in), float(dt)
        self.register_buffer("a_syn", euler_coefficient(self.tau_syn, self.dt))
        self.register_buffer("a_mem", euler_coefficient(self.tau_mem, self.dt))
        self.register_buffer("resistance", _float32(self.r))
        self.register_buffer("input_weight", _float32(self.w_in))
        self.register_buffer("leak_potential", _float32(self.v_leak))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_multistep(self, x)
        i = torch.zeros_like(x[0])
        v = self.leak_potential.expand(x.shape[1:])
        potentials = []
        for x_t in x.unbind(0):
            i = i + self.a_syn * ((0 - i) + self.input_weight * x_t)
            v = v + self.a_mem * ((self.leak_potential - v) + self.resistance * i)
            potentials.append(v)
        return torch.stack(potentials)

    def extra_repr(self) -> str:
        return f"shape={self.tau_mem.shape}, dt={self.dt}"


class Integrator(nn.Module):
    """NIR ``I`` (integrator): ``v[t] = v[t-1] + r*x[t]`` from ``v[0] = 0``, outputs ``v`` at every step.

    Integrated per time step, as Norse and SpiNNaker2 read NIR's ``IF`` (``dv/dt = R*I`` without a ``dt`` factor).
    Not fused (a loop over T; ``torch.cumsum`` would accumulate float32 in float64 on the CPU, another rounding).
    """

    def __init__(self, r):
        super().__init__()
        self.r = _float64(r)
        self.register_buffer("resistance", _float32(self.r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_multistep(self, x)
        v = torch.zeros_like(x[0])
        potentials = []
        for x_t in x.unbind(0):
            v = v + self.resistance * x_t
            potentials.append(v)
        return torch.stack(potentials)

    def extra_repr(self) -> str:
        return f"shape={self.r.shape}"


class EulerLIF(nn.Module):
    """NIR ``LIF`` integrated by forward Euler literally, on the fused kernels (all T steps in one call).

    ``h[t] = u[t-1] + ((r*x[t]) - (u[t-1] - v_leak)) * a`` with ``a = dt/tau`` (:func:`euler_coefficient`),
    spike ``s[t] = (h[t] >= threshold)``, post-reset ``u[t] = v_leak if s[t] else h[t]``, ``u[0] = v_leak``. This is
    Norse's ``LIFBoxCell`` step bit for bit when ``v_leak = v_reset = 0`` and ``r = 1`` (Norse fires on ``>``, so
    spikes differ only where ``h`` equals the threshold exactly). It is SpikingJelly's LIF definition
    ``SPIKINGJELLY_MODELS[("hard", "mul_input")]`` with ``decay = a``, so it needs ``v_reset == v_leak``.

    ``tau`` is one value or one per channel (channel = dim 2 of ``[T, B, C, ...]``), ``r`` broadcasts against the
    per-sample shape, ``v_leak`` (= ``v_reset``) and ``threshold`` are numbers.
    """

    def __init__(self, tau, r, v_leak: float, threshold: float, dt: float, surrogate=Sigmoid(4.0), backend="auto"):
        super().__init__()
        self.tau, self.r, self.dt = _float64(tau), _float64(r), float(dt)
        if self.tau.ndim > 1:
            raise ValueError(f"tau must be a number or one value per channel, got shape {self.tau.shape}")
        self.v_leak, self.threshold = float(v_leak), float(threshold)
        self.surrogate = resolve(surrogate)
        self.backend = backend
        self.register_buffer("coefficient", euler_coefficient(self.tau, self.dt))
        # r = 1 multiplies by 1 exactly; skipping it spares a pass over the input.
        self.register_buffer("resistance", None if np.all(self.r == 1) else _float32(self.r))

    def neuron(self) -> NeuronSpec:
        """SpikingJelly's hard-reset LIF with the ``mul_input`` charge (``k = a``), resetting to ``v_leak``."""
        return lif_spec(
            SPIKINGJELLY_MODELS[("hard", "mul_input")],
            self.threshold,
            self.v_leak,
            True,
            self.surrogate,
            backend=self.backend,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_multistep(self, x)
        if self.resistance is not None:
            x = x * self.resistance
        spikes, _ = run_lif(x, self.coefficient, self.neuron())
        return spikes

    def extra_repr(self) -> str:
        return (
            f"tau_shape={self.tau.shape}, dt={self.dt}, v_leak={self.v_leak}, threshold={self.threshold}, "
            f"surrogate={self.surrogate}, backend={self.backend!r}"
        )


class CubaLIFNode(nn.Module):
    """NIR ``CubaLIF`` on the neuron engine's kernels (:func:`spikefuse.neuron`): ``model`` is
    :data:`~spikefuse.neurons.CUBA_LIF_HARD` (``lif_form="decay"``, snnTorch's arithmetic) or
    :data:`~spikefuse.neurons.CUBA_LIF_EULER` (``lif_form="euler"``, Norse's), ``params`` its parameters (numbers
    or float32 tensors of one value or one per channel), ``input_scale`` a number the input is multiplied by first
    (None: not scaled). ``fields`` keeps the NIR node's parameters, so that :func:`spikefuse.nir.export` writes the
    same node back; :func:`spikefuse.nir.load` builds it (see there for the mapping)."""

    def __init__(
        self, model, params: dict, fields: dict, dt: float, input_scale=None, surrogate=Sigmoid(4.0), backend="auto"
    ):
        super().__init__()
        self.model, self.fields, self.dt = model, {k: _float64(v) for k, v in fields.items()}, float(dt)
        self.surrogate, self.backend = resolve(surrogate), backend
        self.scalars = {k: float(v) for k, v in params.items() if not isinstance(v, torch.Tensor)}
        self.tensor_names = [k for k, v in params.items() if isinstance(v, torch.Tensor)]
        for k in self.tensor_names:
            self.register_buffer(f"param_{k}", params[k])
        self.input_scale = None if input_scale is None else float(input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..neuron_functional import neuron

        _check_multistep(self, x)
        if self.input_scale is not None:
            x = x * self.input_scale
        params = {**self.scalars, **{k: getattr(self, f"param_{k}") for k in self.tensor_names}}
        return neuron(x, self.model, surrogate=self.surrogate, backend=self.backend, **params)

    def extra_repr(self) -> str:
        return f"model={self.model.name}, dt={self.dt}, surrogate={self.surrogate}, backend={self.backend!r}"
