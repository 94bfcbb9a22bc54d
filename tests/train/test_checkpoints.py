"""The run's files survive interruptions and failures: atomic writes, a full disk, signals during a write, stale
temp files, unreadable checkpoints, and a fresh run that would replace an earlier one."""

import contextlib
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
    with pytest.raises(
        ConfigError, match="cannot write .*checkpoint.pt: No space left on device; the previous checkpoint.pt is intact"
    ):
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
    assert (
        _metrics_epochs(tmp_path) == [1] == [r["epoch"] for r in load_checkpoint(tmp_path / "checkpoint.pt")["history"]]
    )
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
    # the temp names tempfile.mkstemp makes (8 random characters); files of the user's that merely start alike stay
    stale = [".checkpoint.pt.k3j2x9_a.tmp", ".metrics.csv.a1b2c3d4.tmp", ".curves.png.q9w8e7r6.png"]
    kept = [
        ".hidden",
        "notes.txt",
        ".checkpointer.tmp",
        ".checkpoint.pt.backup",
        ".metrics.csv.mine.tmp",
        ".curves.png.xyz",
    ]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"partial")
    fit(tiny_config(tmp_path), log=quiet)
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & set(stale)
    assert names >= set(kept) | {"checkpoint.pt", "metrics.csv", "curves.png"}


def test_fresh_run_refuses_an_earlier_run_unless_overwrite(tmp_path):
    fit(tiny_config(tmp_path, epochs=2), log=quiet)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    with pytest.raises(
        ConfigError,
        match="holds an earlier run \\(checkpoint.pt, metrics.csv\\): pass --resume to "
        "continue it, --overwrite to replace it",
    ):
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
    with pytest.raises(
        ConfigError,
        match="training diverged: NaN or inf reached the spiking neurons at epoch 1/1, batch \\d+ \\(the input holds NaN "
        "or inf \\(first at step 0, neuron 0 of \\d+\\)\\); lower --lr.*none was written",
    ):
        fit(tiny_config(tmp_path, lr=1e308), log=quiet)
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "metrics.csv").exists()


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    """Two runs into one --out at once: the second is refused while the first holds the folder's lock (released
    when the first ends however it ends: here another process holds it)."""
    import subprocess
    import sys
    import time

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from spikefuse.train.checkpoints import lock_out_dir; "
                f"lock_out_dir(Path({str(tmp_path)!r})); print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            ConfigError,
            match=rf"--out {tmp_path} is in use by another spikefuse train \(process "
            rf"{holder.pid}\)",
        ):
            fit(tiny_config(tmp_path), log=quiet)
        assert not (tmp_path / "metrics.csv").exists()
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    fit(tiny_config(tmp_path), log=quiet)  # the lock died with its holder
    assert (tmp_path / "metrics.csv").exists()


def test_resume_never_replaces_another_run(tmp_path):
    """--resume <run A's checkpoint> --out <run B>: refused, run B's files untouched; into an empty folder it
    continues A's run there."""
    fit(tiny_config(tmp_path / "a", epochs=1), log=quiet)
    fit(tiny_config(tmp_path / "b", epochs=1, lr=0.01), log=quiet)
    before = (tmp_path / "b" / "checkpoint.pt").read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"--resume .*a/checkpoint.pt continues the run of .*a, but --out .*b holds "
        r"another run",
    ):
        fit(tiny_config(tmp_path / "b", epochs=2), resume=tmp_path / "a" / "checkpoint.pt", log=quiet)
    assert (tmp_path / "b" / "checkpoint.pt").read_bytes() == before and _metrics_epochs(tmp_path / "b") == [1]
    fit(tiny_config(tmp_path / "c", epochs=2), resume=tmp_path / "a" / "checkpoint.pt", log=quiet)
    assert _metrics_epochs(tmp_path / "c") == [1, 2]


def test_a_failed_start_leaves_no_folder(tmp_path):
    with pytest.raises(ConfigError, match="empty"):
        from tests.data.test_mnist import write_mnist

        write_mnist(tmp_path / "mnist", n_train=0, n_test=3)
        fit(
            tiny_config(
                tmp_path / "run", dataset="mnist", data_dir=str(tmp_path / "mnist"), train_subset=None, test_subset=None
            ),
            log=quiet,
        )
    assert not (tmp_path / "run").exists()


def _descendants(pid: int) -> set[int]:
    """The living descendants of ``pid``, from /proc."""
    from pathlib import Path

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc (Linux)")
def test_ranks_end_with_their_parent(tmp_path):
    """kill -9 of `spikefuse train --nproc 2`: its ranks end too, instead of training on and writing the run."""
    import subprocess
    import sys
    import time

    command = [
        sys.executable,
        "-m",
        "spikefuse.cli",
        "train",
        "--nproc",
        "2",
        "--epochs",
        "1000",
        "--batch-size",
        "8",
        "--T",
        "2",
        "--train-subset",
        "32",
        "--test-subset",
        "16",
        "--neuron-backend",
        "reference",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
    ]
    parent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in parent.stdout:  # the ranks are up once the first epoch ends
            if line.startswith("epoch 1/"):
                break
        ranks = _descendants(parent.pid)
        assert len(ranks) >= 2, ranks
        parent.kill()
        parent.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(
            os.path.exists(f"/proc/{p}") and not open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
            for p in ranks
        ):
            time.sleep(0.2)
        alive = [
            p
            for p in ranks
            if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        ]
        assert not alive, f"ranks still running after their parent died: {alive}"
    finally:
        parent.kill()
        for p in _descendants(parent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
