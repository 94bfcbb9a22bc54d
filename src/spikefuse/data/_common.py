"""Shared types of :mod:`spikefuse.data`: the error type, the data-set description and the in-memory data sets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["DataError", "MissingRootError", "DatasetInfo", "TensorDataset", "describe_path", "resolve_root"]


class DataError(RuntimeError):
    """Any problem loading a data set: missing folder or file, corrupt or truncated file, wrong format.

    The message names the file, says what is wrong and, for a missing data set, where the files must go.
    """


class MissingRootError(DataError):
    """No root folder was given for a data set read from files. The message names ``option``, the way to give one:
    ``root=...`` to the Python API; a caller with its own way (the command line's ``--data-dir``) re-raises
    :meth:`naming` that."""

    def __init__(self, name: str, layout: str, option: str = "root=..."):
        super().__init__(name, layout, option)  # the arguments, not the message: the error pickles (DDP ranks)

    def __str__(self) -> str:
        name, layout, option = self.args
        return (
            f"data set {name!r} needs a root folder (pass {option} or set SPIKEFUSE_DATA); the files must be laid "
            f"out as:\n{layout}"
        )

    def naming(self, option: str) -> "MissingRootError":
        """The same error, naming ``option`` as the way to give the folder."""
        name, layout, _ = self.args
        return MissingRootError(name, layout, option)


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a data set.

    ``kind == "static"``: samples are images ``[C, H, W]`` float in [0, 1], to be encoded per batch by
    :func:`spikefuse.data.encode`. ``kind == "event"``: samples are frames ``[T, C, H, W]`` float (event
    counts), already time-binned.
    """

    name: str
    in_channels: int
    num_classes: int
    height: int
    width: int
    kind: str


class TensorDataset(Dataset):
    """A data set held in memory: ``data[i]`` (float32 tensor) with ``int(targets[i])``.

    ``data`` is ``[N, C, H, W]`` for static data sets and ``[N, T, C, H, W]`` for framed event data sets;
    ``targets`` is an int64 tensor ``[N]``. Both are public so that a training loop may batch by slicing.
    """

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, classes: tuple[str, ...] | None = None):
        if data.shape[0] != targets.shape[0]:
            raise ValueError(f"data has {data.shape[0]} samples but targets has {targets.shape[0]}")
        self.data = data
        self.targets = targets.to(torch.int64)
        self.classes = classes

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __getitem__(self, index: int):
        return self.data[index], int(self.targets[index])


def describe_path(path: str | os.PathLike) -> str:
    return str(Path(path).expanduser())


def resolve_root(root: str | os.PathLike | None, name: str, layout: str) -> Path:
    """The data-set root folder: ``root``, else ``$SPIKEFUSE_DATA``; a DataError with the layout if neither exists."""
    if root is None:
        env = os.environ.get("SPIKEFUSE_DATA")
        if not env:
            raise MissingRootError(name, layout)
        root = env
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DataError(
            f"data set {name!r}: root folder {describe_path(path)} does not exist or is not a folder; "
            f"the files must be laid out as:\n{layout}"
        )
    return path
