"""Beyond one device: the temporal-fusion paper's time split across ranks (Sec. 3.3) and data-parallel training,
on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

- :mod:`spikefuse.distributed.timesplit`: every rank holds a contiguous block of time steps; LIF layers pass the
  membrane state down the ranks (pipelined over neuron chunks), BatchNorm synchronizes its statistics.
- :mod:`spikefuse.distributed.ddp`: spawn or join a process group and wrap models in DDP.
"""

from . import ddp
from .ddp import launch, run_data_parallel, wrap_model
from .timesplit import (
    TimeSplitBatchNorm,
    TimeSplitLIF,
    allreduce_gradients,
    convert_batchnorm,
    convert_timesplit,
    gather_time,
    local_time_range,
    split_time,
    time_partition,
    time_reduce,
    timesplit_lif,
    timesplit_neuron,
)

__all__ = [
    "ddp",
    "launch",
    "run_data_parallel",
    "wrap_model",
    "TimeSplitLIF",
    "TimeSplitBatchNorm",
    "timesplit_lif",
    "timesplit_neuron",
    "time_partition",
    "local_time_range",
    "split_time",
    "gather_time",
    "time_reduce",
    "allreduce_gradients",
    "convert_timesplit",
    "convert_batchnorm",
]
