"""The numba building blocks both CPU backends share: the vectorizable exp against the exact value, and the block
row loads against numpy indexing."""

import numpy as np
import pytest

pytest.importorskip("numba")
from numba import njit

from spikefuse.ops.numba_common import channel_row, exp, load_row


@njit(error_model="numpy")
def _exp_all(y, out):
    for i in range(y.shape[0]):
        out[i] = exp(y[i])


@pytest.mark.parametrize("dtype, low, high, tol", [(np.float32, -110.0, 100.0, 4e-6), (np.float64, -760.0, 720.0, 1e-12)])
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


@pytest.mark.parametrize("channels, inner, n0, m", [(1, 5, 3, 17), (3, 4, 0, 30), (3, 4, 7, 30), (5, 1, 2, 11),
                                                    (2, 7, 13, 1)])  # fmt: skip
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
