"""The numba building blocks both CPU backends share: the vectorizable exp against the exact value, the block
row loads and the bit unpacking against numpy, the blocks' split over threads, and the rows-apart promise in the
compiled signature."""

import numpy as np
import pytest

pytest.importorskip("numba")
from numba import njit

from spikefuse.ops.numba_common import block_for, channel_row, exp, load_row, pack_rows, rows_apart, unpack_bits


@njit(error_model="numpy")
def _exp_all(y, out):
    for i in range(y.shape[0]):
        out[i] = exp(y[i])


@pytest.mark.parametrize(
    "dtype, low, high, tol", [(np.float32, -110.0, 100.0, 4e-6), (np.float64, -760.0, 720.0, 1e-12)]
)
def test_exp_is_within_its_error_bound(dtype, low, high, tol):
    y = np.linspace(low, high, 200_001).astype(dtype)
    out = np.empty_like(y)
    _exp_all(y, out)
    exact = np.exp(y.astype(np.longdouble))
    finfo = np.finfo(dtype)
    normal = (exact > 2 * finfo.tiny) & (exact <= finfo.max)
    rel = np.abs(out[normal] - exact[normal]) / exact[normal]
    assert float(rel.max()) <= tol
    small = np.abs(y[normal]) < 20
    assert float(rel[small].max()) <= (1e-6 if dtype == np.float32 else 1e-12)
    assert np.all(np.isinf(out[exact > finfo.max])), "overflow gives inf"
    assert np.all(out[exact <= finfo.tiny] == 0), "below the normal range gives 0"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_special_values(dtype):
    y = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], dtype=dtype)
    out = np.empty_like(y)
    _exp_all(y, out)
    assert np.isnan(out[0])
    assert list(out[1:3]) == [np.inf, 0.0]
    tol = 1e-6 if dtype == np.float32 else 1e-12
    assert out[3:] == pytest.approx([1.0, 1.0, np.e], rel=tol)


@pytest.mark.parametrize(
    "channels, inner, n0, m",
    [(1, 5, 3, 17), (3, 4, 0, 30), (3, 4, 7, 30), (5, 1, 2, 11), (2, 7, 13, 1), (3, 64, 100, 500), (4, 1000, 10, 20)],
)
def test_channel_row_matches_division(channels, inner, n0, m):
    values = np.arange(1, channels + 1, dtype=np.float32)
    dst = np.empty(m, np.float32)
    channel_row(dst, values, n0, inner)
    want = values[((n0 + np.arange(m)) // inner) % channels]
    assert np.array_equal(dst, want)


def test_load_row_takes_the_block_or_the_one_value():
    src = np.arange(20, dtype=np.float64)
    dst = np.empty(6)
    load_row(dst, src, 5, 6)
    assert np.array_equal(dst, src[5:11])
    load_row(dst, np.array([2.5]), 5, 6)
    assert np.array_equal(dst, np.full(6, 2.5))


@njit(error_model="numpy")
def _scaled_rows_apart(x, halves, out, m):
    rows_apart()
    for j in range(m):
        out[j] = x[j] * 2.0 + halves[j]


def test_rows_apart_marks_the_array_data_noalias():
    """The promise goes on the data of float and 16-bit arrays (the half-precision spikes' integer view), not on the
    arrays' owner pointers; results are unchanged."""
    x, out = np.arange(5, dtype=np.float32), np.zeros(5, np.float32)
    halves = np.ones(5, np.int16)
    _scaled_rows_apart(x, halves, out, 5)
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]
    llvm = _scaled_rows_apart.inspect_llvm(_scaled_rows_apart.signatures[0])
    header = next(line for line in llvm.splitlines() if line.startswith("define") and "_scaled_rows_apart" in line)
    params = {p.split("%")[-1]: p for p in header[header.index("(") + 1 : header.rindex(")")].split(", ")}
    for name in ("x", "halves", "out"):  # numba passes an array as its fields: the owner first, the data fifth
        assert "noalias" in params[f"arg.{name}.4"], params[f"arg.{name}.4"]
        assert "noalias" not in params[f"arg.{name}.0"], params[f"arg.{name}.0"]


@pytest.mark.parametrize("start, m", [(0, 64), (0, 61), (3, 1), (3, 5), (5, 70), (8, 16), (13, 0), (1, 7)])
@pytest.mark.parametrize("dtype, one", [(np.float32, 1.0), (np.float64, 1.0), (np.int32, 0x3F800000), (np.uint8, 1)])
def test_unpack_bits_matches_numpy(start, m, dtype, one):
    """Any start bit (the unrolled bytes from the first byte boundary, single bits before and after) and length."""
    bits = np.random.default_rng(start * 100 + m).integers(0, 256, size=12, dtype=np.uint8)
    out = np.full(m, 7, dtype=dtype)
    unpack_bits(bits, start, out, dtype(one))
    want = np.unpackbits(bits, bitorder="little")[start : start + m].astype(dtype) * dtype(one)
    assert np.array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16], ids=["fp32", "fp64", "int16-view"])
@pytest.mark.parametrize(
    "t0, steps, n0, m",
    [(0, 1, 0, 8), (1, 2, 16, 24), (0, 3, 0, 48), (2, 1, 40, 8), (0, 3, 0, 200), (1, 2, 64, 136), (0, 1, 8, 64)],
)
def test_pack_rows_matches_numpy(dtype, t0, steps, n0, m):
    """The rows of a block packed as ``bitpack.pack`` packs the whole ``[T, N]`` (bit k of byte j is element 8j+k;
    64-element words, then the bytes after the last), the bytes outside the block untouched; -0.0 and other nonzero
    values as numpy's ``!= 0`` has them."""
    rng = np.random.default_rng(t0 * 1000 + n0 + m)
    spikes = (rng.random((3, 200)) < 0.4).astype(dtype)
    if dtype != np.int16:
        spikes[rng.random((3, 200)) < 0.1] = -0.0
    bits = np.full((3, 25), 0xA5, dtype=np.uint8)
    pack_rows(spikes, t0, steps, n0, m, bits)
    want = np.full((3, 25), 0xA5, dtype=np.uint8)
    rows = slice(t0, t0 + steps)
    want[rows, n0 // 8 : (n0 + m) // 8] = np.packbits(spikes[rows, n0 : n0 + m] != 0, axis=1, bitorder="little")
    assert np.array_equal(bits, want)
    pack_rows(spikes, t0, steps, n0, m, np.empty((0, 0), dtype=np.uint8))  # no bits asked: nothing to write


@pytest.mark.parametrize(
    "n, threads, block",
    [(65536, 2, 7680), (16384, 2, 7680), (100, 2, 16384), (1, 4, 2048), (0, 2, 2048), (10**6, 3, 16384)],
)
def test_block_for_splits_evenly_over_the_threads(n, threads, block):
    b = block_for(n, threads, block)
    tasks = -(-n // b)
    assert b % 64 == 0 and 64 <= b <= max(64, block)
    if n >= 64 * threads:
        assert tasks % threads == 0, "every thread runs as many tasks"
