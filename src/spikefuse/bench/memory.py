"""``spikefuse bench memory``: memory of one BPTT training step, vanilla PyTorch vs SpikingJelly vs spikefuse.

The memory-lean BPTT paper's CIFAR-10 "medium" network (Liang et al., Table I: 128C-128C-128C-256C-256C-512C-512C-
1024FC-512FC-10FC, :mod:`spikefuse.models.liang`), a Spiking-ResNet18 and a SEW-ResNet18 (connect function ADD)
(``--stem cifar``, the default, or SpikingJelly's ``imagenet`` stem), each in five forms built from the same weights:

- ``vanilla``: ``nn.BatchNorm`` + the serial PyTorch LIF loop (spikefuse's reference backend, differentiated by
  autograd), ``nn.Conv2d``/``nn.Linear`` -- what a plain PyTorch implementation does;
- ``spikingjelly``: SpikingJelly 2.0's multi-step ``LIFNode`` in every neuron slot, ``nn.BatchNorm`` (when
  installed);
- ``fused``: spikefuse's default, ``nn.BatchNorm`` + fused LIF kernels saving the membrane potentials;
- ``lean``: the library's :func:`spikefuse.nn.to_lean` -- BN fused with LIF (saves only the conv output and
  per-channel statistics; Liang et al. Alg. 1-4) wherever a BN feeds a LIF, BN + residual add + LIF in one op for
  the last neuron of every ResNet block, :class:`~spikefuse.nn.SpikeConv2d`/``SpikeLinear`` (spike inputs saved as
  bits) for every conv/linear layer whose input is spikes, average pooling that saves nothing;
- ``floor``: the convolution floor -- every neuron replaced by ``nn.ReLU`` and every BatchNorm removed, the
  conv/linear layers alone (not a spiking network: its loss and gradients are not compared).

Measured per model and form, on one training step (forward, cross-entropy of the time-averaged output, backward,
and an Adam update unless ``--no-optimizer``):

- bytes saved for backward: the unique storages (``untyped_storage().data_ptr()``) packed by
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward, parameters excluded, split into the
  Conv/FC-BN-LIF stack (every conv, BN and neuron module) and the rest (pooling, readout, loss);
- step peak memory: the process's resident-set high-water mark during the step above the resident set before it
  (``/proc/self/status`` ``VmHWM`` after resetting it through ``/proc/self/clear_refs``), with glibc's mmap
  threshold fixed at 64 KiB (``mallopt``) so that every tensor buffer is mapped and unmapped on its own and the
  RSS follows the bytes live on the heap (a tracemalloc for torch's CPU allocator); in the default subprocess mode
  also the process's resident-set high-water mark (``VmHWM``); spikefuse's CPU buffer cache is off for this step (:mod:`spikefuse.ops.buffers`);
- the time of a step, measured side by side: one more process builds every form of the model and times their steps
  in alternation (each cycle one step of each form, the order rotating from cycle to cycle), so that a drift of the
  shared machine, which moved separate processes' step times by 10-30% within minutes, hits every form of a cycle
  alike; the step time is the median over the cycles, and each ratio ("vs fused", "vs floor") the median of the
  cycles' ratios, with their quartiles beside it (how far a single cycle's ratio strays on this machine), and
  every cycle's step times are written out too (``bench-memory*-cycles.csv``);
- loss and gradients against ``vanilla`` (same weights, same input): max relative difference (max abs difference
  over max abs value, per parameter, worst parameter reported).

On a GPU (``--device cuda``) the model, input and optimizer live on the GPU, the fused and lean forms run their
Triton kernels, the step peak is ``torch.cuda.max_memory_allocated`` during the step above what was allocated before
it, and every timed step ends with a synchronization.

Each form runs in its own fresh subprocess (``--in-process`` runs them in this process, e.g. for ``--quick``).
Writes ``benchmarks/results/bench-memory[-cuda][-quick].md`` and ``.csv`` with the machine info and the exact
command, and ``...-cycles.csv`` with each timed step (model, round, cycle, form, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .common import RESULTS, command_line, gpu_machine_info, machine_info, markdown_table, write_csv

MODELS = ("liang-medium", "resnet18", "sew_resnet18")
RESNETS = ("resnet18", "sew_resnet18")  # built with --stem and --resnet-width
FORMS = {
    "vanilla": "vanilla PyTorch (nn.BatchNorm + serial LIF loop)",
    "spikingjelly": "SpikingJelly 2.0 LIFNode + nn.BatchNorm",
    "fused": "spikefuse default (nn.BatchNorm + fused LIF, saves h)",
    "lean": "spikefuse lean (spikefuse.nn.to_lean: BN+LIF and BN+add+LIF fused with recompute, spike inputs as bits)",
    "floor": "convolution floor (every LIF -> ReLU, no BatchNorm)",
}
NOT_COMPARED = ("floor",)  # another network: no loss or gradient comparison
QUICK = {"T": 2, "batch_size": 2, "image_size": 8, "repeats": 1, "resnet_width": 8}
COLUMNS = [
    "model",
    "form",
    "T",
    "batch_size",
    "image_size",
    "saved_total_MiB",
    "saved_stack_MiB",
    "saved_other_MiB",
    "stack_vs_vanilla",
    "step_peak_MiB",
    "peak_vs_vanilla",
    "maxrss_MiB",
    "step_s",
    "step_vs_fused",
    "step_vs_fused_q1",
    "step_vs_fused_q3",
    "step_vs_floor",
    "step_vs_floor_q1",
    "step_vs_floor_q3",
    "loss",
    "loss_rel_diff",
    "grad_max_rel_diff",
    "worst_param",
]
CYCLE_COLUMNS = ["model", "round", "cycle", "form", "step_s"]


def ratio_quartiles(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of the paired ratios ``times[i] / base[i]`` (one cycle's steps each); q1 = q3 = the
    median with a single cycle."""
    ratios = [a / b for a, b in zip(times, base)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, median, q3


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "memory",
        help="saved-for-backward bytes, peak memory and step time: vanilla PyTorch vs SpikingJelly vs spikefuse lean",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="(default: all)")
    p.add_argument(
        "--forms",
        nargs="+",
        choices=list(FORMS),
        default=list(FORMS),
        help="implementations (default: all; spikingjelly is skipped when not installed)",
    )
    p.add_argument("-T", type=int, default=10, help="time steps (default: %(default)s, as the paper)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="batch size (default: %(default)s; the paper's 64 needs ~4x the memory and time)",
    )
    p.add_argument("--image-size", type=int, default=32, help="input height = width (default: 32, CIFAR-10)")
    p.add_argument("--resnet-width", type=int, default=64, help="ResNet18 first-stage width (default: 64)")
    p.add_argument(
        "--stem",
        choices=["cifar", "imagenet"],
        default="cifar",
        help="ResNet18 stem: cifar (3x3/1 conv, full resolution) or imagenet (SpikingJelly's 7x7/2 conv "
        "+ max-pool) (default: %(default)s)",
    )
    p.add_argument(
        "--no-optimizer",
        dest="optimizer",
        action="store_false",
        help="time forward+backward only (default: an Adam update is part of every step)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed cycles per timing process, one step of every form each (default: %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timing processes, each building every form anew; step times and ratios are medians over "
        "the cycles of all of them (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch/numba threads (default: all cores)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model trains (default: %(default)s; cuda: peak memory from torch's CUDA allocator)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: every form's forward and loss under torch.autocast in bfloat16 (default: %(default)s)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time every form's step replayed from a CUDA graph (captured after the warm-up; Adam capturable): the "
        "GPU's work without the host's launch costs; a form that cannot be captured is reported so",
    )
    p.add_argument("--seed", type=int, default=0, help="of the weights and inputs (default: %(default)s)")
    p.add_argument(
        "--in-process", action="store_true", help="run every form in this process (no maxrss column; faster start-up)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"check the harness: T={QUICK['T']}, batch {QUICK['batch_size']}, "
        f"{QUICK['image_size']}x{QUICK['image_size']} images, ResNet width {QUICK['resnet_width']}",
    )
    p.add_argument("--results-dir", default=str(RESULTS), help="where the .md/.csv go (default: %(default)s)")
    return p


# ---------------------------------------------------------------------------------------------------- models
def _build(cfg: dict):
    """The model of ``cfg`` in its ``vanilla`` form, with weights drawn from ``cfg['seed']``."""
    import torch

    from ..models import build_model

    torch.manual_seed(cfg["seed"])
    if cfg["model"] in RESNETS:
        return build_model(cfg["model"], 3, 10, neuron_backend="reference", stem=cfg["stem"], width=cfg["resnet_width"])
    return build_model(cfg["model"], 3, 10, neuron_backend="reference", image_size=cfg["image_size"])


def to_floor(model) -> None:
    """The convolution floor in place: every spikefuse neuron becomes ``nn.ReLU`` and every BatchNorm
    ``nn.Identity``, leaving the conv/linear layers (and pooling) -- the cost no neuron library can remove."""
    from torch import nn

    from ..nn import LIF, SeqToBatch

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LIF):
                setattr(parent, name, nn.ReLU())
            elif isinstance(child, SeqToBatch) and isinstance(child.module, nn.modules.batchnorm._BatchNorm):
                setattr(parent, name, nn.Identity())


