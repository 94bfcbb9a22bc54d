import os

# The Triton kernels run on the CPU only through Triton's interpreter, which must be chosen before triton is
# imported; the backend reads it at call time, so setting it for the whole session is harmless elsewhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
