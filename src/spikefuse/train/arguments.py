"""The options of ``spikefuse train``, shared with ``spikefuse bench train`` (which builds its own command line of
them): here, in the library, so that neither imports the command-line module."""

from __future__ import annotations

import argparse

__all__ = ["add_train_arguments", "bounded_int", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def bounded_int(setting: str):
    """An argparse type: an integer within the bounds of ``setting`` (:func:`spikefuse.train.config.bounds`), so that
    a value that would only exhaust the machine is refused before anything starts."""

    def parse(text: str) -> int:
        from .config import out_of_bounds

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        problem = out_of_bounds(setting, value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def add_train_arguments(p: argparse.ArgumentParser, defaults=None) -> None:
    """The options shared by ``spikefuse train`` and ``spikefuse bench train`` (defaults from ``TrainConfig``)."""
    from ..data import DATASETS
    from ..models import CELLS, MODELS

    from .config import SPARSE_CHOICES

    d = defaults or {}
    p.add_argument(
        "--model", default=d.get("model", "resnet-tiny"), choices=list(MODELS), help="network (default: %(default)s)"
    )
    p.add_argument(
        "--dataset",
        default=d.get("dataset", "digits"),
        choices=DATASETS,
        help="data set; digits and digits-events are embedded, the others read --data-dir (default: %(default)s)",
    )
    p.add_argument("--data-dir", default=None, help="folder holding the data set files (default: $SPIKEFUSE_DATA)")
    p.add_argument("--T", type=bounded_int("T"), default=d.get("T", 4), help="time steps (default: %(default)s)")
    p.add_argument(
        "--epochs",
        type=bounded_int("epochs"),
        default=d.get("epochs", 6),
        help="epochs in total (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size", type=bounded_int("batch_size"), default=d.get("batch_size", 32), help="(default: %(default)s)"
    )
    p.add_argument(
        "--lr", type=positive_float, default=d.get("lr", 1e-3), help="Adam learning rate (default: %(default)s)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--threads", type=bounded_int("threads"), default=2, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--seed", type=bounded_int("seed"), default=0, help="(default: %(default)s)")
    p.add_argument(
        "--encoding",
        choices=("direct", "poisson"),
        default=d.get("encoding", "direct"),
        help="input coding of static images and of smnist/psmnist's pixels: the analog values every step, or "
        "Bernoulli rate coding, each value a spike with its intensity as probability at every step (default: %(default)s)",
    )
    p.add_argument(
        "--neuron-backend",
        choices=("auto", "cpu", "triton", "reference"),
        default="auto",
        help="spikefuse neuron backend; 'reference' is the serial PyTorch loop (default: %(default)s)",
    )
    p.add_argument(
        "--stem",
        choices=("auto", "cifar", "imagenet"),
        default="auto",
        help="ResNet stem; auto: cifar (3x3 conv, no max-pool) for images up to 64 px (default: %(default)s)",
    )
    p.add_argument(
        "--width",
        type=bounded_int("width"),
        default=d.get("width"),
        help="ResNets: channels of the first stage (default: the model's, 64; resnet-tiny 16)",
    )
    p.add_argument(
        "--hidden",
        type=bounded_int("hidden"),
        default=d.get("hidden", 256),
        help="srnn: recurrent neurons per layer; mlp: neurons per hidden layer (default: %(default)s)",
    )
    p.add_argument(
        "--layers",
        type=bounded_int("layers"),
        default=d.get("layers", 1),
        help="srnn: recurrent layers (default: %(default)s)",
    )
    p.add_argument(
        "--cell",
        choices=list(CELLS),
        default=d.get("cell", "lif"),
        help="the neurons of every layer: lif (the model's LIF), cubalif (current-based LIF: synaptic and membrane "
        "decay 0.5, threshold 1), alif (adaptive threshold: decay 0.5, baseline 1 raised 0.2 "
        "per spike, the raise decaying by 0.9 a step), each with the paper's Sigmoid(4) surrogate; srnn's recurrent layers: cubalif "
        "decays 0.8 and 0.9, alif Bellec et al.'s (decay 0.95, 0.99, baseline 0.5, raise 0.2) (default: %(default)s)",
    )
    p.add_argument(
        "--cnf",
        choices=("ADD", "AND", "IAND"),
        default=d.get("cnf", "ADD"),
        help="SEW-ResNets: how a block joins its residual spikes and its shortcut (default: %(default)s)",
    )
    p.add_argument(
        "--memory",
        choices=("fused", "lean"),
        default="fused",
        help="fused: nn.BatchNorm + fused neurons that keep their potentials for backward; lean: BatchNorm "
        "fused with the neurons and recomputed in backward, spike inputs of conv/linear saved as bits "
        "(about a third of the memory saved for backward; same results) (default: %(default)s)",
    )
    p.add_argument(
        "--sparse",
        choices=list(SPARSE_CHOICES),
        default=d.get("sparse", "false"),
        help="mlp, srnn: linear layers whose products read only the nonzero inputs (spikes; the input layer's "
        "event counts by their values), on the CPU: true, auto (per call, by the measured share of nonzero "
        "inputs: the dense product above it), false: torch's nn.Linear (default: %(default)s)",
    )
    p.add_argument(
        "--sparse-grad",
        type=positive_float,
        default=d.get("sparse_grad"),
        metavar="WIDTH",
        help="mlp: gradients only through the neurons within WIDTH of the threshold (the LIF's surrogate zero "
        "outside), the layers before the neurons reading only the nonzero gradients, on the CPU (default: off)",
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: convolutions and linear layers under torch.autocast in bfloat16 (the neurons read and write "
        "bfloat16, their membranes stay float32) (default: %(default)s)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (the fused neurons are custom ops it traces through; the first batches "
        "compile for a minute or more)",
    )
    p.add_argument(
        "--image-size",
        type=bounded_int("image_size"),
        default=None,
        help="resize static images to this size (digits: upsample from 8) (default: native)",
    )
    p.add_argument(
        "--train-subset", type=positive_int, default=None, help="train on a seeded random subset of this many samples"
    )
    p.add_argument(
        "--test-subset", type=positive_int, default=None, help="test on a seeded random subset of this many samples"
    )
    p.add_argument(
        "--cache-frames",
        action=argparse.BooleanOptionalAction,
        default=d.get("cache_frames", True),
        help="keep the samples of event and sequence data sets (nmnist, dvsgesture, shd, ssc) in memory once framed, "
        "so that the epochs after the first read no file (the same samples; at most 2 GiB a split, samples past it "
        "framed at every read) (default: on)",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
