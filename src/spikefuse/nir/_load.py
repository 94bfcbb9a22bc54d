"""NIR graph -> spikefuse network."""

from __future__ import annotations

import os
import warnings
from collections import deque
from dataclasses import dataclass, replace

import nir
import numpy as np
import torch
from torch import nn

from ..neurons import CUBA_LIF_EULER, CUBA_LIF_HARD, LIF_MODELS, SPIKINGJELLY_MODELS
from ..nn import IF, LIF, Flatten, Recurrent, SeqToBatch
from ..surrogate import Sigmoid, Surrogate, resolve
from ._common import check_dt
from .modules import (
    CubaLeakyIntegrator,
    CubaLIFNode,
    EulerLIF,
    Integrator,
    LeakyIntegrator,
    Scale,
    SumPool2d,
    Threshold,
    euler_coefficient,
)

LIF_FORMS = ("auto", "decay", "euler")


@dataclass(frozen=True)
class _Options:
    dt: float
    lif_form: str
    surrogate: Surrogate
    backend: str


class NIRNetwork(nn.Module):
    """A NIR graph as a network on ``[T, B, *shape]`` input: one module per node, run in topological order; the
    outputs of all edges into a node are summed (in the graph's edge order) to form its input.

    ``layers`` maps node names to modules (``'.'`` in a name becomes ``'_'``, as ``nn.ModuleDict`` requires).
    """

    def __init__(
        self,
        layers: dict[str, nn.Module],
        sources: dict[str, list[str]],
        order: list[str],
        input_name: str,
        output_name: str,
    ):
        super().__init__()
        self.layers = nn.ModuleDict()
        self.module_keys: dict[str, str] = {}
        for name in order:
            key = name.replace(".", "_") or "node"
            while key in self.layers:
                key += "_"
            self.layers[key] = layers[name]
            self.module_keys[name] = key
        self.sources, self.order = sources, order
        self.input_name, self.output_name = input_name, output_name

    def _input_of(self, name: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        first, *rest = self.sources[name]
        total = values[first]
        for source in rest:
            total = total + values[source]
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = {self.input_name: x}
        for name in self.order:
            values[name] = self.layers[self.module_keys[name]](self._input_of(name, values))
        return self._input_of(self.output_name, values)


def _array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):  # some exporters (Norse) store torch tensors in the nodes
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def _weight(value) -> torch.Tensor:
    return torch.as_tensor(_array(value), dtype=torch.float32)


def _bias(what: str, value, weight: torch.Tensor) -> torch.Tensor:
    """``value`` as the bias of a layer of ``weight`` ``[out, ...]``; ValueError unless it holds one value per output
    (a wrong size would fail only in the forward pass, naming no node)."""
    bias = _weight(value)
    if tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{what}: bias must hold one value per output ({weight.shape[0]}), got shape {tuple(bias.shape)}"
        )
    return bias


def _ints(value, n: int, what: str, field: str) -> tuple[int, ...]:
    a = np.atleast_1d(np.asarray(value)).reshape(-1)
    if a.size == 1:
        a = np.repeat(a, n)
    if a.size != n or np.any(a != np.round(a)):
        raise ValueError(f"{what}: {field} must be one integer or {n}, got {value!r}")
    return tuple(int(v) for v in a)


def _padding(value, n: int, what: str):
    if isinstance(value, bytes):  # strings come back from HDF5 as bytes
        value = value.decode()
    if isinstance(value, str):
        return value
    return _ints(value, n, what, "padding")


def _uniform(what: str, field: str, values) -> float:
    """The one value of a per-neuron parameter array; ValueError if the neurons differ (never averaged)."""
    a = _array(values)
    if a.size == 0 or not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: {field} must hold finite numbers, got {a}")
    first = a.reshape(-1)[0]
    if np.any(a != first):
        raise ValueError(
            f"{what}: {field} differs between neurons (from {a.min()} to {a.max()}): spikefuse's neurons take one "
            f"{field} per layer, and per-neuron values are not averaged"
        )
    return float(first)