def make_form(cfg: dict):
    """``(model, reset)`` for ``cfg['form']``; ``reset(model)`` clears neuron state between steps."""
    from ..compat.spikingjelly import use_spikingjelly_neurons
    from ..models import set_neuron_backend
    from ..batchnorm.lean import to_lean
    from ..train import reset_states

    model = _build(cfg)
    form = cfg["form"]
    if form in ("fused", "lean"):
        set_neuron_backend(model, "auto")
    if form == "spikingjelly":
        use_spikingjelly_neurons(model)
    elif form == "lean":
        to_lean(model)
    elif form == "floor":
        to_floor(model)
    return model, reset_states


def _param_name(name: str) -> str:
    """A parameter's name without the ``.module`` of ``SeqToBatch`` wrappers (shorter in the report)."""
    return ".".join(part for part in name.split(".") if part != "module")


# ----------------------------------------------------------------------------------------------- measurement
def _set_malloc_thresholds(mmap_bytes: int) -> None:
    """Fix glibc's mmap threshold (and the trim threshold at twice it): buffers above it are mapped on allocation
    and unmapped when freed."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, mmap_bytes)  # M_MMAP_THRESHOLD (also turns off its dynamic adjustment)
        libc.mallopt(-1, 2 * mmap_bytes)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


# The peak step: every tensor buffer goes back to the OS when freed, so the RSS follows the live tensors.
PEAK_MMAP_THRESHOLD = 64 * 1024
# The timed steps: where glibc's dynamic threshold ends in a training run (its maximum, 32 MiB on 64-bit): the
# heap keeps freed buffers for the next step instead of faulting fresh pages in for every tensor.
TIMING_MMAP_THRESHOLD = 32 * 2**20


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _group(module) -> str | None:
    """``"stack"`` for conv/linear/BN/neuron modules, ``"other"`` for the rest; None for containers."""
    from torch import nn

    from ..nn import LIF, SeqToBatch
    from ..batchnorm.modules import ConvBatchNormLIF, BatchNormLIFBase

    if isinstance(module, SeqToBatch):
        module = module.module
    if isinstance(module, (nn.Conv2d, nn.modules.batchnorm._BatchNorm, LIF, BatchNormLIFBase, ConvBatchNormLIF)):
        return "stack"
    if isinstance(module, nn.Linear):
        return "linear"  # the readout is "other"; decided by the caller
    if type(module).__module__.startswith("spikingjelly"):
        return "stack"
    if len(list(module.children())) == 0:
        return "other"
    return None


def step_input(cfg: dict):
    """``(x [T, B, 3, H, W], labels [B])`` of a training step of ``cfg`` on the CPU, drawn from ``cfg['seed']``: one
    random image per sample, the same at every step (direct encoding)."""
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    image = torch.rand(cfg["batch_size"], 3, cfg["image_size"], cfg["image_size"], generator=g)
    labels = torch.randint(0, 10, (cfg["batch_size"],), generator=g)
    return image.unsqueeze(0).repeat(cfg["T"], 1, 1, 1, 1), labels


def _readout(model):
    """The model's last linear layer, whose saved input counts as "other"."""
    for name in ("fc", "head"):
        if hasattr(model, name):
            return getattr(model, name)
    return model.classifier[-1]


