"""Triton kernels built before their first launch, on threads beside the caller.

A kernel's first build in a process is slow (Triton's compiler passes and ptxas, which run without Python's
lock), and a first call on a new model would otherwise build its kernels one after another on the calling
thread, at their first launches (docs/benchmarks/gpu.md, "The first call").  Instead the call collects the launches
its forwards will make (`collecting`: each `run_kernel` inside is recorded, not made), starts a build of each one
this process has not built (`start`), and runs its forwards under `awaiting`: their first launch waits for the
builds, so what the thread does before it (torch.compile's compilation of the layers' parts, the first layer's
GEMMs) overlaps them, and the builds overlap each other.

Triton keeps what it builds in its cache on disk, so only a machine's first start builds for long (tens of seconds
on a new model); `announce` says so on stderr where builds outlast NOTE_AFTER_S: a line once they have run that
long, with where Triton keeps them, and one when they are done (`kernels.notices`; a command's --quiet turns
both off).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import triton

from .notices import note, notes_on

_LOCAL = threading.local()  # `launches`: launches collected, not made; `pending`: builds the next launch waits for
STARTED: set[tuple] = set()  # (device, specialization data) of the builds started in this process
_BUILDERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hf_parallel_build")
NOTE_AFTER_S = 2.0  # builds that Triton's cache on disk holds end sooner; longer ones are its compiler at work


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


def announce(futures: list[Future], after_s: float = NOTE_AFTER_S, cache: str | None = None) -> threading.Thread | None:
    """Where `futures` (builds `start` returned) are not all done `after_s` seconds on, one note saying that Triton
    builds the kernels of a first call and where it keeps them (`cache`, default Triton's cache folder), and one
    when they are all done, with how long they took; nothing where they end sooner (Triton's cache on disk held
    them) or notes are off.  Watches from a thread of its own, returned (None where there is nothing to watch)."""
    if not futures or not notes_on():
        return None
    args = (list(futures), after_s, cache or cache_folder())
    watcher = threading.Thread(target=_watch, args=args, name="hf_parallel_build_note", daemon=True)
    watcher.start()
    return watcher


def cache_folder() -> str:
    """Where Triton keeps the kernels it builds (TRITON_CACHE_DIR, else ~/.triton/cache)."""
    knobs = getattr(getattr(triton, "knobs", None), "cache", None)
    folder = getattr(knobs, "dir", None) or os.environ.get("TRITON_CACHE_DIR")
    return str(folder or os.path.join(os.path.expanduser("~"), ".triton", "cache"))


def _watch(futures: list[Future], after_s: float, cache: str) -> None:
    start = time.perf_counter()
    _, running = concurrent.futures.wait(futures, timeout=after_s)
    if not running:
        return
    count = f"{len(futures)} Triton kernel{'s' if len(futures) > 1 else ''}"
    note(f"building {count} for this model's first call (once: later starts load them from {cache})")
    concurrent.futures.wait(futures)
    failed = sum(f.exception() is not None for f in futures)
    said = f"; {failed} failed, and fail again at their launch" if failed else ""
    note(f"built {count} in {time.perf_counter() - start:.1f} s, into {cache}{said}")
