"""Triton kernels (the `@triton.jit` code) and `prebuild`, through which every launch goes.

The launchers live with their callers: the attention kernel's in `hf_parallel.attention.launcher`, the
K/V write's in `hf_parallel.row.cache`.  Importing this package imports no Triton.
"""