def _training(cfg: dict, make: Callable = make_form):
    """``(model, step, update)`` for ``cfg``'s model and form, built by ``make(cfg) -> (model, reset)``:
    ``step(hooks)`` runs the forward (with ``hooks``: recording the storages saved for backward by group) and
    backward and returns ``(loss, saved)``; ``update()`` the optimizer's."""
    import torch
    import torch.nn.functional as F

    device = torch.device(cfg.get("device", "cpu"))
    model, reset = make(cfg)
    model.to(device).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    readout = _readout(model)
    x, labels = step_input(cfg)
    x, labels = x.to(device), labels.to(device)
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-4, capturable=cfg.get("cuda_graph", False))
        if cfg.get("optimizer", True)
        else None
    )
    from ..train.config import PRECISIONS

    autocast = PRECISIONS[cfg.get("precision", "fp32")]

    def forward():
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            out = model(x)
            # [T, B, classes], or [B, classes] from a model that averages over T before its head (SpikingJelly's zoo)
            return F.cross_entropy((out.mean(0) if out.dim() == 3 else out).float(), labels)

    def update():
        if optimizer is not None:
            optimizer.step()

    def step(hooks: bool = False):
        reset(model)
        for p in model.parameters():
            p.grad = None
        saved: dict[int, tuple[int, str]] = {}
        ctx_stack: list[str] = []
        handles = []
        if hooks:

            def pre(mod, _inp, group):
                ctx_stack.append(group)

            def post(mod, _inp, _out):
                ctx_stack.pop()

            for mod in model.modules():
                grp = _group(mod)
                if grp is None:
                    continue
                if grp == "linear":
                    grp = "other" if mod is readout or mod is getattr(readout, "module", None) else "stack"
                handles.append(mod.register_forward_pre_hook(lambda m, i, grp=grp: pre(m, i, grp)))
                handles.append(mod.register_forward_hook(post))

            def pack(t):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in params and ptr not in saved and storage.nbytes():
                    saved[ptr] = (storage.nbytes(), ctx_stack[-1] if ctx_stack else "other")
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = forward()
            for h in handles:
                h.remove()
        else:
            loss = forward()
        loss.backward()
        return loss, saved

    return model, step, update


