"""Spikformer (Zhou et al., "Spikformer: When Spiking Neural Network Meets Transformer", ICLR 2023) with SpikingJelly
2.0's zoo structure (``spikingjelly.activation_based.model.spikformer``), on spikefuse's :class:`~spikefuse.nn.LIF`.

Same layers in the same order as the zoo's ``Spikformer``:

- the spiking patch splitting stem (SPS): four 3x3 conv-BN-neuron stages of ``embed_dims`` / 8, / 4, / 2 and
  ``embed_dims`` channels, the last ``log2(patch_size)`` of them with a 3x3 stride-2 max-pool between the BN and
  the neuron (the zoo takes ``patch_size`` 4, the last two, or 16, all four; 1, 2 and 8 are accepted here too),
  then a relative position embedding ``x + neuron(BN(conv3x3(x)))``;
- ``depths`` blocks ``x + SSA(x)``, ``x + MLP(x)`` over the tokens ``[T, B, C, L]`` (``L = H*W / patch_size**2``):
  the spiking self-attention (SSA) computes Q, K, V with one 1x1 conv1d + BN + neuron, their spike product
  ``(Q K^T) V * scale`` per head (:func:`spike_attention`), an attention neuron of its own threshold, and a 1x1
  conv1d + BN + neuron projection; the MLP is 1x1 conv1d + BN + neuron twice (``mlp_ratio`` x wider between);
- the mean over the tokens and a linear head per time step: outputs ``[T, B, num_classes]`` for inputs
  ``[T, B, C, H, W]`` (the training loop averages over T; the zoo also repeats 4-D images T times, here the
  caller encodes).

The neurons: the zoo's default ``LIFNode(tau=2, decay_input=True, v_threshold=1, detach_reset=True)`` (attention
neuron ``v_threshold=0.5``) charges ``H = V + (X - V) / tau``, halving the input. spikefuse's LIF charges
``v = decay * v + x``; with the potential scaled by ``tau`` (``v = tau * H``) the same neuron is ``decay = 1/2``,
threshold 2 (attention: 1) and the sigmoid surrogate's ``alpha`` halved (2): :data:`SPIKFORMER_NEURON` and
:data:`SPIKFORMER_ATTENTION_NEURON`, the defaults. Same spikes and gradients in exact arithmetic; the rounding of
the charge differs, so a potential within a rounding of the threshold may spike in one and not the other.
``neuron=`` sets every neuron (the attention neuron too, as the zoo does with a ``spiking_neuron`` class) unless
``attention_neuron=`` is given.

Weights: the parameters and buffers are the zoo's, in its order and under its names with spikefuse's
:class:`~spikefuse.nn.SeqToBatch` wrappers' ``module.`` inserted; :func:`from_spikingjelly_state_dict` maps a zoo
``state_dict`` to them (``model.load_state_dict(from_spikingjelly_state_dict(zoo.state_dict()))`` loads strict).
Load before converting to the lean form, which renames the fused layers.

The lean form (:func:`spikefuse.nn.to_lean`, ``build_model(..., memory="lean")``): every BN followed directly by a
neuron is fused with it (the SPS stages without pooling, the position embedding, Q/K/V, the projection, both MLP
layers); the convs that read spikes (SPS stages 2-4, the position embedding, the projection, the MLP's second
layer) save them as bits; the first stage's conv (on the image) and the Q/K/V and first MLP convs (on the
residual stream, spike counts 0, 1, 2, ... rather than spikes) are recomputed in backward from their input where
:data:`~spikefuse.batchnorm.lean.RECOMPUTE_MAX_MACS` allows; the other neurons (after a max-pool, the attention
neuron) recompute their states.

Spike products: Q, K and V are spikes (0 or 1), so ``(Q K^T) V`` is a product of binary matrices whose entries are
integers. :func:`spike_attention` computes it with torch's matmul in the zoo's order, ``Q (K^T V)`` (a
``D x D`` intermediate per head instead of ``L x L``), exact in float32 while ``D * L < 2**24``;
:func:`spike_attention_reference` is the textbook order. Not built yet: a spike product kernel, which would keep
Q, K, V bit-packed (32 spikes to a word, also as what backward keeps) and count the products with AND + popcount
instead of multiply-adds.
"""

from __future__ import annotations

import torch
from torch import nn

from ..batchnorm.lean import conv_batchnorm_neuron_from, fused_batchnorm_from, spike_layer_from
from ..nn import LIF, MaxPool2d, NeuronFactory, SeqToBatch
from ..surrogate import Sigmoid

