"""``spikefuse bench models``: a training step of the spiking transformers and the SEW-ResNet, SpikingJelly's zoo
models against spikefuse's.

Each model (the tiny CIFAR configurations of ``spikformer_tiny``, ``sdt_tiny`` and ``qkformer_tiny``, and
``sew_resnet18`` with the CIFAR stem; 32x32 inputs, T=4) runs in four forms from the same weights, in one process:

- ``spikingjelly``: SpikingJelly 2.0's zoo model (``spikingjelly.activation_based.model``) with its own multi-step
  ``LIFNode`` at each position's defaults, as the zoo builds it, reset by ``functional.reset_net``;
- ``sj-dropin``: the same zoo model with every ``LIFNode`` replaced by ``spikefuse.compat.spikingjelly.LIFNode``
  (:func:`spikefuse.compat.use_spikefuse_neurons`: the same settings and state);
- ``fused``: spikefuse's native model (:mod:`spikefuse.models`), default form, the zoo's weights loaded through
  ``from_spikingjelly_state_dict``;
- ``lean``: the same with ``memory="lean"`` (:func:`spikefuse.nn.to_lean`).

SpikingJelly's SEW-ResNet imports torchvision, which cannot run here; its ``spikingjelly`` form is the structure
``spikefuse bench memory`` runs instead: spikefuse's SEW-ResNet (SpikingJelly's structure on torch's conv and
BatchNorm, connect function ADD) with every neuron SpikingJelly's ``LIFNode`` of the same dynamics
(:func:`spikefuse.compat.spikingjelly.use_spikingjelly_neurons`).

Measured as ``spikefuse bench memory`` measures (its functions, in this process): the bytes saved for backward
during one training step's forward (unique storages, parameters excluded), the step's peak resident memory, and the
step time (forward, cross-entropy of the time-averaged output, backward, Adam), every form's step in turn for
``--repeats`` cycles after an untimed one; the speed-up against ``spikingjelly`` is the median of the cycles'
ratios. On one batch every form's head input (averaged over T: the zoo's SDT and QKFormer average before their
head) and output are compared with ``spikingjelly``'s, and the gradients of the step
(:func:`gradient_difference`).

Writes ``benchmarks/results/bench-models[-quick].md`` and ``.csv`` with the machine and the exact command.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from pathlib import Path

from .common import RESULTS, command_line, machine_info, markdown_table, write_csv

#: spikefuse's registered model -> (the module of SpikingJelly's zoo and of spikefuse's models holding it, the zoo's
#: class, the sizes both take, whether the zoo's class takes the image size).
ZOO = {
    "spikformer_tiny": ("spikformer", "Spikformer", dict(embed_dims=64, num_heads=4, depths=1, patch_size=4), True),
    "sdt_tiny": (
        "spike_driven_transformer",
        "SpikeDrivenTransformer",
        dict(embed_dims=64, num_heads=4, depths=1, pooling_stat="0011"),
        False,
    ),
    "qkformer_tiny": ("qkformer", "QKFormer", dict(embed_dims=64, num_heads=(2, 4, 4), depths=(1, 1, 1)), False),
}
#: Built as ``spikefuse bench memory`` builds them (its ``spikingjelly`` form for SpikingJelly's).
RESNETS = ("sew_resnet18",)
MODELS = (*ZOO, *RESNETS)
FORMS = {
    "spikingjelly": "SpikingJelly 2.0's zoo model with its own multi-step LIFNode",
    "sj-dropin": "the same zoo model, every LIFNode replaced by spikefuse.compat.spikingjelly.LIFNode",
    "fused": "spikefuse's native model, default form",
    "lean": "spikefuse's native model, memory='lean'",
}
REFERENCE = "spikingjelly"
DEFAULTS = {"T": 4, "image_size": 32, "resnet_width": 64, "stem": "cifar"}
QUICK = {"T": 2, "batch_size": 2, "repeats": 1, "resnet_width": 8}
COLUMNS = [
    "model",
    "form",
    "T",
    "batch_size",
    "image_size",
    "step_s",
    "speedup",
    "speedup_q1",
    "speedup_q3",
    "saved_MiB",
    "saved_vs_spikingjelly",
    "step_peak_MiB",
    "peak_vs_spikingjelly",
    "head_input_equal",
    "output_max_abs_diff",
    "loss",
    "grad_diff",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "models",
        help="training step and memory kept for backward of the spiking transformers and SEW-ResNet18: "
        "SpikingJelly's zoo model, with spikefuse's LIFNode, spikefuse's model, its lean form",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="(default: all)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed cycles, one step of every form each (default: %(default)s)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="batch size (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch/numba threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="of the weights and inputs (default: %(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"check the harness: T={QUICK['T']}, batch {QUICK['batch_size']}, {QUICK['repeats']} cycle, "
        f"SEW-ResNet width {QUICK['resnet_width']}",
    )
    p.add_argument("--results-dir", default=str(RESULTS), help="where the .md/.csv go (default: %(default)s)")
    return p


# ---------------------------------------------------------------------------------------------------- models
def _zoo_model(cfg: dict):
    """SpikingJelly's zoo model of ``cfg['model']`` with its own neurons, weights drawn from ``cfg['seed']``."""
    import torch

    module, cls, sizes, takes_image_size = ZOO[cfg["model"]]
    zoo = importlib.import_module(f"spikingjelly.activation_based.model.{module}")
    image = dict(img_size_h=cfg["image_size"], img_size_w=cfg["image_size"]) if takes_image_size else {}
    torch.manual_seed(cfg["seed"])
    return getattr(zoo, cls)(T=cfg["T"], in_channels=3, num_classes=10, **sizes, **image)


