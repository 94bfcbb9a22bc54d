"""Run the test suite's Triton tests on a CUDA GPU instead of Triton's interpreter.

The tests draw their inputs on the CPU and compare the Triton backend with the CPU reference. With
``SPIKEFUSE_TEST_TRITON=cuda`` (see ``tests/conftest.py``) every Triton kernel launch moves the storages of its CPU
tensor arguments to the GPU, runs the compiled kernel there and copies every storage back, so the same tests
compare the compiled GPU kernels with the CPU reference, bit for bit where they ask for it. Storages shared by two
arguments (grad_x written over a saved tensor) stay shared on the GPU. The launchers' own CUDA paths (device guard,
streams, CUDA tensors from the public API) are covered by ``tests/ops/test_triton_cuda.py``. The two tests of the
error for CPU tensors without the interpreter skip in this mode (``GPU_TEST_MODE``).

CI has no GPU and never takes this path.
"""

from __future__ import annotations

import os

GPU_TEST_MODE = os.environ.get("SPIKEFUSE_TEST_TRITON") == "cuda"


def install() -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # before anything imports triton: kernels compile for the GPU
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("SPIKEFUSE_TEST_TRITON=cuda needs a CUDA GPU; unset it to run Triton's interpreter")
    from triton.runtime.jit import JITFunction

    import spikefuse.ops

    # The backends accept the tests' CPU tensors for backend="triton", as under the interpreter.
    spikefuse.ops.triton_interpreted = lambda: True
    launch = JITFunction.run

    def run_on_gpu(self, *args, grid, warmup, **kwargs):
        storages: dict[int, tuple] = {}

        def to_gpu(a):
            if not isinstance(a, torch.Tensor) or a.device.type != "cpu":
                return a
            host = a.untyped_storage()
            key = host.data_ptr() if host.nbytes() else id(host)
            if key not in storages:
                device = torch.UntypedStorage(host.nbytes(), device="cuda")
                device.copy_(host)
                storages[key] = (host, device)
            return torch.empty(0, dtype=a.dtype, device="cuda").set_(
                storages[key][1], a.storage_offset(), a.size(), a.stride()
            )

        result = launch(self, *map(to_gpu, args), grid=grid, warmup=warmup, **{k: to_gpu(v) for k, v in kwargs.items()})
        if not storages:  # a launch on CUDA tensors (the public API's): as unpatched, no sync (CUDA-graph capture)
            return result
        torch.cuda.synchronize()
        for host, device in storages.values():
            host.copy_(device)
        return result

    JITFunction.run = run_on_gpu
