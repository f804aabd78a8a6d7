"""One GPU check, one command: on one H100 or H200, in under 9 minutes and in this order,

1. tests    every GPU test (each test file that touches CUDA), as `python -m pytest` runs them there (`-n auto`);
2. ab       one row of 8k tokens x 64 questions x 128 new tokens, this tree beside a baseline commit loaded as a
            second package, Qwen2.5-7B's and CodeLlama-7B's shapes (`eval/ab_bench.py ... 3 row`);
3. engine   the serving engine in process, SGLang's generated-shared-prefix workload, from 64 closed-loop clients
            and with every request at once, against the workload's bound (`eval/engine_bench.py`);
4. copy     prompt lookup on the copy workload at Qwen2.5-7B's shape, drafts 10% and 30% wrong
            (`eval/speculation_bench.py copy`), each in a process of its own;

then one table of figures, each beside its target, on stdout and in `summary.md` (with `summary.json` and each
part's log) under `--out`.  A part that runs past its share of the time is stopped and reported as such.

The GPU machine has no git and no network, so what the check needs is made here first, into `.carry/`
(ignored by git): the baseline commit's `hf_parallel/` as `.carry/pkgs/hf_parallel_main`, and War and Peace for
the copy workload's documents.

    python eval/gpu_check.py prepare --baseline main       # here, in a git checkout (../shared/data for the book)
    python eval/gpu_check.py run --out $OUT                # there, with .carry/ carried along
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".carry"
BOOK = "war-and-peace.txt.gz"
CUDA = re.compile(r"cuda\.is_available\(\)|\.cuda\(\)")
# each part's share of the time, seconds: they add up to 9 minutes less what the start and the table take
SHARES = {"tests": 215, "ab": 110, "engine": 120, "copy": 90}


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Every test file that touches CUDA: the GPU tests, with the rest of each such file."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py") if CUDA.search(p.read_text()))


def prepare(baseline: str, data: Path) -> None:
    """`.carry/`: the baseline commit's package as `hf_parallel_main` (what eval/ab_bench.py imports) and the book."""
    commit = subprocess.run(["git", "rev-parse", "--short", baseline], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    archive = subprocess.run(["git", "archive", commit, "hf_parallel"], cwd=ROOT, check=True, capture_output=True)
    pkgs = CARRY / "pkgs"
    shutil.rmtree(pkgs, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
        pkgs.mkdir(parents=True)
        shutil.move(Path(tmp) / "hf_parallel", pkgs / "hf_parallel_main")
    (pkgs / "BASELINE").write_text(commit + "\n")
    (CARRY / "data").mkdir(parents=True, exist_ok=True)
    if not (data / BOOK).is_file():
        sys.exit(f"{BOOK} not found in {data}: pass --data DIR (the copy workload's documents)")
    shutil.copy(data / BOOK, CARRY / "data" / BOOK)
    print(f"baseline {commit} in {pkgs / 'hf_parallel_main'}; {BOOK} in {CARRY / 'data'}")


def run_part(name: str, argv: list[str], log: Path, limit: float, env: dict) -> tuple[list[dict], str, float]:
    """Run one command with its output in `log`; returns the JSON objects it printed a line each, its outcome
    ("ok", "exit N" or "stopped after N s") and its seconds."""
    start = time.perf_counter()
    with log.open("w") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=max(limit, 1))
            outcome = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            outcome = f"stopped after {limit:.0f} s"
    seconds = time.perf_counter() - start
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    print(f"[{name}] {outcome} in {seconds:.0f} s", flush=True)
    return rows, outcome, seconds


def pytest_summary(log: Path) -> dict:
    """The counts of pytest's last summary line, and the tests it names as failed."""
    text = log.read_text(errors="replace")
    counts = {}
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|errors)\b.* in [\d.]+s", line)]
    if lines:
        for n, word in re.findall(r"(\d+) (\w+)", lines[-1]):
            counts[word.rstrip("s") if word.startswith("error") else word] = int(n)
        counts["seconds"] = float(re.search(r" in ([\d.]+)s", lines[-1]).group(1))
    counts["failed_tests"] = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    return counts


