"""Long-sequence data sets for recurrent networks; samples ``[T, F]`` (F features per step), ``info.kind ==
"sequence"``:

- ``smnist``: sequential MNIST from the MNIST files, row by row (``T=28``, 28 pixels a step) or pixel by pixel
  (``T=784``, one pixel a step), intensities in [0, 1];
- ``psmnist``: pixel by pixel through one fixed permutation of the 784 pixels (``torch.randperm`` of
  :data:`PERMUTATION_SEED`, the same for every run and split; :func:`permutation` gives it); the intensities of
  both as spikes, drawn anew per batch: :func:`bernoulli_steps` (``spikefuse train --encoding poisson``);
- ``shd`` / ``ssc``: the Spiking Heidelberg Digits and Spiking Speech Commands (Cramer et al. 2020), read from their
  HDF5 files (``spikes/times`` in seconds, ``spikes/units`` 0..699, ``labels``) and binned into ``T`` frames of 700
  channels: frame ``floor(t / duration * T)`` for a spike at ``t`` seconds (``duration`` 1.4 s, which every sample
  of the published files fits; later spikes count in the last frame), the spike counts per channel and frame.

The SHD/SSC files are not on this machine: download them from https://zenkelab.org/datasets/ (``shd_train.h5.gz``,
``shd_test.h5.gz``; ``ssc_train.h5.gz``, ``ssc_valid.h5.gz``, ``ssc_test.h5.gz``), unpack them into one folder, and
pass it as the root. The files are opened through :func:`spikefuse.hdf5.open_hdf5`, which refuses links to other
files, storage outside the file and sizes beyond the file's before anything is read; every value is checked
(whole-number labels and units, finite times) before a sample is built.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ._common import DataError, DatasetInfo, describe_path, resolve_root

__all__ = [
    "PERMUTATION_SEED",
    "permutation",
    "load_smnist",
    "load_shd",
    "SpikeTrainDataset",
    "CHANNELS",
    "DURATION",
    "INTENSITIES",
    "bernoulli_steps",
]

#: The seed of psMNIST's one permutation of the pixels.
PERMUTATION_SEED = 0
#: Input channels of SHD and SSC (the cochlea model's fibres) and the time the binning spans, in seconds.
CHANNELS, DURATION = 700, 1.4
#: The sequence data sets of intensities in [0, 1] (grey values), which :func:`bernoulli_steps` turns into spikes;
#: SHD's and SSC's frames are spike counts already.
INTENSITIES = ("smnist", "psmnist")
_CLASSES = {"shd": 20, "ssc": 35}
_SPLITS = {"shd": {True: "shd_train.h5", False: "shd_test.h5"}, "ssc": {True: "ssc_train.h5", False: "ssc_test.h5"}}


def permutation(pixels: int = 784) -> torch.Tensor:
    """psMNIST's permutation: position ``k`` of a sequence holds pixel ``permutation()[k]`` of the row-major image."""
    return torch.randperm(pixels, generator=torch.Generator().manual_seed(PERMUTATION_SEED))


def load_smnist(root, *, train: bool, T: int, permuted: bool = False):
    """Sequential MNIST (``permuted``: psMNIST, pixel by pixel only): ``T=28`` rows of 28 pixels or ``T=784``
    pixels."""
    from .mnist import load_mnist
    from ._common import TensorDataset

    name = "psmnist" if permuted else "smnist"
    shapes = {784: (784, 1)} if permuted else {28: (28, 28), 784: (784, 1)}
    if T not in shapes:
        raise DataError(
            f"{name} runs {' or '.join(f'T={t}' for t in shapes)} ("
            + ("one pixel a step" if permuted else "28 rows of 28 pixels, or one pixel a step")
            + f"), got T={T}"
        )
    images, info = load_mnist(root, train=train)
    data = images.data.reshape(len(images), *shapes[T])
    if permuted:
        data = data[:, permutation()]
    return TensorDataset(data.contiguous(), images.targets), DatasetInfo(
        name=name, in_channels=shapes[T][1], num_classes=info.num_classes, height=1, width=1, kind="sequence"
    )


