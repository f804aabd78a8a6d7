"""How many threads torch computes on, on the CPU: the CPUs this process may use, less those other work keeps busy.

torch starts a thread for every core it sees in the process's affinity mask, not for the CPUs a container's cgroup
quota allows, and an OpenMP thread that shares its core with another busy process holds up every parallel region
of the others: on 2 cores with one kept busy by another job, SmolLM2 runs several times slower on 2 threads than
on 1 (docs/guides/cli.md, "Threads on the CPU").  So the command line and `load_smollm2` (and `load_model` on the
CPU) choose:

    usable_cpus      the CPUs of the affinity mask (`os.sched_getaffinity`), capped by a cgroup CPU quota
                     (cgroup v2's `cpu.max`, v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`, of this process's
                     cgroup and each above it), rounded up
    busy_cpus        how many of the affinity mask's CPUs other work keeps busy: their busy share in /proc/stat
                     from the command's start to the model's load (`mark_start`; elsewhere over SAMPLE_S seconds
                     of sleep), less this process's own share
    default_threads  usable_cpus, less what the busy CPUs take from the mask, rounded (half a CPU busy or more
                     counts), at least 1

`choose_threads` applies it once per process; an explicit count wins: a command's `--threads N` (`requested`),
the OMP_NUM_THREADS or MKL_NUM_THREADS environment variables, or a `torch.set_num_threads` called before the
first model loads (a count other than torch's own default).  Where the machine looks oversubscribed (other work
busy, so the threads exceed the CPUs left) one note says so, naming the flag (`kernels.notices`).

This module imports no torch until `choose_threads` runs: the command line reads its flags first.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

from ..kernels.notices import note

SAMPLE_S = 0.2  # how long /proc/stat is watched for other work, once per process
CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_STAT = Path("/proc/stat")
SYS_CPUS = Path("/sys/devices/system/cpu")
PYTHON_FLAG = "torch.set_num_threads({})"  # how a Python user chooses; a command's is its --threads
_STATE = {"decided": False, "noted": False, "threads": None, "flag": PYTHON_FLAG}


def affinity() -> set[int]:
    """The CPUs this process may run on (every CPU where the platform has no affinity mask)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return set(range(os.cpu_count() or 1))


def cgroup_quota(root: Path | None = None, membership: Path | None = None) -> float | None:
    """The CPUs a cgroup CPU quota gives this process (quota / period), the smallest over its cgroup and each above
    it; None where no quota applies.  root: where the cgroup file systems are mounted (default CGROUP);
    membership: the process's cgroups (default PROC_CGROUP, one `hierarchy:controllers:path` a line)."""
    root, membership = root or CGROUP, membership or PROC_CGROUP
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # cgroup v2: cpu.max, "max 100000" or "QUOTA PERIOD"
            limits += [_v2_quota(folder) for folder in _cgroup_folders(root, path)]
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own mount
            mounts = [root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
            mount = next((folder for folder in mounts if folder.is_dir()), None)
            if mount is not None:
                limits += [_v1_quota(folder) for folder in _cgroup_folders(mount, path)]
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _cgroup_folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under `mount` and each above it up to `mount`; `mount` alone where the folder is not
    there (a container whose cgroup is its mount's root while /proc/self/cgroup names the host's path)."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        return [mount]
    found = [folder]
    while folder != mount and mount in folder.parents:
        folder = folder.parent
        found.append(folder)
    return found


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: no quota


def usable_cpus(root: Path | None = None, membership: Path | None = None) -> int:
    """The CPUs of the affinity mask, capped by the cgroup CPU quota (rounded up), at least 1."""
    cpus, quota = len(affinity()), cgroup_quota(root, membership)
    return max(1, min(cpus, math.ceil(quota)) if quota is not None else cpus)


def cpu_times(stat: Path | None = None) -> dict[int, tuple[int, int]]:
    """(busy, total) clock ticks of each CPU so far, from /proc/stat (PROC_STAT; {} where there is none)."""
    try:
        lines = (stat or PROC_STAT).read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)
            total = sum(ticks)
            times[int(name[3:])] = (total - ticks[3] - ticks[4], total)
    return times


def busy_between(before: dict, after: dict, cpus: set[int]) -> float:
    """How many of `cpus` were busy between two `cpu_times`: the sum of their busy shares."""
    busy = 0.0
    for cpu in cpus & before.keys() & after.keys():
        ticks = after[cpu][1] - before[cpu][1]
        busy += (after[cpu][0] - before[cpu][0]) / ticks if ticks > 0 else 0.0
    return busy


