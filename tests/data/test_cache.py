"""The memory cache of framed samples (``load_dataset(..., cache="memory")``, :class:`spikefuse.data.CachedDataset`):
the same samples bit for bit, filled by the first pass, no file read after it, bounded, refused by message."""

import os
import pickle
import re
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from spikefuse.data import DEFAULT_CACHE_BYTES, CachedDataset, TensorDataset, load_dataset
from spikefuse.data.cache import CachedBatches, batch_loader
from spikefuse.ops import buffers

SHARED = Path(os.environ.get("SPIKEFUSE_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
NMNIST = SHARED / "nmnist-small"
needs_nmnist = pytest.mark.skipif(not NMNIST.is_dir(), reason=f"no real N-MNIST recordings at {NMNIST}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


class Counting(Dataset):
    """Given samples, counting the reads."""

    def __init__(self, samples):
        self.samples, self.reads, self.targets = samples, 0, [y for _, y in samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.reads += 1
        x, y = self.samples[i]
        return x.clone(), y


def test_nmnist_cached_gives_the_same_samples_and_reads_no_file_after_the_first_pass(tmp_path, monkeypatch):
    pytest.importorskip("tonic")
    from tests.data.test_neuromorphic import write_nmnist

    write_nmnist(tmp_path, n_events=400)  # up to 40 events a frame: counts above 1 in places
    for framing in ("events", "time"):
        plain, info = load_dataset("nmnist", tmp_path, train=True, T=4, framing=framing)
        cached, info_cached = load_dataset("nmnist", tmp_path, train=True, T=4, framing=framing, cache="memory")
        assert isinstance(cached, CachedDataset) and info_cached == info and len(cached) == len(plain)
        assert cached.cached_samples == 0
        first = [cached[i] for i in range(len(cached))]  # the first pass fills it
        assert cached.cached_samples == len(plain) and 0 < cached.cached_bytes <= len(plain) * 4 * 2 * 34 * 34
        monkeypatch.setattr(cached.dataset, "events", lambda i: pytest.fail("read a file after the first pass"))
        for i in range(len(plain)):
            want_x, want_y = plain[i]
            for x, y in (first[i], cached[i], cached[i - len(plain)]):  # negative indices too
                assert same_bits(x, want_x) and y == want_y
        monkeypatch.undo()
        assert torch.equal(cached.targets, plain.targets) and cached.files == plain.files  # the data set's attributes


def test_a_shuffled_loader_fills_it_in_one_epoch_and_gives_the_same_batches():
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 5, (3, 2, 4, 4), generator=g).float(), i % 3) for i in range(10)]
    source = Counting(samples)
    cached = CachedDataset(source)
    batches = []
    for _ in range(3):
        order = torch.Generator().manual_seed(1)
        batches.append(list(DataLoader(cached, batch_size=4, shuffle=True, generator=order)))
    assert source.reads == 10  # every sample read once, in the first epoch
    plain = list(DataLoader(Counting(samples), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)))
    for epoch in batches:
        for (x, y), (want_x, want_y) in zip(epoch, plain, strict=True):
            assert same_bits(x, want_x) and torch.equal(y, want_y)


def test_values_that_are_not_small_counts_are_kept_as_they_are_bit_for_bit():
    tricky = [
        torch.tensor([0.5, 1.0, 2.0]),  # fractions
        torch.tensor([0.0, 256.0, 3.0]),  # a count past uint8
        torch.tensor([-0.0, 1.0, 0.0]),  # -0.0: equal to 0 but not the same bits
        torch.tensor([float("nan"), 1.0, float("inf")]),
        torch.tensor([-1.0, 2.0, 3.0]),
        torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
        torch.tensor([1, 2, 3]),
        torch.zeros(0),
    ]
    cached = CachedDataset(Counting([(x, 0) for x in tricky]))
    for _ in range(2):
        for i, want in enumerate(tricky):
            x, _ = cached[i]
            assert x.dtype == want.dtype and torch.equal(x.view(torch.uint8), want.view(torch.uint8)), i
    small = CachedDataset(Counting([(torch.tensor([0.0, 255.0, 7.0]), 0)]))
    small[0]
    assert small.cached_bytes == 3  # integers 0..255 kept as uint8, a quarter of float32


