"""Beyond one device: the temporal-fusion paper's time split across ranks (Sec. 3.3) and data-parallel training,
on ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

- :mod:`spikefuse.distributed.timesplit`: every rank holds a contiguous block of time steps; LIF layers pass the
  membrane state down the ranks (pipelined over neuron chunks), BatchNorm synchronizes its statistics.
- :mod:`spikefuse.distributed.ddp`: spawn or join a process group and wrap models in DDP.
"""

from . import ddp, timesplit
from .ddp import launch, run_data_parallel, wrap_model
from .timesplit import *  # noqa: F403  (the names listed in timesplit.__all__)

__all__ = ["ddp", "launch", "run_data_parallel", "wrap_model", *timesplit.__all__]
