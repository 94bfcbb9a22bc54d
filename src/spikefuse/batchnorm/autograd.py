"""BatchNorm (plus an optional residual) fused with a spiking neuron, saving only the BN input ``x`` (and the
residual) for backward (Liang et al., Alg. 1-4).

The neuron is any neuron of the engine (a :class:`~spikefuse.neurons.NeuronSpec`: a
:class:`~spikefuse.neurons.NeuronModel` with its surrogate and ``detach_reset``; the LIF of
:func:`spikefuse.batchnorm_lif` is one of its definitions, :func:`spikefuse.neurons.lif.lif_spec`), on any of the
engine's backends, its reference too. The entry points take a call's arguments as records: the BatchNorm's as
:class:`BatchNormArgs`, the neurons' tensors as :class:`spikefuse.ops.engine.NeuronInputs`, the neuron as the key of
its record. The custom ops take lists of tensors (an absent optional one empty), of numbers and of sizes, and the
call's settings (neuron, backend, BatchNorm's mode, the residual's form) as one key (:class:`_Call`).

Forward (``[T, B, C, ...]`` input ``x``, the conv/FC output), one custom op ``spikefuse::bn_lif_forward``:

1. ``y, mean, invstd`` of BatchNorm on ``x`` merged to ``[T*B, C, ...]`` by the very implementation ``nn.BatchNorm``
   runs (``aten._batch_norm_impl_index``, which ``F.batch_norm`` calls: ``native_batch_norm`` on the CPU, cuDNN on
   CUDA), so the statistics, the running-statistics update and ``y`` are bit-identical to the reference
   composition ``SeqToBatch(nn.BatchNorm) -> LIF`` on every device (torch's CPU kernel computes
   ``y = fma(x, a, fma(-mean, a, b))`` with ``a = weight*invstd``, cuDNN its own rounding; plain tensor ops
   reproduce neither bit for bit, hence the call). The op
   updates copies of the running statistics and returns them (it stays functional, as registered autograd
   needs); the caller copies them into the buffers. Being inside the opaque op, ``y`` is torch's eager result
   under ``torch.compile`` too (inductor would otherwise decompose the BatchNorm with another rounding), so the
   backward's recomputation matches it. The cpu backend in training mode on float32 input
   (:func:`spikefuse.batchnorm.cpu.statistics_supported`) computes only the statistics, bit-identical to
   ``native_batch_norm``'s (:func:`spikefuse.batchnorm.cpu.statistics`), and normalizes inside its neuron
   kernel (plus the residual), each step's row right before the neuron reads it: no ``y`` is written (steps 2
   and 3 in one);
2. ``y += residual`` when a residual is given (the shortcut of a residual block: ``LIF(BN(conv(x)) + shortcut)``,
   the same float add as the composition); with ``pack_residual`` (a binary residual: the spikes of an identity
   shortcut) it is also packed to bits (:mod:`spikefuse.ops.bitpack`) and saved as those, otherwise saved as is;
3. the backend's neuron ``forward`` on ``y``, saving nothing (only the spikes and the final states are written);
   ``y`` dies here. The autograd context saves ``x`` and the per-channel ``mean``/``invstd`` (training) or the
   snapshot of the running statistics (eval), plus ``weight``, ``bias``, the neuron's parameters and its initial
   states: with the default start (one value shared by every neuron) nothing of size ``N``.

Backward (``spikefuse::bn_lif_backward``):

1. recompute ``y`` plus the residual (unpacked from bits when packed) and from it the neuron's states, and run the
   neuron's ``backward``, which returns ``grad_y`` (and the parameters' and initial states' gradients). The cpu
   backend in training mode does all of it in its neuron kernel (:func:`_neuron_backward` with the normalization: each block of
   neurons normalizes its rows from the saved ``mean``/``invstd`` with torch's formula into a tile in cache, see
   :func:`spikefuse.batchnorm.cpu.source_tile`, bit-identical), so backward holds one tensor of ``x``'s size,
   ``grad_y``. Elsewhere the same BatchNorm call runs again into a transient (training: the statistics
   again from ``x``, which torch computes deterministically, so ``y`` is bit-identical to the forward's; eval: from
   the saved running statistics) that the cpu backend's ``backward`` overwrites with ``grad_y`` (``overwrite_x``;
   the engine's Triton kernels write a buffer of their own);
2. BatchNorm's backward -- the per-channel reduction torch's ``aten.native_batch_norm_backward`` runs:
   ``grad_gamma = sum(gy*xhat)``, ``grad_beta = sum(gy)``, ``grad_x = a*(gy - mean(gy) - xhat*mean(gy*xhat))``
   in training mode, ``grad_x = a*gy`` in eval mode; the residual's gradient is ``grad_y`` itself. The cpu
   backend in training mode runs it with :func:`spikefuse.batchnorm.cpu.backward`, writing ``grad_x`` over
   ``grad_y`` (when that is not also the residual's gradient); elsewhere the backward ``nn.BatchNorm``'s autograd
   runs after the same implementation (``aten._batch_norm_impl_index_backward``: cuDNN's in training on CUDA, from
   the reserve space of the recomputing call, the native one otherwise), so the gradients equal the composition's
   on a GPU too.

Every backend works through the engine's common ``forward``/``backward`` entry points; the cpu backend's own options
(the normalization inside its kernels, the spike bits) are keywords of its entry points, given by
:func:`_neuron_forward` and :func:`_neuron_backward` on that backend alone. Both ops are
``torch.library`` custom ops with fake kernels, so ``torch.compile(fullgraph=True)`` traces through them; eager
calls run the same functions through a plain ``autograd.Function``, without the custom-op dispatch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..neurons.lif import lif_initial, lif_params
from ..neurons.spec import NeuronSpec, registered_key
from ..ops import engine
from ..ops.bitpack import pack, packed_numel, unpack
from ..ops.autograd_guards import refuse_double_backward
from ..ops.numerics import compute_dtype
from ..registry import OBJECTS
from ..surrogate import refuse_active
from . import cpu

__all__ = [
    "BatchNormArgs",
    "bn_neuron",
    "bn_lif",
    "bn_neuron_backward_from_stats",
    "bn_lif_forward",
    "bn_lif_backward",
]


def _neuron_forward(
    neuron: NeuronSpec,
    backend: str,
    inputs: engine.NeuronInputs,
    normalization: cpu.Normalization | None = None,
    spike_bits: bool = False,
) -> tuple[Tensor, list]:
    """``(spikes, final states)`` of the neurons on ``inputs`` (``x`` their input ``[T, N]``), through the engine's
    entry point (saving nothing). On the cpu backend with its own options (:func:`spikefuse.ops.engine.cpu.forward`):
    ``normalization`` given, ``inputs.x`` is the raw input ``[T*B, C, ...]`` merged, as ``[T, N]``, and the kernel
    normalizes it (plus the residual) itself; ``spike_bits``: the kernel also packs the spikes it writes."""
    # a half-precision input runs in float32 (converted where the backend does not read it as it is), its spikes
    # in its own dtype
    kernels = engine.module(backend)
    stream = engine.stream(kernels, inputs.x)
    options = {}
    if normalization is not None or spike_bits:
        src = None if normalization is None else cpu.source_args(stream, normalization)
        options = {"src": src, "spike_bits": spike_bits}
    spikes, final, _ = kernels.forward(neuron, inputs._replace(x=stream), spike_dtype=inputs.x.dtype, **options)
    return spikes, final


def _neuron_backward(
    neuron: NeuronSpec,
    backend: str,
    grads: tuple[Tensor, list],
    inputs: engine.NeuronInputs,
    need_param_grads: list,
    normalization: cpu.Normalization | None = None,
) -> tuple[Tensor, list, list]:
    """``(grad_y, grad per state of init, grad per parameter)`` of the neurons for ``grads`` (the spikes' and the
    final states'), through the engine's entry point. ``inputs.x``: the neurons' input ``[T, N]``, a transient of
    the caller's that the backend may write ``grad_y`` over (``overwrite_x``); or, with ``normalization`` (the cpu
    backend), the raw input ``[T*B, C, ...]`` merged, as ``[T, N]``, read, not written, which the kernel normalizes
    itself."""
    kernels = engine.module(backend)
    grad_spikes, grad_final = grads
    if normalization is None:
        inputs, options = inputs._replace(x=engine.stream(kernels, inputs.x)), {"overwrite_x": True}
    else:
        options = {"src": cpu.source_args(inputs.x, normalization)}
    return kernels.backward(
        neuron, inputs, engine.stream(kernels, grad_spikes), grad_final, need_param_grads, **options
    )


# aten._batch_norm_impl_index's implementation numbers
_NATIVE_IMPL, _CUDNN_IMPL = 0, 1


def _torch_batch_norm(
    xb: Tensor, weight, bias, running_mean, running_var, training: bool, momentum: float, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """``(y, mean, invstd, reserve, impl)`` of BatchNorm on ``xb [T*B, C, ...]`` from the implementation
    ``F.batch_norm`` picks (cuDNN on CUDA: its ``y`` differs from ``native_batch_norm``'s in the last bit in places,
    enough to flip a spike that lands on the threshold), updating the running statistics in place in training mode;
    ``mean`` and ``invstd`` are empty in eval mode; ``reserve`` and ``impl`` are what :func:`_torch_batch_norm_backward`
    takes."""
    return torch._batch_norm_impl_index(
        xb, weight, bias, running_mean, running_var, training, momentum, eps, torch.backends.cudnn.enabled
    )


def _batch_norm(
    xb: Tensor, weight, bias, running_mean, running_var, training: bool, eps: float
) -> tuple[Tensor, Tensor, int]:
    """``(y, reserve, impl)`` of BatchNorm on ``xb [T*B, C, ...]`` (no running-statistics update)."""
    running = (None, None) if training else (running_mean, running_var)
    y, _, _, reserve, impl = _torch_batch_norm(xb, weight, bias, *running, training, 0.0, eps)
    return y, reserve, impl


def _torch_batch_norm_backward(
    grad_y: Tensor,
    xb: Tensor,
    weight,
    running_mean,
    running_var,
    mean,
    invstd,
    training: bool,
    eps: float,
    affine: bool,
    reserve: Tensor,
    impl: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_x, grad_weight, grad_bias)``: the backward ``nn.BatchNorm``'s autograd runs after
    :func:`_torch_batch_norm` -- cuDNN's in training on CUDA (from the ``reserve`` of the recomputing call), torch's
    native one otherwise -- so the gradients are the composition's bit for bit there too."""
    if training and impl == _CUDNN_IMPL:
        grad_y = grad_y.contiguous()  # as xb is
    else:
        impl = _NATIVE_IMPL
    return torch.ops.aten._batch_norm_impl_index_backward(
        impl,
        xb,
        grad_y,
        weight,
        None if training else running_mean,
        None if training else running_var,
        mean if training else None,
        invstd if training else None,
        training,
        eps,
        [True, affine, affine],
        reserve,
    )