def _positive(what: str, field: str, values) -> np.ndarray:
    a = _array(values)
    if a.size == 0 or not np.all(np.isfinite(a) & (a > 0)):
        raise ValueError(f"{what}: {field} must hold finite numbers > 0, got {a}")
    return a


def _per_channel(what: str, field: str, values) -> np.ndarray:
    """One value (0-d) or one per channel (dim 0 of the neuron shape); ValueError if it varies within a channel."""
    a = _positive(what, field, values)
    if np.all(a == a.reshape(-1)[0]):
        return np.asarray(a.reshape(-1)[0])
    per_channel = a.reshape(a.shape[0], -1)
    if np.any(per_channel != per_channel[:, :1]):
        raise ValueError(
            f"{what}: {field} varies within a channel (dim 0 of its shape {a.shape}): spikefuse's decay is one "
            "value per layer or per channel"
        )
    return per_channel[:, 0].copy()


def _after_scale(scale: np.ndarray, neuron: nn.Module) -> nn.Module:
    """``neuron`` fed through ``Scale(scale)``, or alone where the float32 scale is 1 (x*1 = x exactly)."""
    if np.all(scale.astype(np.float32) == 1):
        return neuron
    return nn.Sequential(Scale(scale), neuron)


def _lif(what: str, node: nir.LIF, opts: _Options) -> nn.Module:
    tau = _per_channel(what, "tau", node.tau)
    threshold = _uniform(what, "v_threshold", node.v_threshold)
    v_reset = _uniform(what, "v_reset", node.v_reset)
    r, v_leak = _array(node.r), _array(node.v_leak)
    if opts.lif_form == "euler":
        leak_to = _uniform(what, "v_leak", v_leak)
        if leak_to != v_reset:
            raise ValueError(
                f"{what}: lif_form='euler' runs NIR's LIF on a kernel that resets to v_leak, so it needs "
                f"v_reset == v_leak, got v_reset={v_reset}, v_leak={leak_to}"
            )
        return EulerLIF(tau, r, leak_to, threshold, opts.dt, opts.surrogate, opts.backend)
    if np.any(v_leak != 0):
        raise ValueError(
            f"{what}: v_leak must be 0 for lif_form='decay': spikefuse's LIF leaks toward 0 (h = k*h + x) and has no "
            "constant drive dt/tau*v_leak nor a resting state at v_leak; lif_form='euler' supports v_leak = v_reset"
        )
    if v_reset != 0:
        raise ValueError(
            f"{what}: v_reset must be 0 for lif_form='decay': after a spike spikefuse's LIF restarts at v_reset + x, "
            "NIR's at (1 - dt/tau)*v_reset + x; lif_form='euler' supports v_reset = v_leak"
        )
    decay = 1 - opts.dt / tau
    if decay.ndim == 0:
        neuron = LIF(
            decay=float(decay), threshold=threshold, v_reset=0.0, surrogate=opts.surrogate, backend=opts.backend
        )
    else:
        # spikefuse's per-channel decay is a learnable parameter; NIR's time constants are fixed: freeze it.
        neuron = LIF(
            threshold=threshold,
            v_reset=0.0,
            surrogate=opts.surrogate,
            backend=opts.backend,
            learnable_decay=True,
            channels=decay.size,
        )
        neuron.decay.data = torch.as_tensor(decay, dtype=torch.float32)
        neuron.decay.requires_grad_(False)
    return _after_scale(opts.dt * r / _array(node.tau), neuron)