def run_form(cfg: dict, make: Callable = make_form) -> dict:
    """Measure one model in one form's memory, loss and gradients (in this process), built by ``make`` (see
    :func:`_training`); returns a JSON-able result plus ``grads``."""
    import gc

    import spikefuse

    from ..threads import set_threads

    _set_malloc_thresholds(PEAK_MMAP_THRESHOLD)
    if cfg.get("threads"):
        set_threads(cfg["threads"])
    model, step, update = _training(cfg, make)
    # 1: saved bytes, loss and gradients (also the warm-up: numba/Triton compilation)
    loss, saved = step(hooks=True)
    result = {
        **{k: cfg[k] for k in ("model", "form", "T", "batch_size", "image_size")},
        "saved_stack": sum(b for b, grp in saved.values() if grp == "stack"),
        "saved_other": sum(b for b, grp in saved.values() if grp != "stack"),
        "loss": float(loss.detach()),
    }
    # in registration order, which every form keeps (names change: see spikefuse.batchnorm.lean)
    grads = [
        (_param_name(n), None if p.grad is None else p.grad.detach().to("cpu", copy=True))
        for n, p in model.named_parameters()
    ]
    update()  # creates the optimizer state, which the peak below then counts as already there
    del loss, saved
    if cfg.get("device", "cpu") == "cuda":
        result["step_peak"] = _cuda_step_peak(model, step, update)
        return result, grads
    # 2: peak memory of one step above the memory before it, without the CPU buffer cache (its idle buffers would
    # count in "before" and then be reused, hiding what the step's tensors need)
    for p in model.parameters():
        p.grad = None
    cache_limit = spikefuse.cpu_cache_limit()
    spikefuse.set_cpu_cache_limit(0)
    gc.collect()
    before = _status_kib("VmRSS")
    if before is not None and _reset_peak():
        step()
        update()
        result["step_peak"] = (_status_kib("VmHWM") - before) * 1024
    spikefuse.set_cpu_cache_limit(cache_limit)
    return result, grads


