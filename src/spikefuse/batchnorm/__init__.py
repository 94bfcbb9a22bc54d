"""BatchNorm fused with the neurons: the memory-lean ``Conv/FC -> BN -> neuron`` of Liang et al. (Alg. 1-4), in one
place. The fused op keeps only the BatchNorm's input (and a residual) for backward and recomputes the normalized
input, the neurons' states and the spikes there.

- :mod:`.autograd`: the op, for any neuron of the engine on any backend (``torch.library`` custom ops and their
  autograd);
- :mod:`.cpu`: its numba pieces on the cpu backend: BatchNorm's statistics and backward, and the normalization
  that the engine's generated neuron kernels run inside their blocks (their ``_src`` variants);
- :mod:`.modules`: the modules (``BatchNormLIF1d``/``2d``, ``BatchNormNeuron``, ``ConvBatchNormLIF``);
- :mod:`.lean`: :func:`~spikefuse.nn.to_lean`, the conversion of a model to its memory-lean form.

The public names stay where users find them: the functions in :mod:`spikefuse.bn_functional` (beside the other
public functions; ``spikefuse.batchnorm_lif`` and ``batchnorm_neuron`` at the top level), the modules and
``to_lean`` in :mod:`spikefuse.nn`.
"""
