"""The Spike-driven Transformer v1 (Yao et al., "Spike-driven Transformer", NeurIPS 2023) with SpikingJelly 2.0's zoo
structure (``spikingjelly.activation_based.model.spike_driven_transformer``), on spikefuse's :class:`~spikefuse.nn.LIF`.

Same layers in the same order as the zoo's ``SpikeDrivenTransformer``, on ``[T, B, C, H, W]`` throughout:

- the patch embedding: three conv3x3-BN-neuron stages of ``embed_dims`` / 8, / 4 and / 2 channels, each followed
  by a 3x3 stride-2 max-pool where its digit of ``pooling_stat`` is ``"1"`` (of spikes:
  :class:`~spikefuse.nn.SpikeMaxPool2d`, in every form), a final conv3x3-BN (pooled where the
  fourth digit is ``"1"``), and the relative position embedding ``x + BN(conv3x3(neuron(x)))``;
- ``depths`` blocks on the membrane shortcut (the residual stream stays real-valued; each branch starts with a
  neuron): the spike-driven self-attention ``x + BN(conv1x1(Q * neuron(sum_tokens(K * V))))`` with ``Q``, ``K``,
  ``V`` each ``neuron(BN(conv1x1(neuron(x))))``, per head (:class:`SpikeDrivenSelfAttention`), then the MLP
  ``x + BN(conv1x1(neuron(BN(conv1x1(neuron(x))))))`` (``mlp_ratio`` x wider between);
- a neuron on the mean over the tokens and a linear head per time step: outputs ``[T, B, num_classes]`` (the zoo
  averages over T before its head; the training loop averages after, the same up to rounding).

The neurons: by default the zoo's (SpikingJelly's ``LIFNode()``, :data:`~spikefuse.models.spikformer.ZOO_LIF_NEURON`, in
the patch embedding, the MLP and before the head; ``detach_reset=True`` in the attention layers,
:data:`~spikefuse.models.spikformer.SPIKFORMER_NEURON`; the attention neuron's threshold 0.5,
:data:`~spikefuse.models.spikformer.SPIKFORMER_ATTENTION_NEURON`), each with the potential scaled by tau as for the
Spikformer; ``neuron=`` sets every neuron unless ``attention_neuron=`` is given.

Weights: the zoo's parameters and buffers in its order and under its names, with spikefuse's
:class:`~spikefuse.nn.SeqToBatch` wrappers' ``module.`` inserted: :func:`from_spikingjelly_state_dict`.

The lean form (:func:`spikefuse.nn.to_lean`): every BN followed directly by a neuron is fused with it (the three
patch stages, Q, K and V, the MLP's first BN); every conv and the head read spikes and save them as bits, but the
first stage's conv, which reads the image and is recomputed in backward. The BNs before a residual add (the final
patch stage's, the position embedding's, the projection's, the MLP's second) stay torch's; the neurons on the
residual stream, after the final stage and the attention neuron recompute their states.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn import NeuronFactory, SeqToBatch, SpikeMaxPool2d
from .spikformer import _fuse, _max_pool, _pair, _replace_spike_layer, _with_seq_to_batch_keys, _zoo_neurons

__all__ = [
    "SDTPatchEmbed",
    "SpikeDrivenSelfAttention",
    "SDTMLP",
    "SDTBlock",
    "SpikeDrivenTransformer",
    "from_spikingjelly_state_dict",
    "sdt",
    "sdt_tiny",
    "sdt_8_384",
]


def _spike_max_pool() -> SeqToBatch:
    """The zoo's 3x3 stride-2 max-pool where it pools a neuron's spikes: :class:`~spikefuse.nn.SpikeMaxPool2d`,
    torch's output and gradients on binary input, keeping the input as bits and no indices; in the default form
    too, where its step is faster than the real-valued max-pool's (``benchmarks/ab_models_step.py``)."""
    return SeqToBatch(SpikeMaxPool2d(kernel_size=3, stride=2, padding=1))


def _conv_bn(in_channels: int, out_channels: int, kernel_size: int, bias: bool = True) -> list[nn.Module]:
    return [
        SeqToBatch(nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=bias)),
        SeqToBatch(nn.BatchNorm2d(out_channels)),
    ]