def bernoulli_steps(steps: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Spikes of a batch of intensity sequences ``steps`` ``[T, B, F]`` in [0, 1] (sequential MNIST's pixels, time
    first): at every step each value spikes (1.0) with its intensity as probability, independently, as
    :func:`spikefuse.data.encode`'s ``"poisson"`` draws an image's pixels at every step; the same ``[T, B, F]``, the
    steps the sequence's own. Draws from ``generator`` if given (on ``steps``' device); an integer ``steps`` gives
    float32 spikes."""
    if steps.ndim != 3:
        raise ValueError(f"bernoulli_steps takes sequences [T, B, F], got shape {tuple(steps.shape)}")
    if not steps.is_floating_point():
        steps = steps.float()
    u = torch.rand(steps.shape, generator=generator, device=steps.device, dtype=steps.dtype)
    return (u < steps).to(steps.dtype)


def _described(dtype) -> str:
    import h5py

    if dtype.names:
        return "a compound type"
    if dtype.hasobject and h5py.check_string_dtype(dtype) is not None:
        return "variable-length strings"
    return str(dtype)


def _first_bad(arrays, good) -> str | None:
    """``"<value> (sample <i>)"`` for the first value of ``arrays`` (one per sample) that ``good(array) -> mask``
    rejects; None if there is none."""
    for i, a in enumerate(arrays):
        bad = ~good(a)
        if bad.any():
            return f"{a[bad][0]} (sample {i})"
    return None


def _whole(values: np.ndarray) -> np.ndarray:
    """Which values are whole numbers (NaN is not; an infinity is, and fails any range)."""
    return values == np.floor(values) if values.dtype.kind == "f" else np.ones(values.shape, bool)


def _read_h5(path: Path, what: str, classes: int):
    """``(times, units, labels)`` of an SHD/SSC file, checked: per sample, an array of spike times in seconds
    (finite, >= 0) and one of as many units (whole numbers in 0..CHANNELS-1); whole-number labels in
    0..classes-1. Everything else raises one DataError naming the file, never a truncated value."""
    import h5py

    from ..hdf5 import open_hdf5

    if not path.is_file():
        raise DataError(f"{describe_path(path)}: no such file")
    with open_hdf5(path, what=what, error=DataError) as h5:
        for key in ("spikes/times", "spikes/units", "labels"):
            if key not in h5.datasets:
                h5.fail(f"no dataset {key!r}: not an SHD/SSC file (it needs spikes/times, spikes/units and labels)")
            if h5.datasets[key].ndim != 1:
                h5.fail(f"{key} must be one-dimensional, got shape {h5.datasets[key].shape}")
        lengths = {key: len(h5.datasets[key]) for key in ("labels", "spikes/times", "spikes/units")}
        if len(set(lengths.values())) > 1:
            h5.fail(
                f"{lengths['labels']} labels but {lengths['spikes/times']} spike time and "
                f"{lengths['spikes/units']} unit arrays"
            )
        for key, kinds, wanted in (("spikes/times", "f", "floating-point seconds"), ("spikes/units", "iuf", "numbers")):
            dtype = h5.datasets[key].dtype
            base = h5py.check_vlen_dtype(dtype)
            if not isinstance(base, np.dtype) or base.names:
                h5.fail(f"{key} must hold one variable-length array of numbers per sample, got {_described(dtype)}")
            if base.kind not in kinds:
                h5.fail(f"{key} must hold {wanted}, got {base}")
        if h5.datasets["labels"].dtype.kind not in "iuf":
            h5.fail(f"labels must hold integers, got {_described(h5.datasets['labels'].dtype)}")
        labels, times, units = (h5.read(key) for key in ("labels", "spikes/times", "spikes/units"))
        counts, unit_counts = (np.fromiter(map(len, arrays), np.int64, len(arrays)) for arrays in (times, units))
        for i in np.flatnonzero(counts != unit_counts)[:1]:
            h5.fail(f"sample {i} has {counts[i]} spike times but {unit_counts[i]} units")
        bad = _first_bad(times, lambda t: np.isfinite(t) & (t >= 0))
        if bad:
            h5.fail(f"spike times must be finite and >= 0, got {bad}")
        bad = _first_bad(units, lambda u: _whole(u) & (u >= 0) & (u < CHANNELS))
        if bad:
            h5.fail(f"spikes/units must be whole numbers in 0..{CHANNELS - 1}, got {bad}")
        for rule, good in (
            ("be whole numbers", _whole),
            (f"lie in 0..{classes - 1}", lambda v: (v >= 0) & (v < classes)),
        ):
            bad = np.flatnonzero(~good(labels))
            if bad.size:
                h5.fail(f"labels must {rule}, got {labels[bad[0]]} (sample {bad[0]})")
    return times, units, labels.astype(np.int64)


class SpikeTrainDataset(Dataset):
    """Spike trains of :data:`CHANNELS` channels binned into ``T`` frames when a sample is read: ``[T, CHANNELS]``
    float32 spike counts, and the label."""

    def __init__(self, times, units, labels: np.ndarray, T: int, duration: float = DURATION):
        self.times, self.units, self.targets = times, units, torch.as_tensor(labels)
        self.T, self.duration = int(T), float(duration)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        t = np.asarray(self.times[index], dtype=np.float64)  # float16 in the files: widen before scaling
        u = np.asarray(self.units[index], dtype=np.int64)
        # clipped before the cast to integers: a finite time far past the duration would overflow int64
        frames = np.minimum(np.minimum(t, self.duration) * (self.T / self.duration), self.T - 1).astype(np.int64)
        counts = np.bincount(frames * CHANNELS + u, minlength=self.T * CHANNELS)
        return torch.from_numpy(counts.astype(np.float32)).reshape(self.T, CHANNELS), int(self.targets[index])


def load_shd(root: str | os.PathLike | None, name: str, *, train: bool, T: int):
    """SHD (``name="shd"``) or SSC (``"ssc"``): the train split, or the test split (``train=False``)."""
    file = _SPLITS[name][train]
    layout = (
        f"    <root>/{_SPLITS[name][True]}\n    <root>/{_SPLITS[name][False]}\n(unpacked from the .h5.gz files of "
        "https://zenkelab.org/datasets/)"
    )
    path = resolve_root(root, name, layout) / file
    classes = _CLASSES[name]
    times, units, labels = _read_h5(path, f"{name.upper()} file", classes)
    return SpikeTrainDataset(times, units, labels, T), DatasetInfo(
        name=name, in_channels=CHANNELS, num_classes=classes, height=1, width=1, kind="sequence"
    )
