"""BatchNorm (plus an optional residual) fused with a spiking neuron, saving only the BN input ``x`` (and the
residual) for backward (Liang et al., Alg. 1-4).

The neuron is any neuron of the engine (a :class:`~spikefuse.neurons.NeuronSpec`: a
:class:`~spikefuse.neurons.NeuronModel` with its surrogate and ``detach_reset``; the LIF of
:func:`spikefuse.batchnorm_lif` is one of its definitions, :func:`spikefuse.neurons.lif.lif_spec`), on any of the
engine's backends, its reference too. The op takes it as a key, and its parameters and initial states as lists of
tensors.

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

import math

import torch
from torch import Tensor

from ..neurons.lif import lif_initial, lif_params
from ..neurons.spec import NeuronSpec
from ..ops import engine
from ..ops.bitpack import pack, packed_numel, unpack
from ..ops.autograd_guards import refuse_double_backward
from ..ops.numerics import compute_dtype
from ..registry import OBJECTS
from . import cpu

__all__ = [
    "bn_neuron",
    "bn_lif",
    "bn_neuron_backward_from_stats",
    "bn_lif_forward",
    "bn_lif_backward",
]


def _neuron_forward(
    neuron: NeuronSpec,
    backend: str,
    x2: Tensor,
    params: list,
    inner: int,
    init: list,
    normalization: cpu.Normalization | None = None,
    spike_bits: bool = False,
) -> tuple[Tensor, list]:
    """``(spikes, final states)`` of the neurons on their input ``x2 [T, N]``, through the engine's entry point
    (saving nothing). On the cpu backend with its own options (:func:`spikefuse.ops.engine.cpu.forward`):
    ``normalization`` given, ``x2`` is the raw input ``[T*B, C, ...]`` merged and the kernel normalizes it (plus the
    residual) itself; ``spike_bits``: the kernel also packs the spikes it writes."""
    # a half-precision input runs in float32 (converted where the backend does not read it as it is), its spikes
    # in its own dtype
    kernels = engine.module(backend)
    stream = engine.stream(kernels, x2)
    options = {}
    if normalization is not None or spike_bits:
        src = None if normalization is None else cpu.source_args(stream, normalization)
        options = {"src": src, "spike_bits": spike_bits}
    spikes, final, _ = kernels.forward(
        neuron, engine.NeuronInputs(stream, params, init, inner), spike_dtype=x2.dtype, **options
    )
    return spikes, final


def _neuron_backward(
    neuron: NeuronSpec,
    backend: str,
    grads: tuple[Tensor, list],
    x2: Tensor,
    params: list,
    inner: int,
    init: list,
    need_param_grads: list,
    normalization: cpu.Normalization | None = None,
) -> tuple[Tensor, list, list]:
    """``(grad_y, grad per state of init, grad per parameter)`` of the neurons for ``grads`` (the spikes' and the
    final states'), through the engine's entry point. ``x2``: the neurons' input ``[T, N]``, a transient of the
    caller's that the backend may write ``grad_y`` over (``overwrite_x``); or, with ``normalization`` (the cpu
    backend), the raw input ``[T*B, C, ...]`` merged, read, not written, which the kernel normalizes itself."""
    kernels = engine.module(backend)
    grad_spikes, grad_final = grads
    if normalization is None:
        inputs, options = engine.NeuronInputs(engine.stream(kernels, x2), params, init, inner), {"overwrite_x": True}
    else:
        inputs, options = engine.NeuronInputs(x2, params, init, inner), {"src": cpu.source_args(x2, normalization)}
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


def _forward(
    xb: Tensor,
    residual: Tensor | None,
    pack_residual: bool,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    params: list[Tensor],
    init: list[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    t_steps: int,
    inner: int,
    neuron: str,
    backend: str,
    eager: bool,
) -> list[Tensor]:
    """BatchNorm of ``xb [T*B, C, ...]``, plus ``residual`` (shaped like ``xb``) when given, then the neuron
    (``neuron``: the key of a :class:`~spikefuse.neurons.NeuronSpec`); returns ``[spikes [T, N], mean,
    invstd, new_running_mean, new_running_var, residual_bits, *final states [N]]``. The running statistics are
    updated on copies (the op stays functional; the caller copies them back); in eval mode the copies are the
    snapshot backward normalizes with. ``residual_bits`` is the residual packed to bits with ``pack_residual``, else
    empty. ``eager`` (not the custom op, whose outputs must be its own): the residual's bits may be those its
    earlier packing made (:func:`spikefuse.ops.bitpack.remember`), and in training the cpu kernel packs the spikes
    it writes for the layers that save them as bits."""
    # in training the cpu kernel (an option of its only) packs the spikes for the layers that save them as bits
    spike_bits = eager and training and backend == "cpu"
    spec = OBJECTS[neuron]
    bits = (
        pack(residual, reuse=eager)[0] if residual is not None and pack_residual else xb.new_empty(0, dtype=torch.uint8)
    )
    if _fused_statistics(backend, training, xb, running_mean, weight, bias):
        # the statistics alone, then BatchNorm (plus residual) inside the neuron kernel: no normalized copy of x
        mean, invstd, rm, rv = cpu.statistics(xb, running_mean, running_var, momentum, eps)
        norm = cpu.Normalization(mean, invstd, weight, bias, math.prod(xb.shape[2:]), residual)
        spikes, final = _neuron_forward(
            spec, backend, xb.reshape(t_steps, -1), list(params), inner, list(init), norm, spike_bits
        )
    else:
        rm = running_mean.clone() if running_mean is not None else None
        rv = running_var.clone() if running_var is not None else None
        y, mean, invstd, _, _ = _torch_batch_norm(xb, weight, bias, rm, rv, training, momentum, eps)
        if residual is not None:
            y += residual
        y2 = y.reshape(t_steps, -1)
        spikes, final = _neuron_forward(spec, backend, y2, list(params), inner, list(init), spike_bits=spike_bits)
        del y, y2
    empty = xb.new_empty(0)
    return [spikes, mean, invstd, empty if rm is None else rm, empty if rv is None else rv, bits, *final]


def _forward_impl(
    xb: Tensor,
    residual: Tensor | None,
    pack_residual: bool,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    params: list[Tensor],
    init: list[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    t_steps: int,
    inner: int,
    neuron: str,
    backend: str,
) -> list[Tensor]:
    """The custom op's body: :func:`_forward`, not eager."""
    return _forward(
        xb,
        residual,
        pack_residual,
        weight,
        bias,
        running_mean,
        running_var,
        params,
        init,
        training,
        momentum,
        eps,
        t_steps,
        inner,
        neuron,
        backend,
        eager=False,
    )


