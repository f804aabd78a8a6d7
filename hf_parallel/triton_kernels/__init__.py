"""Triton kernels of hf_parallel (the @triton.jit code only; launchers live in `hf_parallel.attention` and
`hf_parallel.cache`)."""
