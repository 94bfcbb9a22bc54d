"""Adam's step in ``spikefuse train``: torch's default on the CPU (one parameter at a time) against the fused kernel
(``torch.optim.Adam(fused=True)``, what ``spikefuse.train.make_optimizer`` builds where every parameter's device has
it), on the parameters of the models ``spikefuse train`` builds; medians of ``--repeats`` steps, the two side by side
in one process, and the largest difference of the weights after the same steps (3 x (1 + repeats) each).

    python benchmarks/fused_adam.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spikefuse.models import build_model

MODELS = (
    ("mlp", dict(in_channels=2, num_classes=10, image_size=34, hidden=512), "N-MNIST MLP, hidden 512"),
    ("mlp", dict(in_channels=2, num_classes=10, image_size=34, hidden=256), "N-MNIST MLP, hidden 256"),
    ("resnet-tiny", dict(in_channels=1, num_classes=10), "resnet-tiny (MNIST)"),
)


def _step_ms(params, kw, repeats: int) -> float:
    opt = torch.optim.Adam(params, lr=1e-3, **kw)
    opt.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=51)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| model | parameters | default step ms | fused step ms | default / fused | max weight difference after the same steps |"
    )
    print("|---|---|---|---|---|---|")
    for name, kw, label in MODELS:
        forms = {}
        for form in ({}, {"fused": True}):
            torch.manual_seed(0)
            model = build_model(name, **kw)
            params = list(model.parameters())
            for q in params:
                q.grad = torch.randn_like(q)
            forms[bool(form)] = (params, form)
        ms = {fused: [] for fused in forms}
        for _ in range(3):  # the two alternate, so that drift of the machine falls on both
            for fused, (params, form) in forms.items():
                ms[fused].append(_step_ms(params, form, args.repeats))
        default, fused = statistics.median(ms[False]), statistics.median(ms[True])
        diff = max((a - b).abs().max().item() for a, b in zip(forms[False][0], forms[True][0]))
        n = sum(q.numel() for q in forms[False][0])
        print(f"| {label} | {n:,} | {default:.3f} | {fused:.3f} | {default / fused:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