bn_lif_forward = torch.library.custom_op("spikefuse::bn_lif_forward", _forward_impl, mutates_args=())


@bn_lif_forward.register_fake
def _(
    xb,
    residual,
    pack_residual,
    weight,
    bias,
    running_mean,
    running_var,
    params,
    init,
    training,
    momentum,
    eps,
    t_steps,
    inner,
    neuron,
    backend,
):
    n = xb.numel() // t_steps
    stat_dtype = weight.dtype if weight is not None else xb.dtype
    stats = (xb.shape[1],) if training else (0,)
    bits = packed_numel(xb.numel()) if residual is not None and pack_residual else 0
    return [
        xb.new_empty((t_steps, n)),
        xb.new_empty(stats, dtype=stat_dtype),
        xb.new_empty(stats, dtype=stat_dtype),
        torch.empty_like(running_mean) if running_mean is not None else xb.new_empty(0),
        torch.empty_like(running_var) if running_var is not None else xb.new_empty(0),
        xb.new_empty((bits,), dtype=torch.uint8),
        *(xb.new_empty((n,), dtype=compute_dtype(xb.dtype)) for _ in init),
    ]


def _backward_impl(
    grad_spikes: Tensor,
    grad_final: list[Tensor],
    xb: Tensor,
    residual: Tensor | None,
    residual_bits: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    params: list[Tensor],
    init: list[Tensor],
    inner: int,
    neuron: str,
    backend: str,
    training: bool,
    eps: float,
    need_param_grads: list[bool],
    need_affine_grad: bool,
    need_residual_grad: bool,
) -> list[Tensor]:
    """``[grad_x [T*B, C, ...], grad_weight, grad_bias, grad_residual, *grad per initial state, *grad per
    parameter]``; unneeded ones are empty. The residual is ``residual`` or, when that is None and ``residual_bits``
    is not empty, those bits."""
    t_steps, n = grad_spikes.shape
    spec = OBJECTS[neuron]
    fused = _fused_batch_norm(backend, training, xb)
    if fused:
        # BatchNorm inside the neuron kernel's recompute, from the saved statistics (bit-identical to the forward's)
        bits = residual_bits if residual is None and residual_bits.numel() else None
        norm = cpu.Normalization(mean, invstd, weight, bias, math.prod(xb.shape[2:]), residual, bits)
        del residual
        grad_y, grad_init, grad_params = _neuron_backward(
            spec,
            backend,
            (grad_spikes, list(grad_final)),
            xb.reshape(t_steps, n),
            list(params),
            inner,
            list(init),
            list(need_param_grads),
            norm,
        )
        del norm
    else:
        y, reserve, impl = _batch_norm(xb, weight, bias, running_mean, running_var, training, eps)
        if residual is None and residual_bits.numel():
            residual = unpack(residual_bits, xb.shape, xb.dtype)
        if residual is not None:
            y += residual
        y2 = y.reshape(t_steps, n)  # this function's own transient: the backend may write grad_y over it
        del y, residual
        grad_y, grad_init, grad_params = _neuron_backward(
            spec, backend, (grad_spikes, list(grad_final)), y2, list(params), inner, list(init), list(need_param_grads)
        )
        del y2
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
def _(
    grad_spikes,
    grad_final,
    xb,
    residual,
    residual_bits,
    weight,
    bias,
    mean,
    invstd,
    running_mean,
    running_var,
    params,
    init,
    inner,
    neuron,
    backend,
    training,
    eps,
    need_param_grads,
    need_affine_grad,
    need_residual_grad,
):
    affine = weight is not None and need_affine_grad
    n = grad_spikes.shape[1]
    return [
        torch.empty_like(xb),
        torch.empty_like(weight) if affine else xb.new_empty(0),
        torch.empty_like(weight) if affine else xb.new_empty(0),
        torch.empty_like(xb) if need_residual_grad else xb.new_empty(0),
        *(torch.empty_like(v) if v.numel() == n else xb.new_empty(0) for v in init),
        *(torch.empty_like(p) if need else xb.new_empty(0) for p, need in zip(params, need_param_grads)),
    ]