__all__ = [
    "SPIKFORMER_NEURON",
    "SPIKFORMER_ATTENTION_NEURON",
    "ZOO_LIF_NEURON",
    "PATCH_SIZES",
    "Spikformer",
    "SpikformerConv2dBNLIF",
    "SpikformerPatchStem",
    "SpikingSelfAttention",
    "SpikformerMLP",
    "SpikformerBlock",
    "spike_attention",
    "spike_attention_reference",
    "from_spikingjelly_state_dict",
    "spikformer",
    "spikformer_tiny",
    "spikformer_cifar10",
]

#: The zoo's LIFNode(tau=2, decay_input=True, v_threshold=1, detach_reset=True, Sigmoid(alpha=4)), its potential
#: scaled by tau (see the module docstring).
SPIKFORMER_NEURON = NeuronFactory(LIF, dict(decay=0.5, threshold=2.0, surrogate=Sigmoid(2.0), detach_reset=True))
#: The zoo's attention neuron (v_threshold=0.5), scaled likewise.
SPIKFORMER_ATTENTION_NEURON = NeuronFactory(
    LIF, dict(decay=0.5, threshold=1.0, surrogate=Sigmoid(2.0), detach_reset=True)
)

#: SpikingJelly's ``LIFNode()`` with its own defaults (:data:`SPIKFORMER_NEURON` but ``detach_reset=False``), scaled
#: likewise: the neurons the zoo's Spike-driven Transformer and QKFormer make outside their attention layers.
ZOO_LIF_NEURON = NeuronFactory(LIF, dict(decay=0.5, threshold=2.0, surrogate=Sigmoid(2.0), detach_reset=False))

#: The patch sizes the stem takes: a 3x3 stride-2 max-pool in each of its last ``log2(patch_size)`` stages.
PATCH_SIZES = (1, 2, 4, 8, 16)


def spike_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The spiking self-attention's product ``(Q K^T) V * scale`` in the channel-major layout of the zoo:
    ``q``, ``k``, ``v`` are ``[..., D, L]`` (D channels of a head, L tokens; ``Q = q^T``) and the result is
    ``((Q K^T) V)^T * scale``, ``[..., D, L]``. Computed as ``(v @ k^T) @ q``, i.e. ``Q (K^T V)``, the zoo's order.

    For spikes (every element 0 or 1) every product and sum is an integer, exact in float32 while ``D * L < 2**24``,
    so the result equals :func:`spike_attention_reference` bit for bit (``scale`` a power of two, or any scale
    applied to those exact integers). Gradients are real-valued: they agree with the reference's to rounding."""
    return ((v @ k.transpose(-2, -1)) @ q) * scale


