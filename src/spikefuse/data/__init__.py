"""Data sets and input encoding for spiking networks.

``load_dataset(name, root, train=..., T=...)`` returns ``(dataset, info)``; the dataset yields
``(sample, label:int)``:

* ``info.kind == "static"`` (digits, mnist, cifar10): ``sample`` is an image ``[C, H, W]`` float32 in [0, 1];
  encode a batch with :func:`encode` (``[B, C, H, W] -> [T, B, C, H, W]``).
* ``info.kind == "event"`` (digits-events, nmnist, dvsgesture): ``sample`` is ``[T, C, H, W]`` float32 event
  counts per frame (C = 2 polarities), framed with tonic's ``ToFrame`` either by equal event counts
  (``framing="events"``, SpikingJelly's "split_by number", the paper's SBE) or by equal time bins
  (``framing="time"``).
* ``info.kind == "sequence"`` (smnist, psmnist, shd, ssc; :mod:`spikefuse.data.sequences`): ``sample`` is
  ``[T, F]``, F features per step, for recurrent networks.

``load_dataset(..., cache="memory")`` keeps the samples that are framed at every read (event and sequence data sets)
in memory as they are first read (:class:`CachedDataset`): the epochs after the first read no file.

Every data-loading problem raises :class:`DataError` with a message naming the file, what is wrong and, for a
missing data set, the expected folder layout.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from ._common import DataError, DatasetInfo, TensorDataset
from .cache import CACHES, DEFAULT_CACHE_BYTES, CachedDataset

__all__ = [
    "CACHES",
    "DATASETS",
    "DEFAULT_CACHE_BYTES",
    "CachedDataset",
    "DataError",
    "DatasetInfo",
    "TensorDataset",
    "encode",
    "load_dataset",
    "time_major",
]

DATASETS: tuple[str, ...] = (
    "digits",
    "digits-events",
    "mnist",
    "cifar10",
    "nmnist",
    "dvsgesture",
    "smnist",
    "psmnist",
    "shd",
    "ssc",
)
FRAMINGS: tuple[str, ...] = ("events", "time")
ENCODINGS: tuple[str, ...] = ("poisson", "direct")


def time_major(batch):
    """A ``DataLoader`` ``collate_fn`` for samples that hold time first (``[T, ...]``: framed events, sequences):
    ``(x [T, B, ...], labels [B])``, time first as spikefuse's layers and models take it. The default collate makes
    ``[B, T, ...]``, which a model taking ``[T, B, ...]`` reads with time and batch swapped, silently where the sizes
    allow: ``DataLoader(dataset, batch_size=32, collate_fn=spikefuse.data.time_major)``."""
    x, labels = torch.utils.data.default_collate(batch)
    return x.transpose(0, 1).contiguous(), labels


def load_dataset(
    name: str,
    root: str | os.PathLike | None,
    *,
    train: bool,
    T: int,
    seed: int = 0,
    framing: str = "events",
    size: int | None = None,
    cache: str | None = None,
) -> tuple[Dataset, DatasetInfo]:
    """Load data set ``name`` (one of :data:`DATASETS`) from ``root``.

    Args:
        root: folder holding the data set's files (see each reader for the layout; ``None`` falls back to
            ``$SPIKEFUSE_DATA``). Ignored by ``digits`` and ``digits-events``, which need no files.
        train: the training split, else the test split.
        T: number of time steps; event data sets are framed into exactly ``T`` frames (static data sets
            ignore it: encode them per batch with :func:`encode`); sequential MNIST takes 28 (rows) or 784 (pixels).
        seed: seed of the random parts of synthetic data (``digits-events``' training recordings); the
            train/test splits and the test recordings are fixed, so runs with different seeds share a test set.
        framing: ``"events"`` (equal event counts per frame) or ``"time"`` (equal time bins), event data only.
        size: optional spatial size: ``digits`` upsampled to ``size x size`` (default 8);
            ``digits-events`` sensor ``size x size`` (default 16); ``dvsgesture`` downsampled from 128 to
            ``size`` (e.g. 32, default 128). Other data sets accept only their native size or ``None``.
        cache: ``None`` (default): a data set that frames its samples when they are read (``nmnist``,
            ``dvsgesture``, ``shd``, ``ssc``) frames them at every read; ``"memory"``: it keeps them in memory as
            they are first read (:class:`CachedDataset`, at most :data:`DEFAULT_CACHE_BYTES`; the same samples bit
            for bit), so that every epoch after the first reads no file. The other data sets are held in memory
            already and ignore it.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    if int(T) < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    if framing not in FRAMINGS:
        raise ValueError(f"unknown framing {framing!r}; choose 'events' (equal event counts) or 'time' (time bins)")
    if isinstance(cache, bool) or cache not in CACHES:
        raise ValueError(
            f"unknown cache {cache!r}; choose 'memory' (keep the framed samples in memory as they are first read) "
            "or None (frame them at every read)"
        )
    dataset, info = _load(name, root, train=train, T=int(T), seed=seed, framing=framing, size=size)
    if cache == "memory" and not isinstance(dataset, TensorDataset):
        dataset = CachedDataset(dataset)
    return dataset, info


def _load(name: str, root, *, train: bool, T: int, seed: int, framing: str, size: int | None):
    if name == "digits":
        from .digits import load_digits

        return load_digits(train=train, size=size)
    if name == "digits-events":
        from .digits_events import load_digits_events

        return load_digits_events(train=train, T=T, seed=seed, framing=framing, size=size)
    if name == "mnist":
        from .mnist import load_mnist

        return load_mnist(root, train=train, size=size)
    if name == "cifar10":
        from .cifar10 import load_cifar10

        return load_cifar10(root, train=train, size=size)
    if name in ("smnist", "psmnist"):
        from .sequences import load_smnist

        _native_size_only(name, size)
        return load_smnist(root, train=train, T=T, permuted=name == "psmnist")
    if name in ("shd", "ssc"):
        from .sequences import load_shd

        _native_size_only(name, size)
        return load_shd(root, name, train=train, T=T)
    if name == "nmnist":
        from .neuromorphic import load_nmnist

        return load_nmnist(root, train=train, T=T, framing=framing, size=size)
    from .neuromorphic import load_dvsgesture

    return load_dvsgesture(root, train=train, T=T, framing=framing, size=size)


def _native_size_only(name: str, size) -> None:
    if size is not None:
        raise ValueError(f"{name} has no image size to set: leave size (--image-size) out")


def encode(
    images: torch.Tensor, T: int, method: str = "poisson", generator: torch.Generator | None = None
) -> torch.Tensor:
    """Encode a batch of images ``[B, C, H, W]`` in [0, 1] as ``[T, B, C, H, W]``.

    * ``"poisson"``: Bernoulli rate coding: at every step each pixel spikes (1.0) with probability equal to
      its intensity, independently (draws from ``generator`` if given, which must live on the images'
      device). Output dtype is the images' floating dtype.
    * ``"direct"``: the analog image repeated ``T`` times (an expanded view; ``.contiguous()`` it if needed).
    """
    if images.dim() != 4:
        raise ValueError(f"encode expects images [B, C, H, W], got shape {tuple(images.shape)}")
    T = int(T)
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    if not images.is_floating_point():
        images = images.float()
    if method == "direct":
        return images.unsqueeze(0).expand(T, *images.shape)
    if method == "poisson":
        u = torch.rand((T, *images.shape), generator=generator, device=images.device, dtype=images.dtype)
        return (u < images.unsqueeze(0)).to(images.dtype)
    raise ValueError(f"unknown encoding {method!r}; choose one of {', '.join(ENCODINGS)}")