class SDTPatchEmbed(nn.Module):
    """The zoo's ``_PatchEmbed``: ``stages`` (conv-BN-neuron, pooled per ``pooling_stat``), ``final_stage``
    (conv-BN, pooled per its last digit) and the position embedding ``rpe_bn(rpe_conv(final_lif(x))) + x``."""

    def __init__(self, in_channels: int, embed_dims: int, pooling_stat: str, neuron: NeuronFactory):
        super().__init__()
        self.stages = nn.ModuleList()
        previous = in_channels
        for pool, channels in zip(pooling_stat[:3], (embed_dims // 8, embed_dims // 4, embed_dims // 2)):
            layers = [*_conv_bn(previous, channels, 3), neuron.make()]
            if pool == "1":  # after the neuron: a max-pool of spikes (an OR over each window)
                layers.append(_spike_max_pool())
            self.stages.append(nn.Sequential(*layers))
            previous = channels
        final = _conv_bn(previous, embed_dims, 3)
        if pooling_stat[3] == "1":
            final.append(_max_pool())
        self.final_stage = nn.Sequential(*final)
        self.final_lif = neuron.make()
        self.rpe_conv, self.rpe_bn = _conv_bn(embed_dims, embed_dims, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        x = self.final_stage(x)
        return self.rpe_bn(self.rpe_conv(self.final_lif(x))) + x

    def convert_to_lean(self, counts: dict) -> None:
        # The convs reading the spikes of the stage before; to_lean's pass over each nn.Sequential sees one stage.
        for stage in (*self.stages[1:], self.final_stage):
            _replace_spike_layer(stage, "0", counts)
        _replace_spike_layer(self, "rpe_conv", counts)


class SpikeDrivenSelfAttention(nn.Module):
    """The zoo's ``SpikeDrivenSelfAttention`` on ``[T, B, C, H, W]``: ``s = shortcut_lif(x)``; Q, K, V spikes of
    conv1x1-BN-neuron on ``s``; per head and channel the tokens where K and V both spike, counted, through
    ``attn_lif``, masking Q; a conv1x1-BN projection added to ``x``."""

    def __init__(self, dim: int, num_heads: int, neuron: NeuronFactory, attention_neuron: NeuronFactory):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dims {dim} must be divisible by num_heads {num_heads}")
        self.dim, self.num_heads = dim, num_heads
        self.shortcut_lif = neuron.make()
        self.q_conv, self.q_bn = _conv_bn(dim, dim, 1, bias=False)
        self.q_lif = neuron.make()
        self.k_conv, self.k_bn = _conv_bn(dim, dim, 1, bias=False)
        self.k_lif = neuron.make()
        self.v_conv, self.v_bn = _conv_bn(dim, dim, 1, bias=False)
        self.v_lif = neuron.make()
        self.attn_lif = attention_neuron.make()
        self.proj_conv, self.proj_bn = _conv_bn(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, B, C, H, W = x.shape
        s = self.shortcut_lif(x)
        # Channel-major heads [T, B, heads, C / heads, H*W]: views of the convs' outputs, no transposes.
        heads = (T, B, self.num_heads, C // self.num_heads, H * W)
        q = self.q_lif(self.q_bn(self.q_conv(s))).reshape(heads)
        k = self.k_lif(self.k_bn(self.k_conv(s))).reshape(heads)
        v = self.v_lif(self.v_bn(self.v_conv(s))).reshape(heads)
        # Spikes: K * V and its sum over the tokens are exact integers, so Q * attn_lif(...) is the zoo's bit for bit.
        kv = self.attn_lif((k * v).sum(dim=-1, keepdim=True))
        return self.proj_bn(self.proj_conv((q * kv).reshape(T, B, C, H, W))) + x

    def convert_to_lean(self, counts: dict) -> None:
        for name in "qkv":
            _fuse(self, f"{name}_conv", f"{name}_bn", f"{name}_lif", True, counts)
        _replace_spike_layer(self, "proj_conv", counts)  # reads Q * KV: spikes

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"


class SDTMLP(nn.Module):
    """The zoo's ``_MLP``: ``x + BN(conv1x1(lif2(BN(conv1x1(lif1(x))))))``; where the hidden width equals ``dim``,
    the first branch is a residual too (``x + BN(conv1x1(lif1(x)))``), as in the zoo."""

    def __init__(self, dim: int, hidden: int, neuron: NeuronFactory):
        super().__init__()
        self.residual = dim == hidden
        self.fc1, self.bn1 = _conv_bn(dim, hidden, 1)
        self.lif1 = neuron.make()
        self.fc2, self.bn2 = _conv_bn(hidden, dim, 1)
        self.lif2 = neuron.make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        x = self.bn1(self.fc1(self.lif1(x)))
        if self.residual:
            x = x + identity
            identity = x
        return self.bn2(self.fc2(self.lif2(x))) + identity

    def convert_to_lean(self, counts: dict) -> None:
        if self.residual:  # a residual add between bn1 and lif2: nothing to fuse
            _replace_spike_layer(self, "fc1", counts)
        else:
            _fuse(self, "fc1", "bn1", "lif2", True, counts)
        _replace_spike_layer(self, "fc2", counts)


class SDTBlock(nn.Module):
    """The zoo's ``_Block``: ``mlp(attn(x))``, each adding its branch to ``x`` itself."""

    def __init__(self, dim, num_heads, mlp_ratio, neuron, attention_layer_neuron, attention_neuron):
        super().__init__()
        self.attn = SpikeDrivenSelfAttention(dim, num_heads, attention_layer_neuron, attention_neuron)
        self.mlp = SDTMLP(dim, int(dim * mlp_ratio), neuron)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class SpikeDrivenTransformer(nn.Module):
    """A multi-step Spike-driven Transformer v1 (see the module docstring).

    Args:
        in_channels: input channels.
        num_classes: classes.
        neuron: :class:`~spikefuse.nn.NeuronFactory` of every neuron (default: the zoo's, see the module docstring).
        attention_neuron: the attention neuron's options (default: the zoo's when ``neuron`` is None, else
            ``neuron``).
        neuron_backend: overrides every neuron's backend.
        embed_dims: channels of the tokens (a multiple of 8 and of ``num_heads``).
        num_heads: attention heads.
        depths: transformer blocks.
        mlp_ratio: the MLP's hidden width over ``embed_dims``.
        pooling_stat: four ``"0"``/``"1"`` digits, whether each patch stage max-pools (the zoo's default ``"1111"``
            for ImageNet; ``"0011"``, 16x fewer tokens, for 32x32 images).
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
        num_heads: int = 8,
        depths: int = 8,
        mlp_ratio: float = 4.0,
        pooling_stat: str = "1111",
        image_size: int | tuple[int, int] | None = None,
    ):
        super().__init__()
        if not isinstance(pooling_stat, str) or len(pooling_stat) != 4 or set(pooling_stat) - {"0", "1"}:
            raise ValueError(
                f"pooling_stat must be four '0'/'1' digits (whether each patch stage max-pools), got {pooling_stat!r}"
            )
        if embed_dims < 8 or embed_dims % 8:
            raise ValueError(
                f"embed_dims must be a positive multiple of 8 (the first patch stage's embed_dims / 8 channels), "
                f"got {embed_dims}"
            )
        if depths < 1:
            raise ValueError(f"depths must be >= 1, got {depths}")
        neuron, attention_layer_neuron, attention_neuron = _zoo_neurons(neuron, attention_neuron, neuron_backend)
        self.in_channels = in_channels
        self.image_size = None if image_size is None else _pair(image_size)
        self.patch_embed = SDTPatchEmbed(in_channels, embed_dims, pooling_stat, neuron)
        self.blocks = nn.ModuleList(
            SDTBlock(embed_dims, num_heads, mlp_ratio, neuron, attention_layer_neuron, attention_neuron)
            for _ in range(depths)
        )
        self.head_lif = neuron.make()
        self.head = nn.Linear(embed_dims, num_classes)  # on [T, B, C]: every time step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5 or x.shape[2] != self.in_channels:
            raise ValueError(
                f"SpikeDrivenTransformer expects [T, B, {self.in_channels}, H, W] input, got shape {tuple(x.shape)}"
            )
        if self.image_size is not None and tuple(x.shape[3:]) != self.image_size:
            raise ValueError(f"SpikeDrivenTransformer was built for {self.image_size} images, got {tuple(x.shape[3:])}")
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.head_lif(x.flatten(3).mean(dim=-1)))

    def convert_to_lean(self, counts: dict) -> None:
        _replace_spike_layer(self, "head", counts)  # reads head_lif's spikes


def from_spikingjelly_state_dict(state_dict: dict) -> dict:
    """A SpikingJelly zoo ``SpikeDrivenTransformer``'s ``state_dict`` with its keys as
    :class:`SpikeDrivenTransformer`'s: ``module.`` inserted before the last name of every conv's and BN's key
    (``blocks.0.attn.q_conv.weight`` -> ``blocks.0.attn.q_conv.module.weight``); the head's unchanged."""
    return _with_seq_to_batch_keys(state_dict)


def _build(in_channels, num_classes, neuron, neuron_backend, defaults: dict, kw: dict) -> SpikeDrivenTransformer:
    return SpikeDrivenTransformer(
        in_channels, num_classes, neuron=neuron, neuron_backend=neuron_backend, **{**defaults, **kw}
    )


def sdt(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """Spike-driven Transformer-2-512, the paper's CIFAR configuration: embed 512, 8 heads, 2 blocks, patch stages
    pooling ``"0011"`` (8x8 tokens from 32x32 images). Keywords: those of :class:`SpikeDrivenTransformer`."""
    defaults = dict(embed_dims=512, num_heads=8, depths=2, pooling_stat="0011")
    return _build(in_channels, num_classes, neuron, neuron_backend, defaults, kw)


def sdt_tiny(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """A small Spike-driven Transformer for quick runs and tests: embed 64, 4 heads, 1 block, pooling ``"0011"``."""
    defaults = dict(embed_dims=64, num_heads=4, depths=1, pooling_stat="0011")
    return _build(in_channels, num_classes, neuron, neuron_backend, defaults, kw)


def sdt_8_384(in_channels: int = 3, num_classes: int = 10, neuron=None, neuron_backend: str | None = None, **kw):
    """The zoo's ``sdt_8_384`` (ImageNet): embed 384, 8 heads, 8 blocks, every patch stage pooling."""
    defaults = dict(embed_dims=384, num_heads=8, depths=8, pooling_stat="1111")
    return _build(in_channels, num_classes, neuron, neuron_backend, defaults, kw)