def _cuba_lif(what: str, node: nir.CubaLIF, opts: _Options) -> nn.Module:
    tau_syn = _per_channel(what, "tau_syn", node.tau_syn)
    tau_mem = _per_channel(what, "tau_mem", node.tau_mem)
    threshold = _uniform(what, "v_threshold", node.v_threshold)
    v_reset = _uniform(what, "v_reset", node.v_reset)
    if _uniform(what, "v_leak", node.v_leak) != 0:
        raise ValueError(f"{what}: v_leak must be 0: spikefuse's CubaLIF starts from and leaks toward 0")
    fields = {
        "tau_syn": _array(node.tau_syn),
        "tau_mem": _array(node.tau_mem),
        "r": _array(node.r),
        "w_in": _array(node.w_in),
        "v_leak": _array(node.v_leak),
        "v_threshold": _array(node.v_threshold),
        "v_reset": _array(node.v_reset),
    }

    def f32(a):
        return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=torch.float32).reshape(-1)

    if opts.lif_form == "euler":
        params = {
            "a_syn": euler_coefficient(tau_syn, opts.dt).reshape(-1),
            "a_mem": euler_coefficient(tau_mem, opts.dt).reshape(-1),
            "w_in": _uniform(what, "w_in", node.w_in),
            "r": _uniform(what, "r", node.r),
            "v_leak": 0.0,
            "v_threshold": threshold,
            "v_reset": v_reset,
        }
        return CubaLIFNode(CUBA_LIF_EULER, params, fields, opts.dt, None, opts.surrogate, opts.backend)
    if v_reset != 0:
        raise ValueError(
            f"{what}: v_reset must be 0 for lif_form='decay' (its reset zeroes the membrane); "
            "lif_form='euler' resets to any v_reset"
        )
    membrane_scale = (_array(node.r) * opts.dt / _array(node.tau_mem)).astype(np.float32)
    if np.any(membrane_scale != 1):
        raise ValueError(
            f"{what}: lif_form='decay' needs r = tau_mem/dt (the current enters the membrane unscaled, "
            f"as snnTorch and spikefuse export it), got r*dt/tau_mem = {membrane_scale.reshape(-1)[:4]}; "
            "lif_form='euler' takes any r"
        )
    input_scale = _uniform(
        what, "w_in*dt/tau_syn", (_array(node.w_in) * opts.dt / _array(node.tau_syn)).astype(np.float32)
    )
    params = {"alpha": f32(1 - opts.dt / tau_syn), "beta": f32(1 - opts.dt / tau_mem), "threshold": threshold}
    return CubaLIFNode(
        CUBA_LIF_HARD, params, fields, opts.dt, None if input_scale == 1 else input_scale, opts.surrogate, opts.backend
    )


