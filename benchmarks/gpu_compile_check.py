"""Where ``torch.compile`` of a whole Spiking-ResNet on a GPU departs from eager mode (issue 49: the fullgraph test
failed on an H200 with 110 of 120 outputs off): the same model and input under several backends, settings and
modes, and a conv -> BatchNorm -> LIF stack alone, each compared with eager mode. Prints one line per case.

    python3 benchmarks/gpu_compile_check.py
"""

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

from spikefuse import nn as snn
from spikefuse.models import build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _stack():
    return torch.nn.Sequential(
        snn.SeqToBatch(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)),
        snn.SeqToBatch(torch.nn.BatchNorm2d(8)),
        snn.LIF(0.2, 0.3),
    )


def _case(name, make, x, backend, mode, grad, layout=True):
    torch._dynamo.reset()
    inductor_config.layout_optimization = layout
    torch.manual_seed(0)
    model = make().to(DEVICE).train(mode == "train")
    want_model = make().to(DEVICE).train(mode == "train")
    want_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.set_grad_enabled(grad):
        try:
            got = compiled(x)
        except Exception as err:  # report and go on
            print(
                f"{name:14s} {backend:9s} {mode:5s} grad={grad!s:5s} layout={layout!s:5s} FAILED {type(err).__name__}: "
                f"{str(err).splitlines()[0][:160]}",
                flush=True,
            )
            return
        want = want_model(x)
    diff = (got.float() - want.float()).abs()
    print(
        f"{name:14s} {backend:9s} {mode:5s} grad={grad!s:5s} layout={layout!s:5s} max diff {float(diff.max()):.3e}, "
        f"{int((diff > 1e-4).sum())} of {diff.numel()} off, strides got {got.stride()} want {want.stride()}",
        flush=True,
    )


def main():
    x = torch.rand(3, 4, 3, 16, 16, device=DEVICE)
    resnet = lambda: build_model("resnet-tiny", 3, 10, stem="cifar")  # noqa: E731
    for name, make in (("stack", _stack), ("resnet-tiny", resnet)):
        for backend in ("aot_eager", "inductor"):
            for mode, grad in (("eval", True), ("eval", False), ("train", True)):
                _case(name, make, x, backend, mode, grad)
        _case(name, make, x, "inductor", "eval", True, layout=False)


if __name__ == "__main__":
    main()
