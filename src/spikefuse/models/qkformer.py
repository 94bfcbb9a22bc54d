"""QKFormer (Zhou et al., "QKFormer: Hierarchical Spiking Transformer using Q-K Attention", NeurIPS 2024) with
SpikingJelly 2.0's zoo structure (``spikingjelly.activation_based.model.qkformer``), on spikefuse's
:class:`~spikefuse.nn.LIF`.

Same layers in the same order as the zoo's ``QKFormer``: three stages of ``embed_dims`` / 4, / 2 and
``embed_dims`` channels, each a patch embedding then ``depths[i]`` blocks ``x + attn(x)``, ``x + MLP(x)`` over the
tokens ``[T, B, C, L]``:

- the first patch embedding (:class:`QKFormerPatchEmbedInit`): conv3x3-BN-maxpool-neuron twice (the first to half
  the channels), conv3x3-BN-neuron, plus a shortcut conv1x1 (stride 2)-BN-neuron from the first neuron's spikes;
  the next two (:class:`QKFormerPatchEmbedStage`): conv3x3-BN-maxpool-neuron, conv3x3-BN-neuron, plus a shortcut
  conv1x1 (stride 2)-BN-neuron from the stage's input. Each halves the height and width (the first quarters them):
  32x32 images give 8x8, 4x4 and 2x2 tokens;
- the first two stages' attention is Q-K attention (:class:`QKAttention`): Q, K spikes from one conv1x1-BN-neuron,
  Q summed over a head's channels (``qka_type="token"``) or tokens (``"channel"``) through the attention neuron,
  masking K, then a conv1x1-BN-neuron projection; the last stage's is the Spikformer's spiking self-attention
  (:class:`~spikefuse.models.spikformer.SpikingSelfAttention`, scale 0.125); the MLP (:class:`QKFormerMLP`) is
  conv1x1-BN-neuron twice;
- the mean over the tokens and a linear head per time step: outputs ``[T, B, num_classes]`` (the zoo averages over T
  before its head; the training loop averages after, the same up to rounding).

The neurons: by default the zoo's (SpikingJelly's ``LIFNode()``, :data:`~spikefuse.models.spikformer.ZOO_LIF_NEURON`, in
the patch embeddings and the MLPs; ``detach_reset=True`` in the attention layers,
:data:`~spikefuse.models.spikformer.SPIKFORMER_NEURON`; the attention neuron's threshold 0.5,
:data:`~spikefuse.models.spikformer.SPIKFORMER_ATTENTION_NEURON`), each with the potential scaled by tau as for the
Spikformer; ``neuron=`` sets every neuron unless ``attention_neuron=`` is given.

Weights: the zoo's parameters and buffers in its order and under its names, with spikefuse's
:class:`~spikefuse.nn.SeqToBatch` wrappers' ``module.`` inserted: :func:`from_spikingjelly_state_dict`.

The lean form (:func:`spikefuse.nn.to_lean`): every BN followed directly by a neuron is fused with it (each patch
embedding's last conv and shortcut, the attentions' Q/K (Q/K/V) and projection, both MLP layers); the convs that
read spikes (after a patch embedding's neurons, the projections, the MLPs' second) save them as bits; the convs on
the residual stream (spike counts) followed by a fused BN+neuron (the shortcuts of the last two patch embeddings,
Q/K, the MLPs' first) are recomputed in backward where :data:`~spikefuse.batchnorm.lean.RECOMPUTE_MAX_MACS`
allows. The neurons after a max-pool and the attention neurons recompute their states.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn import NeuronFactory, SeqToBatch
from .spikformer import (
    SpikingSelfAttention,
    _fuse,
    _max_pool,
    _pair,
    _replace_spike_layer,
    _with_seq_to_batch_keys,
    _zoo_neurons,
)

__all__ = [
    "QKA_TYPES",
    "QKFormerPatchEmbedInit",
    "QKFormerPatchEmbedStage",
    "QKAttention",
    "QKFormerMLP",
    "QKFormerBlock",
    "QKFormer",
    "from_spikingjelly_state_dict",
    "qkformer",
    "qkformer_tiny",
    "qkformer_10_384",
]

#: What Q-K attention sums Q over (per head): its channels (``"token"``: one attention per token) or its tokens
#: (``"channel"``: one per channel).
QKA_TYPES = ("token", "channel")


def _conv_bn(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> list[nn.Module]:
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2)
    return [SeqToBatch(conv), SeqToBatch(nn.BatchNorm2d(out_channels))]


def _shortcut(in_channels: int, out_channels: int, neuron: NeuronFactory) -> nn.Sequential:
    return nn.Sequential(*_conv_bn(in_channels, out_channels, 1, stride=2), neuron.make())


class QKFormerPatchEmbedInit(nn.Module):
    """The zoo's ``_PatchEmbedInit``: ``lif1(pool1(bn1(conv1(x))))`` (half the channels), then
    ``lif3(bn3(conv3(lif2(pool2(bn2(conv2(.)))))))`` plus ``shortcut`` of the first neuron's spikes."""

    def __init__(self, in_channels: int, out_channels: int, neuron: NeuronFactory):
        super().__init__()
        hidden = out_channels // 2
        self.conv1, self.bn1 = _conv_bn(in_channels, hidden, 3)
        self.pool1 = _max_pool()
        self.lif1 = neuron.make()
        self.conv2, self.bn2 = _conv_bn(hidden, out_channels, 3)
        self.pool2 = _max_pool()
        self.lif2 = neuron.make()
        self.conv3, self.bn3 = _conv_bn(out_channels, out_channels, 3)
        self.lif3 = neuron.make()
        self.shortcut = _shortcut(hidden, out_channels, neuron)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lif1(self.pool1(self.bn1(self.conv1(x))))
        identity = x
        x = self.lif2(self.pool2(self.bn2(self.conv2(x))))
        x = self.lif3(self.bn3(self.conv3(x)))
        return x + self.shortcut(identity)

    def convert_to_lean(self, counts: dict) -> None:
        _replace_spike_layer(self, "conv2", counts)
        _fuse(self, "conv3", "bn3", "lif3", True, counts)
        _replace_spike_layer(self, "shortcut.0", counts)  # to_lean's pass over the nn.Sequential fuses its BN


