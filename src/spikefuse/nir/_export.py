"""spikefuse network -> NIR graph, and the BatchNorm folding that makes Spiking-ResNets exportable."""

from __future__ import annotations

import copy

import nir
import numpy as np
import torch
from torch import nn

from ..neurons import CUBA_LIF_HARD, LIF_MODELS
from ..nn import LIF, BatchNormLIF1d, BatchNormLIF2d, CubaLIF, EngineNeuron, Flatten, Recurrent, SeqToBatch
from ._common import check_dt
from ._trace import INPUT, OUTPUT, trace
from .modules import (
    CubaLeakyIntegrator,
    CubaLIFNode,
    EulerLIF,
    Integrator,
    LeakyIntegrator,
    Scale,
    SumPool2d,
    Threshold,
)

_LAYERS = (
    SeqToBatch,
    LIF,
    Flatten,
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    BatchNormLIF1d,
    BatchNormLIF2d,
    Scale,
    Threshold,
    LeakyIntegrator,
    Integrator,
    EulerLIF,
    EngineNeuron,
    CubaLIFNode,
    CubaLeakyIntegrator,
)


def _is_layer(module: nn.Module) -> bool:
    """A module that is one NIR node. ``nn.Linear`` / ``nn.ConvNd`` outside ``SeqToBatch`` are spikefuse's
    multi-step ``SpikeLinear`` / ``SpikeConvNd`` (or a linear layer on the last dim): the same per-step layer."""
    return isinstance(module, _LAYERS)


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy().copy()


