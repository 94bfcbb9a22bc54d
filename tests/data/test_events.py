"""The event-camera simulator, the framing (against tonic's ToFrame) and the digits-events data set."""

import numpy as np
import pytest
import torch

from spikefuse.data import DatasetInfo, load_dataset
from spikefuse.data.event_sim import EVENT_DTYPE, shift_bilinear, simulate_events, simulate_saccades
from spikefuse.data.framing import frame_events, frame_events_batch


def square(n=1, size=8):
    img = np.zeros((n, size, size), np.float32)
    img[:, 2:6, 2:6] = 1.0
    return img


def test_moving_digit_gives_both_polarities():
    ev = simulate_saccades(square(), (12, 12), seed=0)[0]
    assert ev.dtype == EVENT_DTYPE and set(ev.dtype.names) == {"x", "y", "t", "p"}
    assert len(ev) > 50
    assert (ev["p"] == 1).sum() > 10 and (ev["p"] == 0).sum() > 10  # leading edge ON, trailing edge OFF
    assert np.all(np.diff(ev["t"]) >= 0) and ev["t"].min() >= 0 and ev["t"].max() <= 300_000
    assert ev["x"].min() >= 0 and ev["x"].max() < 12 and ev["y"].min() >= 0 and ev["y"].max() < 12


def test_static_or_blank_gives_no_events():
    blank = np.zeros((2, 8, 8), np.float32)
    assert all(len(e) == 0 for e in simulate_saccades(blank, (12, 12), seed=0))  # moving blank image
    still = square(2)
    frames = [shift_bilinear(still, (12, 12), np.full((2, 2), 1.5))] * 10  # a digit that does not move
    evs = simulate_events(frames, np.arange(10) * 1000, threshold=0.2)
    assert len(evs) == 2 and all(len(e) == 0 for e in evs)


def test_event_polarity_follows_brightness_change():
    dark = np.zeros((1, 3, 3), np.float32)
    bright = np.full((1, 3, 3), 1.0, np.float32)
    ev = simulate_events([dark, bright, dark], [0, 1000, 2000], threshold=0.5, eps=0.1)[0]
    n = int(np.floor(np.log(1.1 / 0.1) / 0.5))  # levels crossed per pixel and direction
    on, off = ev[ev["p"] == 1], ev[ev["p"] == 0]
    assert len(on) == len(off) == 9 * n
    assert on["t"].max() <= 1000 < off["t"].min()
    assert np.all(np.diff(ev["t"]) >= 0)


def test_shift_bilinear_subpixel():
    img = np.zeros((1, 3, 3), np.float32)
    img[0, 1, 1] = 1.0
    out = shift_bilinear(img, (5, 5), np.array([[1.5, 0.0]]))[0]  # x + 1.5: pixel (1, 1) -> halves at x = 2, 3
    assert out[1, 2] == pytest.approx(0.5) and out[1, 3] == pytest.approx(0.5) and out.sum() == pytest.approx(1.0)
    out = shift_bilinear(img, (5, 5), np.array([[-2.0, 0.0]]))[0]  # moved off the canvas
    assert out.sum() == 0


def test_simulator_deterministic_with_seed():
    imgs = square(3)
    a = simulate_saccades(imgs, (12, 12), jitter=0.5, threshold_sigma=0.1, seed=4)
    b = simulate_saccades(imgs, (12, 12), jitter=0.5, threshold_sigma=0.1, seed=4)
    c = simulate_saccades(imgs, (12, 12), jitter=0.5, threshold_sigma=0.1, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("framing", ["events", "time"])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_batch_framing_equals_tonic(framing, T):
    recs = simulate_saccades(np.random.default_rng(0).random((6, 8, 8), dtype=np.float32), (12, 12), seed=0)
    recs[1] = recs[1][:0]  # empty recording
    recs[2] = recs[2][:3]  # fewer events than frames
    recs[3] = recs[3][:1]  # a single event: no time span
    bounds = np.concatenate([[0], np.cumsum([len(r) for r in recs])])
    batch = frame_events_batch(np.concatenate(recs), bounds, (12, 12, 2), T, framing)
    ref = torch.stack([frame_events(r, (12, 12, 2), T, framing) for r in recs])  # tonic.transforms.ToFrame
    assert batch.shape == (6, T, 2, 12, 12)
    assert torch.equal(batch, ref)


def test_digits_events_dataset():
    train, info = load_dataset("digits-events", None, train=True, T=8)
    assert info == DatasetInfo("digits-events", in_channels=2, num_classes=10, height=16, width=16, kind="event")
    test, _ = load_dataset("digits-events", None, train=False, T=8)
    assert len(train) + len(test) == 1797
    x, y = test[0]
    assert x.shape == (8, 2, 16, 16) and x.dtype == torch.float32 and isinstance(y, int)
    counts = test.data.sum(dim=(1, 2, 3, 4))
    assert counts.min() > 100  # every digit moves, so every recording has events
    # equal event counts per frame (n // T each)
    n = torch.as_tensor(np.diff(test.bounds))
    assert torch.equal(test.data.sum(dim=(2, 3, 4)), (n // 8)[:, None].expand(-1, 8).float())
    assert test.data[:, :, 0].sum() > 0 and test.data[:, :, 1].sum() > 0  # both polarities
    # class balance (same stratified split as digits)
    frac = np.bincount(train.targets.numpy(), minlength=10) / len(train)
    assert np.all(np.abs(frac - 0.1) < 0.012)
    digits, _ = load_dataset("digits", None, train=False, T=8)
    assert torch.equal(test.targets, digits.targets)


def test_digits_events_deterministic_and_seeded():
    from spikefuse.data.digits_events import digits_event_streams

    a, _ = load_dataset("digits-events", None, train=True, T=4, seed=0, size=8)
    ev, bounds, labels = digits_event_streams.__wrapped__(True, 0, 8)  # simulated again, bypassing the cache
    assert np.array_equal(ev, a.events) and np.array_equal(bounds, a.bounds)
    c, _ = load_dataset("digits-events", None, train=True, T=4, seed=1, size=8)
    assert not torch.equal(a.data, c.data)  # the seed changes the training recordings...
    t0, _ = load_dataset("digits-events", None, train=False, T=4, seed=0)
    t1, _ = load_dataset("digits-events", None, train=False, T=4, seed=1)
    assert torch.equal(t0.data, t1.data)  # ...not the test recordings
    t, _ = load_dataset("digits-events", None, train=False, T=5, framing="time")
    assert t.data.shape == (len(t0), 5, 2, 16, 16)
    assert 0.9 < t.data.sum() / t0.data.sum() < 1.1


def test_digits_events_size():
    ds, info = load_dataset("digits-events", None, train=False, T=4, size=24)
    assert (info.height, info.width) == (24, 24) and ds[0][0].shape == (4, 2, 24, 24)