def check(out: Path, shares: dict, parts: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this tree, installed or not
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0", OUT=str(tmp), PYTHONPATH=path,
               HF_PARALLEL_DATA=str(CARRY / "data"), BASELINE=str(CARRY / "pkgs"))  # fmt: skip
    py = sys.executable
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
    try:
        import torch
        import transformers
        import triton

        report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        report["versions"] = dict(torch=torch.__version__, transformers=transformers.__version__,
                                  triton=triton.__version__)  # fmt: skip
    except ImportError as err:
        report["device"] = f"unknown ({err})"
    baseline = CARRY / "pkgs" / "BASELINE"
    report["baseline"] = baseline.read_text().strip() if baseline.is_file() else None
    print(json.dumps(report), flush=True)

    if "tests" in parts:
        files = gpu_test_files()
        argv = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
        _, outcome, seconds = run_part("tests", argv, out / "pytest.log", shares["tests"], env)
        report["parts"]["tests"] = dict(outcome=outcome, wall_s=round(seconds, 1), files=files,
                                        **pytest_summary(out / "pytest.log"))  # fmt: skip
    if "ab" in parts:
        if report["baseline"] is None:
            report["parts"]["ab"] = dict(outcome="no baseline: run `python eval/gpu_check.py prepare` first")
        else:
            argv = [py, "eval/ab_bench.py", "qwen2.5-7b,codellama-7b", "3", "row"]
            rows, outcome, seconds = run_part("ab", argv, out / "ab.log", shares["ab"], env)
            report["parts"]["ab"] = dict(outcome=outcome, wall_s=round(seconds, 1), rows=rows)
    if "engine" in parts:
        argv = [py, "eval/engine_bench.py", "--model", "qwen2.5-7b", "--groups", "32", "--concurrency", "64", "all",
                "--max-streams", "256", "512", "--deadline", str(shares["engine"])]  # fmt: skip
        rows, outcome, seconds = run_part("engine", argv, out / "engine.log", shares["engine"], env)
        report["parts"]["engine"] = dict(outcome=outcome, wall_s=round(seconds, 1), rows=rows[1:])
    if "copy" in parts:
        report["parts"]["copy"] = dict(rows=[], outcome=[])
        for reject in (0.1, 0.3):
            argv = [py, "eval/speculation_bench.py", "copy", "--shape", "qwen2.5-7b", "--reject", str(reject),
                    "--k", "8", "--device", "cuda"]  # fmt: skip
            rows, outcome, _ = run_part(f"copy {reject}", argv, out / f"copy-{reject}.log", shares["copy"] / 2, env)
            report["parts"]["copy"]["rows"] += rows
            report["parts"]["copy"]["outcome"].append(outcome)
    shutil.rmtree(tmp, ignore_errors=True)
    report["table"] = table(report)
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    text = "\n".join([f"device: {report['device']}; baseline: {report['baseline']}; {report.get('versions')}", "",
                      "| check | figure | target | met |", "| --- | --- | --- | --- |",
                      *(f"| {' | '.join(map(str, r))} |" for r in report["table"])])  # fmt: skip
    (out / "summary.md").write_text(text + "\n")
    print(text, flush=True)
    return report


