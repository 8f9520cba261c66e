"""Triton kernels of kalmanscan (``@triton.jit`` functions only; launch wrappers live in
``kalmanscan``). Importing this package does not import triton: each kernel module does."""