def test_a_caller_changing_a_sample_in_place_leaves_the_cache_alone():
    for value in (torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.0])):  # kept as uint8, kept as float32
        cached = CachedDataset(Counting([(value, 0)]))
        cached[0][0].add_(1)
        x, _ = cached[0]
        x.mul_(10)
        assert torch.equal(cached[0][0], value)


def test_the_cache_keeps_at_most_max_bytes_and_frames_the_rest_at_every_read():
    samples = [(torch.full((10,), float(i)), i) for i in range(6)]  # 10 bytes each as uint8
    source = Counting(samples)
    cached = CachedDataset(source, max_bytes=35)
    for _ in range(3):
        assert [(x.tolist(), y) for x, y in (cached[i] for i in range(6))] == [(x.tolist(), y) for x, y in samples]
    assert cached.cached_samples == 3 and cached.cached_bytes == 30
    assert source.reads == 6 + 2 * 3  # the three kept read once, the others at every pass
    nothing = CachedDataset(Counting(samples), max_bytes=0)
    assert nothing[2][1] == 2 and nothing.cached_samples == 0
    assert "3 of 6 samples" in repr(cached)


def test_bad_values_are_refused_by_message():
    for bad in ("disk", "Memory", True, "none", 1):
        with pytest.raises(ValueError, match=r"unknown cache .*; choose 'memory' \(keep the framed samples in memory"):
            load_dataset("digits", None, train=True, T=2, cache=bad)
    for bad in (-1, 1.5, True, "1GB", None):
        with pytest.raises(ValueError, match=r"max_bytes must be a number of bytes >= 0 \(0 keeps nothing\), got"):
            CachedDataset(Counting([]), max_bytes=bad)
    cached = CachedDataset(Counting([(torch.zeros(2), 0)]))
    with pytest.raises(IndexError, match="sample 1 out of range for a data set of 1 samples"):
        cached[1]
    with pytest.raises(TypeError):
        cached[0.5]
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=r"stack_dim must be a dimension >= 0, got"):
            cached.batch([0], stack_dim=bad)
    with pytest.raises(
        TypeError, match="CachedBatches reads the batches of a CachedDataset or of a Subset of one, got"
    ):
        CachedBatches(Subset(Counting([]), []))


def test_data_sets_held_in_memory_already_are_returned_as_they_are():
    for name in ("digits", "digits-events"):
        ds, _ = load_dataset(name, None, train=False, T=2, cache="memory")
        assert type(ds) is not CachedDataset and isinstance(ds, TensorDataset)


def test_the_sequences_framed_at_every_read_are_cached_too(tmp_path):
    pytest.importorskip("h5py")
    from tests.data.test_sequences import write_shd

    spikes = [([0.1, 0.2, 0.2, 1.3], [1, 5, 5, 699]), ([0.5], [0])]
    write_shd(tmp_path / "shd_train.h5", spikes, np.array([0, 1]))
    plain, _ = load_dataset("shd", tmp_path, train=True, T=3)
    cached, _ = load_dataset("shd", tmp_path, train=True, T=3, cache="memory")
    assert isinstance(cached, CachedDataset)
    for _ in range(2):
        for i in range(2):
            assert same_bits(cached[i][0], plain[i][0]) and cached[i][1] == plain[i][1]
    assert cached.cached_samples == 2


def test_the_framed_data_sets_give_the_same_sample_at_every_read(tmp_path):
    """What makes caching them sound: nothing random happens in their ``__getitem__`` (Poisson coding and every
    other draw of an epoch run on the batch, in the training loop, after the cache)."""
    pytest.importorskip("tonic")
    from tests.data.test_neuromorphic import write_dvsgesture, write_nmnist

    write_nmnist(tmp_path, n_events=200)
    write_dvsgesture(tmp_path)
    for name, size in (("nmnist", None), ("dvsgesture", 32)):
        ds, _ = load_dataset(name, tmp_path, train=True, T=3, size=size)
        torch.manual_seed(0)
        np.random.seed(0)
        first = ds[1][0]
        torch.manual_seed(1)
        np.random.seed(1)
        assert same_bits(ds[1][0], first)