class BatchNormArgs(NamedTuple):
    """The BatchNorm's arguments of one call, as :func:`torch.nn.functional.batch_norm` takes them after its input:
    the running statistics (None: none kept), the affine ``weight``/``bias`` (None: none), ``training`` (a bool),
    ``momentum`` and ``eps`` (floats)."""

    running_mean: Tensor | None
    running_var: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    training: bool
    momentum: float
    eps: float


@dataclasses.dataclass(frozen=True)
class _Call:
    """What the custom ops take by key (:data:`spikefuse.registry.OBJECTS`) besides tensors and numbers: the neuron
    (the :attr:`~spikefuse.neurons.NeuronSpec.op_key` of its record), the concrete backend, BatchNorm's mode and the
    residual: ``"none"``, ``"tensor"`` (added, saved as it is) or ``"bits"`` (added, saved packed to bits)."""

    neuron: str
    backend: str
    training: bool
    residual: str


def _call_key(neuron: str, backend: str, training: bool, residual: str) -> str:
    """The key of the :class:`_Call` of these settings, kept by them (a bounded cache, as the neuron records')."""
    return registered_key(_CALL_KEYS, _Call, (neuron, backend, training, residual))


_CALL_KEYS: dict[tuple, str] = {}
# torch.compile calls this as Python and takes its result as a constant (strings and bools), as it does the neuron
# record's op key
_call_key._dynamo_marked_constant = True

