"""Two harness runs' `--log_samples` outputs side by side: whether one backend answered as the other did.

A run's output folder holds, per task, `samples_TASK_DATE.jsonl` (one line per document: its requests'
responses `resps` and its metrics) and `results_DATE.json`; the latest of each is read.  Responses are compared
request by request: a generated string must be identical; a log-likelihood must lie within LL_ATOL of the other, or
within LL_ULPS float32 spacings where the value is so large that LL_ATOL is below them (a rolling log-likelihood of a
whole passage: both backends sum float32 log-probabilities, each rounding the total to float32); its is_greedy flag
must be identical; a document's metric values and the task's final metrics must be equal (those computed from
log-likelihoods, such as perplexities, to a relative METRIC_RTOL).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LL_ATOL = 1e-4  # a continuation's log-likelihood: float32 sums of a few log-probabilities
LL_ULPS = 4  # a passage's: a few float32 spacings of the total (1.2e-4 apart from 1,024 to 2,048)
METRIC_RTOL = 1e-6  # metrics from log-likelihoods (perplexities): equal but for the log-likelihoods' rounding


@dataclass
class TaskComparison:
    """One task of two runs: counts of each kind of response, how many agree, the largest log-likelihood gap."""

    task: str
    documents: int = 0
    strings: int = 0
    identical_strings: int = 0
    loglikelihoods: int = 0
    largest_difference: float = 0.0
    loglikelihood_mismatches: int = 0  # beyond LL_ATOL and LL_ULPS
    greedy_mismatches: int = 0
    metric_mismatches: list[str] = field(default_factory=list)

    def identical(self) -> bool:
        """Every string, greedy flag and metric the same, every log-likelihood within the module's tolerance."""
        return (
            self.identical_strings == self.strings
            and not self.loglikelihood_mismatches
            and not self.greedy_mismatches
            and not self.metric_mismatches
        )


def compare_runs(ours: str | Path, theirs: str | Path) -> list[TaskComparison]:
    """Every task found in both output folders (searched recursively), compared as the module says."""
    mine, other = latest_files(ours, "samples_"), latest_files(theirs, "samples_")
    found = []
    for task in sorted(mine.keys() & other.keys()):
        found.append(compare_samples(task, read_lines(mine[task]), read_lines(other[task])))
    results = latest_files(ours, "results_"), latest_files(theirs, "results_")
    if results[0] and results[1]:
        finals = [json.loads(max(r.values()).read_text())["results"] for r in results]
        for comparison in found:
            a, b = finals[0].get(comparison.task, {}), finals[1].get(comparison.task, {})
            comparison.metric_mismatches += [f"final {k}" for k in differing_metrics(a, b)]
    return found


def compare_samples(task: str, ours: list[dict], theirs: list[dict]) -> TaskComparison:
    """One task's sample lines of two runs, matched by document and filter."""
    result = TaskComparison(task)
    other = {(line["doc_id"], line["filter"]): line for line in theirs}
    for line in ours:
        match = other.get((line["doc_id"], line["filter"]))
        if match is None:
            result.metric_mismatches.append(f"document {line['doc_id']} missing from the other run")
            continue
        result.documents += 1
        for a, b in zip(_responses(line), _responses(match), strict=True):
            _compare_response(result, a, b)
        result.metric_mismatches += [
            f"document {line['doc_id']} {name}" for name in line["metrics"] if not _same(line[name], match.get(name))
        ]
    return result


def _responses(line: dict) -> list[tuple[str, object]]:
    """(kind, response) of each request of a document: "text" (generate_until), "pair" (loglikelihood: the
    log-likelihood and is_greedy) or "number" (loglikelihood_rolling); each request's first response.  A line as
    the harness writes it (arguments as {"gen_args_i": {"arg_j": ...}}) or as `evaluate` returns it (a list)."""
    arguments = line["arguments"]
    if isinstance(arguments, dict):
        ordered = sorted(arguments, key=lambda name: int(name.rsplit("_", 1)[1]))
        arguments = [[args[f"arg_{j}"] for j in range(len(args))] for args in map(arguments.get, ordered)]
    kinds = ["text" if len(args) > 1 and isinstance(args[1], dict) else "number" for args in arguments]
    responses = [resp[0] for resp in line["resps"]]
    return [("pair" if isinstance(r, list) else kind, r) for kind, r in zip(kinds, responses, strict=True)]


def _compare_response(result: TaskComparison, a: tuple[str, object], b: tuple[str, object]) -> None:
    (kind, mine), (_, other) = a, b
    if kind == "text":
        result.strings += 1
        result.identical_strings += mine == other
        return
    result.loglikelihoods += 1
    mine, other = (mine, other) if kind == "pair" else ([mine], [other])
    value, gap = float(mine[0]), abs(float(mine[0]) - float(other[0]))
    result.largest_difference = max(result.largest_difference, gap)
    result.loglikelihood_mismatches += gap > max(LL_ATOL, LL_ULPS * float(np.spacing(np.float32(abs(value)))))
    if kind == "pair":
        result.greedy_mismatches += mine[1] != other[1]


def differing_metrics(a: dict, b: dict) -> list[str]:
    """The names of the metrics (a task's final results) whose values differ between `a` and `b`."""
    return [k for k in sorted(a.keys() | b.keys()) if not _same(a.get(k), b.get(k))]


def _same(a, b) -> bool:
    """Equal metric values: lists element by element, floats to METRIC_RTOL, the rest exactly."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=METRIC_RTOL) or (math.isnan(a) and math.isnan(b))
    return a == b


def latest_files(folder: str | Path, prefix: str) -> dict[str, Path]:
    """Task name (or the run, for results) -> the newest file named PREFIX...DATE.json(l) under `folder`."""
    newest: dict[str, Path] = {}
    for path in Path(folder).rglob(f"{prefix}*.json*"):
        key = path.stem[len(prefix) :].rsplit("_", 1)[0] if prefix == "samples_" else "run"
        if key not in newest or path.name > newest[key].name:
            newest[key] = path
    return newest


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
