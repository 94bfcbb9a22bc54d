"""Long-sequence data sets for recurrent networks; samples ``[T, F]`` (F features per step), ``info.kind ==
"sequence"``:

- ``smnist``: sequential MNIST from the MNIST files, row by row (``T=28``, 28 pixels a step) or pixel by pixel
  (``T=784``, one pixel a step), intensities in [0, 1];
- ``psmnist``: pixel by pixel through one fixed permutation of the 784 pixels (``torch.randperm`` of
  :data:`PERMUTATION_SEED`, the same for every run and split; :func:`permutation` gives it);
- ``shd`` / ``ssc``: the Spiking Heidelberg Digits and Spiking Speech Commands (Cramer et al. 2020), read from their
  HDF5 files (``spikes/times`` in seconds, ``spikes/units`` 0..699, ``labels``) and binned into ``T`` frames of 700
  channels: frame ``floor(t / duration * T)`` for a spike at ``t`` seconds (``duration`` 1.4 s, which every sample
  of the published files fits; later spikes count in the last frame), the spike counts per channel and frame.

The SHD/SSC files are not on this machine: download them from https://zenkelab.org/datasets/ (``shd_train.h5.gz``,
``shd_test.h5.gz``; ``ssc_train.h5.gz``, ``ssc_valid.h5.gz``, ``ssc_test.h5.gz``), unpack them into one folder, and
pass it as the root. The reader refuses HDF5 datasets stored outside the file (external or virtual) and checks
every size against the file's before reading it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ._common import DataError, DatasetInfo, describe_path, resolve_root

__all__ = ["PERMUTATION_SEED", "permutation", "load_smnist", "load_shd", "SpikeTrainDataset", "CHANNELS", "DURATION"]

#: The seed of psMNIST's one permutation of the pixels.
PERMUTATION_SEED = 0
#: Input channels of SHD and SSC (the cochlea model's fibres) and the time the binning spans, in seconds.
CHANNELS, DURATION = 700, 1.4
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


def _read_h5(path: Path):
    """``(times, units, labels)`` of an SHD/SSC file, each sample's spikes as arrays."""
    import h5py

    if not path.is_file():
        raise DataError(f"{describe_path(path)}: no such file")
    try:
        with h5py.File(path, "r") as f:
            datasets = {}
            for key in ("spikes/times", "spikes/units", "labels"):
                if key not in f:
                    raise DataError(
                        f"{describe_path(path)}: no dataset {key!r}: not an SHD/SSC file (it needs "
                        "spikes/times, spikes/units and labels)"
                    )
                ds = f[key]
                if not isinstance(ds, h5py.Dataset) or ds.is_virtual or ds.external:
                    raise DataError(
                        f"{describe_path(path)}: {key} is not a dataset stored in the file (external or "
                        "virtual storage is refused: it reads other files)"
                    )
                if ds.ndim != 1:
                    raise DataError(f"{describe_path(path)}: {key} must be one-dimensional, got shape {ds.shape}")
                datasets[key] = ds
            n = len(datasets["labels"])
            if len(datasets["spikes/times"]) != n or len(datasets["spikes/units"]) != n:
                raise DataError(
                    f"{describe_path(path)}: {n} labels but {len(datasets['spikes/times'])} spike time "
                    f"and {len(datasets['spikes/units'])} unit arrays"
                )
            labels = np.asarray(datasets["labels"][()], dtype=np.int64)
            times, units = datasets["spikes/times"][()], datasets["spikes/units"][()]
    except OSError as err:
        raise DataError(f"{describe_path(path)}: not a readable HDF5 file ({err})") from None
    return times, units, labels


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
        frames = np.minimum((t * (self.T / self.duration)).astype(np.int64), self.T - 1)
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
    times, units, labels = _read_h5(path)
    for i in range(len(labels)):
        if len(times[i]) != len(units[i]):
            raise DataError(
                f"{describe_path(path)}: sample {i} has {len(times[i])} spike times but {len(units[i])} units"
            )
        if len(units[i]) and (int(np.min(units[i])) < 0 or int(np.max(units[i])) >= CHANNELS):
            raise DataError(f"{describe_path(path)}: sample {i} has units outside 0..{CHANNELS - 1}")
        if len(times[i]) and not (np.isfinite(times[i]).all() and float(np.min(times[i])) >= 0):
            raise DataError(f"{describe_path(path)}: sample {i} has spike times that are negative or not finite")
    classes = _CLASSES[name]
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(
            f"{describe_path(path)}: labels must lie in 0..{classes - 1}, got {labels.min()}..{labels.max()}"
        )
    return SpikeTrainDataset(times, units, labels, T), DatasetInfo(
        name=name, in_channels=CHANNELS, num_classes=classes, height=1, width=1, kind="sequence"
    )
