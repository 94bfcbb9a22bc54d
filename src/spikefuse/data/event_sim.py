"""A small event-camera (DVS) simulator: images moved along saccade paths -> ON/OFF event streams.

Like N-MNIST (Orchard et al. 2015), which recorded MNIST digits on a screen with a sensor making three
saccades along a triangle, the image is translated along a piecewise-linear path with sub-pixel (bilinear)
shifts. Each pixel of the simulated sensor keeps the log intensity at its last event; whenever the current
log intensity differs from it by a multiple of the pixel's contrast threshold, the pixel emits that many
events: ON (p=1) for an increase, OFF (p=0) for a decrease, with time stamps interpolated linearly within the
rendering step at which each threshold level was crossed.

Events are tonic-style structured numpy arrays with fields ``x, y, t, p`` (t in microseconds), sorted by time.
Everything is vectorised over the batch of images, so the 1797 scikit-learn digits simulate in about a second.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EVENT_DTYPE", "saccade_offsets", "shift_bilinear", "simulate_events", "simulate_saccades", "split_events"]

EVENT_DTYPE = np.dtype([("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)])

# N-MNIST's three saccades, in units of the travel amplitude: (x, y) vertices of the triangle.
SACCADE_VERTICES = np.array([[0.0, 0.0], [0.5, 1.0], [1.0, 0.0], [0.0, 0.0]])


def saccade_offsets(
    n: int,
    *,
    amplitude: float,
    steps_per_saccade: int = 16,
    saccade_us: int = 100_000,
    jitter: float = 0.0,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The (x, y) offsets of ``n`` images along the three-saccade triangle and the rendering times.

    Returns ``offsets [n, K, 2]`` (float, pixels) and ``times_us [K]`` (int64) with
    ``K = 3 * steps_per_saccade + 1``. ``jitter`` adds a uniform ±jitter px displacement to each vertex of each
    image's path (drawn from ``rng``), so that every recording differs slightly.
    """
    verts = np.broadcast_to(SACCADE_VERTICES * float(amplitude), (n, 4, 2)).copy()
    if jitter:
        if rng is None:
            raise ValueError("jitter needs an rng")
        verts += rng.uniform(-jitter, jitter, size=verts.shape)
        verts[:, 3] = verts[:, 0]  # closed path: back to the start
    frac = np.linspace(0.0, 1.0, steps_per_saccade + 1)[:-1]
    parts = [verts[:, s, None] + (verts[:, s + 1, None] - verts[:, s, None]) * frac[None, :, None] for s in range(3)]
    offsets = np.concatenate(parts + [verts[:, 3:4]], axis=1)
    K = offsets.shape[1]
    times = np.round(np.arange(K) * (saccade_us / steps_per_saccade)).astype(np.int64)
    return offsets, times


def _tent(size_out: int, size_in: int, off: np.ndarray) -> np.ndarray:
    """Bilinear interpolation matrices ``[n, size_out, size_in]``: weight of source pixel j for output pixel i
    when the source is displaced by ``off[n]`` (the tent ``max(0, 1 - |i - off - j|)``; zero outside)."""
    diff = np.arange(size_out, dtype=np.float32)[None, :, None] - off.astype(np.float32)[:, None, None]
    diff = diff - np.arange(size_in, dtype=np.float32)[None, None, :]
    return np.maximum(np.float32(0.0), np.float32(1.0) - np.abs(diff))


def shift_bilinear(images: np.ndarray, canvas: tuple[int, int], offset: np.ndarray) -> np.ndarray:
    """Place ``images [n, h, w]`` on a zero ``canvas (H, W)`` with their top-left corner at ``offset [n, 2]``
    (x, y; fractional: bilinear interpolation, zero outside the image). Returns float32 ``[n, H, W]``."""
    images = np.asarray(images, dtype=np.float32)
    n, h, w = images.shape
    H, W = canvas
    offset = np.asarray(offset, dtype=np.float32)
    ay = _tent(H, h, offset[:, 1])  # [n, H, h]
    ax = _tent(W, w, offset[:, 0])  # [n, W, w]
    return np.matmul(np.matmul(ay, images), ax.transpose(0, 2, 1))