def spike_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`spike_attention` in the textbook order: the ``L x L`` scores ``Q K^T``, then times ``V``."""
    qt, kt, vt = q.transpose(-2, -1), k.transpose(-2, -1), v.transpose(-2, -1)
    return ((qt @ kt.transpose(-2, -1)) @ vt).transpose(-2, -1) * scale


def _zoo_neurons(
    neuron: NeuronFactory | None, attention_neuron: NeuronFactory | None, backend: str | None
) -> tuple[NeuronFactory, NeuronFactory, NeuronFactory]:
    """The neurons of a zoo transformer whose layers take SpikingJelly's defaults or the attention's (the
    Spike-driven Transformer, QKFormer): ``(outside the attention, in the attention layers, the attention neuron)``.
    ``neuron=None``: the zoo's, :data:`ZOO_LIF_NEURON`, :data:`SPIKFORMER_NEURON` and
    :data:`SPIKFORMER_ATTENTION_NEURON`; else ``neuron`` for all three (as the zoo's ``spiking_neuron``), the last
    ``attention_neuron`` where given. ``backend`` overrides each one's."""
    if attention_neuron is None:
        attention_neuron = SPIKFORMER_ATTENTION_NEURON if neuron is None else neuron
    outside, inside = (ZOO_LIF_NEURON, SPIKFORMER_NEURON) if neuron is None else (neuron, neuron)
    return outside.with_backend(backend), inside.with_backend(backend), attention_neuron.with_backend(backend)


def _replace_spike_layer(owner: nn.Module, path: str, counts: dict) -> None:
    """The conv/linear at ``owner``'s dotted ``path`` (which reads spikes) as its spike layer, saving them as bits."""
    new = spike_layer_from(owner.get_submodule(path))
    if new is not None:
        owner.set_submodule(path, new)
        counts["spike_layers"] += 1


def _fuse(owner: nn.Module, conv: str, bn: str, neuron: str, input_spikes: bool, counts: dict) -> None:
    """Lean form of ``neuron(bn(conv(x)))``, three submodules of ``owner`` at these dotted paths (the conv and the
    BN in ``SeqToBatch``): BN fused with the neuron; the conv saving spikes as bits, or, reading real values,
    recomputed in backward."""
    if input_spikes:
        _replace_spike_layer(owner, conv, counts)
    fused = fused_batchnorm_from(owner.get_submodule(bn), owner.get_submodule(neuron))
    if fused is None:
        return
    owner.set_submodule(bn, fused)
    owner.set_submodule(neuron, nn.Identity())
    counts["bn_lif"] += 1
    if not input_spikes:
        conv_bn_neuron = conv_batchnorm_neuron_from(owner.get_submodule(conv), fused)
        if conv_bn_neuron is not None:
            owner.set_submodule(conv, conv_bn_neuron)
            owner.set_submodule(bn, nn.Identity())
            counts["conv_bn_lif"] += 1


def _max_pool() -> SeqToBatch:
    """The zoo transformers' 3x3 stride-2 max-pool: torch's output and gradients, on spikefuse's kernel."""
    return SeqToBatch(MaxPool2d(kernel_size=3, stride=2, padding=1))


class _ConvBN(nn.Module):
    """The zoo's ``SpikformerConv2dBN``: ``block`` = 3x3 conv, BN and (``pool``) a 3x3 stride-2 max-pool."""

    def __init__(self, in_channels: int, out_channels: int, pool: bool):
        super().__init__()
        layers = [
            SeqToBatch(nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)),
            SeqToBatch(nn.BatchNorm2d(out_channels)),
        ]
        if pool:
            layers.append(_max_pool())
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class SpikformerConv2dBNLIF(nn.Module):
    """One SPS stage: ``neuron(conv_bn(x))`` (conv 3x3, BN, optional max-pool). ``input_spikes``: whether its
    input is spikes (every stage but the first), which the lean form saves as bits."""

    def __init__(self, in_channels: int, out_channels: int, pool: bool, neuron: NeuronFactory, input_spikes: bool):
        super().__init__()
        self.conv_bn = _ConvBN(in_channels, out_channels, pool)
        self.neuron = neuron.make()
        self.input_spikes = input_spikes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.neuron(self.conv_bn(x))

    def convert_to_lean(self, counts: dict) -> None:
        if len(self.conv_bn.block) == 2:  # conv, BN, neuron
            _fuse(self, "conv_bn.block.0", "conv_bn.block.1", "neuron", self.input_spikes, counts)
        elif self.input_spikes:  # BN then max-pool of real values: only the conv reads spikes
            _replace_spike_layer(self, "conv_bn.block.0", counts)


