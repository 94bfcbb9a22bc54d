"""Linear, convolution and max-pooling layers fed by spikes that save their input for backward as bits.

In BPTT training a linear or convolution layer saves its input to compute the weight gradient
``grad_W = grad_y^T x``. When the input is the spike output of a neuron layer it holds only 0 and 1, so saving
it as float32 spends 32 bits on one bit of information (Liang et al., Sec. III). The layers here compute the
forward pass exactly as :class:`torch.nn.Linear` / :class:`torch.nn.Conv2d` do, but save the input packed
8 spikes to a byte (:func:`spikefuse.ops.bitpack.pack`, 32x less than float32, 16x less than float16); backward
unpacks it to the exact original 0/1 tensor and calls the same torch ops that torch's own backward calls
(``mm`` / ``aten.convolution_backward``), so outputs and all gradients are bit-identical to the torch layer
applied to the same float input. The input is saved only when the weight needs a gradient; the gradient of
the input needs only the weight (and the input's shape).

Contract: **the input must be binary, every element 0 or 1 in the layer's dtype** (the bits could not give back
any other value: backward would see every nonzero element as 1, a wrong weight gradient). On the CPU the packing
kernel checks this as it reads the input, always: a layer that keeps its input raises :class:`ValueError` naming
the layer and the first offending value and its index (spikes a neuron kernel packed are not read again). On
other devices reading that check's result would stall the host: there the input is checked in debug mode only
(:func:`set_debug` ``(True)`` or the environment variable ``SPIKEFUSE_DEBUG=1``, read when this module is
imported), which checks every call's input with a pass of its own. Debug mode also re-packs an input whose bits a
neuron kernel made and refuses bits that an edit where torch counts nothing (through ``.data`` or a numpy view)
left stale; edits through torch drop the bits without it.

``SpikeLinear(..., sparse=True)`` (or ``"auto"``) computes its forward product and weight gradient on the CPU from
the input's bits, adding only the weights of the active inputs (:mod:`spikefuse.ops.spike_layers.cpu`): faster below a
spike rate, equal to the dense product up to rounding. On the CPU such a layer also takes an input that is not
binary (framed events are counts), by its nonzero entries and their values. The default, ``sparse=False``, keeps
torch's product.

The layers take multi-step input ``[T, B, ...]`` and return ``[T, B, ...]``; the time steps are merged into the
batch, as :class:`spikefuse.nn.SeqToBatch` does. They subclass the torch layers, with the same constructor
arguments, parameters and ``state_dict``, so weights of a ``nn.Conv2d`` / ``nn.Linear`` load unchanged.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import bitpack
from ..ops.maxpool.autograd import _SpikeMaxPoolFn
from ..ops.spike_layers import cpu as sparse_cpu
from ..ops.spike_layers.autograd import CSRLinearFunction, SparseGradLinearFunction, _SpikeConvFn, _SpikeLinearFn

__all__ = [
    "SpikeLinear",
    "SpikeConv1d",
    "SpikeConv2d",
    "SpikeConv3d",
    "SpikeMaxPool1d",
    "SpikeMaxPool2d",
    "SpikeMaxPool3d",
    "set_debug",
    "debug_enabled",
]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


_debug = _env_flag("SPIKEFUSE_DEBUG")


def set_debug(enabled: bool = True) -> bool:
    """Turn the binary-input check of the spike layers on or off (overrides ``SPIKEFUSE_DEBUG``); returns the
    previous setting, so ``prev = set_debug(True); ...; set_debug(prev)`` restores it."""
    global _debug
    previous, _debug = _debug, bool(enabled)
    return previous


def debug_enabled() -> bool:
    """Whether the spike layers check that their input is binary."""
    return _debug


def _apply_as_autocast_would(fn, x: torch.Tensor, weight: torch.Tensor, bias, *args) -> torch.Tensor:
    """``fn.apply(x, weight, bias, *args)`` with the casts autocast gives torch's conv and linear (both on its
    lower-precision list): inputs in the autocast dtype, autocast off inside, so our ops see what theirs see."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return fn.apply(x, weight, bias, *args)
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        return fn.apply(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), *args)