def _native_model(cfg: dict):
    """spikefuse's model of ``cfg['model']`` holding the zoo model's weights (in the default form)."""
    from ..models import build_model

    module, _, sizes, _ = ZOO[cfg["model"]]
    model = build_model(cfg["model"], 3, 10, image_size=cfg["image_size"], **sizes)
    keys = importlib.import_module(f"spikefuse.models.{module}").from_spikingjelly_state_dict
    model.load_state_dict(keys(_zoo_model(cfg).state_dict()))  # strict: the sizes agree
    return model


def make_form(cfg: dict):
    """``(model, reset)`` of ``cfg['model']`` in ``cfg['form']``; ``reset(model)`` clears neuron state between steps
    (``bench memory``'s :func:`~spikefuse.bench.memory.make_form` signature)."""
    from spikingjelly.activation_based.functional import reset_net

    from ..compat import use_spikefuse_neurons
    from ..nn import to_lean
    from ..train import reset_states
    from . import memory

    form = cfg["form"]
    if form == "sj-dropin":
        model, _ = make_form({**cfg, "form": REFERENCE})
        use_spikefuse_neurons(model)
        return model, reset_net  # SpikingJelly's reset, as its users reset a zoo model
    if cfg["model"] in RESNETS:
        return memory.make_form(cfg)
    if form == REFERENCE:
        return _zoo_model(cfg), reset_net
    model = _native_model(cfg)
    if form == "lean":
        to_lean(model)
    return model, reset_states


# ----------------------------------------------------------------------------------------------- measurement
def _per_sample(t):
    """``t`` averaged over T where it has T (``[T, B, F]`` -> ``[B, F]``): the zoo's SDT and QKFormer average their
    features over T before the head, spikefuse's models and the zoo's Spikformer after."""
    return t.mean(0) if t.dim() == 3 else t


def one_batch(cfg: dict) -> tuple:
    """``(head input, output)`` of ``cfg``'s model and form on the step's batch, each averaged over T."""
    import torch

    from .memory import _readout, step_input

    model, reset = make_form(cfg)
    model.train()
    reset(model)
    seen = []
    _readout(model).register_forward_hook(lambda module, args, out: seen.append(args[0]))
    x, _ = step_input(cfg)
    with torch.no_grad():
        out = model(x)
    return _per_sample(seen[0]), _per_sample(out)


def gradient_difference(grads: list, reference: list) -> float:
    """The largest difference of a gradient in ``grads`` from ``reference`` (both ``[(name, grad)]`` in registration
    order) over the largest gradient of ``reference``: a parameter whose gradient is 0 in exact arithmetic (a conv
    bias before BatchNorm, which removes the mean) has rounding noise there, no scale of its own. inf where the
    parameters do not line up."""
    pairs = [(g, r) for (_, g), (_, r) in zip(grads, reference) if g is not None or r is not None]
    if len(grads) != len(reference) or any(g is None or r is None or g.shape != r.shape for g, r in pairs):
        return float("inf")
    largest = max(float(r.abs().max()) for _, r in pairs)
    return max(float((g - r).abs().max()) for g, r in pairs) / largest


