"""A corpus on a Ray cluster: `hf-parallel answer --corpus --ray` with 1, 2, ... actors against one process.

The corpus is SQuAD v1.1 dev's first --docs paragraphs with at least --questions questions, the first --questions
of each.  Each run is the command itself in a fresh process, timed from start to exit (torch's import, the
cluster's start where the command starts one, the actors' model loads, the answers, the shutdown); every run's
lines are checked equal, once sorted, to the one-process run's, whose calls hold about as many documents as a
batch on Ray (--tokens-per-call).  Ray's start-up is measured apart: `ray.init` of
a local cluster (or the connection to --ray's), a first task's round trip, and `ray.shutdown`.

  python eval/ray_bench.py --docs 200 --questions 4 --max-new-tokens 16 --actors 1,2 --out results/ray
  python eval/ray_bench.py --docs 4000 --max-new-tokens 64 --model DIR --ray auto --actors 1,2,8 --out results/ray
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SQUAD = Path(os.environ.get("HF_PARALLEL_DATA") or ROOT.parent / "shared" / "data") / "squad-dev-v1.1.json.zip"


def squad_corpus(path: Path, docs: int, questions: int) -> list[dict]:
    """The first `docs` paragraphs of SQuAD dev with at least `questions` questions, the first `questions` each."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            data = json.loads(archive.read(next(n for n in archive.namelist() if n.endswith(".json"))))
    else:
        data = json.loads(path.read_text())
    corpus = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            if len(paragraph["qas"]) >= questions and len(corpus) < docs:
                asked = [qa["question"] for qa in paragraph["qas"][:questions]]
                corpus.append({"id": f"squad-{len(corpus)}", "document": paragraph["context"], "questions": asked})
    return corpus


def startup(address: str | None, cpus: int | None) -> dict:
    """Seconds of `ray.init` (a new local cluster, else the connection to `address`), a first task, `ray.shutdown`."""
    code = f"""
import json, time
start = time.perf_counter()
import ray
imported = time.perf_counter()
ray.init(address={address or "local"!r}, num_cpus={cpus if not address else None!r}, include_dashboard=False,
         logging_level="WARNING")
ready = time.perf_counter()
ray.get(ray.remote(lambda: 1).remote())
task = time.perf_counter()
ray.shutdown()
print(json.dumps({{"import_s": imported - start, "init_s": ready - imported, "first_task_s": task - ready,
                  "shutdown_s": time.perf_counter() - task}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def timed(argv: list[str]) -> float:
    """Wall seconds of `python -m hf_parallel ARGV`, which must exit 0."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hf_parallel", *argv], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"hf-parallel {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=SQUAD, help="SQuAD v1.1 dev (json, or a zip holding it)")
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--questions", type=int, default=4, help="questions per document")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--model", help="--model of the runs (default: the embedded SmolLM2)")
    parser.add_argument("--ray", default="", help="--ray's address (default: a new local cluster for each run)")
    parser.add_argument("--actors", default="1,2", help="comma list of --ray-actors")
    parser.add_argument("--gpus-per-actor", type=float, help="--ray-gpus-per-actor (default: the command's)")
    parser.add_argument("--cpus-per-actor", type=float, default=0.5, help="--ray-cpus-per-actor")
    parser.add_argument("--batch-size", type=int, default=32, help="--ray-batch-size")
    parser.add_argument(
        "--tokens-per-call",
        type=int,
        default=8192,
        help="the one process's --tokens-per-call: about --batch-size documents a call, as on Ray",
    )
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs of the start-up's local cluster")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-process run")
    parser.add_argument("--out", type=Path, required=True, help="folder of the results' JSON and the runs' files")
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / f"work{args.tag}"
    work.mkdir(exist_ok=True)
    corpus = squad_corpus(args.data, args.docs, args.questions)
    source = work / "corpus.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in corpus))
    common = ["answer", "--corpus", str(source), "--max-new-tokens", str(args.max_new_tokens), "--quiet"]
    common += ["--model", args.model] if args.model else []
    result = {"docs": len(corpus), "questions": sum(len(r["questions"]) for r in corpus), "cpus": os.cpu_count(),
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "runs": []}  # fmt: skip
    result["startup"] = startup(args.ray or None, args.cpus)
    print(f"ray start-up: {json.dumps(result['startup'])}", flush=True)
    expected = None
    if not args.no_baseline:
        out = work / "one-process.jsonl"
        out.unlink(missing_ok=True)
        seconds = timed([*common, "--out", str(out), "--tokens-per-call", str(args.tokens_per_call)])
        expected = sorted(out.read_text().splitlines())
        result["runs"].append({"run": "one process", "wall_s": seconds, "tokens_per_call": args.tokens_per_call})
        print(f"one process: {seconds:.1f} s", flush=True)
    for actors in [int(a) for a in args.actors.split(",")]:
        out = work / f"ray-{actors}.jsonl"
        out.unlink(missing_ok=True)
        flags = ["--ray", *([args.ray] if args.ray else []), "--ray-actors", str(actors)]
        flags += ["--ray-cpus-per-actor", str(args.cpus_per_actor), "--ray-batch-size", str(args.batch_size)]
        flags += ["--ray-gpus-per-actor", str(args.gpus_per_actor)] if args.gpus_per_actor is not None else []
        seconds = timed([*common, "--out", str(out), *flags])
        same = None if expected is None else sorted(out.read_text().splitlines()) == expected
        result["runs"].append({"run": f"ray, {actors} actor(s)", "wall_s": seconds, "same_lines": same})
        print(f"ray, {actors} actor(s): {seconds:.1f} s; the one process's lines: {same}", flush=True)
    (args.out / f"ray{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
