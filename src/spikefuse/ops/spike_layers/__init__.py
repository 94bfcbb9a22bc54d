"""The ops of the linear and convolution layers fed by spikes (:mod:`spikefuse.nn.spike_layers`), laid out as the
neuron engine's (:mod:`spikefuse.ops.engine`) are, side by side:

- :mod:`.cpu`: the numba kernels of the spike-sparse products (``SpikeLinear(sparse=...)``, and the recurrent layer's
  sparse current, :mod:`spikefuse.ops.recurrent.cpu`), their crossover constants and the CSR of inputs with values
  and of output gradients;
- :mod:`.reference`: those products in plain torch ops, summed in the kernels' order: their oracle, bit for bit;
- :mod:`.autograd`: the autograd operations of ``SpikeLinear`` and ``SpikeConv1d/2d/3d`` (the input kept as bits),
  and the products of an input with values and of a sparse output gradient.

The modules keep the validation and the choice of a path (dense, sparse, values); the operations and their kernels
are here. One package for the linear layer and the convolution: the convolution has no kernel of its own (torch's,
on the unpacked bits), so it is one autograd operation beside the linear layer's, which shares its saving of the
input as bits. The max-pool's kernels serve a module of real values too and share nothing with these:
:mod:`spikefuse.ops.maxpool`.
"""
