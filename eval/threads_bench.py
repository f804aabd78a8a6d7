"""The demo's wall time on the CPU with torch's default threads and with the threads hf_parallel chooses, side by side:
idle, and beside a busy process pinned to one CPU (`while True: pass`, as `taskset -c 0` would start it).

Each run is a fresh `python -m hf_parallel demo` (loading the converted SmolLM2, answering its ten questions in
parallel, then one at a time with `model.generate`), timed from start to exit.  *before*: torch's default, that is
another copy of the package (`--baseline DIR`, a folder holding a commit's `hf_parallel/`, for instance
`git archive main hf_parallel | tar -x -C DIR`), or, without one, this tree under OMP_NUM_THREADS set to torch's
default count; *after*: this tree as it chooses.  The variants alternate run by run, the busy process runs through
the busy runs and stops before the idle ones.  Prints a Markdown table (each run's wall seconds, the median, the
threads the demo reported, its two timings, the load average as each run started, the notes) and writes it
with every run as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CASES = {"busy": "one, pinned to one CPU", "idle": "none"}


def clean_env(**extra) -> dict:
    """This process's environment without the thread variables, with `extra`."""
    return {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES} | extra


def torch_default_threads() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def variants(baseline: str | None, default: int) -> dict[str, dict]:
    """name -> the environment of its demo processes (run from an empty folder, so PYTHONPATH picks the package)."""
    before = clean_env(PYTHONPATH=baseline)
    if not baseline:
        before = clean_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(default))
    return {"before": before, "after": clean_env(PYTHONPATH=str(ROOT))}


def package_of(env: dict, folder: str) -> str:
    code = "import hf_parallel; print(hf_parallel.__file__)"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=folder, capture_output=True, text=True, check=True
    ).stdout.strip()


def run_demo(env: dict, folder: str, max_new_tokens: int) -> dict:
    """One demo process: its wall seconds, the threads it reported, its two timings, its notes on stderr."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    argv = [sys.executable, "-m", "hf_parallel", "demo", "--max-new-tokens", str(max_new_tokens)]
    done = subprocess.run(argv, env=env, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the demo failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out = done.stdout
    return {
        "wall_s": round(wall, 2),
        "threads": int(re.search(r"CPU, (\d+) threads", out).group(1)),
        "parallel_s": float(re.search(r"generate_parallel:\s+([\d.]+) s", out).group(1)),
        "one_at_a_time_s": float(re.search(r"one at a time:\s+([\d.]+) s", out).group(1)),
        "load_average_at_start": round(load, 2),
        "notes": [line for line in done.stderr.splitlines() if line.startswith("other work")],
    }


def start_busy(cpu: int) -> subprocess.Popen:
    """`while True: pass` pinned to `cpu`, for at most an hour."""
    code = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass"
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))


def table(results: dict) -> str:
    lines = [
        "| busy process started | demo | threads | wall s, each run | wall s, median | generate_parallel s "
        "| one at a time s | load average at the starts |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for case, by_variant in results["cases"].items():
        for name, runs in by_variant.items():
            walls = [r["wall_s"] for r in runs]
            threads = "/".join(sorted({str(r["threads"]) for r in runs}))
            loads = ", ".join(f"{r['load_average_at_start']:.1f}" for r in runs)
            lines.append(
                f"| {CASES[case]} | {name} | {threads} | {', '.join(f'{w:.1f}' for w in walls)} | "
                f"{statistics.median(walls):.1f} | {statistics.median(r['parallel_s'] for r in runs):.2f} | "
                f"{statistics.median(r['one_at_a_time_s'] for r in runs):.2f} | {loads} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each variant in each case (default: 3)")
    parser.add_argument("--baseline", metavar="DIR", help="a folder holding the package before (see above)")
    parser.add_argument("--cases", default="busy,idle", help="busy, idle or both, in this order (default: busy,idle)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the demo's (default: 48, its own)")
    parser.add_argument("--busy-cpu", type=int, default=min(os.sched_getaffinity(0)), help="(default: the first)")
    parser.add_argument("--out", metavar="DIR", help="writes demo-<max-new-tokens>-tokens-<runs>x.json (and .md) there")
    args = parser.parse_args(argv)
    default = torch_default_threads()
    envs = variants(args.baseline, default)
    results = {
        "setup": {
            "cpus": sorted(os.sched_getaffinity(0)),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch_default_threads": default,
            "busy": f"python -c 'while True: pass' pinned to CPU {args.busy_cpu}",
            "before": f"the package at {args.baseline}" if args.baseline else f"OMP_NUM_THREADS={default}",
            "runs": args.runs,
        },
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        results["setup"]["packages"] = {name: package_of(env, folder) for name, env in envs.items()}
        for case in args.cases.split(","):
            busy = start_busy(args.busy_cpu) if case == "busy" else None
            try:
                if busy is not None:
                    time.sleep(2)
                runs = results["cases"][case] = {name: [] for name in envs}
                for run in range(args.runs):
                    for name in list(envs)[:: 1 if run % 2 == 0 else -1]:  # alternating which goes first
                        runs[name].append(run_demo(envs[name], folder, args.max_new_tokens))
                        print(case, name, runs[name][-1], file=sys.stderr, flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    print(table(results))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"demo-{args.max_new_tokens}-tokens-{args.runs}x.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        path.with_suffix(".md").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