def simulate_events(
    frames,
    times_us: np.ndarray,
    *,
    threshold: float = 0.3,
    threshold_sigma: float = 0.0,
    eps: float = 0.1,
    rng: np.random.Generator | None = None,
) -> list[np.ndarray]:
    """Events of a batch of intensity videos.

    Args:
        frames: a sequence (or iterable) of ``K`` arrays ``[n, H, W]`` with intensities >= 0 at ``times_us``.
        threshold: contrast threshold in log-intensity units.
        threshold_sigma: relative spread of the per-pixel thresholds (mismatch, drawn once per recording from
            ``rng``).
        eps: offset of the log, ``log(I + eps)``, so that black is finite.
    Returns:
        ``n`` structured arrays (:data:`EVENT_DTYPE`), each sorted by time.
    """
    times_us = np.asarray(times_us, dtype=np.int64)
    it = iter(frames)
    first = np.asarray(next(it), dtype=np.float32)
    n, H, W = first.shape
    ref = np.log(first + np.float32(eps)).reshape(-1)  # log intensity at each pixel's last event (flat n*H*W)
    thr = np.full((n, H, W), threshold, dtype=np.float32)
    if threshold_sigma:
        if rng is None:
            raise ValueError("threshold_sigma needs an rng")
        thr *= np.clip(1.0 + threshold_sigma * rng.standard_normal((n, H, W)), 0.5, 1.5).astype(np.float32)
    thr = thr.reshape(-1)
    chunks: list[tuple[np.ndarray, ...]] = []
    k = 0
    for k, frame in enumerate(it, start=1):
        if k >= len(times_us):
            raise ValueError(f"more frames than times ({len(times_us)})")
        logi = np.log(np.asarray(frame, dtype=np.float32) + np.float32(eps)).reshape(-1)
        d = logi - ref
        cnt = np.floor(np.abs(d) / thr)
        idx = np.flatnonzero(cnt)
        if idx.size == 0:
            continue
        c = cnt[idx].astype(np.int32)
        dd = d[idx]
        th = thr[idx]
        ref[idx] += np.sign(dd) * c * th
        # one event per crossed level j = 1..c, at the time the linear ramp crossed it
        rep = np.repeat(np.arange(idx.size, dtype=np.int32), c)
        j = np.arange(1, rep.size + 1, dtype=np.int32) - np.repeat(np.cumsum(c, dtype=np.int32) - c, c)
        t0, t1 = int(times_us[k - 1]), int(times_us[k])
        frac = j * (th / np.abs(dd))[rep]  # in (0, 1]
        dt = np.minimum(np.floor(frac * np.float32(t1 - t0)).astype(np.int64), t1 - t0)
        # sort this step's events by (recording, time): then a stable sort by recording orders everything
        flat = idx[rep]
        order = np.argsort((flat // (H * W)) * (t1 - t0 + 1) + dt, kind="stable")
        chunks.append((flat[order], (t0 + dt)[order], (dd > 0).astype(np.int8)[rep][order]))
    if k + 1 != len(times_us):
        raise ValueError(f"{k + 1} frames but {len(times_us)} times")
    if not chunks:
        return split_events(np.zeros(0, dtype=EVENT_DTYPE), np.zeros(n + 1, dtype=np.int64))
    flat, t, p = (np.concatenate(a) for a in zip(*chunks, strict=True))
    s, rest = np.divmod(flat, H * W)
    order = np.argsort(s, kind="stable")  # the chunks are in time order, each sorted by (recording, time)
    s, rest, t, p = s[order], rest[order], t[order], p[order]
    ev = np.empty(order.size, dtype=EVENT_DTYPE)
    ev["y"], ev["x"] = np.divmod(rest, W)
    ev["t"], ev["p"] = t, p
    bounds = np.searchsorted(s, np.arange(n + 1))
    return split_events(ev, bounds)


def split_events(events: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
    """Views ``events[bounds[i]:bounds[i + 1]]`` (recording i of a concatenation)."""
    return [events[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


def simulate_saccades(
    images: np.ndarray,
    sensor_size: tuple[int, int],
    *,
    amplitude: float | None = None,
    steps_per_saccade: int = 16,
    saccade_us: int = 100_000,
    jitter: float = 0.0,
    threshold: float = 0.3,
    threshold_sigma: float = 0.0,
    eps: float = 0.1,
    seed: int | np.random.SeedSequence | None = 0,
) -> list[np.ndarray]:
    """Record ``images [n, h, w]`` (in [0, 1]) with a simulated sensor of ``sensor_size (W, H)`` making
    N-MNIST's three saccades (travel ``amplitude`` px, default: the free margin of the sensor).

    Deterministic for a given ``seed`` (which draws the path jitter and the threshold mismatch).
    """
    images = np.asarray(images, dtype=np.float32)
    if images.ndim != 3:
        raise ValueError(f"images must be [n, h, w], got shape {images.shape}")
    n, h, w = images.shape
    W, H = sensor_size
    if amplitude is None:
        amplitude = float(max(0, min(W - w, H - h)))
    rng = np.random.default_rng(seed)
    offsets, times = saccade_offsets(
        n, amplitude=amplitude, steps_per_saccade=steps_per_saccade, saccade_us=saccade_us, jitter=jitter, rng=rng
    )
    frames = (shift_bilinear(images, (H, W), offsets[:, k]) for k in range(offsets.shape[1]))
    return simulate_events(frames, times, threshold=threshold, threshold_sigma=threshold_sigma, eps=eps, rng=rng)