class QKFormerPatchEmbedStage(nn.Module):
    """The zoo's ``_PatchEmbedStage``: ``lif2(bn2(conv2(lif1(pool(bn1(conv1(x)))))))`` plus ``shortcut(x)``."""

    def __init__(self, in_channels: int, out_channels: int, neuron: NeuronFactory):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(in_channels, out_channels, 3)
        self.pool = _max_pool()
        self.lif1 = neuron.make()
        self.conv2, self.bn2 = _conv_bn(out_channels, out_channels, 3)
        self.lif2 = neuron.make()
        self.shortcut = _shortcut(in_channels, out_channels, neuron)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lif1(self.pool(self.bn1(self.conv1(x))))
        return self.lif2(self.bn2(self.conv2(y))) + self.shortcut(x)

    def convert_to_lean(self, counts: dict) -> None:
        # conv1 and the shortcut read the residual stream (spike counts): conv1 stays, the shortcut is fused by
        # to_lean's pass over its nn.Sequential.
        _fuse(self, "conv2", "bn2", "lif2", True, counts)


class QKAttention(nn.Module):
    """The zoo's ``QKAttention`` over tokens ``[T, B, C, L]``: Q and K spikes from one 1x1 conv1d + BN + neuron;
    per head, Q summed over its channels (``qka_type="token"``) or its tokens (``"channel"``) through
    ``attn_lif``, masking K; a 1x1 conv1d + BN + neuron projection."""

    def __init__(self, dim: int, num_heads: int, qka_type: str, neuron: NeuronFactory, attention_neuron: NeuronFactory):
        super().__init__()
        if qka_type not in QKA_TYPES:
            raise ValueError(f"qka_type must be one of {QKA_TYPES}, got {qka_type!r}")
        if dim % num_heads:
            raise ValueError(f"{dim} channels must be divisible by num_heads {num_heads}")
        self.dim, self.num_heads, self.qka_type = dim, num_heads, qka_type
        self.qk_conv_bn = nn.Sequential(
            SeqToBatch(nn.Conv1d(dim, dim * 2, kernel_size=1, bias=False)), SeqToBatch(nn.BatchNorm1d(dim * 2))
        )
        self.qk_lif = neuron.make()
        self.attn_lif = attention_neuron.make()
        self.proj_conv_bn = nn.Sequential(
            SeqToBatch(nn.Conv1d(dim, dim, kernel_size=1, bias=False)), SeqToBatch(nn.BatchNorm1d(dim))
        )
        self.proj_lif = neuron.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B, C, L = x.shape
        qk = self.qk_lif(self.qk_conv_bn(x)).reshape(T, B, 2, self.num_heads, C // self.num_heads, L)
        q, k = qk.flatten(2, 3).chunk(2, dim=2)  # the zoo's views, so backward runs the same ops
        # Spikes: the sum is an exact count, so attn_lif(...) * K is the zoo's bit for bit.
        attention = self.attn_lif(q.sum(dim=3 if self.qka_type == "token" else 4, keepdim=True))
        return self.proj_lif(self.proj_conv_bn((attention * k).flatten(2, 3)))

    def convert_to_lean(self, counts: dict) -> None:
        _fuse(self, "qk_conv_bn.0", "qk_conv_bn.1", "qk_lif", False, counts)  # reads the residual stream: counts
        _fuse(self, "proj_conv_bn.0", "proj_conv_bn.1", "proj_lif", True, counts)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, qka_type={self.qka_type}"


class QKFormerMLP(nn.Module):
    """The zoo's QKFormer ``_MLP``: ``lif2(bn2(fc2(lif1(bn1(fc1(x))))))``, 1x1 conv1d layers."""

    def __init__(self, dim: int, hidden: int, neuron: NeuronFactory):
        super().__init__()
        self.fc1 = SeqToBatch(nn.Conv1d(dim, hidden, kernel_size=1))
        self.bn1 = SeqToBatch(nn.BatchNorm1d(hidden))
        self.lif1 = neuron.make()
        self.fc2 = SeqToBatch(nn.Conv1d(hidden, dim, kernel_size=1))
        self.bn2 = SeqToBatch(nn.BatchNorm1d(dim))
        self.lif2 = neuron.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif2(self.bn2(self.fc2(self.lif1(self.bn1(self.fc1(x))))))

    def convert_to_lean(self, counts: dict) -> None:
        _fuse(self, "fc1", "bn1", "lif1", False, counts)  # reads the residual stream: spike counts
        _fuse(self, "fc2", "bn2", "lif2", True, counts)


class QKFormerBlock(nn.Module):
    """The zoo's QKFormer ``_Block`` on ``[T, B, C, H, W]``: over the tokens, ``x + attn(x)``, then
    ``x + mlp(x)``; ``attn`` the Spikformer's spiking self-attention (``self_attention``) or :class:`QKAttention`."""

    def __init__(
        self, dim, num_heads, mlp_ratio, qka_type, self_attention, neuron, attention_layer_neuron, attention_neuron
    ):
        super().__init__()
        if self_attention:
            self.attn = SpikingSelfAttention(dim, num_heads, attention_layer_neuron, attention_neuron, scale=0.125)
        else:
            self.attn = QKAttention(dim, num_heads, qka_type, attention_layer_neuron, attention_neuron)
        self.mlp = QKFormerMLP(dim, int(dim * mlp_ratio), neuron)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(3)
        tokens = tokens + self.attn(tokens)
        return (tokens + self.mlp(tokens)).reshape(x.shape)


class QKFormer(nn.Module):
    """A multi-step QKFormer (see the module docstring).

    Args:
        in_channels: input channels.
        num_classes: classes.
        neuron: :class:`~spikefuse.nn.NeuronFactory` of every neuron (default: the zoo's, see the module docstring).
        attention_neuron: the attention neuron's options (default: the zoo's when ``neuron`` is None, else
            ``neuron``).
        neuron_backend: overrides every neuron's backend.
        embed_dims: the last stage's channels (a multiple of 4, at least 8); the stages have ``embed_dims`` / 4,
            / 2 and ``embed_dims``, each divisible by its ``num_heads``.
        num_heads: attention heads of the three stages.
        depths: blocks of the three stages.
        mlp_ratio: the MLPs' hidden width over their stage's channels.
        qka_type: one of :data:`QKA_TYPES`, the first two stages' Q-K attention.
        image_size: ``(H, W)`` or one int, checked against each input.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        neuron: NeuronFactory | None = None,
        attention_neuron: NeuronFactory | None = None,
        neuron_backend: str | None = None,
        embed_dims: int = 384,
        num_heads: tuple[int, int, int] = (3, 6, 6),
        depths: tuple[int, int, int] = (1, 2, 7),
        mlp_ratio: float = 4.0,
        qka_type: str = "token",
        image_size: int | tuple[int, int] | None = None,
    ):
        super().__init__()
        if len(num_heads) != 3 or len(depths) != 3:
            raise ValueError(
                f"num_heads and depths take one value per stage, three each; got num_heads={num_heads!r}, "
                f"depths={depths!r}"
            )
        if embed_dims < 8 or embed_dims % 4:
            raise ValueError(
                f"embed_dims must be a multiple of 4 and at least 8 (the first patch embedding's embed_dims / 8 "
                f"channels), got {embed_dims}"
            )
        dims = (embed_dims // 4, embed_dims // 2, embed_dims)
        for stage, (dim, heads, depth) in enumerate(zip(dims, num_heads, depths), start=1):
            if depth < 0:
                raise ValueError(f"depths must be >= 0, got {depth} for stage {stage}")
            if heads < 1 or dim % heads:
                raise ValueError(f"stage {stage}'s {dim} channels must be divisible by its num_heads {heads}")
        if qka_type not in QKA_TYPES:
            raise ValueError(f"qka_type must be one of {QKA_TYPES}, got {qka_type!r}")
        neuron, attention_layer_neuron, attention_neuron = _zoo_neurons(neuron, attention_neuron, neuron_backend)
        self.in_channels = in_channels
        self.image_size = None if image_size is None else _pair(image_size)
        self.patch_embed1 = QKFormerPatchEmbedInit(in_channels, dims[0], neuron)
        self.patch_embed2 = QKFormerPatchEmbedStage(dims[0], dims[1], neuron)
        self.patch_embed3 = QKFormerPatchEmbedStage(dims[1], dims[2], neuron)
        self.stage1, self.stage2, self.stage3 = (
            nn.ModuleList(
                QKFormerBlock(
                    dim, heads, mlp_ratio, qka_type, stage == 2, neuron, attention_layer_neuron, attention_neuron
                )
                for _ in range(depth)
            )
            for stage, (dim, heads, depth) in enumerate(zip(dims, num_heads, depths))
        )
        self.head = nn.Linear(embed_dims, num_classes)  # on [T, B, C]: every time step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5 or x.shape[2] != self.in_channels:
            raise ValueError(f"QKFormer expects [T, B, {self.in_channels}, H, W] input, got shape {tuple(x.shape)}")
        if self.image_size is not None and tuple(x.shape[3:]) != self.image_size:
            raise ValueError(f"QKFormer was built for {self.image_size} images, got {tuple(x.shape[3:])}")
        for embed, stage in (
            (self.patch_embed1, self.stage1),
            (self.patch_embed2, self.stage2),
            (self.patch_embed3, self.stage3),
        ):
            x = embed(x)
            for block in stage:
                x = block(x)
        return self.head(x.flatten(3).mean(dim=-1))


def from_spikingjelly_state_dict(state_dict: dict) -> dict:
    """A SpikingJelly zoo ``QKFormer``'s ``state_dict`` with its keys as :class:`QKFormer`'s: ``module.`` inserted
    before the last name of every conv's and BN's key (``stage1.0.mlp.fc1.weight`` ->
    ``stage1.0.mlp.fc1.module.weight``); the head's unchanged."""
    return _with_seq_to_batch_keys(state_dict)


def _build(in_channels, num_classes, neuron, neuron_backend, defaults: dict, kw: dict) -> QKFormer:
    return QKFormer(in_channels, num_classes, neuron=neuron, neuron_backend=neuron_backend, **{**defaults, **kw})


def qkformer(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """QKFormer-4-384's size in the zoo's three stages for 32x32 images: 96, 192 and 384 channels, 6 heads each, 1,
    1 and 2 blocks (the paper's CIFAR model has two stages). Keywords: those of :class:`QKFormer`."""
    defaults = dict(embed_dims=384, num_heads=(6, 6, 6), depths=(1, 1, 2))
    return _build(in_channels, num_classes, neuron, neuron_backend, defaults, kw)


def qkformer_tiny(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """A small QKFormer for quick runs and tests: 16, 32 and 64 channels, 2, 4 and 4 heads, one block a stage."""
    defaults = dict(embed_dims=64, num_heads=(2, 4, 4), depths=(1, 1, 1))
    return _build(in_channels, num_classes, neuron, neuron_backend, defaults, kw)


def qkformer_10_384(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """The zoo's ``qkformer_10_384`` (ImageNet): 96, 192 and 384 channels, 6 heads each, 1, 2 and 7 blocks."""
    defaults = dict(embed_dims=384, num_heads=(6, 6, 6), depths=(1, 2, 7))
    return _build(in_channels, num_classes, neuron, neuron_backend, defaults, kw)
