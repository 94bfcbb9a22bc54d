"""The training loop behind ``spikefuse train`` / ``spikefuse eval``: data, model, Adam + cross-entropy on the
time-averaged output, per-epoch metrics, atomic checkpoints with every RNG state, and exact resumption.

Modules: :mod:`~spikefuse.train.config` (the settings and :class:`ConfigError`), :mod:`~spikefuse.train.checkpoints`
(the run's files and what keeps them whole), :mod:`~spikefuse.train.loop` (epochs, :func:`fit`, evaluation),
:mod:`~spikefuse.train.reports` (metrics, curves, memory) and :mod:`~spikefuse.train.parallel` (data parallel).

Determinism: ``seed`` seeds torch, numpy and python's ``random`` before the model is built; the training order
comes from a dedicated ``torch.Generator`` (the DataLoader's, ``num_workers=0``), Poisson encoding of training
batches from another, and every evaluation encodes the test set with a fresh generator seeded from ``seed`` (so the
test accuracy of an epoch does not depend on how the run got there, and ``spikefuse eval`` reproduces it). The
checkpoint holds the model, the optimizer, the epoch, the metric history and the states of all four RNGs plus both
generators: resuming from epoch ``e`` continues to exactly the weights and metrics of an uninterrupted run (on the
same machine, thread count and backend).

Files in ``out``: ``metrics.csv`` (one row per epoch, :data:`METRIC_COLUMNS`), ``checkpoint.pt`` and
``curves.png`` (loss and accuracy per epoch), all rewritten atomically after every epoch, as a pair that SIGINT and
SIGTERM do not split. A fresh run refuses an ``out`` that holds an earlier run unless told ``overwrite`` (or
``resume``); temp files that a killed run left behind are removed by the next run in the folder. A loss or weights
that turn NaN or inf stop the run with :class:`ConfigError`, before a checkpoint of them is written.

Data parallel (:func:`fit_data_parallel`, ``spikefuse train --nproc N`` or under ``torchrun``): ``batch_size`` is the
global batch, split evenly over the ranks. Every rank builds the same loader, generators and model, encodes the
same global batch and trains on its contiguous shard (:func:`spikefuse.distributed.ddp.shard`); the loss is each
rank's sum over its shard divided by the global batch size (times the world size, which DDP's gradient averaging
divides out), so a step is that of one process on the joint batch, BatchNorm included (converted to the
synchronized :class:`~spikefuse.distributed.TimeSplitBatchNorm`), up to the order of the floating-point reductions.
Evaluation is sharded the same way and the sums are all-reduced. Only rank 0 logs and writes the files; the
checkpoint holds the plain (unconverted) model's state and loads in a run with any number of processes. A final
training batch with fewer samples than ranks is skipped (each rank would otherwise get an empty shard).
"""

from ..compat.spikingjelly import use_spikingjelly_neurons
from .checkpoints import load_checkpoint, save_checkpoint
from .config import ConfigError, TrainConfig
from .loop import FIRST_BATCH_NOTE, evaluate_checkpoint, fit, make_model, reset_states, run_epoch
from .parallel import fit_data_parallel
from .reports import METRIC_COLUMNS, peak_memory_mb, plot_curves, write_metrics

__all__ = [
    "TrainConfig",
    "ConfigError",
    "METRIC_COLUMNS",
    "fit",
    "fit_data_parallel",
    "evaluate_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "peak_memory_mb",
    "use_spikingjelly_neurons",
    "reset_states",
    "run_epoch",
    "FIRST_BATCH_NOTE",
    "make_model",
    "write_metrics",
    "plot_curves",
]