def check_input(module: nn.Module, x: torch.Tensor, binary: bool = True) -> None:
    """The debug mode's checks of a spike layer's input: binary (:func:`check_binary`; skipped with ``binary=False``,
    for a layer that takes values too), and no bits remembered for it that an edit around torch's version counter
    (``.data``, numpy) left stale, which the layer would read instead of ``x``."""
    if binary:
        check_binary(module, x)
    if bitpack.stale(x):
        raise ValueError(
            f"{module._get_name()}({module.extra_repr()}): its input was changed in place where torch does not count "
            "it (through .data or a numpy view) after a neuron made it, so the bits spikefuse kept of it are stale "
            "and the layer would read those. Change it through torch (x.detach().copy_(...), x.masked_fill_(...)) "
            "or make a new tensor"
        )


def _refusing_non_binary(module: nn.Module, x: torch.Tensor, op):
    """``op()``, a spike layer's op on ``x``, whose packing refuses an input that is not binary
    (:class:`spikefuse.ops.bitpack.NotBinaryError`): raised again naming ``module`` and the first such value."""
    try:
        return op()
    except bitpack.NotBinaryError:
        check_binary(module, x)
        raise


def check_binary(
    module: nn.Module,
    x: torch.Tensor,
    what: str = "input",
    because: str = "it saves its {what} as bits for backward",
    instead: str = "use the torch layer for non-binary input",
) -> None:
    """Raise ``ValueError`` naming ``module`` and the first element of ``x`` that is neither 0 nor 1, why the module
    needs spikes (``because``) and what to do (``instead``)."""
    ok = (x == 0) | (x == 1)
    if bool(ok.all()):
        return
    first = int((~ok).reshape(-1).nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape))
    value = x.reshape(-1)[first].item()
    raise ValueError(
        f"{module._get_name()}({module.extra_repr()}) expects binary spikes (0 or 1) as {what}, because "
        f"{because.format(what=what)}; got {value!r} at index {index} of the {what} of shape "
        f"{tuple(x.shape)}. Feed it spikes, or {instead}."
    )


