"""Where ``torch.compile`` of a whole Spiking-ResNet on a GPU departs from eager mode (issue 49: the fullgraph test
failed on an H200 with 110 of 120 outputs off), each case compared with eager mode, one line per case:

- ``settings``: the same model and input, and a conv -> BatchNorm -> LIF stack alone, under several backends,
  modes and inductor's layout optimization on and off;
- ``bisect``: each stage and first block of ``resnet-tiny`` compiled alone (layout optimization on) on the input
  eager mode gives it, then a few hand-made compositions.

    python3 benchmarks/gpu_compile_check.py [settings] [bisect]   (default: both)
"""

import sys

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

import spikefuse
from spikefuse import nn as snn
from spikefuse.models import build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Fn(torch.nn.Module):
    """A function as a module, for torch.compile."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def compare(name: str, compiled, eager, *inputs, backend: str = "inductor", grad: bool = False) -> None:
    """Print how far ``torch.compile(compiled, fullgraph=True)`` lands from ``eager`` on ``inputs``."""
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        try:
            got = torch.compile(compiled, fullgraph=True, backend=backend)(*inputs)
        except Exception as err:  # report and go on
            print(f"{name:48s} FAILED {type(err).__name__}: {str(err).splitlines()[0][:150]}", flush=True)
            return
        want = eager(*inputs)
    diff = (got.detach().float() - want.detach().float()).abs()
    print(
        f"{name:48s} {int((diff > 1e-4).sum()):7d} of {diff.numel():7d} off, max {float(diff.max()):.3e}; "
        f"strides got {tuple(got.stride())} want {tuple(want.stride())}",
        flush=True,
    )


def _stack():
    return torch.nn.Sequential(
        snn.SeqToBatch(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)),
        snn.SeqToBatch(torch.nn.BatchNorm2d(8)),
        snn.LIF(0.2, 0.3),
    )


def _resnet():
    return build_model("resnet-tiny", 3, 10, stem="cifar")


def settings(x):
    for name, make in (("stack", _stack), ("resnet-tiny", _resnet)):
        cases = [
            (b, m, g, True)
            for b in ("aot_eager", "inductor")
            for m, g in (("eval", True), ("eval", False), ("train", True))
        ]
        for backend, mode, grad, layout in [*cases, ("inductor", "eval", True, False)]:
            inductor_config.layout_optimization = layout
            torch.manual_seed(0)
            model, eager = (make().to(DEVICE).train(mode == "train") for _ in range(2))
            eager.load_state_dict(model.state_dict())
            label = f"{name} {backend} {mode} grad={grad} layout={layout}"
            compare(label, model, eager, x, backend=backend, grad=grad)


def bisect(x):
    inductor_config.layout_optimization = True
    torch.manual_seed(0)
    model = _resnet().to(DEVICE).eval()
    compare("whole model", model, model, x)
    stages = [("stem", Fn(lambda v: model.maxpool(model.sn1(model.bn1(model.conv1(v))))))]
    stages += [(name, getattr(model, name)) for name in ("layer1", "layer2", "layer3", "layer4")]
    stages += [("head", Fn(lambda v: model.fc(model.flatten(model.avgpool(v)))))]
    v = x
    for name, stage in stages:
        compare(f"stage {name}", stage, stage, v)
        if isinstance(stage, torch.nn.Sequential):
            block = stage[0]
            first = Fn(lambda u, b=block: b.sn1(b.bn1(b.conv1(u))))
            compare(f"  {name}[0]", block, block, v)
            compare(f"  {name}[0] conv1+bn1+sn1", first, first, v)
        with torch.no_grad():
            v = stage(v)
    conv = snn.SeqToBatch(torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)).to(DEVICE).eval()
    spikes = (torch.rand(3, 4, 8, 8, 8, device=DEVICE) < 0.3).float()
    for name, fn in (
        ("conv then lif", lambda u: spikefuse.lif(conv(u), decay=0.2, threshold=0.3)),
        ("conv then lif(+ residual)", lambda u: spikefuse.lif(conv(u) + u, decay=0.2, threshold=0.3)),
        (
            "lif of channels-last",
            lambda u: spikefuse.lif(
                conv(u).flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, (3, 4)),
                decay=0.2,
                threshold=0.3,
            ),
        ),
    ):
        compare(name, Fn(fn), Fn(fn), spikes)


def main(parts):
    x = torch.rand(3, 4, 3, 16, 16, device=DEVICE)
    for part in parts or ("settings", "bisect"):
        {"settings": settings, "bisect": bisect}[part](x)


if __name__ == "__main__":
    main(sys.argv[1:])