def _backward_for(backend: str):
    """The backward op, or for the reference backend its implementation: the reference differentiates its loop
    with autograd, which a custom op's body cannot use (the dispatcher runs it below autograd)."""
    return _backward_impl if backend == "reference" else bn_lif_backward


# Inputs of bn_lif_forward, by position.
(_X, _RES, _PACK, _W, _B, _RM, _RV, _PARAMS, _INIT, _TRAINING, _MOMENTUM, _EPS, _T, _INNER, _NEURON, _BACKEND) = range(
    16
)
_N_OUTPUTS_BEFORE_STATES = 6  # spikes, mean, invstd, running mean, running var, residual bits
_EAGER_TENSORS = 15  # the position of the first parameter among _EagerBatchNormNeuron.forward's inputs


def _save(ctx, xb, residual, weight, bias, params, init, output, training, inner, neuron, backend, eps):
    ctx.args = (inner, neuron, backend, training, eps)
    ctx.n_params, ctx.t_steps = len(params), output[0].shape[0]
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
        empty if training else rm,  # eval: the snapshot of the running statistics y was made with
        empty if training else rv,
        *params,
        *init,
    )


def _gradients(ctx, grads, need_params, need_affine: bool, need_residual: bool, backward_op) -> tuple:
    """``(grad_x, grad_weight, grad_bias, grad_residual, grad per parameter, grad per initial state)``."""
    xb, residual, bits, w, b, mean, invstd, rm, rv, *tensors = ctx.saved_tensors
    params, init = tensors[: ctx.n_params], tensors[ctx.n_params :]
    inner, neuron, backend, training, eps = ctx.args
    refuse_double_backward(
        f"the fused BatchNorm+neuron op ({OBJECTS[neuron].name})",
        "use torch.nn.BatchNorm and the neuron with backend='reference' instead",
    )
    n = xb.numel() // ctx.t_steps
    grad_spikes = grads[0] if grads[0] is not None else torch.zeros((ctx.t_steps, n), dtype=xb.dtype, device=xb.device)
    cdt = compute_dtype(xb.dtype)
    grad_final = [g if g is not None else xb.new_zeros(1, dtype=cdt) for g in grads[_N_OUTPUTS_BEFORE_STATES:]]
    out = backward_op(
        grad_spikes.contiguous(),
        [g.contiguous() for g in grad_final],
        xb,
        residual if ctx.residual_as_is else None,
        bits,
        w if ctx.has_w else None,
        b if ctx.has_b else None,
        mean,
        invstd,
        rm if rm.numel() else None,
        rv if rv.numel() else None,
        list(params),
        list(init),
        inner,
        neuron,
        backend,
        training,
        eps,
        [bool(need) for need in need_params],
        need_affine,
        need_residual,
    )
    grad_x, grad_w, grad_b, grad_res = out[:4]
    grad_init, grad_params = out[4 : 4 + len(init)], out[4 + len(init) :]
    grad_params = [g if need else None for g, need in zip(grad_params, need_params)]
    grad_init = [g if g.numel() else None for g in grad_init]
    return grad_x, grad_w, grad_b, grad_res, grad_params, grad_init


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    _save(
        ctx,
        inputs[_X],
        inputs[_RES],
        inputs[_W],
        inputs[_B],
        inputs[_PARAMS],
        inputs[_INIT],
        output,
        inputs[_TRAINING],
        inputs[_INNER],
        inputs[_NEURON],
        inputs[_BACKEND],
        inputs[_EPS],
    )