def _cuda_step_peak(model, step, update) -> int:
    """Bytes that torch's CUDA allocator held at most during one training step beyond what it held before."""
    import torch

    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    update()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def side_by_side(
    cfg: dict,
    forms: list[str],
    cycles: int,
    sample: Callable[[Callable[[], None]], object],
    make: Callable = make_form,
) -> dict:
    """``sample(train_step)`` of every form of ``cfg``'s model, ``cycles`` times, in this process, the forms
    alternating: cycle ``i`` samples each form once, starting at form ``i mod len(forms)``, after one untimed step of
    each, with the training run's allocator settings; ``train_step()`` runs one step (forward, backward, the
    optimizer's update; on a GPU ending with a synchronization, so that its time is the GPU's work, not the
    launches'). Returns each form's samples, entry ``i`` of every list from cycle ``i``."""
    import torch

    from ..threads import set_threads

    _set_malloc_thresholds(TIMING_MMAP_THRESHOLD)
    if cfg.get("threads"):
        set_threads(cfg["threads"])
    runs = {form: _training({**cfg, "form": form}, make) for form in forms}
    synchronize = torch.cuda.synchronize if cfg.get("device", "cpu") == "cuda" else lambda: None

    def eager_step(form):
        _, step, update = runs[form]
        step()
        update()

    for form in forms:
        eager_step(form)
        synchronize()
    steps = {form: lambda form=form: eager_step(form) for form in forms}
    if cfg.get("cuda_graph"):
        # the peers' and the serial reference's steps last (the reference reads a value to refuse NaN: a host sync):
        # a capture that fails can leave the process unable to capture another
        for form in sorted(forms, key=lambda f: f in ("vanilla", "spikingjelly")):
            try:
                steps[form] = _captured(steps[form])
            except Exception as err:  # reported in the results, its step not timed
                steps[form] = None
                cfg.setdefault("notes", []).append(
                    f"{form}: its step could not be captured in a CUDA graph ({type(err).__name__}: "
                    f"{str(err).splitlines()[0]}): not timed"
                )

    def train_step(form):
        steps[form]()
        synchronize()

    samples = {form: [] for form in forms}
    for cycle in range(cycles):
        for k in range(len(forms)):
            form = forms[(cycle + k) % len(forms)]
            samples[form].append(float("nan") if steps[form] is None else sample(lambda: train_step(form)))
    return samples


