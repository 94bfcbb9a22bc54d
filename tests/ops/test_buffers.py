"""The CPU output-buffer cache: a buffer is handed out again only when nothing but the cache holds it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spikefuse
from spikefuse.ops import buffers

SHAPE = (4, 1 << 17)  # 2 MiB in float32: above the cache's minimum size


@pytest.fixture(autouse=True)
def clean_cache():
    limit = spikefuse.cpu_cache_limit()
    spikefuse.set_cpu_cache_limit(0)
    spikefuse.set_cpu_cache_limit(64 << 20)
    yield
    spikefuse.set_cpu_cache_limit(0)
    spikefuse.set_cpu_cache_limit(limit)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_freed_buffer_is_reused():
    a = buffers.empty(SHAPE, torch.float32)
    ptr = _ptr(a)
    del a
    b = buffers.empty(SHAPE, torch.float32)
    assert _ptr(b) == ptr and b.shape == SHAPE and b.dtype == torch.float32


@pytest.mark.parametrize("holder", ["tensor", "view", "numpy", "autograd", "storage", "shared"])
def test_buffer_in_use_is_not_reused(holder):
    a = buffers.empty(SHAPE, torch.float32).fill_(3.0)
    ptr = _ptr(a)
    w = torch.ones(SHAPE, requires_grad=True)
    if holder == "storage":  # the storage object alone: its use count does not see it
        keep = torch.empty(0).set_(a.untyped_storage(), 0, SHAPE)
        storage = a.untyped_storage()
        keep = None
    elif holder == "shared":  # sent to another process: nothing here can tell when that one is done with it
        a.share_memory_()
        keep = a.clone()
    elif holder == "view":
        keep = a[1:].view(-1)
    elif holder == "numpy":
        keep = a.numpy()
    elif holder == "autograd":
        keep = (w * a).sum()  # mul saves a for backward
    else:
        keep = a
    del a
    b = buffers.empty(SHAPE, torch.float32).fill_(-1.0)
    assert _ptr(b) != ptr
    if holder == "autograd":
        keep.backward()
        assert bool((w.grad == 3.0).all())  # the saved buffer still holds what was written into it
    elif holder == "storage":
        assert bool((torch.empty(0).set_(storage, 0, SHAPE) == 3.0).all())
    else:
        assert bool((torch.as_tensor(keep) == 3.0).all())


class _Spikes(torch.utils.data.Dataset):
    """Spikes made by spikefuse in the DataLoader worker that fetches the sample."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return spikefuse.lif(torch.full(SHAPE, float(i)), decay=0.5, threshold=0.3 if i % 2 else 100.0)


