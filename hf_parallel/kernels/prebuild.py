"""Triton kernels built before their first launch, on threads beside the caller.

A kernel's first build in a process is slow (Triton's compiler passes and ptxas, which run without Python's
lock), and a first call on a new model would otherwise build its kernels one after another on the calling
thread, at their first launches (docs/benchmarks/gpu.md, "The first call").  Instead the call collects the launches
its forwards will make (`collecting`: each `run_kernel` inside is recorded, not made), starts a build of each one
this process has not built (`start`), and runs its forwards under `awaiting`: their first launch waits for the
builds, so what the thread does before it (torch.compile's compilation of the layers' parts, the first layer's
GEMMs) overlaps them, and the builds overlap each other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import triton

_LOCAL = threading.local()  # `launches`: launches collected, not made; `pending`: builds the next launch waits for
STARTED: set[tuple] = set()  # (device, specialization data) of the builds started in this process
_BUILDERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hf_parallel_build")


def run_kernel(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `collecting`, the launch recorded instead; inside `awaiting`, made
    once the awaited builds are done.  Multiplies and adds fuse (`enable_fp_fusion`, as the kernels were tuned
    and tested), whatever the installed Triton's default (Triton 3.10 turns it off)."""
    kwargs.setdefault("enable_fp_fusion", True)
    launches = getattr(_LOCAL, "launches", None)
    if launches is not None:
        launches.append((kernel, grid, args, kwargs))
        return
    if getattr(_LOCAL, "pending", None):
        pending, _LOCAL.pending = _LOCAL.pending, None
        concurrent.futures.wait(pending)  # a build that failed fails again, with its error, at this launch
    kernel[grid](*args, **kwargs)


def recording() -> bool:
    """Whether this thread is inside `collecting`, where a launch is recorded and nothing runs."""
    return getattr(_LOCAL, "launches", None) is not None


@contextlib.contextmanager
def collecting():
    """The launches `run_kernel` is asked for inside the block, (kernel, grid, args, kwargs) each, not made."""
    launches: list = []
    _LOCAL.launches = launches
    try:
        yield launches
    finally:
        del _LOCAL.launches


@contextlib.contextmanager
def awaiting(futures: list[Future]):
    """The block's first `run_kernel` on this thread waits for `futures` (builds `start` returned)."""
    _LOCAL.pending = list(futures)
    try:
        yield
    finally:
        _LOCAL.pending = None


def start(device: torch.device, launches: list) -> list[Future]:
    """A build on a thread for each of `launches` (from `collecting`) that this process has not built or started."""
    futures = []
    with torch.cuda.device(device):
        for kernel, grid, args, kwargs in launches:
            data = _specialization(kernel, grid, args, kwargs)  # None: built in this process
            if data is not None and (device, data) not in STARTED:  # Triton keeps a table per device
                STARTED.add((device, data))
                futures.append(_BUILDERS.submit(_build, device, kernel, grid, args, kwargs))
    return futures


def _specialization(kernel, grid, args, kwargs) -> str | None:
    """The launch's specialization data (Triton's hook before a build hands it over and skips the build): a key of
    the build, or None where this process has the kernel built already.  The warm-up also makes the kernel's
    table for the device here, not on two build threads at once."""
    me, found, previous = threading.get_ident(), [], triton.knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        if threading.get_ident() != me:  # another thread's build: as it would be without this hook
            return previous(*args, **kwargs) if previous else None
        found.append(kwargs["compile"]["specialization_data"])
        return True

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        kernel.warmup(*args, grid=grid, **kwargs)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    return found[0] if found else None


def _build(device: torch.device, kernel, grid, args, kwargs) -> None:
    with torch.cuda.device(device):  # Triton builds for the thread's current device
        kernel.warmup(*args, grid=grid, **kwargs)