def run(args) -> int:
    from ..threads import threads_while

    cfg0 = {
        **DEFAULTS,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "seed": args.seed,
        "threads": args.threads,
    }
    if args.quick:
        cfg0.update(QUICK)
    if cfg0["repeats"] < 1:
        raise SystemExit(f"bench models: --repeats must be at least 1, got {cfg0['repeats']}")
    if importlib.util.find_spec("spikingjelly") is None:
        raise SystemExit(
            "bench models compares against SpikingJelly's zoo models: install it with `pip install spikingjelly "
            "--no-deps`"
        )
    with threads_while(args.threads):
        return _run(args, cfg0)


def _run(args, cfg0: dict) -> int:
    from .memory import ratio_quartiles, run_form, time_side_by_side

    forms = list(FORMS)
    load_before = os.getloadavg()
    measured = {}
    # every model's memory before any timing: the timed steps run with glibc's larger mmap threshold, which leaves
    # freed buffers on the heap, where a later step's peak would reuse them without raising the RSS
    for model in args.models:
        for form in forms:
            print(f"bench models: {model} / {form}: memory and one batch ...", file=sys.stderr, flush=True)
            cfg = {**cfg0, "model": model, "form": form}
            measured[model, form] = run_form(cfg, make_form), one_batch(cfg)
    rows = []
    for model in args.models:
        print(f"bench models: {model}: step times, every form side by side ...", file=sys.stderr, flush=True)
        cfg = {**cfg0, "model": model}
        cycles = time_side_by_side(cfg, forms, make_form)
        results = {form: measured[model, form][0] for form in forms}
        outputs = {form: measured[model, form][1] for form in forms}
        ref, ref_grads = results[REFERENCE]
        ref_features, ref_out = outputs[REFERENCE]
        ref_saved = ref["saved_stack"] + ref["saved_other"]
        for form in forms:
            res, grads = results[form]
            features, out = outputs[form]
            saved = res["saved_stack"] + res["saved_other"]
            peak, ref_peak = res.get("step_peak"), ref.get("step_peak")
            q1, speedup, q3 = ratio_quartiles(cycles[REFERENCE], cycles[form])
            grad_diff = gradient_difference(grads, ref_grads)
            rows.append(
                {
                    "model": model,
                    "form": form,
                    "T": cfg["T"],
                    "batch_size": cfg["batch_size"],
                    "image_size": cfg["image_size"],
                    "step_s": f"{statistics.median(cycles[form]):.4f}",
                    "speedup": f"{speedup:.3f}",
                    "speedup_q1": f"{q1:.3f}",
                    "speedup_q3": f"{q3:.3f}",
                    "saved_MiB": f"{saved / 2**20:.2f}",
                    "saved_vs_spikingjelly": f"{saved / ref_saved:.3f}",
                    "step_peak_MiB": f"{peak / 2**20:.2f}" if peak is not None else "",
                    "peak_vs_spikingjelly": f"{peak / ref_peak:.3f}" if peak and ref_peak else "",
                    "head_input_equal": str(
                        features.shape == ref_features.shape and bool((features == ref_features).all())
                    ),
                    "output_max_abs_diff": f"{float((out - ref_out).abs().max()):.2e}",
                    "loss": f"{res['loss']:.6f}",
                    "grad_diff": f"{grad_diff:.2e}",
                }
            )
    write_report(rows, cfg0, args, (load_before, os.getloadavg()))
    return 0


# ------------------------------------------------------------------------------------------------------ report
def _agreement(row: dict) -> str:
    """The table's "same as spikingjelly" cell."""
    if row["form"] == REFERENCE:
        return "-"
    features = "head input equal" if row["head_input_equal"] == "True" else "**head input differs**"
    return f"{features}; output {row['output_max_abs_diff']}, grads {row['grad_diff']}"