def test_outputs_sent_to_dataloader_workers_stay_intact():
    """A DataLoader whose workers make spikefuse outputs: they reach the main process through shared memory, which
    the cache must never reuse (7 of 8 samples came back overwritten before). Forkserver workers: this process may
    have run the kernels already, and a forked worker would then be refused (tests/test_threads.py)."""
    loader = torch.utils.data.DataLoader(
        _Spikes(), batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    for i, spikes in enumerate(loader):
        assert torch.equal(spikes, _Spikes()[i]), f"sample {i} overwritten"


def test_a_bad_cache_setting_fails_the_first_use_with_its_name(monkeypatch):
    """SPIKEFUSE_CPU_CACHE_MB is read at the first use, not at import: empty means unset, a non-number is an error
    that names the variable."""
    monkeypatch.setattr(buffers, "_limit", None)
    monkeypatch.setenv("SPIKEFUSE_CPU_CACHE_MB", "")
    assert buffers.cpu_cache_limit() > 0
    monkeypatch.setattr(buffers, "_limit", None)
    monkeypatch.setenv("SPIKEFUSE_CPU_CACHE_MB", "abc")
    with pytest.raises(buffers.SettingError, match="SPIKEFUSE_CPU_CACHE_MB must be a whole number of MiB"):
        buffers.empty(SHAPE, torch.float32)


def test_other_dtype_same_bytes_reuses():
    a = buffers.empty(SHAPE, torch.float32)
    ptr = _ptr(a)
    del a
    b = buffers.empty((SHAPE[0] * 2, SHAPE[1]), torch.bfloat16)
    assert _ptr(b) == ptr and b.dtype == torch.bfloat16


def test_limit_and_empty_cache():
    spikefuse.set_cpu_cache_limit(3 << 20)  # room for one 2 MiB buffer
    a = buffers.empty(SHAPE, torch.float32)
    b = buffers.empty(SHAPE, torch.float32)  # does not fit: a plain tensor
    assert spikefuse.cpu_cache_bytes() == (2 << 20, 0)
    del a, b
    assert spikefuse.cpu_cache_bytes() == (2 << 20, 2 << 20)
    spikefuse.empty_cpu_cache()
    assert spikefuse.cpu_cache_bytes() == (0, 0)
    small = buffers.empty((4, 16), torch.float32)
    assert spikefuse.cpu_cache_bytes() == (0, 0) and small.shape == (4, 16)


def test_idle_buffers_make_room_for_another_size():
    spikefuse.set_cpu_cache_limit(5 << 20)
    a = buffers.empty(SHAPE, torch.float32)
    del a
    b = buffers.empty((4, 1 << 18), torch.float32)  # 4 MiB: the idle 2 MiB buffer is dropped for it
    assert spikefuse.cpu_cache_bytes() == (4 << 20, 0)
    assert b.numel() == 4 << 18


def test_a_busy_buffer_before_an_idle_one_is_dropped_by_its_identity():
    """The idle buffer goes first, so the busy one before it in the cache is passed over: buffers are found by
    identity (a tensor's ``==`` is elementwise, which ``list.remove`` would call on it)."""
    busy = buffers.empty(SHAPE, torch.float32)
    idle = buffers.empty(SHAPE, torch.float32)
    del idle
    spikefuse.set_cpu_cache_limit(3 << 20)  # room for one: the idle buffer is dropped
    assert spikefuse.cpu_cache_bytes() == (2 << 20, 0)
    spikefuse.set_cpu_cache_limit(0)
    assert spikefuse.cpu_cache_bytes() == (0, 0) and busy.shape == SHAPE


def test_off_and_bad_limits():
    spikefuse.set_cpu_cache_limit(0)
    a = buffers.empty(SHAPE, torch.float32)
    assert spikefuse.cpu_cache_bytes() == (0, 0) and a.shape == SHAPE
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="cache limit"):
            spikefuse.set_cpu_cache_limit(bad)


def test_lif_outputs_survive_the_next_call():
    """Outputs of one fused call that the caller still holds are not overwritten by the next call."""
    x = torch.rand(4, 1 << 17) * 2
    first = spikefuse.lif(x, decay=0.5, threshold=1.0, backend="cpu")
    kept = first.clone()
    second = spikefuse.lif(x * 0, decay=0.5, threshold=1.0, backend="cpu")
    assert torch.equal(first, kept) and not second.any() and kept.any()
    assert _ptr(first) != _ptr(second)
    ptr = _ptr(first)
    del first
    third = spikefuse.lif(x, decay=0.5, threshold=1.0, backend="cpu")
    assert _ptr(third) == ptr and torch.equal(third, kept)
    np.testing.assert_array_equal(third.numpy(), kept.numpy())


def test_full_fills_a_reused_buffer():
    a = buffers.full((1 << 18,), 2.5, torch.float32, torch.device("cpu"))
    ptr = _ptr(a)
    assert bool((a == 2.5).all())
    a.fill_(-1.0)
    del a
    b = buffers.full((1 << 18,), 0.0, torch.float32, torch.device("cpu"))
    assert _ptr(b) == ptr and not b.any()


def test_full_under_compile_is_traceable():
    fn = torch.compile(lambda x: x + buffers.full(x.shape, 1.5, x.dtype, x.device), fullgraph=True, backend="eager")
    x = torch.zeros(1 << 18)
    assert bool((fn(x) == 1.5).all())