def test_it_pickles_with_what_it_holds(tmp_path):
    pytest.importorskip("tonic")
    from tests.data.test_neuromorphic import write_nmnist

    write_nmnist(tmp_path)
    cached, _ = load_dataset("nmnist", tmp_path, train=False, T=3, cache="memory")
    want = cached[2]
    copy = pickle.loads(pickle.dumps(cached))
    assert copy.cached_samples == 1 and copy.max_bytes == DEFAULT_CACHE_BYTES
    assert same_bits(copy[2][0], want[0]) and same_bits(copy[0][0], cached[0][0])


@needs_nmnist
def test_real_nmnist_recordings_cached_bit_for_bit():
    plain, _ = load_dataset("nmnist", NMNIST, train=False, T=10)
    cached, _ = load_dataset("nmnist", NMNIST, train=False, T=10, cache="memory")
    for _ in range(2):
        for i in range(len(plain)):
            x, y = cached[i]
            want_x, want_y = plain[i]
            assert same_bits(x, want_x) and y == want_y
    assert cached.cached_samples == 100
    assert cached.cached_bytes == 100 * 10 * 2 * 34 * 34  # N-MNIST's counts fit uint8


def same(a, b) -> bool:
    """The same collated batch: types, structure, dtypes, shapes and bits."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def event_samples(n: int, fractions: bool = False):
    """``n`` samples ``([T=3, C=2, 4, 4] float32 counts, label)``; with ``fractions`` every third holds a 0.5 and a
    -0.0 (kept as float32 beside the others' uint8)."""
    g = torch.Generator().manual_seed(n)
    samples = []
    for i in range(n):
        x = torch.randint(0, 256, (3, 2, 4, 4), generator=g).float()
        if fractions and i % 3 == 0:
            x[0, 0, 0, :2] = torch.tensor([0.5, -0.0])
        samples.append((x, i))
    return samples


def test_a_batch_is_the_collated_samples_bit_for_bit_kept_or_not():
    """What a DataLoader collates, whether the samples are kept (as uint8, as float32), past max_bytes or not kept
    yet; the cache filled as reading them one by one fills it."""
    for fractions in (False, True):
        samples = event_samples(10, fractions)
        indices = [7, 2, 9, 0, 2, -1]
        want = default_collate([samples[i] for i in indices])
        for max_bytes in (DEFAULT_CACHE_BYTES, 4 * 96 + 50, 0):  # all kept, some, none (uint8: 96 bytes a sample)
            for stack_dim in (0, 1, 3, 4, 9):
                source = Counting(samples)
                cached = CachedDataset(source, max_bytes=max_bytes)
                for _ in range(2):  # read first, then (as far as kept) from the cache
                    got = cached.batch(indices, stack_dim)
                    assert same(got, want), (fractions, max_bytes, stack_dim)
                one_by_one = CachedDataset(Counting(samples), max_bytes=max_bytes)
                for _ in range(2):
                    for i in indices:
                        one_by_one[i]
                assert one_by_one.dataset.reads == source.reads
                assert (cached.cached_samples, cached.cached_bytes) == (
                    one_by_one.cached_samples,
                    one_by_one.cached_bytes,
                )


def test_a_batch_stacked_along_time_is_a_time_major_buffer_seen_batch_first():
    cached = CachedDataset(Counting(event_samples(6)))
    x, y = cached.batch(range(6), stack_dim=1)
    assert x.shape == (6, 3, 2, 4, 4) and x.transpose(0, 1).is_contiguous() and not x.is_contiguous()
    assert y.shape == (6,) and y.dtype == torch.int64
    x, _ = cached.batch(range(6))
    assert x.is_contiguous()


def test_a_batch_held_by_its_caller_is_never_written_over():
    """The float32 buffers are reused only once their batch is dropped: batch 1 held while batch 2 is built stays
    as it was; batch 3, built once batch 2 is dropped, takes its memory (1 MiB batches: cached by the buffers)."""
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 256, (4, 64, 256), generator=g).float(), i) for i in range(12)]
    cached = CachedDataset(Counting(samples))
    if buffers.cpu_cache_limit() < 4 << 20:
        pytest.skip("the CPU buffer cache is off or too small here")
    first, _ = cached.batch([0, 1, 2, 3], stack_dim=1)
    held = first.clone()
    second, _ = cached.batch([4, 5, 6, 7], stack_dim=1)
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, held)
    assert torch.equal(second, torch.stack([samples[i][0] for i in (4, 5, 6, 7)]))
    memory = second.data_ptr()
    del second
    third, _ = cached.batch([8, 9, 10, 11], stack_dim=1)
    assert third.data_ptr() == memory and torch.equal(first, held)
    assert torch.equal(third, torch.stack([samples[i][0] for i in (8, 9, 10, 11)]))