# bn_lif_forward's ``tensors`` by position (empty where absent: the channels are never 0, the residual's presence is
# the call's) and its outputs before the final states
_RES, _RM, _RV, _W, _B = range(5)
_N_OUTPUTS_BEFORE_STATES = 6  # spikes, mean, invstd, running mean, running var, residual bits


def _forward(
    xb: Tensor,
    residual: Tensor | None,
    batchnorm: BatchNormArgs,
    inputs: engine.NeuronInputs,
    call: _Call,
    eager: bool,
) -> list[Tensor]:
    """BatchNorm of ``xb [T*B, C, ...]``, plus ``residual`` (shaped like ``xb``) when given, then the neurons of
    ``call`` (``inputs``: ``x`` is ``xb`` as ``[T, N]``, the parameters, initial states and ``inner`` of the
    neurons); returns ``[spikes [T, N], mean, invstd, new_running_mean, new_running_var, residual_bits, *final
    states [N]]``. The running statistics are updated on copies (the op stays functional; the caller copies them
    back); in eval mode the copies are the snapshot backward normalizes with. ``residual_bits`` is the residual
    packed to bits where ``call.residual`` says ``"bits"``, else empty. ``eager`` (not the custom op, whose outputs
    must be its own): the residual's bits may be those its earlier packing made
    (:func:`spikefuse.ops.bitpack.remember`), and in training the cpu kernel packs the spikes it writes for the
    layers that save them as bits."""
    running_mean, running_var, weight, bias, training, momentum, eps = batchnorm
    # in training the cpu kernel (an option of its only) packs the spikes for the layers that save them as bits
    spike_bits = eager and training and call.backend == "cpu"
    spec = OBJECTS[call.neuron]
    packed = residual is not None and call.residual == "bits"
    bits = pack(residual, reuse=eager)[0] if packed else xb.new_empty(0, dtype=torch.uint8)
    if _fused_statistics(call.backend, training, xb, running_mean, weight, bias):
        # the statistics alone, then BatchNorm (plus residual) inside the neuron kernel: no normalized copy of x
        mean, invstd, rm, rv = cpu.statistics(xb, running_mean, running_var, momentum, eps)
        norm = cpu.Normalization(mean, invstd, weight, bias, math.prod(xb.shape[2:]), residual)
        spikes, final = _neuron_forward(spec, call.backend, inputs, norm, spike_bits)
    else:
        rm = running_mean.clone() if running_mean is not None else None
        rv = running_var.clone() if running_var is not None else None
        y, mean, invstd, _, _ = _torch_batch_norm(xb, weight, bias, rm, rv, training, momentum, eps)
        if residual is not None:
            y += residual
        spikes, final = _neuron_forward(
            spec, call.backend, inputs._replace(x=y.reshape(inputs.x.shape)), spike_bits=spike_bits
        )
        del y
    empty = xb.new_empty(0)
    return [spikes, mean, invstd, empty if rm is None else rm, empty if rv is None else rv, bits, *final]