def _recurrent(what: str, node, w_rec, opts: _Options) -> nn.Module:
    """A neuron node (LIF or CubaLIF) with the recurrent connection ``w_rec`` (Affine or Linear) that feeds it its
    own spikes of the previous step: a :class:`spikefuse.nn.Recurrent` of the neuron :func:`load` builds for the
    node alone (one to one where the weight is diagonal). The node's input scale (1 in graphs from spikefuse and
    snnTorch) applies to the recurrent current too: it is folded into the recurrent weight and bias, and a
    :class:`Scale` in front scales the layer's input."""
    weight = _weight(w_rec.weight)
    hidden = weight.shape[0]
    if weight.ndim != 2 or weight.shape != (hidden, hidden):
        raise ValueError(f"{what}: its recurrent weight must be a square matrix, got shape {tuple(weight.shape)}")
    bias = _weight(w_rec.bias) if isinstance(w_rec, nir.Affine) else None

    def per_neuron(values) -> torch.Tensor:
        a = np.broadcast_to(np.asarray(values, dtype=np.float64), (hidden,))
        return torch.as_tensor(a.copy() if np.any(a != a[0]) else a[:1].copy(), dtype=torch.float32)

    if isinstance(node, nir.LIF):
        tau, r = _positive(what, "tau", node.tau), _array(node.r)
        threshold, v_reset = _uniform(what, "v_threshold", node.v_threshold), _uniform(what, "v_reset", node.v_reset)
        if opts.lif_form == "euler":
            if _uniform(what, "v_leak", node.v_leak) != v_reset:
                raise ValueError(f"{what}: lif_form='euler' needs v_reset == v_leak, got {v_reset} and {node.v_leak}")
            model = SPIKINGJELLY_MODELS[("hard", "mul_input")]
            params = {"decay": per_neuron(euler_coefficient(tau, opts.dt)), "threshold": threshold, "v_reset": v_reset}
            scale = r
        else:
            if np.any(_array(node.v_leak) != 0) or v_reset != 0:
                raise ValueError(
                    f"{what}: lif_form='decay' needs v_leak = v_reset = 0; lif_form='euler' takes v_reset = v_leak"
                )
            model = LIF_MODELS[("paper", "hard")]
            params = {"decay": per_neuron(1 - opts.dt / tau), "threshold": threshold, "v_reset": 0.0}
            scale = opts.dt * r / tau
    elif isinstance(node, nir.CubaLIF):
        cuba = _cuba_lif(what, node, opts)
        model, params = cuba.model, {**cuba.scalars, **{k: getattr(cuba, f"param_{k}") for k in cuba.tensor_names}}
        if model is CUBA_LIF_EULER:  # the input enters through w_in inside the step: nothing to scale outside
            scale = np.float64(1.0)
        else:
            scale = np.float64(1.0 if cuba.input_scale is None else cuba.input_scale)
    else:
        raise ValueError(
            f"{what}: a recurrent connection feeds a {type(node).__name__}; spikefuse's recurrent layers "
            "take LIF and CubaLIF neurons"
        )
    scale = np.broadcast_to(np.asarray(scale, dtype=np.float64), (hidden,)).astype(np.float32)
    diagonal = torch.equal(weight, torch.diag(torch.diagonal(weight)))
    layer = Recurrent(
        model,
        hidden,
        all_to_all=not diagonal,
        bias=bias is not None,
        surrogate=opts.surrogate,
        backend=opts.backend,
        **params,
    )
    factor = torch.as_tensor(scale)
    weight = torch.diagonal(weight) if diagonal else weight
    with torch.no_grad():
        w, b = layer.recurrent_weights()
        w.copy_(weight if np.all(scale == 1) else weight * (factor if diagonal else factor[:, None]))
        if b is not None:
            b.copy_(bias if np.all(scale == 1) else bias * factor)
    return layer if np.all(scale == 1) else nn.Sequential(Scale(scale), layer)


def _in_form(what: str, build, opts: _Options) -> nn.Module:
    """``build(opts)`` in ``opts.lif_form``; with "auto", the bit-compatible "decay" form where the node's parameters
    allow it, else forward Euler as written, with a warning that names the node and why."""
    if opts.lif_form != "auto":
        return build(opts)
    try:
        return build(replace(opts, lif_form="decay"))
    except ValueError as decay_error:
        try:
            module = build(replace(opts, lif_form="euler"))
        except ValueError as euler_error:
            raise ValueError(f"{what}: neither lif_form fits: 'decay': {decay_error}; 'euler': {euler_error}") from None
        warnings.warn(f"{what} loaded with lif_form='euler' (forward Euler as written): {decay_error}", stacklevel=4)
        return module


_NOT_YET = {
    nir.Delay: "spikefuse has no delay layer yet",
}