def write_report(rows: list[dict], cfg: dict, args, loads: tuple) -> tuple[Path, Path]:
    """The .md and .csv of ``rows``; ``loads``: the machine's load averages (1, 5, 15 min) before and after the run,
    since other work on a shared machine moves the step times."""
    out = Path(args.results_dir)
    stem = "bench-models" + ("-quick" if args.quick else "")
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    write_csv(csv_path, [{c: row[c] for c in COLUMNS} for row in rows])
    header = [
        "model",
        "form",
        "step s",
        "speed-up vs spikingjelly",
        "saved MiB",
        "saved vs spikingjelly",
        "step peak MiB",
        "peak vs spikingjelly",
        "same as spikingjelly (one batch)",
    ]
    table = [
        [
            r["model"],
            r["form"],
            r["step_s"],
            r["speedup"]
            if r["speedup_q1"] == r["speedup_q3"]
            else f"{r['speedup']} ({r['speedup_q1']}-{r['speedup_q3']})",
            r["saved_MiB"],
            r["saved_vs_spikingjelly"],
            r["step_peak_MiB"] or "-",
            r["peak_vs_spikingjelly"] or "-",
            _agreement(r),
        ]
        for r in rows
    ]
    size = cfg["image_size"]
    load_before, load_after = (", ".join(f"{x:.2f}" for x in load) for load in loads)
    lines = [
        "# bench models" + (" (quick)" if args.quick else ""),
        "",
        f"Machine: {machine_info()}; load average (1, 5, 15 min) {load_before} before the run, {load_after} after it",
        "",
        f"Command: `{command_line()}`",
        "",
        f"T={cfg['T']}, batch {cfg['batch_size']}, {size}x{size}x3 inputs (one random image per sample at every step), "
        f"10 classes; the transformers at their tiny sizes ("
        + "; ".join(f"`{name}`: {', '.join(f'{k}={v}' for k, v in ZOO[name][2].items())}" for name in ZOO)
        + f"), SEW-ResNet18 width {cfg['resnet_width']}, {cfg['stem']} stem, connect function ADD. One step = "
        f"forward, cross-entropy of the time-averaged output, backward, Adam update; all forms in this process; "
        f"{cfg['repeats']} {'cycle' if cfg['repeats'] == 1 else 'cycles'} of one step of every form in turn (the "
        f"order rotating), after an untimed one; step s the median over the cycles, speed-up the median of the "
        f"cycles' ratios spikingjelly / form (in brackets their quartiles).",
        "",
        "Forms: " + "; ".join(f"`{k}` = {v}" for k, v in FORMS.items()) + ".",
        "",
        markdown_table(header, table),
        "",
        "- saved MiB: unique storages packed by `saved_tensors_hooks` in the forward, parameters excluded (the memory "
        "kept for backward), as `spikefuse bench memory` counts them.",
        "- step peak: RSS high-water mark during one step minus RSS before it (glibc mmap threshold fixed at 64 KiB "
        "so freed tensors leave the RSS).",
        "- same as spikingjelly: on the step's batch, whether the head's input (averaged over T) is equal bit for "
        "bit, the largest difference of the time-averaged outputs, and the largest difference of the step's "
        "gradients over the largest gradient (max|g - g_ref| / max|g_ref| over all parameters, in registration "
        "order: a conv bias before a BatchNorm has a gradient 0 but for rounding).",
        "- The zoo's default `LIFNode` charges `v + (x - v) / tau`; spikefuse's native transformers the same dynamics "
        "scaled by tau, rounded differently: a potential within a rounding of its threshold can spike in one and not "
        "the other. The zoo's SDT and QKFormer average over T before their head, spikefuse's after (outputs equal to "
        "rounding).",
        "- SEW-ResNet18: SpikingJelly's SEW-ResNet imports torchvision, which cannot run here; its `spikingjelly` form "
        "is spikefuse's SEW-ResNet structure (SpikingJelly's, on torch's conv and BatchNorm) with every neuron "
        "SpikingJelly's `LIFNode` of spikefuse's default neuron (`tau = 1/(1 - decay)`, `decay_input=False`), as "
        "`spikefuse bench memory`'s `spikingjelly` form; it computes `v - v / tau + x`, spikefuse `decay * v + x`.",
    ]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n")
    print(md_path.read_text())
    print(f"wrote {md_path} and {csv_path}")
    return md_path, csv_path
