import os

from tests import triton_on_cuda

if triton_on_cuda.GPU_TEST_MODE:
    # On a GPU machine: the Triton tests run the compiled kernels on the GPU (tests/triton_on_cuda.py).
    triton_on_cuda.install()
else:
    # The Triton kernels run on the CPU only through Triton's interpreter, which must be chosen before triton is
    # imported; the backend reads it at call time, so setting it for the whole session is harmless elsewhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")