def _module(name: str, node, opts: _Options) -> nn.Module:
    what = f"node {name!r} ({type(node).__name__})"
    if isinstance(node, nir.NIRGraph):
        return _network(node, opts)
    if type(node) in _NOT_YET:
        raise NotImplementedError(f"{what} is not supported yet: {_NOT_YET[type(node)]}")
    if isinstance(node, (nir.Affine, nir.Linear)):
        weight = _weight(node.weight)
        if weight.ndim != 2:
            raise ValueError(f"{what}: weight must be a matrix [out, in], got shape {tuple(weight.shape)}")
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=isinstance(node, nir.Affine))
        layer.weight.data = weight
        if layer.bias is not None:
            layer.bias.data = _bias(what, node.bias, weight)
        return SeqToBatch(layer)
    if isinstance(node, (nir.Conv1d, nir.Conv2d)):
        d = 1 if isinstance(node, nir.Conv1d) else 2
        weight = _weight(node.weight)
        groups = int(node.groups)
        layer = (nn.Conv1d if d == 1 else nn.Conv2d)(
            weight.shape[1] * groups,
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=_ints(node.stride, d, what, "stride"),
            padding=_padding(node.padding, d, what),
            dilation=_ints(node.dilation, d, what, "dilation"),
            groups=groups,
            bias=node.bias is not None,
        )
        layer.weight.data = weight
        if node.bias is not None:
            layer.bias.data = _bias(what, node.bias, weight)
        return SeqToBatch(layer)
    if isinstance(node, nir.Flatten):
        start, end = int(node.start_dim), int(node.end_dim)  # dims of the per-sample shape
        if (start, end) == (0, -1):
            return Flatten()
        return SeqToBatch(nn.Flatten(start + 1 if start >= 0 else start, end + 1 if end >= 0 else end))
    if isinstance(node, (nir.AvgPool2d, nir.SumPool2d)):
        kernel = _ints(node.kernel_size, 2, what, "kernel_size")
        stride = _ints(node.stride, 2, what, "stride")
        padding = _ints(node.padding, 2, what, "padding")
        if isinstance(node, nir.SumPool2d):
            return SeqToBatch(SumPool2d(kernel, stride, padding))
        shape = (node.input_type or {}).get("input")
        if shape is not None and len(shape) == 3 and tuple(shape[1:]) == kernel and not any(padding):
            # Global average pooling: the op spikefuse's models use (avg_pool2d sums in another order, so the
            # last bit of the mean could differ from a spikefuse model's).
            return SeqToBatch(nn.AdaptiveAvgPool2d(1))
        return SeqToBatch(nn.AvgPool2d(kernel, stride, padding))
    if isinstance(node, nir.Scale):
        return Scale(_array(node.scale))
    if isinstance(node, nir.Threshold):
        return Threshold(_array(node.threshold))
    if isinstance(node, nir.I):
        return Integrator(_array(node.r))
    if isinstance(node, nir.CubaLI):
        return CubaLeakyIntegrator(
            _positive(what, "tau_syn", node.tau_syn),
            _positive(what, "tau_mem", node.tau_mem),
            _array(node.r),
            _array(node.v_leak),
            _array(node.w_in),
            opts.dt,
        )
    if isinstance(node, nir.LI):
        return LeakyIntegrator(_positive(what, "tau", node.tau), _array(node.r), _array(node.v_leak), opts.dt)
    if isinstance(node, nir.IF):
        neuron = IF(
            threshold=_uniform(what, "v_threshold", node.v_threshold),
            v_reset=_uniform(what, "v_reset", node.v_reset),
            surrogate=opts.surrogate,
            backend=opts.backend,
        )
        return _after_scale(_array(node.r), neuron)
    if isinstance(node, nir.LIF):
        return _in_form(what, lambda o: _lif(what, node, o), opts)
    if isinstance(node, nir.CubaLIF):
        return _in_form(what, lambda o: _cuba_lif(what, node, o), opts)
    raise ValueError(f"{what}: not a NIR node type spikefuse knows")


