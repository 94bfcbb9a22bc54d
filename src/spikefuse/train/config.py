"""The run's settings (:class:`TrainConfig`), their validation, and the error type of every user-fixable problem."""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field, fields

import torch

__all__ = ["ConfigError", "TrainConfig", "check_resume", "check_batch_split"]

# Settings that define the run's trajectory: a resume with different values would not continue the same run.
TRAJECTORY_KEYS = (
    "model",
    "dataset",
    "T",
    "batch_size",
    "lr",
    "seed",
    "encoding",
    "stem",
    "neurons",
    "train_subset",
    "test_subset",
    "image_size",
    "width",
    "memory",
    "precision",
    "hidden",
    "layers",
    "cell",
    "cnf",
)


#: The bounds of the numeric settings, ``(least, most, what the most counts and why)``. Larger values only exhaust
#: the machine's memory or time (--T 10**9 ended in the allocator's traceback) or overflow torch's 64-bit seeds: the
#: command line refuses them as it parses, :meth:`TrainConfig.validate` in a config from Python or a checkpoint.
#: --lr has none (too large a rate diverges, which training reports at once), nor --train-subset and --test-subset
#: (a subset is at most the data set).
BOUNDS = {
    "T": (1, 10_000, "time steps (every layer keeps the activations of each step for backward)"),
    "epochs": (1, 100_000, "epochs (metrics.csv and the checkpoint's history are rewritten whole after each)"),
    "batch_size": (1, 65_536, "samples (a batch's activations at every step are held at once)"),
    "width": (1, 1024, "channels (a ResNet's weights grow with the square of its width)"),
    "hidden": (1, 16_384, "neurons (the recurrent weights grow with the square of their number)"),
    "layers": (1, 64, "layers (each keeps its activations at every step for backward)"),
    "image_size": (1, 1024, "pixels (the activations grow with its square)"),
    "seed": (-(2**63), 2**63 - 1, "(torch's generators take 64-bit seeds)"),
}
#: torch crashed at --threads 100000
MAX_THREADS_PER_CORE = 16


def bounds(name: str) -> tuple[int, int, str]:
    """``(least, most, what the most counts and why)`` of the numeric setting ``name``: :data:`BOUNDS`, and for
    ``threads`` and ``nproc`` (the processes of a data-parallel run) this machine's."""
    cores = os.cpu_count() or 1
    per_core = f"{MAX_THREADS_PER_CORE} per core of this machine's {cores}; more only contend for them"
    if name == "threads":
        return 1, MAX_THREADS_PER_CORE * cores, f"threads ({per_core})"
    if name == "nproc":  # each process runs a thread at least
        return 1, MAX_THREADS_PER_CORE * cores, f"processes ({per_core})"
    return BOUNDS[name]


def out_of_bounds(name: str, value: int) -> str | None:
    """What is wrong with ``value`` for the numeric setting ``name`` (``"must be ..."``); None within its bounds."""
    least, most, what = bounds(name)
    if value < least:
        return f"must be >= {least}, got {value}"
    if value > most:
        return f"must be at most {most} {what}, got {value}"
    return None


class ConfigError(ValueError):
    """A problem the user can fix: a bad setting, an output folder that holds another run or cannot be written, a
    missing, unreadable or mismatched checkpoint, a full disk, a diverged run. The CLI prints the message on one
    line and exits with code 2."""


#: --sparse: the ``sparse`` of the linear layers of the models that take it (``models.SPARSE_MODELS``)
SPARSE_CHOICES = {"false": False, "true": True, "auto": "auto"}

