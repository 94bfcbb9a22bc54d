"""N-MNIST and DVS Gesture event streams, read through ``tonic`` from local files, framed to ``[T, 2, H, W]``.

tonic's data set classes download their archives when the extracted files are missing; here they never do:
a missing data set raises :class:`DataError` with the folder layout tonic expects (download the archives
yourself and extract them there).

N-MNIST (tonic.datasets.NMNIST; 34x34 sensor, 2 polarities, 10 classes)::

    <root>/NMNIST/Train/0/00002.bin ...  <root>/NMNIST/Train/9/...   (extracted Train.zip; 60000 .bin files)
    <root>/NMNIST/Test/0/00004.bin  ...  <root>/NMNIST/Test/9/...    (extracted Test.zip; 10000 .bin files)

DVS Gesture (tonic.datasets.DVSGesture; tonic's preprocessed release, one ``<label>.npy`` [N, 4] array of
(x, y, p, t in ms) per gesture; 128x128 sensor, 2 polarities, 11 classes)::

    <root>/DVSGesture/ibmGestureTrain/user01_fluorescent/0.npy ... 10.npy   (extracted ibmGestureTrain.tar.gz)
    <root>/DVSGesture/ibmGestureTest/user24_fluorescent/0.npy ...           (extracted ibmGestureTest.tar.gz)

``<root>`` may also be the ``NMNIST`` / ``DVSGesture`` folder itself. DVS Gesture can be downsampled with
``size`` (e.g. 32, via ``tonic.transforms.Downsample``) to be trainable on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ._common import DataError, DatasetInfo, resolve_root
from .framing import frame_events

__all__ = ["NMNIST_LAYOUT", "DVSGESTURE_LAYOUT", "TonicFramesDataset", "load_nmnist", "load_dvsgesture"]

NMNIST_LAYOUT = """  <root>/NMNIST/Train/<digit 0-9>/<id>.bin   (the extracted N-MNIST Train.zip: folders 0..9 of .bin files)
  <root>/NMNIST/Test/<digit 0-9>/<id>.bin    (the extracted N-MNIST Test.zip)
  (<root> may also be the NMNIST folder itself)"""

DVSGESTURE_LAYOUT = """  <root>/DVSGesture/ibmGestureTrain/user<NN>_<lighting>/<label 0-10>.npy   (tonic's ibmGestureTrain.tar.gz, extracted)
  <root>/DVSGesture/ibmGestureTest/user<NN>_<lighting>/<label 0-10>.npy    (tonic's ibmGestureTest.tar.gz, extracted)
  (each .npy an [N, 4] array of x, y, polarity, t in ms; <root> may also be the DVSGesture folder itself)"""


def _tonic():
    try:
        import tonic  # noqa: F401
        import tonic.datasets
        import tonic.transforms
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataError("event data sets need the 'tonic' package: pip install tonic") from exc
    return tonic


def _local(base_cls, name: str, layout: str, suffix: str):
    """A subclass of a tonic data set that reads what is on disk and never downloads."""

    class Local(base_cls):
        _spikefuse_dir: Path

        def _check_exists(self) -> bool:
            folder = self._spikefuse_dir / self.folder_name
            if not folder.is_dir() or next(folder.rglob(f"*{suffix}"), None) is None:
                raise DataError(
                    f"{name}: no {suffix} files under {folder} (the data set is missing or not extracted; "
                    f"spikefuse never downloads); the files must be laid out as:\n{layout}"
                )
            self.location_on_system = str(
                self._spikefuse_dir
            )  # the folder holding Train/Test (tonic would append the class name)
            return True

        def download(self) -> None:  # pragma: no cover - _check_exists raises first
            raise DataError(f"{name}: refusing to download; place the files as:\n{layout}")

    Local.__name__ = Local.__qualname__ = base_cls.__name__
    return Local


def _dataset_dir(root, name: str, folder: str, layout: str) -> Path:
    base = resolve_root(root, name, layout)
    if (base / folder).is_dir():
        return base / folder
    return base  # the data-set folder itself (or a wrong one: the check names the missing subfolder)


class TonicFramesDataset(Dataset):
    """A tonic event data set framed per sample: yields ``(frames [T, P, H, W] float32, label:int)``.

    Each access reads one file; a corrupt or truncated file raises :class:`DataError` naming it.
    """

    def __init__(
        self,
        tonic_ds,
        *,
        name: str,
        sensor_size,
        T: int,
        framing: str,
        num_classes: int,
        downsample=None,
        out_size=None,
        validate=None,
    ):
        self.tonic_ds = tonic_ds
        self.name = name
        self.sensor_size = tuple(sensor_size)  # native (W, H, P)
        self.out_sensor_size = tuple(out_size) if out_size is not None else self.sensor_size
        self.T = int(T)
        self.framing = framing
        self.num_classes = num_classes
        self.downsample = downsample
        self.validate = validate

    def __len__(self) -> int:
        return len(self.tonic_ds)

    def __reduce__(self):
        # the tonic data set is an instance of a class made at run time: rebuild it (DataLoader workers, spawn)
        rebuild = getattr(self, "_rebuild", None)
        if rebuild is None:
            raise TypeError(f"{type(self).__name__} made outside load_dataset cannot be pickled")
        fn, root, kwargs = rebuild
        return _rebuilt, (fn.__name__, root, kwargs)

    @property
    def files(self) -> list[str]:
        return list(self.tonic_ds.data)

    @property
    def targets(self) -> torch.Tensor:
        return torch.as_tensor(self.tonic_ds.targets, dtype=torch.int64)

    def events(self, index: int) -> tuple[np.ndarray, int]:
        """The raw (validated, time-sorted, not downsampled) events of sample ``index`` and its label."""
        path = self.tonic_ds.data[index]
        if self.validate is not None:
            self.validate(path)
        try:
            events, target = self.tonic_ds[index]
        except DataError:
            raise
        except Exception as exc:
            raise DataError(
                f"{self.name} file {path}: cannot read its events (corrupt or not in the published format): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        W, H, P = self.sensor_size
        for field in ("x", "y", "t", "p"):
            if events.dtype.names is None or field not in events.dtype.names:
                raise DataError(f"{self.name} file {path}: events lack the field {field!r}")
        if len(events):
            x, y, p = events["x"], events["y"], events["p"].astype(np.int64)
            if x.min() < 0 or y.min() < 0 or x.max() >= W or y.max() >= H:
                raise DataError(
                    f"{self.name} file {path}: event coordinates x {x.min()}..{x.max()}, y {y.min()}..{y.max()} "
                    f"outside the {W}x{H} sensor (corrupt file?)"
                )
            if p.min() < 0 or p.max() >= P:
                raise DataError(f"{self.name} file {path}: polarities {p.min()}..{p.max()} outside 0..{P - 1}")
            t = events["t"]
            if np.any(t[1:] < t[:-1]):
                events = events[np.argsort(t, kind="stable")]
        target = int(target)
        if not 0 <= target < self.num_classes:
            raise DataError(f"{self.name} file {path}: label {target} outside 0..{self.num_classes - 1}")
        return events, target

    def __getitem__(self, index: int):
        events, target = self.events(index)
        if self.downsample is not None and len(events):
            events = self.downsample(events)
        return frame_events(events, self.out_sensor_size, self.T, self.framing), target


def _rebuilt(fn_name: str, root, kwargs):
    return globals()[fn_name](root, **kwargs)[0]


#: The most time-stamp overflow events an N-MNIST file may hold: tonic's reader shifts every later time stamp once
#: per such event (time quadratic in the file's size), and N-MNIST's 0.3 s recordings need none.
NMNIST_MAX_OVERFLOWS = 64


def _check_nmnist_file(path: str) -> None:
    size = os.path.getsize(path)
    if size % 5:
        raise DataError(
            f"N-MNIST file {path}: {size} bytes is not a multiple of 5 (each event is 5 bytes): truncated or corrupt"
        )
    overflows = int(np.count_nonzero(np.fromfile(path, np.uint8)[1::5] == 240))
    if overflows > NMNIST_MAX_OVERFLOWS:
        raise DataError(
            f"N-MNIST file {path}: holds {overflows} time-stamp overflow events (y = 240), more than the "
            f"{NMNIST_MAX_OVERFLOWS} a recording may hold here (tonic's reader takes time quadratic in them): corrupt"
        )


def _check_npy_file(path: str) -> None:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:
        raise DataError(
            f"DVS Gesture file {path}: not a readable .npy array (corrupt or truncated?): {type(exc).__name__}: {exc}"
        ) from exc
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise DataError(f"DVS Gesture file {path}: expected an [N, 4] array (x, y, p, t), got shape {list(arr.shape)}")


def _downsample(native: int, size: int | None, name: str):
    if size is None or int(size) == native:
        return None, native
    size = int(size)
    if not 1 <= size <= native:
        raise DataError(f"{name}: size must be in 1..{native}, got {size}")
    tonic = _tonic()
    return tonic.transforms.Downsample(sensor_size=(native, native, 2), target_size=(size, size)), size


def _build(base_name: str, name: str, layout: str, folder: str, suffix: str, root, train: bool, **kw):
    tonic = _tonic()
    base_cls = getattr(tonic.datasets, base_name)
    cls = _local(base_cls, name, layout, suffix)
    cls._spikefuse_dir = _dataset_dir(root, name, folder, layout)
    try:
        ds = cls(save_to=str(cls._spikefuse_dir.parent), train=train, **kw)
    except DataError:
        raise
    except Exception as exc:  # tonic derives labels/users from the folder names
        raise DataError(
            f"{name}: files under {cls._spikefuse_dir} are not laid out as expected ({type(exc).__name__}: {exc}); "
            f"the files must be laid out as:\n{layout}"
        ) from exc
    if len(ds) == 0:
        raise DataError(
            f"{name}: no samples found under {cls._spikefuse_dir}; the files must be laid out as:\n{layout}"
        )
    return ds


def load_nmnist(root, *, train: bool, T: int, framing: str = "events", size: int | None = None):
    """N-MNIST: samples ``[T, 2, 34, 34]`` (``[T, 2, size, size]`` if downsampled)."""
    ds = _build("NMNIST", "N-MNIST", NMNIST_LAYOUT, "NMNIST", ".bin", root, train)
    down, s = _downsample(34, size, "nmnist")
    frames = TonicFramesDataset(
        ds,
        name="N-MNIST",
        sensor_size=(34, 34, 2),
        T=T,
        framing=framing,
        num_classes=10,
        downsample=down,
        out_size=(s, s, 2),
        validate=_check_nmnist_file,
    )
    frames._rebuild = (load_nmnist, root, dict(train=train, T=T, framing=framing, size=size))
    return frames, DatasetInfo("nmnist", in_channels=2, num_classes=10, height=s, width=s, kind="event")


def load_dvsgesture(root, *, train: bool, T: int, framing: str = "events", size: int | None = None):
    """DVS Gesture: samples ``[T, 2, 128, 128]`` (``[T, 2, size, size]`` with ``size``, e.g. 32)."""
    ds = _build("DVSGesture", "DVS Gesture", DVSGESTURE_LAYOUT, "DVSGesture", ".npy", root, train)
    down, s = _downsample(128, size, "dvsgesture")
    frames = TonicFramesDataset(
        ds,
        name="DVS Gesture",
        sensor_size=(128, 128, 2),
        T=T,
        framing=framing,
        num_classes=11,
        downsample=down,
        out_size=(s, s, 2),
        validate=_check_npy_file,
    )
    frames._rebuild = (load_dvsgesture, root, dict(train=train, T=T, framing=framing, size=size))
    return frames, DatasetInfo("dvsgesture", in_channels=2, num_classes=11, height=s, width=s, kind="event")
