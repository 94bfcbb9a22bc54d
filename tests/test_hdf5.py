"""spikefuse.hdf5.open_hdf5, the one opener of every HDF5 file spikefuse reads: honest files read as written, every
hostile case of tests/hostile_files.py refused by message before anything is read, variable-length contents
counted against the file's budget as they are read."""

import h5py
import numpy as np
import pytest

import spikefuse.hdf5 as sfh5
from spikefuse.data import DataError
from spikefuse.hdf5 import open_hdf5

from .hostile_files import HOSTILE, make_hostile


def _honest(path):
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.arange(6, dtype=np.float32).reshape(2, 3))
        f.create_dataset("group/name", data="a string")
        ragged = f.create_dataset("group/ragged", (3,), dtype=h5py.vlen_dtype(np.int16))
        for i in range(3):
            ragged[i] = np.arange(i, dtype=np.int16)


def test_an_honest_file_reads_as_written(tmp_path):
    _honest(tmp_path / "f.h5")
    with open_hdf5(tmp_path / "f.h5", what="test file") as h5:
        assert sorted(h5.datasets) == ["data", "group/name", "group/ragged"]
        assert np.array_equal(h5.read("data"), np.arange(6).reshape(2, 3))
        assert h5.read("group/name") == b"a string"
        assert [list(a) for a in h5.read("group/ragged")] == [[], [0], [0, 1]]
        with pytest.raises(ValueError, match=r"^test file .*f.h5: what is wrong$"):
            h5.fail("what is wrong")


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_files_are_refused_before_reading(tmp_path, case):
    _honest(tmp_path / "f.h5")
    message = make_hostile(tmp_path / "f.h5", "data", case, tmp_path)
    with pytest.raises(DataError, match=message) as err:
        with open_hdf5(tmp_path / "f.h5", what="test file", error=DataError):
            pytest.fail("the body ran")
    assert str(err.value).startswith(f"test file {tmp_path / 'f.h5'}: ") and "'data" in str(err.value)


def test_other_types_and_other_files(tmp_path):
    path = tmp_path / "f.h5"
    _honest(path)
    with h5py.File(path, "a") as f:
        f.create_dataset("refs", data=[f["data"].ref], dtype=h5py.ref_dtype)
    with pytest.raises(ValueError, match=r"'refs' has a type spikefuse does not read \(object\): refused"):
        with open_hdf5(path, what="test file"):
            pass
    path.write_text("not HDF5")
    with pytest.raises(ValueError, match=r"test file .*f.h5: not a readable HDF5 file \(OSError: .*signature"):
        with open_hdf5(path, what="test file"):
            pass


def test_variable_length_contents_count_against_the_budget(tmp_path, monkeypatch):
    """Elements of a variable-length dataset may all point at one stored array: what they hold counts as read,
    block by block, and the read stops at the budget (here shrunk below the arrays' 80,000 bytes)."""
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        ragged = f.create_dataset("ragged", (10,), dtype=h5py.vlen_dtype(np.float64))
        for i in range(10):
            ragged[i] = np.zeros(1000)
    monkeypatch.setattr(sfh5, "_MIN_BUDGET", 50_000)
    monkeypatch.setattr(sfh5, "MAX_EXPANSION", 0)
    with open_hdf5(path, what="test file") as h5:
        with pytest.raises(ValueError, match=r"its datasets hold more than 50000 bytes \(at 'ragged'\)"):
            h5.read("ragged")
    monkeypatch.setattr(sfh5, "OBJECT_BYTES", 6000)  # declared: 10 elements of 6000 bytes each
    with pytest.raises(ValueError, match=r"its datasets declare more than 50000 bytes \(at 'ragged'\)"):
        with open_hdf5(path, what="test file"):
            pass