def _given(t: Tensor) -> Tensor | None:
    """A custom op's optional tensor, passed empty where absent (a list of tensors and None is no input that
    autograd sees through): None where empty."""
    return t if t.numel() else None


def _op_arguments(tensors: list[Tensor], numbers: list[float], call: _Call) -> tuple:
    """``(residual, BatchNormArgs)`` from the forward op's lists (``tensors`` as :data:`_RES`...; ``numbers``
    ``[momentum, eps]``)."""
    residual = None if call.residual == "none" else tensors[_RES]
    running_mean, running_var, weight, bias = (_given(t) for t in tensors[_RM:])
    return residual, BatchNormArgs(running_mean, running_var, weight, bias, call.training, *numbers)


def _forward_impl(
    xb: Tensor,
    tensors: list[Tensor],
    params: list[Tensor],
    init: list[Tensor],
    numbers: list[float],
    sizes: list[int],
    call: str,
) -> list[Tensor]:
    """The forward custom op's body: :func:`_forward`, not eager. ``tensors``: ``[residual, running_mean,
    running_var, weight, bias]``, empty where absent; ``numbers``: ``[momentum, eps]``; ``sizes``: ``[T, inner]``;
    ``call``: the key of a :class:`_Call`."""
    record = OBJECTS[call]
    residual, batchnorm = _op_arguments(tensors, numbers, record)
    t_steps, inner = sizes
    inputs = engine.NeuronInputs(xb.reshape(t_steps, -1), list(params), list(init), inner)
    return _forward(xb, residual, batchnorm, inputs, record, eager=False)


bn_lif_forward = torch.library.custom_op("spikefuse::bn_lif_forward", _forward_impl, mutates_args=())


@bn_lif_forward.register_fake
def _(xb, tensors, params, init, numbers, sizes, call):
    record = OBJECTS[call]
    t_steps = sizes[0]
    n = xb.numel() // t_steps
    weight, running_mean, running_var = tensors[_W], tensors[_RM], tensors[_RV]
    stat_dtype = weight.dtype if weight.numel() else xb.dtype
    stats = (xb.shape[1],) if record.training else (0,)
    bits = packed_numel(xb.numel()) if record.residual == "bits" else 0
    return [
        xb.new_empty((t_steps, n)),
        xb.new_empty(stats, dtype=stat_dtype),
        xb.new_empty(stats, dtype=stat_dtype),
        torch.empty_like(running_mean),
        torch.empty_like(running_var),
        xb.new_empty((bits,), dtype=torch.uint8),
        *(xb.new_empty((n,), dtype=compute_dtype(xb.dtype)) for _ in init),
    ]