def _captured(train_step: Callable[[], None]) -> Callable[[], None]:
    """``train_step`` captured in a CUDA graph (after two steps on a side stream, as torch's docs warm up): the
    graph's replay; a step that cannot be captured (a host sync, a host-side allocation) raises with the reason."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    return graph.replay


def time_side_by_side(cfg: dict, forms: list[str], make: Callable = make_form) -> dict[str, list[float]]:
    """Seconds of ``cfg['repeats']`` training steps of each form of ``cfg``'s model (built by ``make``), timed
    :func:`side_by_side`."""
    import time

    def timed_step(train_step) -> float:
        start = time.perf_counter()
        train_step()
        return time.perf_counter() - start

    return side_by_side(cfg, forms, cfg["repeats"], timed_step, make)


def _worker(cfg_json: str, out_path: str) -> None:
    import torch

    from ..train.reports import peak_rss_mb

    cfg = json.loads(cfg_json)
    result, grads = run_form(cfg)
    if cfg.get("device", "cpu") == "cpu":
        result["maxrss"] = peak_rss_mb() * 2**20
    torch.save({"result": result, "grads": grads}, out_path)


def _timing_worker(cfg_json: str, forms_json: str, out_path: str) -> None:
    Path(out_path).write_text(json.dumps(time_side_by_side(json.loads(cfg_json), json.loads(forms_json))))


def _subprocess(what: str, code: str, *argv: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench memory: {what} failed:\n{proc.stderr[-3000:]}")


def _run_isolated(cfg: dict, tmp: Path) -> tuple[dict, dict]:
    import torch

    out = tmp / f"{cfg['model']}-{cfg['form']}.pt"
    code = "import sys; from spikefuse.bench.memory import _worker; _worker(sys.argv[1], sys.argv[2])"
    _subprocess(f"{cfg['model']}/{cfg['form']}", code, json.dumps(cfg), str(out))
    data = torch.load(out)
    return data["result"], data["grads"]


def _time_isolated(cfg: dict, forms: list[str], tmp: Path) -> dict[str, list[float]]:
    out = tmp / f"{cfg['model']}-times.json"
    code = (
        "import sys; from spikefuse.bench.memory import _timing_worker; "
        "_timing_worker(sys.argv[1], sys.argv[2], sys.argv[3])"
    )
    _subprocess(f"{cfg['model']} timing", code, json.dumps(cfg), json.dumps(forms), str(out))
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------------ report
def _max_rel(grads: list, ref: list) -> tuple[float, str]:
    """The largest relative difference of ``grads`` from ``ref`` (both ``[(name, grad)]`` in registration order)
    and the reference name where it is; inf where the parameters do not line up."""
    if len(grads) != len(ref):
        return float("inf"), f"{len(grads)} parameters, the reference has {len(ref)}"
    worst, name = 0.0, ""
    for (_, g), (key, r) in zip(grads, ref):
        if g is None or r is None:
            if g is not r:
                return float("inf"), key
            continue
        if g.shape != r.shape:
            return float("inf"), key
        scale = float(r.abs().max())
        rel = float((g - r).abs().max()) / scale if scale > 0 else float((g - r).abs().max())
        if rel > worst:
            worst, name = rel, key
    return worst, name


def _mib(b) -> str:
    return "" if b is None else f"{b / 2**20:.2f}"


def run(args) -> int:
    from ..threads import threads_while

    cfg0 = {
        "T": args.T,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "repeats": args.repeats,
        "resnet_width": args.resnet_width,
        "seed": args.seed,
        "threads": args.threads,
        "stem": args.stem,
        "optimizer": args.optimizer,
        "device": args.device,
        "precision": args.precision,
        "cuda_graph": args.cuda_graph,
    }
    if args.quick:
        cfg0.update(QUICK)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench memory --device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is False); "
            "run it on a GPU machine with a CUDA build of torch, or leave --device out for the CPU"
        )

    with threads_while(args.threads):  # --in-process from a caller (tests): its thread count is restored after
        return _run(args, cfg0)


def _run(args, cfg0: dict) -> int:
    import importlib.util

    forms = list(args.forms)
    notes = []
    if "spikingjelly" in forms and importlib.util.find_spec("spikingjelly") is None:
        forms.remove("spikingjelly")
        notes.append("SpikingJelly is not installed: its form is skipped (`pip install spikingjelly --no-deps`).")
    if "vanilla" not in forms:
        forms.insert(0, "vanilla")  # the reference of the comparisons
    if args.rounds < 1:
        raise SystemExit(f"bench memory: --rounds must be at least 1, got {args.rounds}")
    if args.cuda_graph and not (args.in_process and args.device == "cuda"):
        raise SystemExit(
            "bench memory: --cuda-graph captures steps on a GPU in this process: add --device cuda --in-process"
        )
    rows, cycle_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            results = {}
            for form in forms:
                cfg = {**cfg0, "model": model, "form": form}
                print(f"bench memory: {model} / {form}: memory ...", file=sys.stderr, flush=True)
                results[form] = run_form(cfg) if args.in_process else _run_isolated(cfg, Path(tmp))
            cycles = {form: [] for form in forms}  # every timing process's cycles, in order
            for round_ in range(args.rounds):
                print(
                    f"bench memory: {model}: step times, every form side by side (round {round_ + 1} of "
                    f"{args.rounds}) ...",
                    file=sys.stderr,
                    flush=True,
                )
                cfg = {**cfg0, "model": model}
                times = time_side_by_side(cfg, forms) if args.in_process else _time_isolated(cfg, forms, Path(tmp))
                notes += cfg.pop("notes", [])
                for form in forms:
                    cycles[form] += times[form]
                    cycle_rows += [
                        {"model": model, "round": round_ + 1, "cycle": i + 1, "form": form, "step_s": f"{t:.5f}"}
                        for i, t in enumerate(times[form])
                    ]

            def ratios(form: str, base: str) -> dict:
                """The ``step_vs_<base>`` columns: the median of the cycles' ratios and its quartiles."""
                if base not in cycles:
                    return {}
                q1, median, q3 = ratio_quartiles(cycles[form], cycles[base])
                key = f"step_vs_{base}"
                return {key: f"{median:.3f}", f"{key}_q1": f"{q1:.3f}", f"{key}_q3": f"{q3:.3f}"}

            ref, ref_grads = results["vanilla"]
            for form, (res, grads) in results.items():
                res["step_s"] = statistics.median(cycles[form])
                compared = form not in NOT_COMPARED
                rel, worst = _max_rel(grads, ref_grads) if compared else (None, "")
                saved = res["saved_stack"] + res["saved_other"]
                peak, ref_peak = res.get("step_peak"), ref.get("step_peak")
                rows.append(
                    {
                        "model": model,
                        "form": form,
                        "T": res["T"],
                        "batch_size": res["batch_size"],
                        "image_size": res["image_size"],
                        "saved_total_MiB": _mib(saved),
                        "saved_stack_MiB": _mib(res["saved_stack"]),
                        "saved_other_MiB": _mib(res["saved_other"]),
                        "stack_vs_vanilla": f"{res['saved_stack'] / ref['saved_stack']:.3f}",
                        "step_peak_MiB": _mib(peak),
                        "maxrss_MiB": _mib(res.get("maxrss")),
                        "peak_vs_vanilla": f"{peak / ref_peak:.3f}" if peak and ref_peak else "",
                        "step_s": f"{res['step_s']:.4f}",
                        **ratios(form, "fused"),
                        **ratios(form, "floor"),
                        "loss": f"{res['loss']:.6f}",
                        "loss_rel_diff": f"{abs(res['loss'] - ref['loss']) / max(abs(ref['loss']), 1e-30):.2e}"
                        if compared
                        else "",
                        "grad_max_rel_diff": f"{rel:.2e}" if compared else "",
                        "worst_param": worst,
                    }
                )
    write_report(rows, cycle_rows, cfg0, args, notes)
    return 0


