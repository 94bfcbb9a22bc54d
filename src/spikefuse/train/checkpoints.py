"""The files of a run that must survive anything: atomic writes, checkpoints with every RNG state, the guard that
keeps a fresh run from replacing an earlier one, and the cleanup of interrupted writes.

A write goes to a temp file beside its target (``.<name>.<random>.tmp``), is fsynced and renamed over the target,
so a reader sees the old file or the new one, never a part. SIGINT and SIGTERM that arrive while an epoch's files
are written (:func:`signals_deferred`) take effect once they are all written, so a checkpoint and ``metrics.csv``
always describe the same epochs; a kill -9 can still leave a temp file, which the next run in that folder removes
(:func:`remove_stale_temp_files`). A write that fails (a full disk) removes its temp file, leaves the previous file
as it was, and raises :class:`ConfigError` naming the file and the cause.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import random
import re
import signal
import tempfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, TrainConfig, a_or_an, check_resume, saved_config_problem

__all__ = [
    "CHECKPOINT_NAME",
    "METRICS_NAME",
    "CURVES_NAME",
    "CHECKPOINT_VERSION",
    "atomic_write",
    "save_checkpoint",
    "load_checkpoint",
    "seed_everything",
    "remove_stale_temp_files",
    "lock_out_dir",
    "unlock_out_dir",
    "LOCK_NAME",
    "signals_deferred",
    "check_out_dir",
]

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.csv"
CURVES_NAME = "curves.png"
CHECKPOINT_VERSION = 1
TEMP_SUFFIX = ".tmp"
WRITE_TEST_NAME = "write-test"
# What a checkpoint must hold for eval and resume, and of which type.
_REQUIRED_KEYS = {
    "config": dict,
    "info": dict,
    "epoch": int,
    "model": dict,
    "optimizer": dict,
    "history": list,
    "rng": dict,
}
#: The training loop's generators, by their names among a checkpoint's RNG states.
GENERATORS = ("data", "encode")
# The columns of a history row that are read back (the curves, the last epoch's report); the others are only
# written to metrics.csv.
_HISTORY_NUMBERS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_states(gens: dict[str, torch.Generator]) -> dict:
    np_state = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        # stored as a tensor + plain values so the checkpoint loads with torch.load(weights_only=True)
        "numpy": {
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": random.getstate(),
        "generators": {name: g.get_state() for name, g in gens.items()},
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict, gens: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(_numpy_state(states["numpy"]))
    random.setstate(_python_state(states["python"]))
    for name, g in gens.items():
        g.set_state(states["generators"][name])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _numpy_state(n: dict) -> tuple:
    return ("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])


def _python_state(py) -> tuple:
    return (py[0], tuple(py[1]), py[2])


def _rng_problem(states: dict) -> str | None:
    """What keeps a checkpoint's RNG states from loading, found by loading each into a new generator (the
    process's own stay as they are); None if they all load."""
    loads = {
        "torch": lambda: torch.Generator().set_state(states["torch"]),
        "numpy": lambda: np.random.RandomState().set_state(_numpy_state(states["numpy"])),
        "python": lambda: random.Random().setstate(_python_state(states["python"])),
        "generators": lambda: [torch.Generator().set_state(states["generators"][name]) for name in GENERATORS],
    }
    if "cuda" in states and torch.cuda.is_available():  # each GPU's state, checked on one GPU
        loads["cuda"] = lambda: [torch.Generator("cuda").set_state(state) for state in states["cuda"]]
    for part, load in loads.items():
        try:
            load()
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as err:
            why = f"lacks {err}" if isinstance(err, KeyError) else _first_line(err)
            return f"its RNG states do not load: {part}: {why}"
    return None


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename). On any failure the
    temp file is removed and ``path`` is left as it was; an ``OSError`` becomes a :class:`ConfigError`."""
    path = Path(path)
    try:
        fd, tmp = _temp_file(path)
    except OSError as err:
        raise ConfigError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files: the run's files get the usual mode
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise ConfigError(
                f"cannot write {path}: {err.strerror or err}; the previous {path.name} is intact"
            ) from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_file(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)


def remove_stale_temp_files(out: str | os.PathLike) -> list[Path]:
    """Remove the temp files that interrupted writes (kill -9, power loss) left in ``out``; returns them.

    They are ``.<file>.<random>.tmp`` for each of the run's files (``.<file>.<random>.png`` from earlier versions),
    ``<random>`` the 8 characters ``tempfile.mkstemp`` draws: only names of that exact form are removed, so a file
    of the user's (``.checkpoint.pt.backup``) stays."""
    out = Path(out)
    names = (CHECKPOINT_NAME, METRICS_NAME, CURVES_NAME, WRITE_TEST_NAME)
    ours = re.compile(r"\.(" + "|".join(re.escape(n) for n in names) + r")\.[a-z0-9_]{8}\.(tmp|png)")
    stale = [p for p in out.glob(".*") if ours.fullmatch(p.name) and p.is_file()]
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()
    return stale


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (:func:`atomic_write`). It is serialized in memory first, so a
    failing disk raises ``OSError`` from a plain write (not from inside torch's zip writer)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(path, buffer.getbuffer())


def load_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint written by ``spikefuse train``, read without unpickling code (``torch.load(weights_only=True)``)
    and checked for its version and every field eval and resume use (types, the config's settings, finite
    weights, RNG states that load); a missing, corrupt, foreign or malformed file raises a one-line
    :class:`ConfigError` naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}")
    ckpt = _read(path)
    if not isinstance(ckpt, dict) or type(ckpt.get("version")) is not int or ckpt["version"] != CHECKPOINT_VERSION:
        raise ConfigError(f"{path} is not a spikefuse checkpoint (version {CHECKPOINT_VERSION})")
    missing = [k for k in _REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise ConfigError(f"checkpoint {path} is incomplete: it lacks {', '.join(repr(k) for k in missing)}")
    problem = _malformed(ckpt)
    if problem:
        raise ConfigError(f"checkpoint {path} is malformed: {problem}")
    return ckpt


def _read(path: Path):
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise ConfigError(f"cannot read checkpoint {path}: {err.strerror or err}") from None
    if not head:
        raise ConfigError(f"cannot read checkpoint {path}: the file is empty (0 bytes)")
    if head != b"PK\x03\x04":
        raise ConfigError(f"cannot read checkpoint {path}: not a file that torch.save wrote (a zip archive)")
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            f"cannot read checkpoint {path}: the file is truncated or corrupt (its zip archive has no end)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # torch's advice (weights_only=False) would run the file's code
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"a {found.group(1)}" if found else "objects other than tensors and plain values"
        raise ConfigError(
            f"cannot read checkpoint {path}: it holds {what}, which checkpoints never hold (spikefuse reads them "
            "without running code from the file)"
        ) from None
    except Exception as err:
        raise ConfigError(f"cannot read checkpoint {path}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _malformed(ckpt: dict) -> str | None:
    """What is wrong with the fields of a checkpoint (its version and keys checked), or None."""
    for key, kind in _REQUIRED_KEYS.items():
        value = ckpt[key]
        if kind is int and (type(value) is not int or value < 1):
            return f"its {key} must be an int >= 1, got {value!r}"
        if not isinstance(value, kind):
            return f"its {key} is {a_or_an(type(value).__name__)}, not {a_or_an(kind.__name__)}"
    return (
        saved_config_problem(ckpt["config"])
        or _weights_problem(ckpt["model"])
        or _optimizer_problem(ckpt["optimizer"])
        or _history_problem(ckpt["history"], ckpt["epoch"])
        or _rng_problem(ckpt["rng"])
    )


def _weights_problem(model: dict) -> str | None:
    for name, value in model.items():
        if not isinstance(name, str):
            return f"its model holds the key {name!r}, not a parameter's name"
        if not isinstance(value, torch.Tensor):
            return f"its model's {name!r} is {a_or_an(type(value).__name__)}, not a tensor"
        if value.layout != torch.strided or value.is_meta or value.is_quantized or value.is_complex():
            return f"its model's {name!r} is not a dense tensor of real numbers"
    if not all(bool(torch.isfinite(v).all()) for v in model.values() if v.is_floating_point()):
        return "its model's weights hold NaN or inf"
    return None


def _optimizer_problem(optimizer: dict) -> str | None:
    for key, kind in (("state", dict), ("param_groups", list)):
        if key not in optimizer:
            return f"its optimizer lacks {key!r}"
        if not isinstance(optimizer[key], kind):
            return f"its optimizer's {key} is {a_or_an(type(optimizer[key]).__name__)}, not {a_or_an(kind.__name__)}"
    if not all(isinstance(group, dict) for group in optimizer["param_groups"]):
        return "its optimizer's param_groups are not all dicts"
    return None


def _history_problem(history: list, epoch: int) -> str | None:
    for i, row in enumerate(history, 1):
        if not isinstance(row, dict):
            return f"its history's row {i} is {a_or_an(type(row).__name__)}, not a dict"
        for column in _HISTORY_NUMBERS:
            if column not in row:
                return f"its history's row {i} lacks {column!r}"
            value = row[column]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"its history's row {i} holds {column} {value!r}, not a number"
    epochs = [row["epoch"] for row in history]
    if epochs != list(range(1, epoch + 1)):  # a row per epoch so far, as training appends them
        shown = ", ".join(map(str, epochs[:8])) + (", ..." if len(epochs) > 8 else "")
        return f"its history holds epochs [{shown}], not 1 to its epoch {epoch}"
    return None


#: Settings of an optimizer's param group that choose how its step runs, not what it computes: a resumed run takes
#: its own (a checkpoint of the multi-tensor step resumes with the fused one, where the device has it).
_IMPLEMENTATION_SETTINGS = ("foreach", "fused", "capturable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, ckpt: dict, path) -> None:
    """``optimizer.load_state_dict`` with a one-line error when the state does not fit the model's parameters or
    the optimizer (Adam would fail at its first step, or train on with moments of other shapes)."""

    def refuse(why: str):
        raise ConfigError(f"the optimizer state in {path} does not fit the model's parameters: {why}")

    fresh = optimizer.state_dict()["param_groups"]
    groups = []
    for saved, group in zip(ckpt["optimizer"]["param_groups"], fresh):
        # how the step runs (fused, foreach, ...) is this run's; what it computes is the checkpoint's
        saved = {**saved, **{key: group[key] for key in _IMPLEMENTATION_SETTINGS if key in group}}
        for key, value in group.items():  # each setting as the fresh optimizer's, where both have it
            if key in saved and not _same_kind(saved[key], value):
                refuse(f"its param group's {key} is {saved[key]!r}")
        groups.append(saved)
    groups += ckpt["optimizer"]["param_groups"][len(groups) :]  # more groups than the model's: refused below
    try:
        optimizer.load_state_dict({**ckpt["optimizer"], "param_groups": groups})
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        refuse(f"{'lacks ' if isinstance(err, KeyError) else ''}{_first_line(err)}")
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name, value in state.items() if isinstance(state, dict) else [("state", state)]:
                if not isinstance(value, torch.Tensor) or (value.ndim and value.shape != param.shape):
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    refuse(f"its {name} is {shape} for a parameter of shape {tuple(param.shape)}")


def _same_kind(saved, fresh) -> bool:
    """Whether ``saved`` is a value of the kind of ``fresh`` (a setting of a param group): a flag, a number, a
    tuple of as many numbers; ``params`` and settings without a value (None) take any."""
    if isinstance(fresh, bool):
        return isinstance(saved, bool)
    if isinstance(fresh, (int, float)):
        return not isinstance(saved, bool) and isinstance(saved, (int, float)) and math.isfinite(saved)
    if isinstance(fresh, tuple):
        return isinstance(saved, (tuple, list)) and len(saved) == len(fresh) and all(map(_same_kind, saved, fresh))
    return True


def load_model_state(model: torch.nn.Module, ckpt: dict, path) -> None:
    """``model.load_state_dict`` with a one-line error when the weights do not fit the model the config builds."""
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as err:
        first = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise ConfigError(
            f"the weights in {path} do not fit the model {ckpt['config'].get('model')!r} of its config: {first}"
        ) from None


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT and SIGTERM back while the body runs (an epoch's files being written), then deliver them.

    Outside the main thread (where handlers cannot be set) the body runs unprotected; atomic writes still keep
    every file whole there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for signum in dict.fromkeys(pending):  # to the restored handlers: they raise, exit or ignore as they would have
        signal.raise_signal(signum)


def check_out_dir(out: Path, resume, overwrite: bool) -> None:
    """Make ``out`` and check that it can be written; refuse to start a fresh run over an earlier one unless
    ``overwrite``, and to resume another folder's checkpoint into a folder that holds a run of its own. Raises
    :class:`ConfigError` with the way out."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = _temp_file(out / WRITE_TEST_NAME)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"cannot write to --out {out}: {err.strerror or err}") from None
    earlier = [name for name in (CHECKPOINT_NAME, METRICS_NAME) if (out / name).exists()]
    if earlier and not resume and not overwrite:
        raise ConfigError(
            f"--out {out} holds an earlier run ({', '.join(earlier)}): pass --resume to continue it, --overwrite to "
            "replace it, or choose another --out"
        )
    if earlier and resume not in (None, True, False) and Path(resume).resolve().parent != out.resolve():
        raise ConfigError(
            f"--resume {resume} continues the run of {Path(resume).parent}, but --out {out} holds another run "
            f"({', '.join(earlier)}) that it would replace: resume into --out {Path(resume).parent}, or into an "
            "empty --out"
        )


LOCK_NAME = ".spikefuse-train.lock"
_held: dict[Path, int] = {}


def lock_out_dir(out: Path) -> None:
    """Take ``out``'s lock for this process until :func:`unlock_out_dir` (or the process ends, however it ends):
    a second run into the same folder at the same time is refused instead of writing over the first's files."""
    import fcntl

    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its holder ended and removed it between open and lock
            raise BlockingIOError
    except OSError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"--out {out} is in use by another spikefuse train (process {holder}): wait for it to end, "
            "or choose another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[out.resolve()] = fd


def unlock_out_dir(out: Path) -> None:
    """Release ``out``'s lock and remove its file (still holding the lock: a run that opened it meanwhile sees the
    file gone and does not take a lock nobody can see)."""
    fd = _held.pop(out.resolve(), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            (out / LOCK_NAME).unlink()
        os.close(fd)


def load_resume_checkpoint(path, cfg: TrainConfig) -> dict:
    ckpt = load_checkpoint(path)
    check_resume(ckpt["config"], cfg)
    return ckpt
