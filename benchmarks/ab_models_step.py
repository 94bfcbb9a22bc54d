"""Training steps of `spikefuse bench models`' models in variants of their forms, side by side in one process: what
a change of the default (`fused`) or lean form would gain before it is made (issue 57).

    python benchmarks/ab_models_step.py [--models ...] [--forms ...] [--repeats 9] [--threads 2] [--cpu-time]

The step, weights and inputs are `bench models`' (T=4, batch 8, 32x32); every cycle runs one step of every form,
the order rotating; a ratio is the median of the cycles' `form / base` ratios (in brackets their quartiles).
`--cpu-time` times the process's CPU time instead of the wall clock: with `--threads 1` it is the step's work, which
other processes on a shared machine move much less than they move a 2-thread wall-clock time.

The variants (besides `bench models`' forms):

- `bn-lif`: the default form with every BatchNorm that feeds a neuron fused with it (`BatchNormLIF1d/2d`, which
  recompute the normalized input and the potentials in backward), torch's convolutions and pools kept;
- `lean-keep-conv`: the lean form, but the 1x1 convolutions on the residual stream (Spikformer's Q/K/V and first
  MLP layer, QKFormer's) keep their output instead of being recomputed in backward;
- `lean-torch-conv`: the lean form with torch's convolutions instead of the spike layers (no bits saved);
- `lean-keep-potential`: the lean form with its recomputing neurons saving their potential again;
- `real-pools`: the default form with every spike max-pool as the real-valued `spikefuse.nn.MaxPool2d`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

from spikefuse.bench import models as bench_models
from spikefuse.bench.memory import ratio_quartiles, side_by_side

lean = importlib.import_module("spikefuse.batchnorm.lean")
spikformer = importlib.import_module("spikefuse.models.spikformer")  # the module, not the builder of that name


class _Patched:
    """Replace functions of modules while converting (restored on exit)."""

    def __init__(self, *replacements):
        self.replacements = replacements  # (module, name, function)

    def __enter__(self):
        self.saved = [(m, n, getattr(m, n)) for m, n, _ in self.replacements]
        for m, n, f in self.replacements:
            setattr(m, n, f)

    def __exit__(self, *exc):
        for m, n, f in self.saved:
            setattr(m, n, f)


def bn_lif(model):
    none = lambda *args: None  # noqa: E731
    memory = {m: m.memory for m in model.modules() if isinstance(getattr(m, "memory", None), str)}
    with _Patched(
        *[(lean, name, none) for name in ("spike_layer_from", "conv_batchnorm_neuron_from", "spike_max_pool_from")],
        *[(spikformer, name, none) for name in ("spike_layer_from", "conv_batchnorm_neuron_from")],
    ):
        counts = lean.to_lean(model)
    for m, mode in memory.items():
        m.memory = mode
    return counts


def lean_keep_conv(model):
    original = lean.conv_batchnorm_neuron_from

    def on_images_only(conv, fused):
        return None if isinstance(getattr(conv, "module", None), torch.nn.Conv1d) else original(conv, fused)

    with _Patched(
        (lean, "conv_batchnorm_neuron_from", on_images_only), (spikformer, "conv_batchnorm_neuron_from", on_images_only)
    ):
        return lean.to_lean(model)


def lean_torch_conv(model):
    from spikefuse.nn import SeqToBatch, SpikeConv1d, SpikeConv2d, SpikeLinear

    counts = lean.to_lean(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, (SpikeConv1d, SpikeConv2d)):
            m.__class__ = torch.nn.Conv1d if isinstance(m, SpikeConv1d) else torch.nn.Conv2d
            model.set_submodule(name, SeqToBatch(m))
        elif isinstance(m, SpikeLinear):
            m.__class__ = torch.nn.Linear
    return counts


def lean_keep_potential(model):
    counts = lean.to_lean(model)
    for m in model.modules():
        if getattr(m, "memory", None) == "recompute":
            m.memory = "potential"
    return counts


def real_pools(model):
    from spikefuse.nn import MaxPool2d, SeqToBatch, SpikeMaxPool2d

    n = 0
    for m in model.modules():
        if isinstance(m, SeqToBatch) and isinstance(m.module, SpikeMaxPool2d):
            p = m.module
            m.module = MaxPool2d(p.kernel_size, p.stride, p.padding, p.dilation)
            n += 1
    return {"pools": n}


VARIANTS = {
    "bn-lif": ("fused", bn_lif),
    "lean-keep-conv": ("fused", lean_keep_conv),
    "lean-torch-conv": ("fused", lean_torch_conv),
    "lean-keep-potential": ("fused", lean_keep_potential),
    "real-pools": ("fused", real_pools),
}


def make(cfg):
    if cfg["form"] not in VARIANTS:
        return bench_models.make_form(cfg)
    base, convert = VARIANTS[cfg["form"]]
    model, reset = bench_models.make_form({**cfg, "form": base})
    print(f"{cfg['model']} / {cfg['form']}: {convert(model)}", file=sys.stderr)
    return model, reset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(bench_models.ZOO), choices=list(bench_models.MODELS))
    p.add_argument(
        "--forms", nargs="+", default=["spikingjelly", "fused", "lean"], choices=[*bench_models.FORMS, *VARIANTS]
    )
    p.add_argument("--base", default="fused", help="the form the ratios divide (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--cpu-time", action="store_true", help="time the process's CPU time, not the wall clock")
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    forms = args.forms if args.base in args.forms else [args.base, *args.forms]

    def timed(step) -> float:
        start = clock()
        step()
        return clock() - start

    print(f"{'cpu' if args.cpu_time else 'wall'} time, {args.threads} threads, {args.repeats} cycles")
    for model in args.models:
        cfg = {
            **bench_models.DEFAULTS,
            "batch_size": args.batch_size,
            "seed": 0,
            "threads": args.threads,
            "model": model,
        }
        load = os.getloadavg()
        samples = side_by_side(cfg, forms, args.repeats, timed, make)
        print(f"{model} (load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f})")
        for form in forms:
            q1, ratio, q3 = ratio_quartiles(samples[args.base], samples[form])
            print(
                f"  {form:20s} {statistics.median(samples[form]) * 1e3:8.2f} ms   speed-up vs {args.base} "
                f"{ratio:.3f} ({q1:.3f}-{q3:.3f})"
            )


if __name__ == "__main__":
    main()