def _backward_impl(
    grads: list[Tensor],
    saved: list[Tensor],
    params: list[Tensor],
    init: list[Tensor],
    needs: list[bool],
    eps: float,
    inner: int,
    call: str,
) -> list[Tensor]:
    """``[grad_x [T*B, C, ...], grad_weight, grad_bias, grad_residual, *grad per initial state, *grad per
    parameter]``; unneeded ones are empty. ``grads``: ``[grad_spikes [T, N], *grad per final state]``; ``saved``:
    ``[xb, residual, residual_bits, weight, bias, mean, invstd, running_mean, running_var]``, empty where absent
    (the running statistics: in training; the residual: none, or saved as its bits); ``needs``: ``[affine,
    residual, *per parameter]``; ``call``: the key of a :class:`_Call`."""
    grad_spikes, *grad_final = grads
    xb, mean, invstd = saved[0], saved[5], saved[6]  # (mean and invstd empty in eval mode)
    residual, residual_bits, weight, bias = (_given(t) for t in saved[1:5])
    running_mean, running_var = _given(saved[7]), _given(saved[8])
    need_affine_grad, need_residual_grad, *need_param_grads = needs
    record = OBJECTS[call]
    backend, training = record.backend, record.training
    t_steps, n = grad_spikes.shape
    spec = OBJECTS[record.neuron]
    fused = _fused_batch_norm(backend, training, xb)
    inputs = engine.NeuronInputs(xb.reshape(t_steps, n), list(params), list(init), inner)
    if fused:
        # BatchNorm inside the neuron kernel's recompute, from the saved statistics (bit-identical to the forward's)
        norm = cpu.Normalization(mean, invstd, weight, bias, math.prod(xb.shape[2:]), residual, residual_bits)
        del residual
        grad_y, grad_init, grad_params = _neuron_backward(
            spec, backend, (grad_spikes, list(grad_final)), inputs, list(need_param_grads), norm
        )
        del norm
    else:
        y, reserve, impl = _batch_norm(xb, weight, bias, running_mean, running_var, training, eps)
        if residual is None and residual_bits is not None:
            residual = unpack(residual_bits, xb.shape, xb.dtype)
        if residual is not None:
            y += residual
        # this function's own transient: the backend may write grad_y over it
        inputs = inputs._replace(x=y.reshape(t_steps, n))
        del y, residual
        grad_y, grad_init, grad_params = _neuron_backward(
            spec, backend, (grad_spikes, list(grad_final)), inputs, list(need_param_grads)
        )
        del inputs
    grad_y = grad_y.reshape(xb.shape).to(xb.dtype)
    affine = weight is not None and need_affine_grad
    if fused:
        # grad_x over grad_y, unless grad_y is also the residual's gradient: no fresh tensor at the memory peak
        grad_x, grad_w, grad_b = cpu.backward(
            grad_y, xb, mean, invstd, weight, affine, overwrite_grad_y=not need_residual_grad
        )
    else:
        grad_x, grad_w, grad_b = _torch_batch_norm_backward(
            grad_y, xb, weight, running_mean, running_var, mean, invstd, training, eps, affine, reserve, impl
        )

    def empty():  # a fresh one each time: outputs of a custom op must not alias each other
        return xb.new_empty(0)

    return [
        grad_x,
        grad_w if affine else empty(),
        grad_b if affine else empty(),
        grad_y if need_residual_grad else empty(),
        *(g if g is not None else empty() for g in grad_init),
        *(g if g is not None and need else empty() for g, need in zip(grad_params, need_param_grads)),
    ]


bn_lif_backward = torch.library.custom_op("spikefuse::bn_lif_backward", _backward_impl, mutates_args=())


@bn_lif_backward.register_fake
def _(grads, saved, params, init, needs, eps, inner, call):
    xb, weight = saved[0], saved[3]
    affine = weight.numel() > 0 and needs[0]
    n = grads[0].shape[1]
    return [
        torch.empty_like(xb),
        torch.empty_like(weight) if affine else xb.new_empty(0),
        torch.empty_like(weight) if affine else xb.new_empty(0),
        torch.empty_like(xb) if needs[1] else xb.new_empty(0),
        *(torch.empty_like(v) if v.numel() == n else xb.new_empty(0) for v in init),
        *(torch.empty_like(p) if need else xb.new_empty(0) for p, need in zip(params, needs[2:])),
    ]


def _backward_for(call: str):
    """The backward op, or for the reference backend its implementation: the reference differentiates its loop
    with autograd, which a custom op's body cannot use (the dispatcher runs it below autograd)."""
    return _backward_impl if OBJECTS[call].backend == "reference" else bn_lif_backward