def _pair(value) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _per_step_node(layer: nn.Module, what: str, shape: tuple[int, ...]):
    if isinstance(layer, nn.Linear):
        weight = _array(layer.weight)
        return nir.Linear(weight=weight) if layer.bias is None else nir.Affine(weight=weight, bias=_array(layer.bias))
    if isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        if layer.padding_mode != "zeros":
            raise ValueError(f"{what}: padding_mode={layer.padding_mode!r}; NIR convolutions pad with zeros")
        bias = torch.zeros(layer.out_channels, dtype=layer.weight.dtype) if layer.bias is None else layer.bias
        args = dict(weight=_array(layer.weight), groups=layer.groups, bias=_array(bias))
        padding = layer.padding  # 'same' / 'valid', or a tuple of ints
        if isinstance(layer, nn.Conv1d):
            return nir.Conv1d(
                input_shape=shape[1],
                stride=layer.stride[0],
                dilation=layer.dilation[0],
                padding=padding if isinstance(padding, str) else padding[0],
                **args,
            )
        return nir.Conv2d(
            input_shape=tuple(shape[1:]),
            stride=tuple(layer.stride),
            dilation=tuple(layer.dilation),
            padding=padding if isinstance(padding, str) else tuple(padding),
            **args,
        )
    if isinstance(layer, nn.AvgPool2d):
        if layer.ceil_mode or layer.divisor_override is not None:
            raise ValueError(f"{what}: ceil_mode and divisor_override have no NIR AvgPool2d equivalent")
        if not layer.count_include_pad and any(_pair(layer.padding)):
            raise ValueError(f"{what}: NIR's AvgPool2d divides by the full window, padding included")
        kernel = _pair(layer.kernel_size)
        return nir.AvgPool2d(
            kernel_size=np.array(kernel), stride=np.array(_pair(layer.stride)), padding=np.array(_pair(layer.padding))
        )
    if isinstance(layer, nn.AdaptiveAvgPool2d):
        size = layer.output_size if isinstance(layer.output_size, tuple) else (layer.output_size,) * 2
        hw = shape[1:]
        out = tuple(hw[i] if size[i] is None else int(size[i]) for i in range(2))
        if hw[0] % out[0] or hw[1] % out[1]:
            raise ValueError(f"{what}: output size {out} does not divide the input size {hw}: no fixed window")
        kernel = (hw[0] // out[0], hw[1] // out[1])
        return nir.AvgPool2d(kernel_size=np.array(kernel), stride=np.array(kernel), padding=np.array((0, 0)))
    if isinstance(layer, SumPool2d):
        return nir.SumPool2d(
            kernel_size=np.array(layer.kernel_size), stride=np.array(layer.stride), padding=np.array(layer.padding)
        )
    if isinstance(layer, nn.Flatten):
        # On [T*B, *shape]: dim 0 is the merged batch, NIR's dims count from the first per-sample dim.
        start, end, n = layer.start_dim, layer.end_dim, len(shape)
        if not (1 <= start or -n <= start < 0):
            raise ValueError(f"{what}: start_dim={start} would merge the batch dim into the features")
        return nir.Flatten(
            input_type={"input": np.array(shape)},
            start_dim=start - 1 if start > 0 else start,
            end_dim=end - 1 if end > 0 else end,
        )
    if isinstance(layer, nn.modules.batchnorm._BatchNorm):
        raise ValueError(
            f"{what}: NIR has no BatchNorm node; fold it into the convolution or linear layer before it first: "
            "spikefuse.nir.fold_batchnorm(model, sample_input)"
        )
    raise ValueError(f"{what}: {type(layer).__name__} has no NIR node")


def _channels_to_shape(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A number or one value per channel (dim 0 of the per-sample shape) broadcast to ``shape``."""
    if values.ndim == 1 and values.size > 1:
        values = values.reshape(values.size, *(1,) * (len(shape) - 1))
    return np.broadcast_to(values, shape).copy()


def _lif_node(m, what: str, shape: tuple[int, ...], dt: float):
    """A spikefuse LIF (the :class:`LIF` family's, or a recurrent layer of the paper's LIF): its ``decay``,
    ``threshold`` and ``v_reset`` (None or absent: the soft reset)."""
    if getattr(m, "v_reset", None) is None:
        raise ValueError(
            f"{what}: soft reset (v_reset=None subtracts the threshold) has no NIR node: NIR's LIF and IF neurons "
            "reset to v_reset"
        )
    decay = m.decay.detach().cpu().double().numpy() if isinstance(m.decay, torch.Tensor) else np.float64(m.decay)
    if not np.all((decay >= 0) & (decay <= 1)):
        raise ValueError(
            f"{what}: decay must lie in [0, 1] for a NIR time constant tau = dt/(1 - decay) > 0, got {decay}"
        )
    decay = _channels_to_shape(decay, shape)

    def full(value: float) -> np.ndarray:
        return np.full(shape, value, dtype=np.float64)

    if np.all(decay == 1):
        return nir.IF(r=full(1.0), v_threshold=full(m.threshold), v_reset=full(m.v_reset))
    if np.any(decay == 1):
        raise ValueError(f"{what}: a per-channel decay mixes 1 (no leak, tau = infinity) with leaky channels")
    if m.v_reset != 0:
        raise ValueError(
            f"{what}: v_reset={m.v_reset} with a leak has no NIR LIF: after a spike spikefuse's LIF restarts at "
            "v_reset + x, NIR's decays from v_reset toward v_leak = 0 ((1 - dt/tau)*v_reset + x); the two agree "
            "only for v_reset = 0 or decay = 1 (an IF neuron)"
        )
    tau = dt / (1 - decay)
    # r = tau/dt makes the input factor dt*r/tau = 1: the input enters unscaled, as in h = decay*h + x.
    return nir.LIF(tau=tau, r=tau / dt, v_leak=full(0.0), v_threshold=full(m.threshold), v_reset=full(0.0))


def _values(value) -> np.ndarray:
    return value.detach().cpu().double().numpy() if isinstance(value, torch.Tensor) else np.float64(value)


def _cuba_lif_node(m, what: str, shape: tuple[int, ...], dt: float):
    """A spikefuse CubaLIF (:class:`CubaLIF`, or a recurrent layer of it): its ``reset``, ``alpha``, ``beta``,
    ``threshold``."""
    if getattr(m, "reset", "hard" if m.model is CUBA_LIF_HARD else None) != "hard":
        raise ValueError(
            f"{what}: reset={m.reset!r} has no NIR node: NIR's CubaLIF sets the membrane to v_reset in the step of "
            "the spike, which is CubaLIF(reset='hard')"
        )
    alpha, beta = _values(m.alpha), _values(m.beta)
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not np.all((value >= 0) & (value < 1)):
            raise ValueError(f"{what}: {name} must lie in [0, 1) for a NIR time constant dt/(1 - {name}), got {value}")
    tau_syn = _channels_to_shape(dt / (1 - alpha), shape)
    tau_mem = _channels_to_shape(dt / (1 - beta), shape)
    # r = tau_mem/dt and w_in = tau_syn/dt make dt*r/tau_mem = dt*w_in/tau_syn = 1: i = alpha*i + x, v = beta*v + i
    return nir.CubaLIF(
        tau_syn=tau_syn,
        tau_mem=tau_mem,
        r=tau_mem / dt,
        w_in=tau_syn / dt,
        v_leak=np.zeros(shape),
        v_threshold=_channels_to_shape(_values(m.threshold), shape),
        v_reset=np.zeros(shape),
    )


def _recurrent_nodes(m: Recurrent, what: str, shape: tuple[int, ...], dt: float) -> tuple:
    """A recurrent layer as NIR writes one (snnTorch's export too): its neuron node, and the node of its recurrent
    connection (an ``Affine``, or a ``Linear`` without bias; one to one: the diagonal matrix), fed by the neuron and
    feeding it (:func:`export` adds the two edges of the cycle)."""
    if m.model is LIF_MODELS[("paper", "soft")]:
        raise ValueError(
            f"{what}: soft reset (v_reset=None subtracts the threshold) has no NIR node: NIR's LIF and "
            "IF neurons reset to v_reset"
        )
    if m.model is LIF_MODELS[("paper", "hard")]:
        neuron = _lif_node(m, what, shape, dt)
    elif m.model is CUBA_LIF_HARD:
        neuron = _cuba_lif_node(m, what, shape, dt)
    else:
        raise ValueError(
            f"{what}: the recurrent neuron model {m.model.name!r} has no NIR node (NIR writes LIF and "
            "CubaLIF with its resets)"
        )
    weight, bias = m.recurrent_weights()
    weight = _array(weight if weight.dim() == 2 else torch.diag(weight))
    return neuron, nir.Linear(weight=weight) if bias is None else nir.Affine(weight=weight, bias=_array(bias))


def _node(module: nn.Module, name: str, shape: tuple[int, ...], dt: float):
    """The NIR node of one layer call on input of per-sample ``shape`` (two for a recurrent layer: the neuron and
    its recurrent connection); ValueError if NIR cannot express it."""
    what = f"{name} ({type(module).__name__})"
    if isinstance(module, Recurrent):
        return _recurrent_nodes(module, what, shape, dt)
    if isinstance(module, LIF):
        return _lif_node(module, what, shape, dt)
    if isinstance(module, CubaLIF):
        return _cuba_lif_node(module, what, shape, dt)
    if isinstance(module, EngineNeuron):
        raise ValueError(f"{what}: the neuron model {module.model.name!r} has no NIR node")
    if isinstance(module, CubaLIFNode):
        scale = 1.0 if dt == module.dt else dt / module.dt  # the same fraction of tau per step with this dt
        return nir.CubaLIF(
            **{
                k: np.broadcast_to(v * scale if k.startswith("tau") else v, shape).copy()
                for k, v in module.fields.items()
            }
        )
    if isinstance(module, (BatchNormLIF1d, BatchNormLIF2d)):
        raise ValueError(
            f"{what}: a fused BatchNorm + LIF layer has no NIR node (NIR has no BatchNorm); build the model with "
            "SeqToBatch(BatchNorm) + LIF and fold the BatchNorm with spikefuse.nir.fold_batchnorm"
        )
    if isinstance(module, SeqToBatch):
        return _per_step_node(module.module, what, shape)
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return _per_step_node(module, what, shape)
    if isinstance(module, Flatten):
        return nir.Flatten(input_type={"input": np.array(shape)}, start_dim=0, end_dim=-1)
    if isinstance(module, Scale):
        return nir.Scale(scale=np.broadcast_to(_array(module.scale), shape).copy())
    if isinstance(module, Threshold):
        return nir.Threshold(threshold=np.broadcast_to(_array(module.threshold), shape).copy())
    if isinstance(module, Integrator):
        return nir.I(r=np.broadcast_to(module.r, shape).copy())
    # The modules below were loaded with their own time step: their time constants are rescaled so that they
    # step by the same fraction of tau with this dt (unchanged when the dt is the same).
    if isinstance(module, LeakyIntegrator):
        tau = module.tau if dt == module.dt else module.tau * (dt / module.dt)
        return nir.LI(
            tau=np.broadcast_to(tau, shape).copy(),
            r=np.broadcast_to(module.r, shape).copy(),
            v_leak=np.broadcast_to(module.v_leak, shape).copy(),
        )
    if isinstance(module, CubaLeakyIntegrator):
        scale = 1.0 if dt == module.dt else dt / module.dt
        return nir.CubaLI(
            **{
                k: np.broadcast_to(getattr(module, k) * (scale if k.startswith("tau") else 1), shape).copy()
                for k in ("tau_syn", "tau_mem", "r", "v_leak", "w_in")
            }
        )
    if isinstance(module, EulerLIF):
        tau = module.tau if dt == module.dt else module.tau * (dt / module.dt)

        def full(value: float) -> np.ndarray:
            return np.full(shape, value, dtype=np.float64)

        return nir.LIF(
            tau=_channels_to_shape(tau, shape),
            r=np.broadcast_to(module.r, shape).copy(),
            v_leak=full(module.v_leak),
            v_threshold=full(module.threshold),
            v_reset=full(module.v_leak),
        )
    raise ValueError(f"{what} has no NIR node")


def export(model: nn.Module, sample_input: torch.Tensor, dt: float = 1e-4, path=None) -> nir.NIRGraph:
    """The NIR graph of ``model``, traced by running it once on ``sample_input`` of shape ``[T, B, *shape]``;
    also written to the file ``path`` (``nir.write``) when one is given.

    ``dt`` is the time step the discrete network stands for: a spikefuse ``LIF`` of decay ``k`` becomes a NIR
    ``LIF`` with ``tau = dt/(1 - k)``, ``r = tau/dt`` (the input enters unscaled), ``v_leak = 0``; read the graph
    back with the same ``dt``. A recurrent layer (:class:`spikefuse.nn.Recurrent` of the paper's LIF or the hard-reset
    CubaLIF) becomes its neuron node and a node ``<name>.w_rec`` of its recurrent connection, with the edges
    neuron -> w_rec -> neuron (a cycle: the recurrent current of a step is that of the previous step's spikes). snnTorch's importer assumes ``dt = 1e-4``, the default. Raises ValueError, naming
    the layer, for what NIR cannot express (soft reset, BatchNorm, max pooling, operations between layers other
    than sums, ...). Surrogates, ``detach_reset`` and the backend shape only training and speed, and NIR does not
    describe them: they are not exported. The stored state of ``stateful`` neurons is left as it was.
    """
    dt = check_dt(dt)
    if not isinstance(sample_input, torch.Tensor) or sample_input.ndim < 3:
        raise ValueError("sample_input must be a tensor of shape [T, B, *shape] (time and batch first)")
    stored_states = {m: m.state for m in model.modules() if isinstance(m, EngineNeuron)}
    try:
        graph_trace = trace(model, sample_input, _is_layer, lambda m, name, shape: _node(m, name, shape, dt))
    finally:
        for m, state in stored_states.items():
            m.state = state
    nodes = {INPUT: nir.Input(input_type={"input": np.array(graph_trace.input_shape)})}
    edges = []
    for call in graph_trace.calls:
        nodes[call.name] = call.node
        edges += [(source, call.name) for source in call.sources]
        if isinstance(call.node, tuple):  # a recurrent layer: the neuron and its recurrent connection, a cycle
            nodes[call.name], nodes[f"{call.name}.w_rec"] = call.node
            edges += [(call.name, f"{call.name}.w_rec"), (f"{call.name}.w_rec", call.name)]
    nodes[OUTPUT] = nir.Output(output_type={"output": np.array(graph_trace.output_shape)})
    edges += [(source, OUTPUT) for source in graph_trace.output_sources]
    repeated = {e for e in edges if edges.count(e) > 1}
    if repeated:
        raise ValueError(
            f"an output is added to itself ({sorted(repeated)}): NIR sums the edges into a node and has no "
            "repeated edges; scale it in a layer instead"
        )
    graph = nir.NIRGraph(nodes=nodes, edges=edges, metadata={"dt": dt})
    if path is not None:
        nir.write(path, graph)
    return graph


def _fold_into(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> None:
    """``bn(layer(x)) = layer'(x)`` with the running statistics: scale the output channels, shift the bias."""
    scale = bn.weight.detach().double() if bn.affine else torch.ones_like(bn.running_var, dtype=torch.float64)
    shift = bn.bias.detach().double() if bn.affine else torch.zeros_like(scale)
    scale = scale / torch.sqrt(bn.running_var.double() + bn.eps)
    weight = layer.weight.detach().double()
    bias = torch.zeros_like(scale) if layer.bias is None else layer.bias.detach().double()
    new_weight = weight * scale.reshape(-1, *(1,) * (weight.ndim - 1))
    new_bias = (bias - bn.running_mean.double()) * scale + shift
    layer.weight = nn.Parameter(new_weight.to(layer.weight.dtype))
    layer.bias = nn.Parameter(new_bias.to(layer.weight.dtype))


def fold_batchnorm(model: nn.Module, sample_input: torch.Tensor) -> nn.Module:
    """A copy of ``model`` with every BatchNorm folded into the convolution or linear layer that feeds it.

    NIR has no BatchNorm node. In eval mode a BatchNorm is an affine map per channel, so
    ``bn(conv(x)) = conv'(x)`` with ``W' = W * g`` and ``b' = (b - running_mean) * g + beta``,
    ``g = gamma / sqrt(running_var + eps)`` (computed in float64, stored in the layer's dtype). The copy equals
    ``model`` up to rounding (a spike may flip where a potential lies within rounding of the threshold). The
    BatchNorm layers must be in eval mode, wrapped in ``SeqToBatch``, and each must be the only user of the output
    of a ``Conv1d``/``Conv2d``/``Linear`` layer called once; otherwise ValueError. ``sample_input``
    ``[T, B, *shape]`` is run once to find which layer feeds which BatchNorm.
    """
    batchnorms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if any(bn.training for bn in batchnorms):
        raise ValueError(
            "fold_batchnorm uses the running statistics, which BatchNorm applies in eval mode only: "
            "call model.eval() first"
        )
    if any(bn.running_mean is None for bn in batchnorms):
        raise ValueError("fold_batchnorm needs running statistics (track_running_stats=True)")
    folded = copy.deepcopy(model)
    graph_trace = trace(folded, sample_input, _is_layer, lambda m, name, shape: None)
    calls = graph_trace.calls
    by_name = {call.name: call for call in calls}
    uses: dict[str, int] = {}  # how many edges leave each node
    calls_of: dict[int, int] = {}
    for sources in [call.sources for call in calls] + [graph_trace.output_sources]:
        for source in sources:
            uses[source] = uses.get(source, 0) + 1
    for call in calls:
        calls_of[id(call.module)] = calls_of.get(id(call.module), 0) + 1
    for call in calls:
        bn = call.module.module if isinstance(call.module, SeqToBatch) else None
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
            continue
        feeder = by_name.get(call.sources[0]) if len(call.sources) == 1 else None
        layer = feeder.module.module if feeder and isinstance(feeder.module, SeqToBatch) else None
        if not (
            isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Linear))
            and uses[feeder.name] == 1
            and calls_of[id(feeder.module)] == 1
            and calls_of[id(call.module)] == 1
        ):
            raise ValueError(
                f"{call.name}: the BatchNorm must be the only user of a convolution or linear layer (in SeqToBatch, "
                "called once) to be folded into it"
            )
        _fold_into(layer, bn)
        parent_name, _, child = call.name.rpartition(".")
        setattr(folded.get_submodule(parent_name), child, nn.Identity())
    return folded
