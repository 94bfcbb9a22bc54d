"""``digits-events``: an N-MNIST-like event version of scikit-learn's digits, simulated in memory.

Each digit (upsampled bilinearly to 3/4 of the sensor, 12x12 on the default 16x16 sensor) is moved along
N-MNIST's three saccades (a triangle, travelling the free margin of the sensor, 100 ms each, rendered every
6.25 ms with sub-pixel bilinear shifts, each recording's path jittered by up to ±0.5 px); a simulated DVS
(log intensity, contrast threshold 0.3 with 5 % per-pixel mismatch) turns that into ON/OFF events
(:mod:`spikefuse.data.event_sim`), which are framed into ``T`` frames of 2 polarity channels with tonic's
``ToFrame`` bins (:mod:`spikefuse.data.framing`), like N-MNIST.

Deterministic for a given ``seed``, which draws the path jitter and threshold mismatch of the training split;
the test split is always simulated with seed 0, so that runs with different seeds evaluate on the same
recordings. The events of the last few (split, seed, size) are cached in memory.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ._common import DataError, DatasetInfo, TensorDataset
from .digits import NUM_CLASSES, digits_split, load_digits_arrays, resize_images
from .event_sim import simulate_saccades
from .framing import frame_events_batch

__all__ = ["DEFAULT_SIZE", "EventFramesDataset", "digits_event_streams", "load_digits_events"]

DEFAULT_SIZE = 16
SIM_PARAMS = dict(steps_per_saccade=16, saccade_us=100_000, jitter=0.5, threshold=0.3, threshold_sigma=0.05, eps=0.1)


class EventFramesDataset(TensorDataset):
    """Framed event recordings in memory: ``data [N, T, P, H, W]`` float32 counts, ``targets [N]``.

    ``events`` (one concatenated tonic-style structured array) and ``bounds`` (recording i is
    ``events[bounds[i]:bounds[i+1]]``) keep the raw streams; :meth:`recording` returns one.
    """

    def __init__(self, data, targets, events: np.ndarray, bounds: np.ndarray, sensor_size, classes=None):
        super().__init__(data, targets, classes)
        self.events = events
        self.bounds = bounds
        self.sensor_size = tuple(sensor_size)

    def recording(self, index: int) -> np.ndarray:
        return self.events[self.bounds[index] : self.bounds[index + 1]]


@lru_cache(maxsize=4)
def digits_event_streams(
    train: bool, seed: int = 0, size: int = DEFAULT_SIZE
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Simulated recordings of one split: ``(events, bounds, labels)`` (read-only arrays)."""
    images, labels = load_digits_arrays()
    idx = digits_split(train)
    digit = max(2, int(round(0.75 * size)))
    x = resize_images(torch.from_numpy(images[idx].copy()).unsqueeze(1), digit)[:, 0].numpy()
    seq = np.random.SeedSequence([int(seed), 1 if train else 0, int(size)])
    recs = simulate_saccades(x, (size, size), seed=seq, **SIM_PARAMS)
    bounds = np.concatenate([[0], np.cumsum([len(r) for r in recs])]).astype(np.int64)
    events = np.concatenate(recs) if recs else np.zeros(0)
    y = labels[idx].copy()
    for a in (events, bounds, y):
        a.setflags(write=False)
    return events, bounds, y


def load_digits_events(
    *, train: bool, T: int, seed: int = 0, framing: str = "events", size: int | None = None
) -> tuple[EventFramesDataset, DatasetInfo]:
    """Samples ``[T, 2, size, size]`` float32 event counts (size 16 by default)."""
    size = DEFAULT_SIZE if size is None else int(size)
    if size < 4:
        raise DataError(f"digits-events: size must be >= 4, got {size}")
    events, bounds, labels = digits_event_streams(bool(train), int(seed) if train else 0, size)
    sensor = (size, size, 2)
    frames = frame_events_batch(events, bounds, sensor, T, framing)
    ds = EventFramesDataset(
        frames,
        torch.from_numpy(labels.copy()),
        events,
        bounds,
        sensor,
        classes=tuple(str(i) for i in range(NUM_CLASSES)),
    )
    info = DatasetInfo("digits-events", in_channels=2, num_classes=NUM_CLASSES, height=size, width=size, kind="event")
    return ds, info