class Given(Dataset):
    """Given samples of any form, as they are."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def test_other_fields_and_forms_collate_as_default_collate_does():
    """Fields that are no tensors, samples that are no tuples, tensors default_collate promotes or refuses: its
    batch or its error, whether kept or not (a namedtuple kept is given back as a tuple, one as read as itself)."""
    Pair = namedtuple("Pair", "x y")
    x = torch.arange(4.0)
    forms = [
        [(x + i, (i, 0.5), "s", torch.tensor(i)) for i in range(3)],  # a tuple field, a float, a string, a 0-d tensor
        [{"x": x + i, "y": i} for i in range(3)],
        [x + i for i in range(3)],  # single tensors
        [(x, 1), (x.double(), 2), (x.int(), 3)],  # dtypes torch.stack promotes
        [(x, 1), (x, 2), (x[:2], 3)],  # shapes it refuses
        [Pair(x + i, i) for i in range(3)],
    ]
    for samples in forms:
        for max_bytes in (DEFAULT_CACHE_BYTES, 20, 0):  # all kept, the first, none
            cached = CachedDataset(Given(samples), max_bytes=max_bytes)
            try:
                want = default_collate([cached[i] for i in range(3)])
            except RuntimeError as err:
                with pytest.raises(RuntimeError, match=re.escape(str(err))):
                    CachedDataset(Given(samples), max_bytes=max_bytes).batch(range(3), stack_dim=1)
                continue
            assert same(CachedDataset(Given(samples), max_bytes=max_bytes).batch(range(3), stack_dim=1), want)
            assert same(cached.batch(range(3), stack_dim=1), want)


def test_the_batch_loader_draws_and_shuffles_as_a_shuffled_dataloader():
    """The same batches in the same order, the generator (shuffled) or torch's global one (in order) left in the same
    state, epoch after epoch, for a cache and a Subset of one."""
    samples = event_samples(10)
    for subset in (None, [1, 2, 4, 5, 6, 8, 9]):
        cached = CachedDataset(Counting(samples))
        data = cached if subset is None else Subset(cached, subset)
        for shuffle in (True, False):
            plain_gen, gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
            plain = DataLoader(data, batch_size=4, shuffle=shuffle, generator=plain_gen if shuffle else None)
            batched = batch_loader(data, 4, shuffle=shuffle, generator=gen if shuffle else None, stack_dim=1)
            assert len(batched) == len(plain) and len(batched.dataset) == len(data)
            for _ in range(2):
                torch.manual_seed(0)
                want = list(plain)
                want_states = plain_gen.get_state(), torch.get_rng_state()
                torch.manual_seed(0)
                assert same(list(batched), want)
                assert all(torch.equal(a, b) for a, b in zip((gen.get_state(), torch.get_rng_state()), want_states))
            labels = torch.cat([y for _, y in want]).tolist()
            assert sorted(labels) == (subset or list(range(10))) and (shuffle or labels == sorted(labels))