def _save(ctx, xb: Tensor, residual: Tensor | None, batchnorm: BatchNormArgs, inputs: engine.NeuronInputs, output):
    """Keeps for :func:`_gradients` what backward reads (``inputs``: the neurons' parameters, initial states and
    ``inner``); ``ctx.call`` is the call's key, set by the caller."""
    ctx.args = (inputs.inner, batchnorm.eps)
    ctx.n_params, ctx.t_steps = len(inputs.params), output[0].shape[0]
    weight, bias = batchnorm.weight, batchnorm.bias
    ctx.has_w, ctx.has_b = weight is not None, bias is not None
    empty = xb.new_empty(0)
    _, mean, invstd, rm, rv, bits = output[:_N_OUTPUTS_BEFORE_STATES]
    ctx.residual_as_is = residual is not None and not bits.numel()
    ctx.save_for_backward(
        xb,
        residual if ctx.residual_as_is else empty,
        bits,
        weight if weight is not None else empty,
        bias if bias is not None else empty,
        mean,
        invstd,
        empty if batchnorm.training else rm,  # eval: the snapshot of the running statistics y was made with
        empty if batchnorm.training else rv,
        *inputs.params,
        *inputs.init,
    )


def _gradients(ctx, grads, need_params, need_affine: bool, need_residual: bool, backward_op) -> tuple:
    """``(grad_x, grad_weight, grad_bias, grad_residual, grad per parameter, grad per initial state)``."""
    xb, residual, bits, w, b, mean, invstd, rm, rv, *tensors = ctx.saved_tensors
    params, init = tensors[: ctx.n_params], tensors[ctx.n_params :]
    inner, eps = ctx.args
    refuse_double_backward(
        f"the fused BatchNorm+neuron op ({OBJECTS[OBJECTS[ctx.call].neuron].name})",
        "use torch.nn.BatchNorm and the neuron with backend='reference' instead",
    )
    n = xb.numel() // ctx.t_steps
    grad_spikes = grads[0] if grads[0] is not None else torch.zeros((ctx.t_steps, n), dtype=xb.dtype, device=xb.device)
    cdt = compute_dtype(xb.dtype)
    grad_final = [g if g is not None else xb.new_zeros(1, dtype=cdt) for g in grads[_N_OUTPUTS_BEFORE_STATES:]]
    out = backward_op(
        [grad_spikes.contiguous(), *(g.contiguous() for g in grad_final)],
        [xb, residual, bits, w, b, mean, invstd, rm, rv],
        list(params),
        list(init),
        [bool(need_affine), bool(need_residual), *(bool(need) for need in need_params)],
        eps,
        inner,
        ctx.call,
    )
    grad_x, grad_w, grad_b, grad_res = out[:4]
    grad_init, grad_params = out[4 : 4 + len(init)], out[4 + len(init) :]
    grad_params = [g if need else None for g, need in zip(grad_params, need_params)]
    grad_init = [g if g.numel() else None for g in grad_init]
    return grad_x, grad_w, grad_b, grad_res, grad_params, grad_init


def _setup_context(ctx, inputs, output):
    xb, tensors, params, init, numbers, sizes, call = inputs
    ctx.set_materialize_grads(False)
    ctx.call = call
    residual, batchnorm = _op_arguments(tensors, numbers, OBJECTS[call])
    _save(ctx, xb, residual, batchnorm, engine.NeuronInputs(xb, params, init, sizes[1]), output)


def _backward(ctx, grads):
    need = ctx.needs_input_grad  # as the inputs: (xb, tensors, params, init, numbers, sizes, call)
    need_tensors = need[1]
    grad_x, grad_w, grad_b, grad_res, grad_params, grad_init = _gradients(
        ctx,
        grads,
        need[2],
        bool(need_tensors[_W] or need_tensors[_B]),
        bool(need_tensors[_RES]),
        _backward_for(ctx.call),
    )
    grad_tensors = [None] * len(need_tensors)
    for index, grad in ((_RES, grad_res), (_W, grad_w), (_B, grad_b)):
        grad_tensors[index] = grad if need_tensors[index] else None
    return grad_x if need[0] else None, grad_tensors, grad_params, grad_init, None, None, None


torch.library.register_autograd("spikefuse::bn_lif_forward", _backward, setup_context=_setup_context)