# ---------------------------------------------------------------------------------------------------- linear
def _sparse_unavailable(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the sparse CPU products cannot compute ``F.linear(x, weight)``, or None where they can."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return f"the sparse products run on the CPU, and the input is on {x.device}, the weight on {weight.device}"
    if torch.is_autocast_enabled("cpu"):
        return (
            f"under autocast the product runs in {torch.get_autocast_dtype('cpu')}, and the sparse CPU kernels take "
            "float32 or float64"
        )
    if x.dtype != weight.dtype or x.dtype not in sparse_cpu.SUPPORTED_DTYPES:
        return (
            f"the sparse CPU kernels take float32 or float64 input and weight of one dtype, got a {x.dtype} input "
            f"and a {weight.dtype} weight"
        )
    if torch.compiler.is_compiling():
        return "torch.compile does not trace the sparse CPU kernels"
    return None


#: The fewest outputs for which ``SpikeLinear(sparse=True | "auto")`` keeps its weight input-major. Narrower layers
#: keep torch's row-major weight: torch's dense products of a few outputs with an input-major weight ran up to 4x
#: slower (``F.linear`` forward and backward of [1280 x 512] spikes -> 2, 10, 33 outputs: 4.4x, 1.19x, 1.13x; from 64
#: outputs on 0.97-1.04x; AMD EPYC, 2 threads), and their sparse products save little by it.
INPUT_MAJOR_MIN_OUT = 64


class SpikeLinear(nn.Linear):
    """:class:`torch.nn.Linear` on multi-step spikes ``[T, B, ..., in_features] -> [T, B, ..., out_features]``
    that saves its input for backward as bits (32x less memory than float32).

    Same arguments, parameters and ``state_dict`` as :class:`torch.nn.Linear`; output and gradients are
    bit-identical to it. **The input must be binary (0/1) in the layer's dtype**: refused on the CPU where the
    layer keeps it (as it packs it), on other devices in debug mode (:func:`set_debug`). See
    :mod:`spikefuse.nn.spike_layers`.

    ``sparse``: ``True`` computes the forward product and the weight gradient from the input's bits, adding only
    the weights of the inputs that spiked (:mod:`spikefuse.ops.spike_layers.cpu`; float32/float64 on the CPU, no
    autocast; anything else is refused, naming why): equal to the dense product up to rounding, each sum taken in
    increasing input (forward) or row (weight gradient) order; the input gradient stays the dense product.
    ``"auto"`` measures the spike rate of every call from the bits and takes the sparse product below the
    crossover rates measured on this machine (``spike_layers.cpu.CROSSOVER_FORWARD``, ``CROSSOVER_WEIGHT_GRAD``), the
    dense one above, for fewer rows (``T*B*...``) than ``spike_layers.cpu.CROSSOVER_ROWS`` or fewer multiply-adds than
    ``CROSSOVER_WORK`` (keeping for backward an input whose bits no neuron kernel made as it is, as ``nn.Linear``
    does: checking it to keep bits would cost a pass) and wherever the sparse one cannot run; it counts only bits it
    has without a pass over the input (a neuron kernel's, or those the layer packs to keep for backward), so without
    a weight gradient to keep it takes the sparse product only for spikes whose bits were made before. ``False``
    (the default): torch's product, bit-identical to ``nn.Linear``. With ``True`` or ``"auto"`` a layer of at least
    :data:`INPUT_MAJOR_MIN_OUT` outputs keeps its weight input-major (``weight.t()`` contiguous), the layout the sparse
    products read and write, so that neither copies it at every call; its values, shape and ``state_dict`` are
    ``nn.Linear``'s.

    Inputs with values: on the CPU, ``True`` and ``"auto"`` take an input the packing finds not binary (framed
    events are counts) by its nonzero entries and their values (:func:`spikefuse.ops.spike_layers.cpu.to_csr`, kept for
    backward instead of the input): each term ``value * weight``, summed in the same orders. ``"auto"`` counts the
    nonzero entries and takes them below ``spike_layers.cpu.CROSSOVER_VALUES``, torch's product (keeping the input, as
    ``nn.Linear``) otherwise, under ``torch.no_grad()`` and wherever the sparse kernels cannot run.

    ``sparse_grad``: ``True`` computes the input gradient ``G @ W`` from the nonzero entries of the output gradient
    ``G`` only (its CSR, :func:`spikefuse.ops.spike_layers.cpu.output_grad_csr`), and the weight gradient ``G.T @ X``
    too where it is not read from the input's own sparsity: faster where most of ``G`` is zero, as behind a neuron
    whose surrogate is zero away from the threshold (:class:`spikefuse.surrogate.Windowed`); equal to the dense
    products up to rounding, each sum in increasing order of the gradient's index. ``"auto"`` counts the nonzero
    gradients of every backward and reads them so below ``spike_layers.cpu.CROSSOVER_GRAD``; ``False`` (the default):
    torch's products. The same kernels as ``sparse``'s: float32/float64 on the CPU, no autocast (``True`` refuses
    anything else by message, ``"auto"`` takes the dense products there).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        sparse=False,
        sparse_grad=False,
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        for name, value in (("sparse", sparse), ("sparse_grad", sparse_grad)):
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"SpikeLinear: {name} must be True, False or 'auto', got {value!r}")
        self.sparse = sparse
        self.sparse_grad = sparse_grad
        if sparse is not False and out_features >= INPUT_MAJOR_MIN_OUT:
            # the sparse products read the weight input by input (a row of W.T per active input) and write its
            # gradient so: kept in that layout, a [out, in] view of a row-major [in, out], neither is copied at every
            # call (a 4.7 MB transpose each for the N-MNIST input layer)
            self.weight = nn.Parameter(self.weight.detach().t().contiguous().t(), self.weight.requires_grad)
        # sparse="auto": the last call's input held values (framed events): check the next one by the count of its
        # nonzero entries, which tells binary input apart in the same pass, before trying to pack it as spikes
        self._values_seen = False

    def extra_repr(self) -> str:
        return super().extra_repr() + "".join(
            f", {name}={value!r}"
            for name, value in (("sparse", self.sparse), ("sparse_grad", self.sparse_grad))
            if value is not False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3:
            raise ValueError(
                f"{self._get_name()} expects multi-step input [T, B, ..., {self.in_features}], "
                f"got shape {tuple(x.shape)}"
            )
        if _debug:  # on the CPU a sparse layer takes values too, and packing checks what it keeps as bits
            check_input(self, x, binary=self.sparse is False or x.device.type != "cpu")
        sparse_grad = self._sparse_grad_for(x)
        if self.sparse is not False:
            y = self._sparse_forward(x, sparse_grad)
            if y is not None:
                return y
        if not torch.is_grad_enabled():  # nothing to keep for a backward: torch's layer
            return super().forward(x)

        def dense():
            return _apply_as_autocast_would(_SpikeLinearFn, x, self.weight, self.bias, None, False, False, sparse_grad)

        if self.sparse == "auto":
            try:
                return dense()
            except bitpack.NotBinaryError:  # values, not spikes: torch's product, which keeps them for backward
                return self._torch_product(x, sparse_grad)
        return _refusing_non_binary(self, x, dense)

    def _sparse_grad_for(self, x: torch.Tensor) -> bool | str:
        """``sparse_grad`` for this call: False without a backward and, for ``"auto"``, where the sparse kernels
        cannot run; ``True`` refuses those places, naming why."""
        if self.sparse_grad is False or not torch.is_grad_enabled():
            return False
        reason = _sparse_unavailable(x, self.weight)
        if reason is None:
            return self.sparse_grad
        if self.sparse_grad == "auto":
            return False
        raise ValueError(
            f"{self._get_name()}({self.extra_repr()}) cannot read its output gradient sparsely: {reason}. Use "
            "sparse_grad='auto' (the dense products wherever the sparse ones cannot run) or sparse_grad=False"
        )

    def _torch_product(self, x: torch.Tensor, sparse_grad: bool | str) -> torch.Tensor:
        """torch's product, keeping ``x`` (an input with values) for backward: ``nn.Linear``'s, or with
        ``sparse_grad`` one whose backward reads the output gradient's CSR."""
        if sparse_grad is False:
            return super().forward(x)
        return SparseGradLinearFunction.apply(x, self.weight, self.bias, sparse_grad)

    def _sparse_forward(self, x: torch.Tensor, sparse_grad: bool | str) -> torch.Tensor | None:
        """The output with the sparse products where ``sparse`` asks for them; None where ``"auto"`` leaves the call
        to the dense path (which refuses a non-binary input it must keep, as with ``sparse=False``)."""
        auto = self.sparse == "auto"
        reason = _sparse_unavailable(x, self.weight)
        if reason is not None:
            if auto:
                return None
            raise ValueError(
                f"{self._get_name()}({self.extra_repr()}) cannot use the sparse products: {reason}. Use "
                "sparse='auto' (the dense product wherever the sparse ones cannot run) or sparse=False"
            )
        # a product this small is over before the sparse one's per-call costs are: auto takes the dense products
        rows = math.prod(x.shape[:-1])
        work = rows * self.in_features * self.out_features
        small = auto and (rows < sparse_cpu.CROSSOVER_ROWS or work < sparse_cpu.CROSSOVER_WORK)
        x2 = x.reshape(-1, self.in_features)
        bits = bitpack.spike_bits(x2)
        if bits is None:
            if auto and not (torch.is_grad_enabled() and self.weight.requires_grad):
                # nothing to keep for backward: packing the input only to count its spikes would cost a few percent
                # of the dense product where that wins, and more on small products
                return None
            if small:
                # torch's product, keeping the input as nn.Linear does: checking it (binary or values) to keep bits
                # instead cost 3-5% of a [128 x 2312] -> 512 call, and an input no neuron made (data) is held for
                # the step anyway
                return self._torch_product(x, sparse_grad)
            counts = None
            if auto and getattr(self, "_values_seen", False):
                # an input with values again, most likely: one pass counts it and tells whether it is binary, where
                # the packing (a slower pass) would fail first and the count follow
                counts, binary = sparse_cpu.nonzero_counts_binary(x2)
                if not binary:
                    return self._values_forward(x, x2, auto, sparse_grad, counts)
                self._values_seen = False
            try:  # before any product: an input with values must not cost a dense product that is then dropped
                bits, _ = bitpack.pack(x2, binary=True)
            except bitpack.NotBinaryError:
                if auto:
                    self._values_seen = True
                return self._values_forward(x, x2, auto, sparse_grad)
        forward = weight_grad = not small
        if auto and not small:
            rate = sparse_cpu.spike_count(bits, x2.numel()) / max(1, x2.numel())
            forward, weight_grad = rate < sparse_cpu.CROSSOVER_FORWARD, rate < sparse_cpu.CROSSOVER_WEIGHT_GRAD
        return _SpikeLinearFn.apply(x, self.weight, self.bias, bits, forward, weight_grad, sparse_grad)

    def _values_forward(
        self,
        x: torch.Tensor,
        x2: torch.Tensor,
        auto: bool,
        sparse_grad: bool | str,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The output for an input that is not binary (the packing found a value other than 0 and 1: framed events
        are counts) from its nonzero entries with their values (:func:`spikefuse.ops.spike_layers.cpu.to_csr`), kept for
        backward instead of ``x``; with ``"auto"`` torch's product where the share of nonzero entries is
        ``spike_layers.cpu.CROSSOVER_VALUES`` or more; ``counts``: :func:`spikefuse.ops.spike_layers.cpu.nonzero_counts`
        of ``x2`` where counted."""
        if counts is None:
            counts = sparse_cpu.nonzero_counts(x2)
        if auto and int(counts.sum()) >= sparse_cpu.CROSSOVER_VALUES * x2.numel():
            return self._torch_product(x, sparse_grad)
        csr = sparse_cpu.to_csr(x2, counts)
        return CSRLinearFunction.apply(x, self.weight, self.bias, csr, sparse_grad)


# ----------------------------------------------------------------------------------------------- convolution
_SPATIAL = {1: "L", 2: "H, W", 3: "D, H, W"}


class _SpikeConvNd:
    """Mixin over ``nn.ConvNd``: multi-step forward through :class:`_SpikeConvFn`."""

    def _conv_args(self):
        d = len(self.kernel_size)
        stride, dilation = list(self.stride), list(self.dilation)
        pre_pad, pre_mode = None, "constant"
        if self.padding_mode != "zeros":
            # As nn.ConvNd: pad with the mode (this also resolves padding='same'/'valid'), then convolve unpadded.
            pre_pad = list(self._reversed_padding_repeated_twice)
            return stride, [0] * d, dilation, self.groups, pre_pad, self.padding_mode
        if self.padding == "valid":
            padding = [0] * d
        elif self.padding == "same":
            # As torch's _convolution_same: symmetric padding plus a zero pad of the remainder on the right.
            padding, pre_pad = [], [0] * (2 * d)
            for i in range(d):
                total = dilation[i] * (self.kernel_size[i] - 1)
                left = total // 2
                padding.append(left)
                pre_pad[2 * (d - 1 - i) + 1] = total - 2 * left
            if not any(pre_pad):
                pre_pad = None
        else:
            padding = list(self.padding)
        return stride, padding, dilation, self.groups, pre_pad, pre_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = len(self.kernel_size)
        if x.dim() != d + 3:
            raise ValueError(
                f"{self._get_name()} expects multi-step input [T, B, C, {_SPATIAL[d]}] "
                f"with {d + 3} dims, got shape {tuple(x.shape)}"
            )
        if _debug:
            check_input(self, x)
        if not torch.is_grad_enabled():  # nothing to keep for a backward: torch's layer
            return super().forward(x.flatten(0, 1)).unflatten(0, x.shape[:2])
        args = (x.flatten(0, 1), self.weight, self.bias, *self._conv_args())
        y = _refusing_non_binary(self, x, lambda: _apply_as_autocast_would(_SpikeConvFn, *args))
        return y.unflatten(0, x.shape[:2])


class SpikeConv1d(_SpikeConvNd, nn.Conv1d):
    """:class:`SpikeConv2d` in one dimension: :class:`torch.nn.Conv1d` on multi-step spikes ``[T, B, C, L]`` that
    saves its input for backward as bits; the input must be binary (0/1)."""

    forward = _SpikeConvNd.forward


class SpikeConv2d(_SpikeConvNd, nn.Conv2d):
    """:class:`torch.nn.Conv2d` on multi-step spikes ``[T, B, C, H, W]`` (time merged into the batch) that saves its
    input for backward as bits (32x less memory than float32).

    Same arguments, parameters and ``state_dict`` as :class:`torch.nn.Conv2d` (a pretrained state dict loads);
    output and gradients are bit-identical to it on the same input. **The input must be binary (0/1) in the
    layer's dtype**: refused on the CPU where the layer keeps it (as it packs it), on other devices in debug mode
    (:func:`set_debug`).
    With ``padding_mode`` other than ``'zeros'`` the padded input is made again in backward from the bits.
    See :mod:`spikefuse.nn.spike_layers`.
    """

    forward = _SpikeConvNd.forward


class SpikeConv3d(_SpikeConvNd, nn.Conv3d):
    """:class:`SpikeConv2d` in three dimensions: :class:`torch.nn.Conv3d` on multi-step spikes ``[T, B, C, D, H,
    W]`` that saves its input for backward as bits; the input must be binary (0/1)."""

    forward = _SpikeConvNd.forward


# ----------------------------------------------------------------------------------------------------- max-pooling
class _SpikeMaxPoolNd:
    """Mixin over ``nn.MaxPoolNd``: the same forward through :class:`_SpikeMaxPoolFn`."""

    _pool = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.return_indices:
            raise ValueError(f"{self._get_name()} does not return indices (it keeps none); use the torch layer")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _debug:
            check_input(self, x)
        args = (self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)
        return _refusing_non_binary(self, x, lambda: _SpikeMaxPoolFn.apply(x, type(self)._pool, args))


class SpikeMaxPool1d(_SpikeMaxPoolNd, nn.MaxPool1d):
    """:class:`SpikeMaxPool2d` in one dimension (``[N, C, L]``): saves its binary input as bits and no indices."""

    _pool = staticmethod(F.max_pool1d)
    forward = _SpikeMaxPoolNd.forward


class SpikeMaxPool2d(_SpikeMaxPoolNd, nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d` on spikes that saves its input for backward as bits and no indices.

    torch's layer keeps its input and the int64 index of every maximum (together 3x a float32 input); this one
    keeps 1 bit per input element and finds torch's indices again from the bits in backward (numba kernels on a
    contiguous float32/float64 CPU input, torch's own pooling of the unpacked input elsewhere). Same arguments
    (except ``return_indices``), output and gradients as :class:`torch.nn.MaxPool2d`; like it, it takes
    ``[N, C, H, W]`` (wrap it in :class:`spikefuse.nn.SeqToBatch` for ``[T, B, ...]``). **The input must be
    binary (0/1)**, as for :class:`SpikeConv2d`.
    """

    _pool = staticmethod(F.max_pool2d)
    forward = _SpikeMaxPoolNd.forward


class SpikeMaxPool3d(_SpikeMaxPoolNd, nn.MaxPool3d):
    """:class:`SpikeMaxPool2d` in three dimensions (``[N, C, D, H, W]``): saves its binary input as bits and no
    indices."""

    _pool = staticmethod(F.max_pool3d)
    forward = _SpikeMaxPoolNd.forward
