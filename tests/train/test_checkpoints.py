"""The run's files survive interruptions and failures: atomic writes, a full disk, signals during a write, stale
temp files, unreadable checkpoints, and a fresh run that would replace an earlier one."""

import csv
import errno
import os
import signal

import pytest
import torch

from spikefuse.train import ConfigError, fit, load_checkpoint
from spikefuse.train import checkpoints as C

from .test_loop import quiet, tiny_config


def _metrics_epochs(out):
    with open(out / "metrics.csv", newline="") as f:
        return [int(r["epoch"]) for r in csv.DictReader(f)]


def _no_space(monkeypatch, after_bytes=0):
    """Make the checkpoint module's writes fail with ENOSPC once ``after_bytes`` are written, as a full disk does."""
    written = [0]
    real_write = os.write

    def write(fd, data):
        if written[0] >= after_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, data[: max(1, after_bytes - written[0])])
        written[0] += n
        return n

    monkeypatch.setattr(C.os, "write", write)


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old")
    _no_space(monkeypatch, after_bytes=1000)
    with pytest.raises(ConfigError, match="cannot write .*checkpoint.pt: No space left on device; the previous "
                                          "checkpoint.pt is intact"):
        C.atomic_write(target, b"x" * 5000)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_full_disk_during_an_epochs_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    fit(tiny_config(tmp_path, epochs=1), log=quiet)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    _no_space(monkeypatch, after_bytes=4096)
    with pytest.raises(ConfigError, match="No space left on device; the previous checkpoint.pt is intact"):
        fit(tiny_config(tmp_path, epochs=2), resume=True, log=quiet)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert _metrics_epochs(tmp_path) == [1] == [r["epoch"] for r in load_checkpoint(tmp_path / "checkpoint.pt")["history"]]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_ctrl_c_during_the_write_takes_effect_after_it(tmp_path):
    # Python's own Ctrl-C handler, as in a terminal (earlier tests of a session may leave SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with C.signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                C.atomic_write(tmp_path / "f", b"whole")  # runs to the end although the signal came first
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (tmp_path / "f").read_bytes() == b"whole"


def test_sigterm_during_the_write_reaches_the_previous_handler_after_it(tmp_path):
    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Stop):
            with C.signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                C.atomic_write(tmp_path / "f", b"whole")
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "f").read_bytes() == b"whole"


def test_stale_temp_files_of_killed_writes_are_removed_by_the_next_run(tmp_path):
    stale = [".checkpoint.pt.k3j2.tmp", ".metrics.csv.a1.tmp", ".curves.png.xyz", ".curves.png.q9.png"]
    kept = [".hidden", "notes.txt", ".checkpointer.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"partial")
    fit(tiny_config(tmp_path), log=quiet)
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & set(stale)
    assert names >= set(kept) | {"checkpoint.pt", "metrics.csv", "curves.png"}


def test_fresh_run_refuses_an_earlier_run_unless_overwrite(tmp_path):
    fit(tiny_config(tmp_path, epochs=2), log=quiet)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with pytest.raises(ConfigError, match="holds an earlier run \\(checkpoint.pt, metrics.csv\\): pass --resume to "
                                          "continue it, --overwrite to replace it"):
        fit(tiny_config(tmp_path, epochs=1, lr=0.01), log=quiet)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before and _metrics_epochs(tmp_path) == [1, 2]
    fit(tiny_config(tmp_path, epochs=1, lr=0.01), log=quiet, overwrite=True)
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["config"]["lr"] == 0.01 and _metrics_epochs(tmp_path) == [1] == [r["epoch"] for r in ckpt["history"]]


def test_metrics_csv_rewritten_from_the_checkpoint_on_resume(tmp_path):
    """Rows written after the checkpoint (a crash between the two writes) are dropped when the run resumes."""
    fit(tiny_config(tmp_path, epochs=1), log=quiet)
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,0.1,0.5,0.1,0.5,1,1,2,10,100,\n")
    fit(tiny_config(tmp_path, epochs=2), resume=True, log=quiet)
    assert _metrics_epochs(tmp_path) == [1, 2]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b""), "the file is empty \\(0 bytes\\)"),
        (lambda p: p.write_bytes(b"not a zip"), "cannot read checkpoint .*: \\S"),
        (lambda p: torch.save({"version": 1, "config": {}}, p), "is incomplete: it lacks 'info', 'epoch', 'model'"),
        (lambda p: torch.save([1, 2], p), "is not a spikefuse checkpoint"),
    ],
)
def test_unreadable_checkpoints_say_why(tmp_path, make, message):
    path = tmp_path / "c.pt"
    make(path)
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(path)


def test_out_that_is_a_file_or_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        fit(tiny_config(tmp_path / "f"), log=quiet)
    with pytest.raises(ConfigError, match="cannot write to --out .*: Not a directory"):
        fit(tiny_config(tmp_path / "f" / "sub"), log=quiet)


def test_divergence_stops_before_a_checkpoint_of_it(tmp_path):
    with pytest.raises(ConfigError, match="training diverged: the training loss is nan at epoch 1/1, batch \\d+; "
                                          "lower --lr.*none was written"):
        fit(tiny_config(tmp_path, lr=1e308), log=quiet)
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "metrics.csv").exists()