#: --precision: the dtype torch.autocast runs convolutions and linear layers in (None: float32 throughout); the
#: neurons' membranes stay float32 either way
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class TrainConfig:
    """Everything a training run needs. The defaults train ``resnet-tiny`` on the embedded digits in about a
    minute on 2 CPU threads."""

    model: str = "resnet-tiny"
    dataset: str = "digits"
    data_dir: str | None = None
    T: int = 4
    epochs: int = 6
    batch_size: int = 32
    lr: float = 1e-3
    device: str = "cpu"
    threads: int | None = 2
    seed: int = 0
    out: str = "runs/spikefuse"
    encoding: str = "direct"  # static data sets: "direct" (analog image every step) or "poisson"; smnist/psmnist too
    neuron_backend: str = "auto"
    neurons: str = "spikefuse"  # or "spikingjelly" (SpikingJelly 2.0 LIFNode in every neuron slot)
    stem: str = "auto"  # ResNets: "auto" = cifar stem for images up to 64 px, else imagenet
    train_subset: int | None = None  # use only this many training samples (a seeded random subset)
    test_subset: int | None = None
    image_size: int | None = None  # resize static images (data set's ``size=``); None = native
    width: int | None = None  # ResNets: channels of the first stage (None = the model's: 64, resnet-tiny 16)
    hidden: int = 256  # srnn: recurrent neurons per layer
    layers: int = 1  # srnn: recurrent layers
    cell: str = "lif"  # the neurons of every layer, "lif", "cubalif" or "alif" (models.CELLS)
    cnf: str = "ADD"  # SEW-ResNets: the connect function of residual and shortcut (models.sew_resnet)
    memory: str = "fused"  # "lean": BatchNorm fused with the neurons, recomputed in backward (models.MEMORY_FORMS)
    precision: str = "fp32"  # "bf16": forward and loss under torch.autocast in bfloat16 (PRECISIONS)
    sparse: str = "false"  # "true", "auto": sparse products in the linear layers of mlp and srnn (SPARSE_CHOICES)
    sparse_grad: float | None = None  # mlp: gradients only through neurons this near the threshold, read sparsely
    compile: bool = False  # torch.compile the model
    cache_frames: bool = True  # event and sequence samples kept in memory after their first framing (data.cache)
    progress: bool = True
    neuron: dict | None = field(default=None)  # NeuronFactory.to_dict(); None = the model's paper defaults

    def validate(self) -> None:
        """Check every setting for a run on this machine: :meth:`check_settings`, then the thread count, the device
        and the neuron backend. Raises :class:`ConfigError` saying which setting is wrong and why."""
        self.check_settings()
        problem = None if self.threads is None else out_of_bounds("threads", self.threads)
        if problem:
            raise ConfigError(f"--threads {problem}")
        from ..ops import resolve_backend

        try:
            device = torch.device(self.device)
        except RuntimeError as err:
            raise ConfigError(f"bad --device {self.device!r}: {err}") from None
        if self.sparse != "false" and device.type != "cpu":
            # there the spike layers could not check without a stall that the input layer's counts are not spikes
            raise ConfigError(f"--sparse runs CPU kernels; on --device {self.device} leave it out")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"--device {self.device} requested but CUDA is not available (this torch: {torch.__version__})"
            )
        if self.neurons == "spikefuse":
            try:
                resolve_backend(self.neuron_backend, device)
            except ValueError as err:
                raise ConfigError(
                    f"--neuron-backend {self.neuron_backend} cannot run on --device {self.device}: {err}"
                ) from None

    def check_settings(self) -> None:
        """The checks that hold on any machine (a checkpoint's config, perhaps from another machine, gets these):
        bounds, choices, and the settings that exclude one another."""
        for name in ("T", "epochs", "batch_size", "seed", "image_size", "width", "hidden", "layers"):
            value = getattr(self, name)
            problem = None if value is None else out_of_bounds(name, value)
            if problem:
                raise ConfigError(f"--{name.replace('_', '-')} {problem}")
        if not isinstance(self.cache_frames, bool):
            raise ConfigError(
                f"cache_frames must be True (--cache-frames) or False (--no-cache-frames), got {self.cache_frames!r}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if self.encoding not in ("direct", "poisson"):
            raise ConfigError(f"--encoding must be 'direct' or 'poisson', got {self.encoding!r}")
        if self.neurons not in ("spikefuse", "spikingjelly"):
            raise ConfigError(f"--neurons must be 'spikefuse' or 'spikingjelly', got {self.neurons!r}")
        if self.stem not in ("auto", "cifar", "imagenet"):
            raise ConfigError(f"--stem must be auto, cifar or imagenet, got {self.stem!r}")
        if self.width is not None and not self.model.startswith(("resnet", "sew_resnet")):
            raise ConfigError(
                f"--width sets the channels of a ResNet's first stage; got {self.width} for --model {self.model}"
            )
        from ..data import DATASETS
        from ..models import CELLS, MEMORY_FORMS, MODELS, RECURRENT_MODELS, SPARSE_MODELS
        from ..models.sew_resnet import CONNECT_FUNCTIONS
        from ..ops import BACKENDS

        if self.model not in RECURRENT_MODELS and self.layers != 1:
            raise ConfigError(f"--layers sets a recurrent network (--model srnn), not --model {self.model}")
        if self.model not in (*RECURRENT_MODELS, "mlp") and self.hidden != 256:
            raise ConfigError(f"--hidden sets the neurons of a layer of --model srnn or mlp, not --model {self.model}")
        if self.sparse not in SPARSE_CHOICES:
            raise ConfigError(f"--sparse must be one of {', '.join(SPARSE_CHOICES)}, got {self.sparse!r}")
        if self.sparse != "false" and self.model not in SPARSE_MODELS:
            raise ConfigError(
                f"--sparse sets the linear layers of --model {' or '.join(SPARSE_MODELS)}, not --model {self.model}"
            )
        if self.sparse_grad is not None:
            if self.model != "mlp":
                raise ConfigError(f"--sparse-grad sets the neurons and layers of --model mlp, not --model {self.model}")
            if not 0 < self.sparse_grad < math.inf:
                raise ConfigError(f"--sparse-grad must be a positive width, got {self.sparse_grad!r}")
        if self.sparse == "true" and (self.precision != "fp32" or self.compile):
            raise ConfigError(
                "--sparse true runs float32 CPU kernels, which neither autocast (--precision bf16) nor torch.compile "
                "(--compile) runs: use --sparse auto (the dense products there) or leave it out"
            )
        if self.cnf not in CONNECT_FUNCTIONS:
            raise ConfigError(f"--cnf must be one of {', '.join(CONNECT_FUNCTIONS)}, got {self.cnf!r}")
        if self.cnf != "ADD" and not self.model.startswith("sew_resnet"):
            raise ConfigError(
                f"--cnf sets a SEW-ResNet's connect function (--model sew_resnet*), not --model {self.model}"
            )
        if self.cell not in CELLS:
            raise ConfigError(f"--cell must be one of {', '.join(CELLS)}, got {self.cell!r}")
        if self.cell != "lif" and self.neurons != "spikefuse":
            raise ConfigError(
                f"--cell {self.cell} builds spikefuse's {self.cell} neurons; --neurons spikingjelly puts SpikingJelly's "
                "LIF in every neuron slot: use --cell lif with it"
            )
        if self.cell != "lif" and self.neuron is not None:
            raise ConfigError(
                f"the config's neuron and --cell {self.cell} both say what the neurons are: leave one of them out"
            )
        for name in ("train_subset", "test_subset"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.memory not in MEMORY_FORMS:
            raise ConfigError(f"--memory must be one of {', '.join(MEMORY_FORMS)}, got {self.memory!r}")
        if self.memory == "lean" and self.neurons != "spikefuse":
            raise ConfigError(
                "--memory lean fuses BatchNorm with spikefuse's neurons; --neurons spikingjelly keeps "
                "SpikingJelly's: use --memory fused with it"
            )
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown data set {self.dataset!r}: use one of {', '.join(DATASETS)}")
        if self.neuron_backend not in BACKENDS:
            raise ConfigError(f"unknown neuron backend {self.neuron_backend!r}: use one of {', '.join(BACKENDS)}")
        if self.neuron is not None:
            _check_neuron_options(self.neuron)

    def check_data_kind(self, kind: str) -> None:
        """Settings that depend on the data set: Poisson coding applies to images and to sequences of intensities
        (each step's values drawn as spikes), not to event frames or SHD/SSC's spike counts; sequences need a
        recurrent network, which takes any data set."""
        from ..data.sequences import INTENSITIES
        from ..models import RECURRENT_MODELS

        if self.encoding != "direct" and not (kind == "static" or kind == "sequence" and self.dataset in INTENSITIES):
            what = "event data (already spikes per frame)" if kind == "event" else "a sequence of spike counts already"
            raise ConfigError(
                f"--encoding {self.encoding} encodes static images; {self.dataset} is {what}: leave --encoding out "
                f"(it draws the intensities of the sequences {' and '.join(INTENSITIES)} as spikes too)"
            )
        if kind == "sequence" and self.model not in RECURRENT_MODELS:
            raise ConfigError(
                f"{self.dataset} is a sequence [T, features]: train it with a recurrent network "
                f"(--model {' or '.join(RECURRENT_MODELS)}), not --model {self.model}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _check_neuron_options(options: dict) -> None:
    """``options`` (``NeuronFactory.to_dict()``, or a LIF's arguments as configs before it wrote) make a neuron;
    :meth:`~spikefuse.nn.NeuronFactory.from_dict` builds only the neuron modules and surrogates it knows by name."""
    from ..models import NeuronFactory

    try:
        NeuronFactory.from_dict(options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"bad neuron options: {err}") from None


def saved_config_problem(saved: dict) -> str | None:
    """What is wrong with a checkpoint's config (:func:`dataclasses.asdict` of a :class:`TrainConfig`), or None:
    settings this version lacks (a newer one wrote it), values of another type than the setting's, or values
    :meth:`TrainConfig.check_settings` refuses. Settings the config lacks (an older version wrote it) are their
    defaults."""
    types = typing.get_type_hints(TrainConfig)
    unknown = [name for name in saved if name not in types]
    if unknown:
        return f"its config holds settings this spikefuse does not know: {', '.join(map(repr, unknown))}"
    for name, value in saved.items():
        allowed = typing.get_args(types[name]) or (types[name],)
        if not any(_is_a(value, kind) for kind in allowed):
            kinds = " or ".join("None" if kind is type(None) else a_or_an(kind.__name__) for kind in allowed)
            return f"its config's {name} must be {kinds}, got {value!r}"
    try:
        TrainConfig(**saved).check_settings()
    except ConfigError as err:
        return f"its config cannot run: {err}"
    return None


def _is_a(value, kind: type) -> bool:
    if isinstance(value, bool):  # a bool is an int to isinstance; never a number setting here
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def a_or_an(noun: str) -> str:
    """``noun`` with its indefinite article, for messages that name a type."""
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def check_resume(saved: dict, cfg: TrainConfig) -> None:
    """Refuse to resume a run whose trajectory settings differ from the checkpoint's. A setting a checkpoint
    predates (written before the setting existed) counts as its default, the value that run had."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    diffs = [
        f"{k}: checkpoint {saved.get(k, defaults[k])!r}, now {getattr(cfg, k)!r}"
        for k in TRAJECTORY_KEYS
        if saved.get(k, defaults[k]) != getattr(cfg, k)
    ]
    if saved.get("neuron") != cfg.neuron:
        diffs.append("neuron options differ")
    if diffs:
        raise ConfigError("cannot resume: the run's settings differ from the checkpoint's (" + "; ".join(diffs) + ")")


def check_batch_split(batch_size: int, world: int) -> None:
    if batch_size % world:
        raise ConfigError(
            f"--batch-size {batch_size} (the global batch) must be divisible by the number of processes ({world})"
        )