def _network(graph: nir.NIRGraph, opts: _Options) -> NIRNetwork:
    inputs = [n for n, node in graph.nodes.items() if isinstance(node, nir.Input)]
    outputs = [n for n, node in graph.nodes.items() if isinstance(node, nir.Output)]
    if len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(f"a graph needs one Input and one Output node, got inputs {inputs} and outputs {outputs}")
    (input_name,), (output_name,) = inputs, outputs
    sources: dict[str, list[str]] = {name: [] for name in graph.nodes}
    consumers: dict[str, list[str]] = {name: [] for name in graph.nodes}
    for edge in graph.edges:
        a, b = str(edge[0]), str(edge[1])
        if a not in graph.nodes or b not in graph.nodes:
            raise ValueError(f"edge {(a, b)} names a node that is not in the graph")
        if b == input_name:
            raise ValueError(f"edge {(a, b)} leads into the Input node: the Input only feeds the graph")
        if a == output_name:
            raise ValueError(f"edge {(a, b)} leaves the Output node: the Output only collects the graph's result")
        if a in sources[b]:
            raise ValueError(f"edge {(a, b)} is repeated")
        sources[b].append(a)
        consumers[a].append(b)
    reached, frontier = {input_name}, [input_name]
    while frontier:
        for consumer in consumers[frontier.pop()]:
            if consumer not in reached:
                reached.add(consumer)
                frontier.append(consumer)
    unreached = [name for name in graph.nodes if name not in reached]
    if unreached:
        raise ValueError(
            f"nodes {unreached} are not reached from the graph's Input (no path of edges leads to them): a network "
            "cannot run them"
        )
    # A recurrent layer: a neuron and a weight node that only it feeds and that only feeds it (NIR's cycle, a
    # one-step delay implied): one spikefuse layer, and the cycle leaves the graph. Weights are never the neuron
    # (two weights in a loop are a cycle to refuse); every node is reached, so the neuron has another source.
    recurrent = {}
    for name, node in graph.nodes.items():
        if isinstance(node, (nir.Affine, nir.Linear)) and len(sources[name]) == 1 and consumers[name] == sources[name]:
            (neuron,) = sources[name]
            if neuron not in recurrent and not isinstance(graph.nodes[neuron], (nir.Affine, nir.Linear)):
                recurrent[neuron] = name
    for neuron, w_rec in recurrent.items():
        sources[neuron].remove(w_rec)
        consumers[neuron].remove(w_rec)
        sources[w_rec], consumers[w_rec] = [], []
    # Kahn's algorithm: a node runs once all its sources have.
    waiting = {name: len(sources[name]) for name in graph.nodes}
    ready, order = deque([input_name]), []
    while ready:
        name = ready.popleft()
        if name not in (input_name, output_name):
            order.append(name)
        for consumer in consumers[name]:
            waiting[consumer] -= 1
            if waiting[consumer] == 0:
                ready.append(consumer)
    stuck = [n for n in graph.nodes if waiting[n] > 0]
    if stuck:
        raise ValueError(
            f"the graph has a cycle (through {stuck}) other than a neuron's own recurrent connection: spikefuse "
            "loads a recurrent layer as a neuron node (LIF, CubaLIF) and an Affine or Linear node that only it "
            "feeds and that only feeds it"
        )
    order = [name for name in order if name not in recurrent.values()]

    def recurrent_layer(name: str) -> nn.Module:
        what = f"node {name!r} ({type(graph.nodes[name]).__name__})"
        w_rec = graph.nodes[recurrent[name]]
        if isinstance(w_rec, nir.Affine) and np.ndim(w_rec.weight) == 2:
            _bias(f"node {recurrent[name]!r} (Affine)", w_rec.bias, _weight(w_rec.weight))
        return _in_form(what, lambda o: _recurrent(what, graph.nodes[name], graph.nodes[recurrent[name]], o), opts)

    layers = {
        name: recurrent_layer(name) if name in recurrent else _module(name, graph.nodes[name], opts) for name in order
    }
    return NIRNetwork(layers, sources, order, input_name, output_name)


#: What NIR's own reading raises on a file that is HDF5 but not a NIR graph it can build (it asserts some shapes).
_NOT_A_GRAPH = (KeyError, ValueError, TypeError, AttributeError, IndexError, AssertionError)