def _backward(ctx, grads):
    need = ctx.needs_input_grad
    grad_x, grad_w, grad_b, grad_res, grad_params, grad_init = _gradients(
        ctx,
        grads,
        need[_PARAMS],
        bool(need[_W] or need[_B]),
        bool(need[_RES]),
        _backward_for(ctx.args[2]),
    )
    grads_out = [None] * len(need)
    for index, grad in (
        (_X, grad_x),
        (_W, grad_w),
        (_B, grad_b),
        (_RES, grad_res),
        (_PARAMS, grad_params),
        (_INIT, grad_init),
    ):
        grads_out[index] = grad if need[index] else None
    return tuple(grads_out)


torch.library.register_autograd("spikefuse::bn_lif_forward", _backward, setup_context=_setup_context)


class _EagerBatchNormNeuron(torch.autograd.Function):
    """``bn_lif_forward`` with the same autograd, without the custom-op dispatch, which costs more than the kernels
    of a small layer (as for the neuron op, :func:`spikefuse.ops.engine.autograd.neuron`); the parameters and initial
    states are flat arguments, so that autograd sees them."""

    @staticmethod
    def forward(
        ctx,
        xb,
        residual,
        pack_residual,
        weight,
        bias,
        running_mean,
        running_var,
        training,
        momentum,
        eps,
        t_steps,
        inner,
        neuron,
        backend,
        n_params,
        *tensors,
    ):
        params, init = list(tensors[:n_params]), list(tensors[n_params:])
        out = _forward(
            xb,
            residual,
            pack_residual,
            weight,
            bias,
            running_mean,
            running_var,
            params,
            init,
            training,
            momentum,
            eps,
            t_steps,
            inner,
            neuron,
            backend,
            eager=True,
        )
        ctx.set_materialize_grads(False)
        _save(ctx, xb, residual, weight, bias, params, init, out, training, inner, neuron, backend, eps)
        ctx.mark_non_differentiable(*out[1:_N_OUTPUTS_BEFORE_STATES])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        need = ctx.needs_input_grad
        n_params = ctx.n_params
        grad_x, grad_w, grad_b, grad_res, grad_params, grad_init = _gradients(
            ctx,
            grads,
            need[_EAGER_TENSORS : _EAGER_TENSORS + n_params],
            bool(need[3] or need[4]),
            bool(need[1]),
            _backward_impl,
        )
        return (
            grad_x if need[0] else None,
            grad_res if need[1] else None,
            None,
            grad_w if need[3] else None,
            grad_b if need[4] else None,
            *([None] * (_EAGER_TENSORS - 5)),
            *grad_params,
            *grad_init,
        )


def _forward_op(
    xb,
    residual,
    pack_residual,
    weight,
    bias,
    running_mean,
    running_var,
    params,
    init,
    training,
    momentum,
    eps,
    t_steps,
    inner,
    neuron,
    backend,
) -> list:
    """The custom op under ``torch.compile``, the plain Function in eager mode."""
    if torch.compiler.is_compiling():
        return bn_lif_forward(
            xb,
            residual,
            pack_residual,
            weight,
            bias,
            running_mean,
            running_var,
            list(params),
            list(init),
            training,
            momentum,
            eps,
            t_steps,
            inner,
            neuron,
            backend,
        )
    return list(
        _EagerBatchNormNeuron.apply(
            xb,
            residual,
            pack_residual,
            weight,
            bias,
            running_mean,
            running_var,
            training,
            momentum,
            eps,
            t_steps,
            inner,
            neuron,
            backend,
            len(params),
            *params,
            *init,
        )
    )