class _EagerBatchNormNeuron(torch.autograd.Function):
    """``bn_lif_forward`` with the same autograd, without the custom-op dispatch, which costs more than the kernels
    of a small layer (as for the neuron op, :func:`spikefuse.ops.engine.autograd.neuron`). The tensors that may
    need gradients (``xb``, the residual, the BatchNorm's weight and bias, the neurons' parameters and initial
    states) come again flat after the records holding them, so that autograd sees them."""

    @staticmethod
    def forward(ctx, batchnorm, inputs, call, xb, residual, *tensors):
        out = _forward(xb, residual, batchnorm, inputs, OBJECTS[call], eager=True)
        ctx.set_materialize_grads(False)
        ctx.call = call
        _save(ctx, xb, residual, batchnorm, inputs, out)
        ctx.mark_non_differentiable(*out[1:_N_OUTPUTS_BEFORE_STATES])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        # as the inputs: (batchnorm, inputs, call, xb, residual, weight, bias, *params, *init)
        need = ctx.needs_input_grad
        grad_x, grad_w, grad_b, grad_res, grad_params, grad_init = _gradients(
            ctx,
            grads,
            need[_EAGER_PARAMS : _EAGER_PARAMS + ctx.n_params],
            bool(need[5] or need[6]),
            bool(need[4]),
            _backward_impl,
        )
        return (
            None,
            None,
            None,
            grad_x if need[3] else None,
            grad_res if need[4] else None,
            grad_w if need[5] else None,
            grad_b if need[6] else None,
            *grad_params,
            *grad_init,
        )


_EAGER_PARAMS = 7  # the position of the first parameter among _EagerBatchNormNeuron.forward's inputs


def _forward_op(
    xb: Tensor, residual: Tensor | None, batchnorm: BatchNormArgs, inputs: engine.NeuronInputs, call: str
) -> list:
    """The custom op under ``torch.compile``, the plain Function in eager mode (``inputs``: ``x`` is ``xb`` as
    ``[T, N]``; ``call`` the key of a :class:`_Call`)."""
    if torch.compiler.is_compiling():
        return bn_lif_forward(
            xb,
            [xb.new_empty(0) if t is None else t for t in (residual, *batchnorm[:4])],
            list(inputs.params),
            list(inputs.init),
            [batchnorm.momentum, batchnorm.eps],
            [inputs.x.shape[0], inputs.inner],
            call,
        )
    tensors = (batchnorm.weight, batchnorm.bias, *inputs.params, *inputs.init)
    return list(_EagerBatchNormNeuron.apply(batchnorm, inputs, call, xb, residual, *tensors))


def bn_neuron(
    inputs: engine.NeuronInputs,
    batchnorm: BatchNormArgs,
    neuron: str,
    backend: str,
    residual: Tensor | None = None,
    residual_binary: bool = False,
    return_stats: bool = False,
):
    """BatchNorm (over T, B and the spatial dims of ``inputs.x [T, B, C, ...]``), plus ``residual`` when given,
    then ``neuron`` (the :attr:`~spikefuse.neurons.NeuronSpec.op_key` of its neurons) on ``backend``.

    Arguments are already validated and resolved (``backend`` concrete; ``inputs.params`` one compute-dtype tensor
    per parameter, ``[1]`` or per channel with ``inputs.inner`` neurons per channel run; ``inputs.init`` one per
    state, ``[N]`` or ``[1]``; ``batchnorm`` as :class:`BatchNormArgs` says; ``residual`` of ``x``'s shape, dtype
    and device or None; ``residual_binary``: it holds only 0 and 1 and is saved as bits). Returns ``(spikes, final
    states)``, shaped like ``x`` and each ``x.shape[1:]``, and with ``return_stats`` also the batch statistics
    ``(mean, invstd)`` that :func:`bn_neuron_backward_from_stats` takes (for a caller with its own backward, run
    without autograd).
    """
    refuse_active(OBJECTS[neuron].surrogate, "the BatchNorm fused with its neurons")
    x = inputs.x
    xb = _merged(x)
    rb = None if residual is None else _merged(residual)
    mode = "none" if residual is None else "bits" if residual_binary else "tensor"
    call = _call_key(neuron, backend, batchnorm.training, mode)
    out = _forward_op(xb, rb, batchnorm, inputs._replace(x=xb.reshape(x.shape[0], -1)), call)
    spikes, mean, invstd, new_rm, new_rv = out[:5]
    if batchnorm.training and batchnorm.running_mean is not None:
        with torch.no_grad():
            batchnorm.running_mean.copy_(new_rm)
            batchnorm.running_var.copy_(new_rv)
    trailing = x.shape[1:]
    result = spikes.reshape(x.shape), [v.reshape(trailing) for v in out[_N_OUTPUTS_BEFORE_STATES:]]
    return (*result, (mean, invstd)) if return_stats else result


def lif_neuron(neuron: NeuronSpec, leak: Tensor, v_init: Tensor | None, x: Tensor) -> tuple:
    """``(neuron key, params, init)`` of :func:`bn_neuron` for a LIF (:func:`~spikefuse.neurons.lif.lif_spec`);
    ``v_init`` None starts every neuron from the reset value (one value shared by all: nothing of size N is read)."""
    return neuron.op_key, lif_params(neuron, leak), lif_initial(neuron, v_init, x)