def _read(path) -> nir.NIRGraph:
    """The graph of a NIR file, read as ``nir.read`` reads it (the ``node`` group as a dict, built by
    ``nir.dict2NIRNode``) but through :func:`spikefuse.hdf5.open_hdf5`: what would read another file or more data
    than the file holds is refused before anything is read, and the graph is built from the checked file's own
    datasets. ValueError naming the file for every problem."""
    import h5py

    from ..hdf5 import open_hdf5

    with open_hdf5(path, what="NIR file") as h5:
        if not isinstance(h5.file.get("node"), h5py.Group):
            h5.fail("no group 'node': not a NIR file")

        def tree(group) -> dict:  # the checked file holds hard links only, no loops, a bounded depth
            out = {}
            for name, item in group.items():
                if isinstance(item, h5py.Group):
                    out[name] = tree(item)
                elif isinstance(item, h5py.Dataset):
                    value = h5.read(item.name[1:])
                    out[name] = value.decode("utf8") if isinstance(value, bytes) else value
            return out

        try:
            data = tree(h5.file["node"])
            if "type_check" in data:
                raise ValueError("a 'type_check' entry in the graph clashes with nir.read's type_check parameter")
            return nir.dict2NIRNode({**data, "type_check": True})
        except _NOT_A_GRAPH as err:
            h5.fail(f"not a NIR graph ({type(err).__name__}: {err})".replace("\n", " "))


def load(graph, dt: float = 1e-4, *, lif_form: str = "auto", surrogate=Sigmoid(4.0), backend: str = "auto"):
    """A spikefuse network (:class:`NIRNetwork`) on ``[T, B, *shape]`` input from a NIR graph or a NIR file.

    ``dt`` is the time step to integrate the graph's time constants with (Norse exports for ``dt = 1e-3`` by
    default, snnTorch for ``1e-4``). ``lif_form`` picks the arithmetic of NIR's LIF, forward Euler either way
    ("auto", the default: "decay" for each node whose parameters allow it, else "euler", with a warning naming
    the node):

    - ``"decay"``: spikefuse's :class:`~spikefuse.nn.LIF`, ``h = k*h + x`` with ``k = 1 - dt/tau`` and the input
      scaled by ``dt*r/tau`` (a :class:`Scale` in front, left out where it is 1 in float32, as in graphs from
      spikefuse and snnTorch); needs ``v_leak = v_reset = 0``.
    - ``"euler"``: :class:`EulerLIF`, ``v + dt/tau*((v_leak - v) + r*x)`` as written (Norse's arithmetic);
      needs ``v_reset = v_leak``.

    NIR's CubaLIF likewise (:class:`CubaLIFNode`, on the neuron engine; ``v_leak = 0``): ``"decay"`` is snnTorch's
    ``i = alpha*i + x``, ``v = beta*v + i`` with the membrane zeroed in the step of a spike (``alpha = 1 -
    dt/tau_syn``, ``beta = 1 - dt/tau_mem``, input scaled by ``w_in*dt/tau_syn``; needs ``r = tau_mem/dt`` and
    ``v_reset = 0``), ``"euler"`` the Euler steps as written with Norse's arithmetic (any ``r``, ``w_in``,
    ``v_reset``).

    A recurrent connection, an ``Affine`` or ``Linear`` node that only a LIF or CubaLIF node feeds and that only
    feeds it (what :func:`export` and snnTorch's ``export_to_nir`` write for recurrent layers), loads with its
    neuron as one :class:`spikefuse.nn.Recurrent` layer: the recurrent current of a step is that of the previous
    step's spikes. Spiking neurons run on the fused kernels of ``backend`` with ``surrogate`` for training;
    parameters are float32. Raises ValueError (naming the node and parameter) for what spikefuse cannot represent exactly, e.g.
    thresholds that differ between neurons, and NotImplementedError for node types it does not support yet
    (Delay). A file is read through :func:`spikefuse.hdf5.open_hdf5`: no link or storage outside it, no more data
    than it can hold; one ValueError naming the file for anything malformed.
    """
    if lif_form not in LIF_FORMS:
        raise ValueError(f"lif_form must be one of {LIF_FORMS}, got {lif_form!r}")
    opts = _Options(check_dt(dt), lif_form, resolve(surrogate), backend)
    if isinstance(graph, (str, os.PathLike)):
        graph = _read(graph)
    if not isinstance(graph, nir.NIRGraph):
        raise TypeError(f"graph must be a nir.NIRGraph or the path of a NIR file, got {type(graph).__name__}")
    return _network(graph, opts)
