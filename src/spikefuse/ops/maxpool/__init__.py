"""Max-pooling on spikefuse's CPU kernels, in the engine's layout: the numba kernels (:mod:`.cpu`) and the autograd
operations that run them (:mod:`.autograd`), for the two modules that pool with them:

- :class:`spikefuse.nn.SpikeMaxPool2d` (and 1d/3d): spikes kept for backward as bits, torch's indices found again
  from the bits (``_SpikeMaxPoolFn``);
- :class:`spikefuse.nn.MaxPool2d`: real values, keeping int32 indices (``_MaxPoolFn``).

One package for both, apart from the linear and convolution layers' ops (:mod:`spikefuse.ops.spike_layers`): they
share these kernels, and none of those. There is no ``reference.py``: the oracle is torch's own max-pooling
(``F.max_pool1d/2d/3d``), which the kernels equal bit for bit (the forward on any input, the backward on spikes).
Here: the forms of the pooling arguments that the modules and the operations both read.
"""

from __future__ import annotations

__all__ = ["per_dim", "out_shape"]


def per_dim(dims: int, args) -> tuple:
    """``(kernel, stride, padding, dilation)`` of ``F.max_poolNd``'s ``args`` as tuples of ``dims`` entries (a
    ``None`` or empty stride is the kernel size, as torch has it)."""
    kernel, stride, padding, dilation, _ = args

    def tup(v):
        return (int(v),) * dims if isinstance(v, int) else tuple(int(e) for e in v)

    return tup(kernel), tup(stride) if stride not in (None, (), []) else tup(kernel), tup(padding), tup(dilation)


def out_shape(in_shape, kernel, stride, padding, dilation) -> tuple:
    """torch's output shape of max-pooling ``[N, C, H, W]`` without ``ceil_mode``, computed here: asking torch
    (pooling a meta tensor) took 50 us a call, more than pooling a small input."""
    n, c, *spatial = in_shape
    return (
        n,
        c,
        *(
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)
        ),
    )