def bn_neuron(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    neuron: str,
    params: list[Tensor],
    init: list[Tensor],
    inner: int,
    backend: str,
    residual: Tensor | None = None,
    residual_binary: bool = False,
    return_stats: bool = False,
):
    """BatchNorm (over T, B and the spatial dims of ``x [T, B, C, ...]``), plus ``residual`` when given, then
    ``neuron`` (the :attr:`~spikefuse.neurons.NeuronSpec.op_key` of its neurons).

    Arguments are already validated and resolved (``backend`` concrete; ``params`` one compute-dtype tensor per
    parameter, ``[1]`` or per channel with ``inner`` neurons per channel run; ``init`` one per state, ``[N]`` or
    ``[1]``; ``residual`` of ``x``'s shape, dtype and device or None; ``residual_binary``: it holds only 0 and 1
    and is saved as bits). Returns ``(spikes, final states)``, shaped like ``x`` and each ``x.shape[1:]``, and with
    ``return_stats`` also the batch statistics ``(mean, invstd)`` that :func:`bn_neuron_backward_from_stats` takes (for
    a caller with its own backward, run without autograd). ``training``/``momentum`` as
    :func:`torch.nn.functional.batch_norm`.
    """
    t_steps, trailing = x.shape[0], x.shape[1:]
    rb = None if residual is None else _merged(residual)
    out = _forward_op(
        _merged(x),
        rb,
        bool(residual_binary),
        weight,
        bias,
        running_mean,
        running_var,
        list(params),
        list(init),
        bool(training),
        float(momentum),
        float(eps),
        t_steps,
        inner,
        neuron,
        backend,
    )
    spikes, mean, invstd, new_rm, new_rv = out[:5]
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.copy_(new_rm)
            running_var.copy_(new_rv)
    result = spikes.reshape(x.shape), [v.reshape(trailing) for v in out[_N_OUTPUTS_BEFORE_STATES:]]
    return (*result, (mean, invstd)) if return_stats else result


def lif_neuron(neuron: NeuronSpec, leak: Tensor, v_init: Tensor | None, x: Tensor) -> tuple:
    """``(neuron key, params, init)`` of :func:`bn_neuron` for a LIF (:func:`~spikefuse.neurons.lif.lif_spec`);
    ``v_init`` None starts every neuron from the reset value (one value shared by all: nothing of size N is read)."""
    return neuron.op_key, lif_params(neuron, leak), lif_initial(neuron, v_init, x)


def bn_lif(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    leak: Tensor,
    neuron: NeuronSpec,
    v_init: Tensor | None,
    backend: str,
    residual: Tensor | None = None,
    residual_binary: bool = False,
    return_stats: bool = False,
):
    """:func:`bn_neuron` with the LIF ``neuron`` (``leak`` its decay, a 1-D compute-dtype tensor of 1 or C entries,
    ``v_init`` of shape ``x.shape[1:]`` or None); returns ``(spikes, state)`` (and the statistics with
    ``return_stats``)."""
    key, params, init = lif_neuron(neuron, leak, v_init, x)
    out = bn_neuron(
        x,
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
        key,
        params,
        init,
        _inner(x, leak),
        backend,
        residual,
        residual_binary,
        return_stats,
    )
    return (out[0], out[1][0], *out[2:])


def bn_neuron_backward_from_stats(
    grad_spikes: Tensor,
    grad_final: list[Tensor],
    x: Tensor,
    stats: tuple[Tensor, Tensor],
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    eps: float,
    neuron: str,
    params: list[Tensor],
    init: list[Tensor],
    inner: int,
    backend: str,
    need_affine: bool,
    need_params: list[bool],
) -> tuple[Tensor, Tensor | None, Tensor | None, list[Tensor | None]]:
    """The backward of :func:`bn_neuron` (no residual) from its input ``x`` and the ``stats`` it returned:
    ``(grad_x, grad_weight, grad_bias, grad per parameter)``, None where not needed; ``grad_final`` one gradient
    per state, shaped like ``x.shape[1:]``. The same op as the fused module's backward: recomputes the normalized
    input and the states, nothing of the forward again."""
    t_steps = x.shape[0]
    n = x.numel() // t_steps
    cdt = compute_dtype(x.dtype)
    mean, invstd = stats
    backward_op = _backward_for(backend) if torch.compiler.is_compiling() else _backward_impl
    out = backward_op(
        grad_spikes.reshape(t_steps, n).contiguous(),
        [g.reshape(n).to(cdt).contiguous() for g in grad_final],
        _merged(x),
        None,
        x.new_empty(0, dtype=torch.uint8),
        weight,
        bias,
        mean,
        invstd,
        None if training else running_mean,
        None if training else running_var,
        list(params),
        list(init),
        inner,
        neuron,
        backend,
        bool(training),
        float(eps),
        [bool(need) for need in need_params],
        bool(need_affine),
        False,
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
