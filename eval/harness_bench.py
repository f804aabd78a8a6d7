"""lm-evaluation-harness: its own HF backend (`--model hf`) against `--model hf-parallel`, side by side in one process.

Each task of `hf_parallel/harness/tasks/` runs on the same documents (`--limit`) with `hf` at each batch size of
`--hf-batch-sizes` and with `hf-parallel`, each backend warmed up first on one document.  Per task and backend:
wall seconds of the model's requests (the harness's own work around them, the same for every backend, is not
counted), the requests, the context tokens they ask for and the tokens hf-parallel's packed rows computed (every
shared prefix once), and whether hf-parallel answered as `hf` at batch size 1 did (strings identical, the largest
log-likelihood difference, is_greedy and metrics; `hf_parallel.harness.compare`).

    python eval/harness_bench.py --limit 32 --threads 1 --out results/harness/cpu-smollm2     # CPU, embedded SmolLM2
    python eval/harness_bench.py --pretrained DIR --dtype bfloat16 --device cuda --limit 500 \\
        --hf-batch-sizes 1,8,32,auto --out results/harness/gpu-smollm2                      # GPU, DIR from save-smollm2

`--out DIR` gets `results.json` (per task: seconds, counts, agreement, metrics; the environment), `results.md`
(its table) and `runs.json.gz` (every backend's samples, as `--log_samples` writes them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, from a clone

import lm_eval  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import handle_non_serializable  # noqa: E402

from hf_parallel.harness import TASKS, HFParallelLM  # noqa: E402
from hf_parallel.harness.compare import compare_samples, differing_metrics  # noqa: E402
from hf_parallel.harness.embedded import embedded_model_dir  # noqa: E402

REQUEST_TYPES = ("generate_until", "loglikelihood", "loglikelihood_rolling")
DEFAULT_TASKS = "hfp_squad,hfp_drop,hfp_squad_mc"
CACHE = Path.home() / ".cache" / "hf_parallel" / "smollm2-135m-instruct"


def timed(lm) -> list[float]:
    """Wrap `lm`'s request methods so that each call adds its wall seconds to the returned one-item list."""
    spent = [0.0]
    for name in REQUEST_TYPES:
        method = getattr(lm, name)

        def wrapper(requests, disable_tqdm=False, method=method):
            start = time.perf_counter()
            try:
                return method(requests, disable_tqdm=True)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(lm, name, wrapper)
    return spent


def run_task(lm, spent: list[float], task: str, args, manager: TaskManager) -> dict:
    """One task on `lm`: its model seconds, final metrics, samples (as `--log_samples` writes them) and, for
    hf-parallel, its requests and tokens (`HFParallelLM.usage`)."""
    spent[0] = 0.0
    usage = getattr(lm, "usage", {})
    usage.clear()
    out = simple_evaluate(model=lm, tasks=[task], limit=args.limit, num_fewshot=args.num_fewshot,
                          task_manager=manager, log_samples=True, verbosity="WARNING")  # fmt: skip
    samples = json.loads(json.dumps(out["samples"][task], default=handle_non_serializable))
    results = json.loads(json.dumps(out["results"][task], default=handle_non_serializable))
    counts = {kind: vars(u).copy() for kind, u in usage.items()}
    return {"seconds": spent[0], "results": results, "samples": samples, "usage": counts}


def backends(args, pretrained: str):
    """(label, LM constructor) of every backend compared, `hf` at batch size 1 first (the reference)."""
    common = dict(pretrained=pretrained, dtype=args.dtype, device=args.device)
    for size in args.hf_batch_sizes.split(","):
        yield f"hf bs={size}", lambda size=size: HFLM(**common, batch_size=size, max_batch_size=args.max_batch_size)
    own = dict(attn=args.attn, max_memory=args.max_memory, max_call_tokens=args.max_call_tokens)
    yield "hf-parallel", lambda: HFParallelLM(**common, **own)


def measure(args) -> dict:
    """Every task on every backend, task by task (each task's backends one after another, so that a change in the
    machine's load touches them alike); each backend loaded and warmed up once."""
    pretrained = args.pretrained or str(embedded_model_dir(CACHE))
    manager = TaskManager(include_path=str(TASKS))
    tasks = args.tasks.split(",")
    loaded = {}
    for label, make in backends(args, pretrained):
        lm = make()
        # warm-up, out of the timings: the first call's costs (hf-parallel's probe of the model, kernels' setup)
        simple_evaluate(model=lm, tasks=tasks, limit=1, num_fewshot=args.num_fewshot, task_manager=manager,
                        verbosity="WARNING")  # fmt: skip
        loaded[label] = lm, timed(lm)
    runs: dict[str, dict] = {label: {} for label in loaded}
    for task in tasks:
        for label, (lm, spent) in loaded.items():
            runs[label][task] = run_task(lm, spent, task, args, manager)
            print(f"{task} {label}: {runs[label][task]['seconds']:.2f} s", flush=True)
    return {"runs": runs, "pretrained": pretrained}