def table(report: dict) -> list[tuple]:
    """(check, figure, target, met) for every figure the parts gave; a part that gave none says why."""
    rows, parts = [], report["parts"]

    def met(ok):
        return "yes" if ok else "NO"

    if "tests" in parts:
        t = parts["tests"]
        bad = t.get("failed", 0) + t.get("error", 0)
        figure = (f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('error', 0)} errors, "
                  f"{t.get('skipped', 0)} skipped in {t.get('seconds', t['wall_s'])} s ({t['outcome']})")  # fmt: skip
        rows.append(("GPU tests, -n auto", figure, "none failed, run to completion",
                     met(bad == 0 and t["outcome"] == "ok" and t.get("passed"))))  # fmt: skip
    for r in parts.get("ab", {}).get("rows", []):
        figure = (f"{r['new_median_s']:.3f} s vs {r['main_median_s']:.3f} s ({r['new_over_main_median']:.3f}x), "
                  f"{r['roofline_s'] / r['new_median_s']:.2f} of the roofline, {r['identical']}/{r['streams']} "
                  "identical")  # fmt: skip
        rows.append((f"one row, {r['shape']}, 8k x 64q x 128", figure, "within 2% of the baseline",
                     met(r["new_over_main_median"] >= 0.98)))  # fmt: skip
    for r in parts.get("engine", {}).get("rows", []):
        clients = "64 clients" if r["concurrency"] == 64 else f"{r['concurrency']} at once"
        figure = (f"{r['output_tokens_per_s']:,.0f} tok/s = {r.get('of_bound', float('nan')):.2f} of the bound "
                  f"({r.get('bound_tokens_per_s', float('nan')):,.0f}); TTFT p50 / p99 {r['ttft_p50_s']} / "
                  f"{r['ttft_p99_s']} s; {r['requests_done']}/{r['requests']} done, {r['errors']} errors")  # fmt: skip
        if r["concurrency"] == 64:
            ok = r.get("of_bound", 0) >= 0.8 and (r["ttft_p99_s"] or 1e9) <= 1.5
            target = ">= 0.8 of the bound; TTFT p99 <= 1.5 s"
        else:
            ok, target = r.get("of_bound", 0) >= 0.7, ">= 0.7 of the bound"
        rows.append((f"serving engine, {clients}, {r['max_streams']} streams", figure, target, met(ok)))
    for r in parts.get("copy", {}).get("rows", []):
        r = r.get("results", r)
        figure = (f"{r['speculative_s']:.3f} s vs {r['plain_s']:.3f} s without ({r['speedup']:.2f}x), "
                  f"{r['speculative_tokens_per_s']:,.0f} tok/s against a one-token roofline of "
                  f"{r['roofline_tokens_per_s']:,.0f}, {r['tokens_per_forward']:.2f} tokens/forward, "
                  f"{r['identical']}/{r['streams']} identical")  # fmt: skip
        if r["reject"] <= 0.1:
            rows.append((f"copy, {r['reject']:.0%} rejected, k={r['k']}", figure, ">= the one-token roofline",
                         met(r["speculative_tokens_per_s"] >= r["roofline_tokens_per_s"])))  # fmt: skip
        else:
            rows.append((f"copy, {r['reject']:.0%} rejected, k={r['k']}", figure, ">= 1.2x over no drafts",
                         met(r["speedup"] >= 1.2)))  # fmt: skip
    for name, part in parts.items():
        outcomes = part.get("outcome")
        outcomes = outcomes if isinstance(outcomes, list) else [outcomes]
        if any(o != "ok" for o in outcomes) and name != "tests":
            rows.append((name, ", ".join(map(str, outcomes)), "runs to the end", "NO"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: the baseline package and the book into .carry/")
    p.add_argument("--baseline", default="main", help="the commit the one-row A/B compares with (default: main)")
    data = Path(os.environ.get("HF_PARALLEL_DATA") or ROOT.parent / "shared" / "data")
    p.add_argument("--data", type=Path, default=data, help=f"the folder holding {BOOK} (default: ../shared/data)")
    r = sub.add_parser("run", help="there: every part, in order, then the table")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")), help="logs and the summary")
    r.add_argument("--parts", default=",".join(SHARES), help=f"a comma list of {', '.join(SHARES)}")
    r.add_argument("--scale", type=float, default=1.0, help="multiply every part's share of the time")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.baseline, args.data)
        return 0
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(SHARES))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(SHARES)}")
    report = check(args.out, {k: v * args.scale for k, v in SHARES.items()}, parts)
    return 0 if all(r[3] == "yes" for r in report["table"]) else 1


if __name__ == "__main__":
    sys.exit(main())