class SpikformerPatchStem(nn.Module):
    """Spiking patch splitting: four conv-BN-neuron stages, the last ``log2(patch_size)`` pooling, and the relative
    position embedding ``x + neuron(BN(conv(x)))`` (the zoo's ``SpikformerPatchStem``)."""

    def __init__(self, in_channels: int, embed_dims: int, patch_size: int, neuron: NeuronFactory):
        super().__init__()
        pools = PATCH_SIZES.index(patch_size)
        dims = [embed_dims // 8, embed_dims // 4, embed_dims // 2, embed_dims]
        stages, c = [], in_channels
        for i, out in enumerate(dims):
            stages.append(SpikformerConv2dBNLIF(c, out, pool=i >= len(dims) - pools, neuron=neuron, input_spikes=i > 0))
            c = out
        self.stages = nn.Sequential(*stages)
        self.positional_encoding = SpikformerConv2dBNLIF(
            embed_dims, embed_dims, pool=False, neuron=neuron, input_spikes=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(x)
        return self.positional_encoding(x) + x


class SpikingSelfAttention(nn.Module):
    """The zoo's ``SpikingSelfAttention`` over tokens ``[T, B, C, L]``: Q, K, V spikes from one 1x1 conv1d + BN +
    neuron, :func:`spike_attention` per head, ``attn_lif``, and a 1x1 conv1d + BN + neuron projection."""

    def __init__(self, dim: int, num_heads: int, neuron: NeuronFactory, attention_neuron: NeuronFactory, scale: float):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dims {dim} must be divisible by num_heads {num_heads}")
        self.dim, self.num_heads, self.scale = dim, num_heads, scale
        self.qkv_conv_bn = nn.Sequential(
            SeqToBatch(nn.Conv1d(dim, dim * 3, kernel_size=1, bias=False)), SeqToBatch(nn.BatchNorm1d(dim * 3))
        )
        self.qkv_lif = neuron.make()
        self.attn_lif = attention_neuron.make()
        self.proj_conv_bn = nn.Sequential(
            SeqToBatch(nn.Conv1d(dim, dim, kernel_size=1, bias=False)), SeqToBatch(nn.BatchNorm1d(dim))
        )
        self.proj_lif = neuron.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B, C, L = x.shape
        qkv = self.qkv_lif(self.qkv_conv_bn(x)).reshape(T, B, 3, self.num_heads, C // self.num_heads, L)
        # The zoo's views (the heads of q, k, v as chunks of one tensor), so backward runs the same ops.
        q, k, v = qkv.flatten(2, 3).chunk(3, dim=2)
        x = self.attn_lif(spike_attention(q, k, v, self.scale)).reshape(T, B, C, L)
        return self.proj_lif(self.proj_conv_bn(x))

    def convert_to_lean(self, counts: dict) -> None:
        _fuse(self, "qkv_conv_bn.0", "qkv_conv_bn.1", "qkv_lif", False, counts)  # reads the residual stream: counts
        _fuse(self, "proj_conv_bn.0", "proj_conv_bn.1", "proj_lif", True, counts)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, scale={self.scale}"


class SpikformerMLP(nn.Module):
    """The zoo's ``SpikformerMLP``: 1x1 conv1d + BN + neuron, twice."""

    def __init__(self, dim: int, hidden: int, neuron: NeuronFactory):
        super().__init__()
        self.fc1 = nn.Sequential(
            SeqToBatch(nn.Conv1d(dim, hidden, kernel_size=1, bias=False)), SeqToBatch(nn.BatchNorm1d(hidden))
        )
        self.neuron1 = neuron.make()
        self.fc2 = nn.Sequential(
            SeqToBatch(nn.Conv1d(hidden, dim, kernel_size=1, bias=False)), SeqToBatch(nn.BatchNorm1d(dim))
        )
        self.neuron2 = neuron.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.neuron2(self.fc2(self.neuron1(self.fc1(x))))

    def convert_to_lean(self, counts: dict) -> None:
        _fuse(self, "fc1.0", "fc1.1", "neuron1", False, counts)  # reads the residual stream: spike counts
        _fuse(self, "fc2.0", "fc2.1", "neuron2", True, counts)


class SpikformerBlock(nn.Module):
    """``x + attn(x)``, then ``x + mlp(x)``, on tokens ``[T, B, C, L]``."""

    def __init__(self, dim, num_heads, mlp_ratio, neuron, attention_neuron, scale):
        super().__init__()
        self.attn = SpikingSelfAttention(dim, num_heads, neuron, attention_neuron, scale)
        self.mlp = SpikformerMLP(dim, int(dim * mlp_ratio), neuron)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Spikformer(nn.Module):
    """A multi-step Spikformer (see the module docstring).

    Args:
        in_channels: input channels.
        num_classes: classes.
        neuron: :class:`~spikefuse.nn.NeuronFactory` of every neuron (default :data:`SPIKFORMER_NEURON`).
        attention_neuron: the attention neuron's options (default: :data:`SPIKFORMER_ATTENTION_NEURON` when
            ``neuron`` is None, else ``neuron``).
        embed_dims: channels of the tokens (a multiple of 8 and of ``num_heads``).
        num_heads: attention heads.
        mlp_ratio: the MLP's hidden width over ``embed_dims``.
        depths: transformer blocks.
        patch_size: one of :data:`PATCH_SIZES`; images' height and width must be multiples of it.
        scale: the attention's scale (the zoo's 0.125).
        image_size: ``(H, W)`` or one int; checked against ``patch_size`` here and against each input.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        neuron: NeuronFactory | None = None,
        attention_neuron: NeuronFactory | None = None,
        embed_dims: int = 384,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        depths: int = 4,
        patch_size: int = 4,
        scale: float = 0.125,
        image_size: int | tuple[int, int] | None = None,
    ):
        super().__init__()
        if patch_size not in PATCH_SIZES:
            raise ValueError(f"patch_size must be one of {PATCH_SIZES}, got {patch_size!r}")
        if embed_dims < 8 or embed_dims % 8:
            raise ValueError(
                f"embed_dims must be a positive multiple of 8 (the stem's embed_dims / 8), got {embed_dims}"
            )
        if depths < 1:
            raise ValueError(f"depths must be >= 1, got {depths}")
        if attention_neuron is None:
            attention_neuron = SPIKFORMER_ATTENTION_NEURON if neuron is None else neuron
        neuron = SPIKFORMER_NEURON if neuron is None else neuron
        self.in_channels, self.patch_size = in_channels, patch_size
        self.image_size = None if image_size is None else self._check_size(_pair(image_size))
        self.patch_embed = SpikformerPatchStem(in_channels, embed_dims, patch_size, neuron)
        self.blocks = nn.ModuleList(
            SpikformerBlock(embed_dims, num_heads, mlp_ratio, neuron, attention_neuron, scale) for _ in range(depths)
        )
        self.head = nn.Linear(embed_dims, num_classes)  # on [T, B, C]: every time step
        for m in self.modules():  # the zoo's initialisation
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0.0)
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                nn.init.constant_(m.weight, 1.0)
                nn.init.constant_(m.bias, 0.0)

    def _check_size(self, size: tuple[int, int]) -> tuple[int, int]:
        if any(s < 1 or s % self.patch_size for s in size):
            raise ValueError(
                f"Spikformer with patch_size={self.patch_size} takes images whose height and width are multiples of "
                f"{self.patch_size}, got {size[0]}x{size[1]}"
            )
        return size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5 or x.shape[2] != self.in_channels:
            raise ValueError(f"Spikformer expects [T, B, {self.in_channels}, H, W] input, got shape {tuple(x.shape)}")
        size = self._check_size(tuple(x.shape[3:]))
        if self.image_size is not None and size != self.image_size:
            raise ValueError(f"Spikformer was built for {self.image_size} images, got {size}")
        x = self.patch_embed(x).flatten(3)  # tokens [T, B, C, L]
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=-1))


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)


def _with_seq_to_batch_keys(state_dict: dict) -> dict:
    """A zoo transformer's ``state_dict`` with :class:`~spikefuse.nn.SeqToBatch`'s ``module.`` inserted before the
    last name of every key but the head's: each of its layers but the head is a conv or BatchNorm that spikefuse
    wraps (``blocks.0.mlp.fc1.0.weight`` -> ``blocks.0.mlp.fc1.0.module.weight``)."""
    return {
        key if key.startswith("head.") else "{}.module.{}".format(*key.rsplit(".", 1)): value
        for key, value in state_dict.items()
    }


def from_spikingjelly_state_dict(state_dict: dict) -> dict:
    """A SpikingJelly zoo ``Spikformer``'s ``state_dict`` with its keys as :class:`Spikformer`'s: ``module.``
    inserted after the index of each layer in its ``SeqToANNContainer`` (``blocks.0.mlp.fc1.0.weight`` ->
    ``blocks.0.mlp.fc1.0.module.weight``); the head's keys unchanged."""
    return _with_seq_to_batch_keys(state_dict)


def _build(in_channels, num_classes, neuron, neuron_backend, attention_neuron=None, **kw) -> Spikformer:
    if attention_neuron is None:
        attention_neuron = SPIKFORMER_ATTENTION_NEURON if neuron is None else neuron
    neuron = SPIKFORMER_NEURON if neuron is None else neuron
    return Spikformer(
        in_channels,
        num_classes,
        neuron=neuron.with_backend(neuron_backend),
        attention_neuron=attention_neuron.with_backend(neuron_backend),
        **kw,
    )


def spikformer(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """Spikformer-4-256 for 32x32 (or 28x28) images: embed 256, 8 heads, 4 blocks, patch 4, the smallest of the
    paper's CIFAR configurations. Keywords: those of :class:`Spikformer`."""
    for key, value in dict(embed_dims=256, num_heads=8, depths=4, patch_size=4).items():
        kw.setdefault(key, value)
    return _build(in_channels, num_classes, neuron, neuron_backend, **kw)


def spikformer_cifar10(
    in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw
):
    """The zoo's ``spikformer_cifar10``: Spikformer-4-384 (embed 384, 12 heads, 4 blocks, patch 4)."""
    for key, value in dict(embed_dims=384, num_heads=12, depths=4, patch_size=4).items():
        kw.setdefault(key, value)
    return _build(in_channels, num_classes, neuron, neuron_backend, **kw)


def spikformer_tiny(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """A small Spikformer for quick runs and tests: embed 64, 4 heads, 1 block, patch 4."""
    for key, value in dict(embed_dims=64, num_heads=4, depths=1, patch_size=4).items():
        kw.setdefault(key, value)
    return _build(in_channels, num_classes, neuron, neuron_backend, **kw)