def summarize(measured: dict, args) -> dict:
    """Per task: the backends' seconds, hf-parallel's counts, its speed-up over the fastest hf, and its agreement
    with hf at batch size 1 (and each larger hf batch size's with batch size 1); a markdown table of it."""
    runs = measured["runs"]
    labels = list(runs)
    hf_labels = [label for label in labels if label.startswith("hf ")]
    reference, ours = hf_labels[0], "hf-parallel"
    rows = []
    for task in runs[ours]:
        mine, base = runs[ours][task], runs[reference][task]
        fastest = min(hf_labels, key=lambda label: runs[label][task]["seconds"])
        agreement = {label: _agreement(task, runs[label][task], base) for label in labels if label != reference}
        usage = mine["usage"].values()
        rows.append({
            "task": task,
            "requests": sum(u["requests"] for u in usage),
            "requested_tokens": sum(u["requested_tokens"] for u in usage),
            "computed_tokens": sum(u["computed_tokens"] for u in usage),
            "seconds": {label: runs[label][task]["seconds"] for label in labels},
            "fastest_hf": fastest,
            "speedup": runs[fastest][task]["seconds"] / mine["seconds"],
            "agreement": agreement,
            "metrics": {label: runs[label][task]["results"] for label in labels},
        })  # fmt: skip
    return {"environment": _environment(args, measured["pretrained"]), "tasks": rows, "table": _table(rows, labels)}


def _agreement(task: str, run: dict, base: dict) -> dict:
    comparison = compare_samples(task, run["samples"], base["samples"])
    return {**vars(comparison), "final_mismatches": differing_metrics(run["results"], base["results"])}


def _table(rows: list[dict], labels: list[str]) -> str:
    head = ["task", "requests", "context tokens", "computed by hf-parallel", *labels, "hf-parallel vs fastest hf",
            "hf-parallel against hf bs=1"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + " |"]
    for row in rows:
        seconds = [f"{row['seconds'][label]:.2f} s" for label in labels]
        cells = [row["task"], str(row["requests"]), f"{row['requested_tokens']:,}", f"{row['computed_tokens']:,}",
                 *seconds, f"{row['speedup']:.1f}x", _said(row["agreement"]["hf-parallel"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _said(agreement: dict) -> str:
    parts = []
    if agreement["strings"]:
        parts.append(f"{agreement['identical_strings']}/{agreement['strings']} strings identical")
    if agreement["loglikelihoods"]:
        parts.append(
            f"{agreement['loglikelihoods']} log-likelihoods, largest difference {agreement['largest_difference']:.1e}"
        )
        parts.append(f"{agreement['greedy_mismatches']} is_greedy differ")
    mismatched = len(agreement["metric_mismatches"]) + len(agreement["final_mismatches"])
    parts.append("metrics identical" if not mismatched else f"{mismatched} metrics differ")
    return ", ".join(parts)


def _environment(args, pretrained: str) -> dict:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else _cpu_name()
    return {"device": device, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "lm_eval": lm_eval.__version__, "pretrained": pretrained,
            "dtype": args.dtype, "limit": args.limit, "num_fewshot": args.num_fewshot, "attn": args.attn,
            "max_call_tokens": args.max_call_tokens, "max_memory": args.max_memory}  # fmt: skip


def _cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", help="a model directory (default: the embedded SmolLM2, written to ~/.cache)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma-separated (default {DEFAULT_TASKS})")
    parser.add_argument("--limit", type=int, default=16, help="documents per task")
    parser.add_argument("--num-fewshot", type=int, default=None, help="shots (default: each task's own)")
    parser.add_argument("--hf-batch-sizes", default="1,4,16", help="hf's batch sizes, 1 first (the reference)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="hf's largest batch size under 'auto'")
    parser.add_argument(
        "--max-call-tokens", default=None, help="hf-parallel's most tokens per call (default: the memory budget's)"
    )
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--max-memory", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json, results.md, runs.json.gz")
    args = parser.parse_args()
    if not args.hf_batch_sizes.startswith("1"):
        parser.error("--hf-batch-sizes must start with 1: hf at batch size 1 is what hf-parallel is checked against")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    measured = measure(args)
    if args.out:  # the runs themselves first: a summary that fails leaves them
        args.out.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.out / "runs.json.gz", "wt") as runs:
            json.dump(measured, runs)
    report = summarize(measured, args)
    print(report["table"])
    if args.out:
        summary = {k: v for k, v in report.items() if k != "table"}
        (args.out / "results.json").write_text(json.dumps(summary, indent=1))
        (args.out / "results.md").write_text(report["table"] + "\n")


if __name__ == "__main__":
    main()