def mark_start() -> None:
    """Note /proc/stat's counts now (a command's start): `busy_cpus` then measures from here, while the command
    imports torch and reads its inputs, instead of sleeping."""
    _STATE["mark"] = (cpu_times(), time.process_time(), time.perf_counter())


def busy_cpus(cpus: set[int] | None = None, seconds: float = SAMPLE_S) -> float | None:
    """How many of `cpus` (default: the affinity mask's) other work keeps busy: their busy share over at least
    `seconds`, from `mark_start` where it was called (else from now, sleeping), less what this process's own
    threads took meanwhile; None without /proc/stat."""
    cpus = affinity() if cpus is None else cpus
    before, own, start = _STATE.pop("mark", None) or (cpu_times(), time.process_time(), time.perf_counter())
    if not before:
        return None
    time.sleep(max(0.0, start + seconds - time.perf_counter()))
    after, own, elapsed = cpu_times(), time.process_time() - own, time.perf_counter() - start
    return max(0.0, busy_between(before, after, cpus) - own / elapsed)


def default_threads(usable: int, cpus: int, busy: float | None) -> int:
    """`usable` threads, fewer where other work keeps `busy` of the mask's `cpus` busy: the CPUs left, half a busy CPU
    or more counting as busy, at least 1."""
    if busy is None:
        return usable
    return max(1, min(usable, math.ceil(cpus - busy - 0.5)))


@contextlib.contextmanager
def requested(threads: int | None, flag: str = "--threads {}"):
    """Within the block (a command), `choose_threads` sets `threads` where given, and its note names `flag`."""
    saved = _STATE["threads"], _STATE["flag"]
    _STATE["threads"], _STATE["flag"] = threads, flag
    try:
        yield
    finally:
        _STATE["threads"], _STATE["flag"] = saved


def choose_threads(device: str = "cpu") -> int:
    """Set torch's thread count as the module docstring says, once per process (a `requested` count every time), and
    return it.  On another device than the CPU only a requested count is set."""
    imported = "torch" in sys.modules  # where it is not, nobody has set its threads yet
    import torch  # start-up: the command line checks its flags before torch loads

    threads, flag = _STATE["threads"], _STATE["flag"]
    if threads is not None and not (_STATE["decided"] and torch.get_num_threads() == threads):
        torch.set_num_threads(threads)
        _STATE["decided"] = True
        _note_oversubscribed(threads, flag)
    if threads is not None:
        return threads
    if _STATE["decided"] or not str(device).startswith("cpu"):
        return torch.get_num_threads()
    _STATE["decided"] = True
    current = torch.get_num_threads()
    if _set_by_user(current, imported):
        _note_oversubscribed(current, flag)
        return current
    cpus, usable = affinity(), usable_cpus()
    busy = busy_cpus(cpus) if usable > 1 else None
    chosen = default_threads(usable, len(cpus), busy)
    torch.set_num_threads(chosen)
    if chosen < usable and not _STATE["noted"]:
        _STATE["noted"] = True
        note(
            f"other work keeps {busy:.1f} of the {len(cpus)} CPUs this process may use busy: computing on {chosen} "
            f"thread{'s' if chosen > 1 else ''} rather than {usable} ({flag.format('N')} chooses)"
        )
    return chosen


def _set_by_user(current: int, imported: bool) -> bool:
    """Whether the thread count is the user's: OMP_NUM_THREADS or MKL_NUM_THREADS set, or, where torch was imported
    before, a count other than torch's own default (the affinity mask's CPUs or, under MKL, their physical cores)."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return True
    return imported and current not in {len(affinity()), _physical_cores(affinity())}


def _physical_cores(cpus: set[int]) -> int:
    """The physical cores of `cpus` (hyperthreads counted once), from sysfs; len(cpus) where it does not say."""
    cores = set()
    for cpu in cpus:
        topology = SYS_CPUS / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def _note_oversubscribed(threads: int, flag: str) -> None:
    """The note that the machine looks oversubscribed, where `threads` (more than one) exceed the CPUs left; once per
    process."""
    if threads < 2 or _STATE["noted"]:
        return
    cpus = affinity()
    busy = busy_cpus(cpus)
    if busy is None:
        return
    fits = default_threads(threads, len(cpus), busy)
    if fits < threads:
        _STATE["noted"] = True
        note(
            f"other work keeps {busy:.1f} of the {len(cpus)} CPUs this process may use busy, and torch computes on "
            f"{threads} threads, which then wait for each other: {flag.format(fits)} may be several times faster"
        )
