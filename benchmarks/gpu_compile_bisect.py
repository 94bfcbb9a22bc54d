"""Which part of a Spiking-ResNet goes wrong under ``torch.compile`` with inductor's layout optimization on a GPU
(``benchmarks/gpu-notes.md``, 2026-11-27): each stage of ``resnet-tiny`` compiled alone on the input eager mode gives
it, then single modules and a few hand-made compositions, each against eager mode. One line per case.

    python3 benchmarks/gpu_compile_bisect.py
"""

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

import spikefuse
from spikefuse import nn as snn
from spikefuse.models import build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(name, module, *inputs):
    torch._dynamo.reset()
    with torch.no_grad():
        want = module(*inputs)
        try:
            got = torch.compile(module, fullgraph=True)(*inputs)
        except Exception as err:
            print(f"{name:34s} FAILED {type(err).__name__}: {str(err).splitlines()[0][:150]}", flush=True)
            return
    diff = (got.float() - want.float()).abs()
    print(
        f"{name:34s} {int((diff > 1e-4).sum()):7d} of {diff.numel():7d} off, max {float(diff.max()):.3e}; "
        f"strides got {tuple(got.stride())} want {tuple(want.stride())}",
        flush=True,
    )


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *a):
        return self.fn(*a)


def main():
    inductor_config.layout_optimization = True
    torch.manual_seed(0)
    model = build_model("resnet-tiny", 3, 10, stem="cifar").to(DEVICE).eval()
    x = torch.rand(3, 4, 3, 16, 16, device=DEVICE)
    stages = [("stem", lambda v: model.maxpool(model.sn1(model.bn1(model.conv1(v)))))]
    stages += [(f"{name}", getattr(model, name)) for name in ("layer1", "layer2", "layer3", "layer4")]
    stages += [("head", lambda v: model.fc(model.flatten(model.avgpool(v))))]
    check("whole model", model, x)
    v = x
    for name, fn in stages:
        module = fn if isinstance(fn, torch.nn.Module) else Fn(fn)
        check(f"stage {name}", module, v)
        for i, block in enumerate(module if isinstance(module, torch.nn.Sequential) else []):
            check(f"  {name}[{i}]", block, v)
            check(f"  {name}[{i}] conv1+bn1+sn1", Fn(lambda u, b=block: b.sn1(b.bn1(b.conv1(u)))), v)
            with torch.no_grad():
                v = block(v)
        if not isinstance(module, torch.nn.Sequential):
            with torch.no_grad():
                v = module(v)
    conv = snn.SeqToBatch(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)).to(DEVICE).eval()
    spikes = (torch.rand(3, 4, 8, 8, 8, device=DEVICE) < 0.3).float()
    check("conv then lif", Fn(lambda u: spikefuse.lif(conv(u), decay=0.2, threshold=0.3)), spikes)
    check("conv then lif(+ residual)", Fn(lambda u: spikefuse.lif(conv(u) + u, decay=0.2, threshold=0.3)), spikes)
    check(
        "lif of channels-last",
        Fn(
            lambda u: spikefuse.lif(
                conv(u).flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, (3, 4)),
                decay=0.2,
                threshold=0.3,
            )
        ),
        spikes,
    )


if __name__ == "__main__":
    main()