def bn_lif(
    x: Tensor,
    batchnorm: BatchNormArgs,
    neuron: NeuronSpec,
    leak: Tensor,
    v_init: Tensor | None,
    backend: str,
    residual: Tensor | None = None,
    residual_binary: bool = False,
):
    """:func:`bn_neuron` with the LIF ``neuron`` (``leak`` its decay, a 1-D compute-dtype tensor of 1 or C entries,
    ``v_init`` of shape ``x.shape[1:]`` or None); returns ``(spikes, state)``."""
    key, params, init = lif_neuron(neuron, leak, v_init, x)
    inputs = engine.NeuronInputs(x, params, init, _inner(x, leak))
    spikes, final = bn_neuron(inputs, batchnorm, key, backend, residual, residual_binary)
    return spikes, final[0]


def bn_neuron_backward_from_stats(
    grads: tuple[Tensor, list[Tensor]],
    inputs: engine.NeuronInputs,
    stats: tuple[Tensor, Tensor],
    batchnorm: BatchNormArgs,
    neuron: str,
    backend: str,
    needs: tuple[bool, list[bool]],
) -> tuple[Tensor, Tensor | None, Tensor | None, list[Tensor | None]]:
    """The backward of :func:`bn_neuron` (no residual) from its ``inputs`` (``x [T, B, C, ...]``, the neurons'
    parameters, initial states and ``inner``) and the ``stats`` it returned: ``(grad_x, grad_weight, grad_bias,
    grad per parameter)``, None where not needed. ``grads``: ``(grad_spikes, grad per final state)``, each state's
    shaped like ``x.shape[1:]``; ``needs``: ``(whether weight and bias need theirs, whether each parameter does)``.
    The same op as the fused module's backward: recomputes the normalized input and the states, nothing of the
    forward again."""
    grad_spikes, grad_final = grads
    need_affine, need_params = needs
    x, params, init, inner = inputs
    t_steps = x.shape[0]
    n = x.numel() // t_steps
    cdt = compute_dtype(x.dtype)
    mean, invstd = stats
    running_mean, running_var, weight, bias, training, _, eps = batchnorm
    call = _call_key(neuron, backend, bool(training), "none")
    backward_op = _backward_for(call) if torch.compiler.is_compiling() else _backward_impl
    empty = x.new_empty(0)
    out = backward_op(
        [grad_spikes.reshape(t_steps, n).contiguous(), *(g.reshape(n).to(cdt).contiguous() for g in grad_final)],
        [
            _merged(x),
            empty,
            x.new_empty(0, dtype=torch.uint8),
            empty if weight is None else weight,
            empty if bias is None else bias,
            mean,
            invstd,
            empty if training or running_mean is None else running_mean,
            empty if training or running_var is None else running_var,
        ],
        list(params),
        list(init),
        [bool(need_affine), False, *(bool(need) for need in need_params)],
        float(eps),
        inner,
        call,
    )
    grad_x, grad_w, grad_b = out[:3]
    affine = weight is not None and need_affine
    grad_params = out[4 + len(init) :]
    return (
        grad_x.reshape(x.shape),
        grad_w if affine else None,
        grad_b if affine and bias is not None else None,
        [g if need else None for g, need in zip(grad_params, need_params)],
    )


def _fused_batch_norm(backend: str, training: bool, xb: Tensor) -> bool:
    """Whether the neuron's backward kernels normalize the input themselves (:mod:`spikefuse.batchnorm.cpu`)."""
    return backend == "cpu" and training and xb.dtype in cpu.SUPPORTED_DTYPES


def _fused_statistics(backend: str, training: bool, xb: Tensor, running_mean, weight, bias) -> bool:
    """Whether the forward computes the statistics itself and normalizes inside the neuron's forward kernel
    (:func:`spikefuse.batchnorm.cpu.statistics`), bit-identical to ``native_batch_norm``."""
    return backend == "cpu" and training and cpu.statistics_supported(xb, running_mean, weight, bias)


def _inner(x: Tensor, leak: Tensor) -> int:
    """Neurons per channel run (the spatial size) for a per-channel leak, else 1 (the kernels' ``inner``)."""
    return math.prod(x.shape[3:]) if leak.numel() > 1 else 1


def _merged(x: Tensor) -> Tensor:
    """``x [T, B, C, ...]`` as the contiguous ``[T*B, C, ...]`` BatchNorm normalizes."""
    xb = x.flatten(0, 1)
    return xb if xb.is_contiguous() else xb.contiguous()