def _cuda_machine_info() -> str:
    import torch

    return gpu_machine_info(f", TF32 convolutions {'on' if torch.backends.cudnn.allow_tf32 else 'off'}")


def _with_quartiles(row: dict, key: str) -> str:
    """A ratio cell of the table: the median and, in brackets, the quartiles of the cycles' ratios."""
    if not row.get(key):
        return "-"
    if row[f"{key}_q1"] == row[f"{key}_q3"]:
        return row[key]
    return f"{row[key]} ({row[f'{key}_q1']}-{row[f'{key}_q3']})"


def write_report(rows: list[dict], cycle_rows: list[dict], cfg: dict, args, notes: list[str]) -> tuple[Path, Path]:
    out = Path(args.results_dir)
    cuda = cfg["device"] == "cuda"
    stem = (
        "bench-memory"
        + ("-cuda" if cuda else "")
        + ("-bf16" if cfg["precision"] == "bf16" else "")
        + ("-graph" if cfg.get("cuda_graph") else "")
        + ("-quick" if args.quick else "")
    )
    csv_path, md_path, cycles_path = out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}-cycles.csv"
    write_csv(csv_path, [{c: row.get(c, "") for c in COLUMNS} for row in rows])
    write_csv(cycles_path, [{c: row[c] for c in CYCLE_COLUMNS} for row in cycle_rows])
    header = [
        "model",
        "form",
        "saved MiB (stack / other)",
        "stack vs vanilla",
        "step peak MiB",
        "peak vs vanilla",
        "maxrss MiB",
        "step s",
        "vs fused",
        "vs floor",
        "loss",
        "grad max rel diff",
    ]
    table = [
        [
            r["model"],
            r["form"],
            f"{r['saved_total_MiB']} ({r['saved_stack_MiB']} / {r['saved_other_MiB']})",
            r["stack_vs_vanilla"],
            r["step_peak_MiB"],
            r["peak_vs_vanilla"] or "-",
            r["maxrss_MiB"] or "-",
            r["step_s"],
            _with_quartiles(r, "step_vs_fused"),
            _with_quartiles(r, "step_vs_floor"),
            r["loss"],
            r["grad_max_rel_diff"] or "-",
        ]
        for r in rows
    ]
    lines = [
        "# bench memory" + (" (quick)" if args.quick else ""),
        "",
        f"Machine: {_cuda_machine_info() if cuda else machine_info()}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"T={cfg['T']}, batch {cfg['batch_size']}, {cfg['image_size']}x{cfg['image_size']}x3 inputs (one random image "
        f"per sample at every step), ResNet18 width {cfg['resnet_width']}, {cfg['stem']} stem; one step = forward, "
        f"cross-entropy of the time-averaged output, backward"
        f"{' (forward and loss under torch.autocast in bfloat16)' if cfg['precision'] == 'bf16' else ''}"
        f"{'; timed as replays of one CUDA graph per form' if cfg.get('cuda_graph') else ''}"
        f"{', Adam update' if cfg['optimizer'] else ' (no optimizer update)'}; "
        f"memory: {'all forms in this process' if args.in_process else 'each form in a fresh subprocess'}; time: "
        f"{args.rounds} {'round' if args.rounds == 1 else 'rounds'} of {cfg['repeats']} "
        f"{'cycle' if cfg['repeats'] == 1 else 'cycles'}"
        f"{'' if args.in_process else ', each round a fresh process building every form'}, a cycle one step of every "
        f"form in turn (the order rotating); step s the median over the cycles, vs fused / vs floor the median of "
        f"the cycles' ratios (in brackets their quartiles: half the cycles fall between; every step's time is in "
        f"`{cycles_path.name}`).",
        "",
        "Forms: " + "; ".join(f"`{k}` = {v}" for k, v in FORMS.items()) + ".",
        "",
        markdown_table(header, table),
        "",
        "- saved MiB: unique storages packed by `saved_tensors_hooks` in the forward, parameters excluded; `stack` = "
        "conv/linear/BN/neuron modules, `other` = pooling, readout and loss.",
        *(
            [
                "- step peak: `torch.cuda.max_memory_allocated()` during one step minus `memory_allocated()` before it "
                "(the optimizer state already there).",
                "- step s: median of the timed steps, after one untimed step of every form, each step ending with "
                "`torch.cuda.synchronize()`.",
                "- With TF32 convolutions (torch's default for cuDNN), gradients that differ in their last float32 bits "
                "(the fused neurons' backward rounds differently from autograd's) reach the next convolution's backward "
                "rounded to TF32's 10-bit mantissa: the forms' gradients then differ by up to ~1e-3, not ~1e-6.",
            ]
            if cuda
            else [
                "- step peak: RSS high-water mark during one step minus RSS before it (glibc mmap threshold fixed at "
                "64 KiB so freed tensors leave the RSS); maxrss: the subprocess's resident-set high-water mark, VmHWM "
                "(imports, weights and all).",
                "- step s: median of the timed steps, after one untimed step of every form, with glibc's mmap threshold "
                "at 32 MiB, where its dynamic threshold ends in a training run (at 64 KiB every tensor would fault its "
                "pages in anew).",
            ]
        ),
        "- grad max rel diff: max over parameters of max|g - g_vanilla| / max|g_vanilla|; loss and gradients from "
        "the same weights and input. SpikingJelly computes the same dynamics with another rounding order "
        "(`V - V/tau` instead of `decay*V`), so a spike can flip there.",
    ]
    lines += [f"- {n}" for n in notes]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n")
    print(md_path.read_text())
    print(f"wrote {md_path}, {csv_path} and {cycles_path}")
    return md_path, csv_path
