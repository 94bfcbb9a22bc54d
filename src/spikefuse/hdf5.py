"""The one way spikefuse opens an HDF5 file it is given (NIR graphs, SHD/SSC): :func:`open_hdf5` walks the whole
file before any dataset is read and refuses, in one error naming the file and the object:

- links other than hard links. An external link reads another file (any file the process may open, passed off as
  part of this one); a soft link may loop or alias, and a refused link is never followed, so the walk needs no
  loop protection of its own. The programs that write these files write neither.
- an object reached under two names (a hard-link loop; a reader that walks the tree, as NIR's does, reads an
  aliased dataset once per name) and groups nested more than :data:`MAX_DEPTH` deep (readers walk by recursion);
- datasets stored outside the file: external storage (raw bytes of another file) and virtual datasets (other
  files' datasets);
- types other than fixed-size ones and variable-length arrays of numbers or strings (references point at other
  objects; variable-length data inside a compound hides its size);
- more declared data than :data:`MAX_EXPANSION` times the file's size: chunks never written cost no bytes in the
  file and read as their full declared size. A variable-length dataset counts :data:`OBJECT_BYTES` per element
  when declared, and what its elements hold when read (:meth:`HDF5File.read`: in blocks, stopping at the budget,
  since many elements may point at one stored array).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

__all__ = ["MAX_EXPANSION", "MAX_DEPTH", "OBJECT_BYTES", "HDF5File", "open_hdf5"]

#: How many times its own size a file may declare in all (room for compression and for the readers' own objects).
MAX_EXPANSION = 16
#: The budget's floor: a small file's few objects always fit.
_MIN_BUDGET = 1 << 20
#: What one object in the file (a link, an element of a variable-length dataset) may cost a reader in memory
#: beyond its data: a Python object, a numpy array header.
OBJECT_BYTES = 128
#: The deepest nesting of groups read.
MAX_DEPTH = 64
#: Elements per read of a variable-length dataset.
_BLOCK = 4096
#: What h5py raises on a damaged file.
_H5PY_ERRORS = (OSError, KeyError, RuntimeError, TypeError, ValueError)


class _Refused(Exception):
    """A check failed; the message is re-raised in the caller's error type, after the file's name."""


class HDF5File:
    """A file :func:`open_hdf5` checked: ``file`` (the ``h5py.File``), ``datasets`` (path -> ``h5py.Dataset``,
    every dataset in the file, paths without the leading ``/``), :meth:`read` and :meth:`fail`."""

    def __init__(self, file, datasets: dict, name: str, error: type[Exception], budget: int, used: int):
        self.file, self.datasets, self.name, self.error = file, datasets, name, error
        self._budget, self._used = budget, used

    def fail(self, message: str):
        """Raise the caller's error type: ``"<what> <path>: <message>"``."""
        raise self.error(f"{self.name}: {message}")

    def read(self, key: str):
        """Dataset ``key`` (one of :attr:`datasets`) as an array (a scalar as its value); a variable-length one in
        blocks, what its elements hold counted against the file's budget."""
        ds = self.datasets[key]
        try:
            if not ds.dtype.hasobject:
                return ds[()]
            if ds.ndim == 0:
                value = ds[()]
                self._count(key, _held(value))
                return value
            step = max(1, _BLOCK // max(1, int(np.prod(ds.shape[1:]))))
            parts = []
            for start in range(0, ds.shape[0], step):
                part = ds[start : start + step]
                self._count(key, sum(map(_held, part.flat)))
                parts.append(part)
            return np.concatenate(parts) if parts else ds[()]
        except _Refused as err:
            self.fail(str(err))
        except _H5PY_ERRORS as err:
            self.fail(f"cannot read {key!r} ({type(err).__name__}: {err})")

    def _count(self, key: str, nbytes: int) -> None:
        self._used += nbytes
        if self._used > self._budget:
            raise _Refused(_too_much(self._budget, key, "hold"))


def _held(value) -> int:
    """Bytes an element of a variable-length dataset holds: an array's, a string's."""
    return value.nbytes if isinstance(value, np.ndarray) else len(value)


def _too_much(budget: int, key: str, verb: str = "declare") -> str:
    return (
        f"its datasets {verb} more than {budget} bytes (at {key!r}), more than {MAX_EXPANSION} times the file's "
        "size: refused (a dataset's unwritten chunks read as its full declared size)"
    )


def _readable(dtype) -> bool:
    """Fixed-size types, and variable-length strings or arrays of fixed-size types."""
    import h5py

    if not dtype.hasobject or h5py.check_string_dtype(dtype) is not None:
        return True
    base = h5py.check_vlen_dtype(dtype)
    return isinstance(base, np.dtype) and not base.hasobject


def _walk(file, budget: int) -> tuple[dict, int]:
    """``(datasets, declared bytes)`` of the whole file, following hard links only; raises _Refused."""
    import h5py

    root = h5py.h5o.get_info(file.id).addr
    seen = {root: "/"}  # object address -> the first path it was reached by
    datasets, declared = {}, 0
    stack = [("", file, 0)]
    while stack:
        path, group, depth = stack.pop()
        for name in group:  # the link names: listing them follows no link
            key = f"{path}/{name}" if path else name
            kind = group.id.links.get_info(name.encode()).type
            if kind == h5py.h5l.TYPE_EXTERNAL:
                link = group.get(name, getlink=True)
                raise _Refused(
                    f"{key!r} is an external link (to {link.filename}:{link.path}), which would read another file: "
                    "refused"
                )
            if kind == h5py.h5l.TYPE_SOFT:
                raise _Refused(
                    f"{key!r} is a soft link (to {group.get(name, getlink=True).path}): refused (a soft link may loop "
                    "or alias; the files read here hold hard links only)"
                )
            if kind != h5py.h5l.TYPE_HARD:
                raise _Refused(f"{key!r} is a user-defined link (type {kind}): refused")
            item = group.get(name)  # a hard link: an object of this file
            address = h5py.h5o.get_info(item.id).addr
            if address in seen:
                raise _Refused(
                    f"{key!r} is the object already at {seen[address]!r} (a loop, or one object under two names): "
                    "refused"
                )
            seen[address] = key
            declared += OBJECT_BYTES
            if isinstance(item, h5py.Group):
                if depth == MAX_DEPTH:
                    raise _Refused(f"groups nested more than {MAX_DEPTH} deep (at {key!r}): refused")
                stack.append((key, item, depth + 1))
            elif isinstance(item, h5py.Dataset):
                if item.is_virtual or item.external:
                    raise _Refused(
                        f"{key!r} is stored outside the file ({'virtual' if item.is_virtual else 'external'} "
                        "storage), which would read other files: refused"
                    )
                if not _readable(item.dtype):
                    raise _Refused(f"{key!r} has a type spikefuse does not read ({item.dtype}): refused")
                declared += int(item.size) * (OBJECT_BYTES if item.dtype.hasobject else item.dtype.itemsize)
                datasets[key] = item
            if declared > budget:
                raise _Refused(_too_much(budget, key))
    return datasets, declared


@contextmanager
def open_hdf5(path: str | os.PathLike, *, what: str, error: type[Exception] = ValueError) -> Iterator[HDF5File]:
    """The HDF5 file at ``path``, checked as the module says, as an :class:`HDF5File`; every problem raises
    ``error`` with the message ``"<what> <path>: ..."``. A missing file raises the OSError of ``open``.

    The file is opened once, from one open file descriptor: what is checked is what is read."""
    import h5py

    name = f"{what} {path}"
    with open(Path(path), "rb") as raw:
        budget = MAX_EXPANSION * os.fstat(raw.fileno()).st_size + _MIN_BUDGET
        try:
            file = h5py.File(raw, "r")
        except _H5PY_ERRORS as err:
            raise error(f"{name}: not a readable HDF5 file ({type(err).__name__}: {err})") from None
        with file:
            try:
                datasets, declared = _walk(file, budget)
            except _Refused as err:
                raise error(f"{name}: {err}") from None
            except _H5PY_ERRORS as err:
                raise error(f"{name}: not a readable HDF5 file ({type(err).__name__}: {err})") from None
            yield HDF5File(file, datasets, name, error, budget, declared)
