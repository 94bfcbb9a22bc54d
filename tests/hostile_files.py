"""Hostile HDF5 files for every reader of HDF5 (``tests/test_hdf5.py``, the SHD/SSC reader, NIR): each case of
:data:`HOSTILE` replaces one dataset of an honest file by something that would read another file, loop, or
allocate far more than the file holds, with the message the reader must refuse it with; :func:`peak_rss_growth`
measures what a refused read cost in memory, in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import h5py
import numpy as np

#: A value no honest file holds: a file standing in for another file's data holds it, so a read of it would show.
FOREIGN = 31337


def _foreign(tmp_path, like: np.ndarray):
    """Another HDF5 file holding, at ``/data``, what the replaced dataset held (so that a reader following a link
    to it would read it without complaint), with :data:`FOREIGN` in its first element."""
    other = tmp_path / "foreign.h5"
    data = np.array(like, copy=True)
    data.reshape(-1)[0] = FOREIGN
    with h5py.File(other, "w") as f:
        f.create_dataset("data", data=data)
    return other


def external_link(f, key, tmp_path):
    other = _foreign(tmp_path, f[key][()])
    del f[key]
    f[key] = h5py.ExternalLink(str(other), "/data")


def external_link_to_text(f, key, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not an HDF5 file\n")
    del f[key]
    f[key] = h5py.ExternalLink(str(notes), "/data")


def soft_link_loop(f, key, tmp_path):
    del f[key]
    f[key] = h5py.SoftLink("/" + key)


def hard_link_loop(f, key, tmp_path):
    del f[key]
    group = f.create_group(key)
    group["again"] = group


def external_storage(f, key, tmp_path):
    like = np.asarray(f[key][()])
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.full(like.shape, FOREIGN, like.dtype).tobytes())
    del f[key]
    f.create_dataset(key, shape=like.shape, dtype=like.dtype, external=[(str(secret), 0, like.nbytes)])


def virtual_dataset(f, key, tmp_path):
    like = np.asarray(f[key][()])
    other = _foreign(tmp_path, like)
    layout = h5py.VirtualLayout(shape=like.shape, dtype=like.dtype)
    layout[...] = h5py.VirtualSource(str(other), "data", shape=like.shape)
    del f[key]
    f.create_virtual_dataset(key, layout)


def declared_huge(f, key, tmp_path):
    """4 GiB declared in chunks never written: the file stays a few KB, a read allocates all of it."""
    dtype = f[key].dtype
    del f[key]
    f.create_dataset(key, shape=((1 << 32) // dtype.itemsize,), dtype=dtype, chunks=(1 << 12,))


def nested_deep(f, key, tmp_path):
    del f[key]
    f.create_group(key + "/g" * 200)


#: name -> (make(file, key, tmp_path): replace dataset ``key`` of the open file, message the reader refuses it with)
HOSTILE = {
    "external link": (external_link, r"is an external link \(to .*foreign.h5:/data\), which would read another file"),
    "external link to a text file": (external_link_to_text, r"is an external link \(to .*notes.txt:/data\)"),
    "soft link loop": (soft_link_loop, r"is a soft link \(to /.*\): refused"),
    "hard link loop": (hard_link_loop, r"is the object already at .*: refused"),
    "external storage": (external_storage, r"is stored outside the file \(external storage\)"),
    "virtual dataset": (virtual_dataset, r"is stored outside the file \(virtual storage\)"),
    "declared huge": (declared_huge, r"its datasets declare more than \d+ bytes"),
    "nested deep": (nested_deep, r"groups nested more than \d+ deep"),
}


def make_hostile(path, key, case, tmp_path) -> str:
    """Turn the honest file at ``path`` into the hostile ``case`` of :data:`HOSTILE`; returns its message."""
    make, message = HOSTILE[case]
    with h5py.File(path, "a") as f:
        make(f, key, tmp_path)
    return message


def peak_rss_growth(setup: str, call: str) -> tuple[int, str]:
    """``(bytes, outcome)``: how far a fresh Python's peak resident memory grew while ``call`` ran (after
    ``setup``), and the exception it raised (``"returned"`` if none)."""
    script = textwrap.dedent(
        f"""
        import resource
        {setup}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            {call}
            outcome = "returned"
        except Exception as err:
            outcome = f"{{type(err).__name__}}: {{err}}"
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        print(outcome)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    growth, outcome = done.stdout.strip().split("\n", 1)
    return int(growth) * 1024, outcome  # ru_maxrss is in KiB on Linux
