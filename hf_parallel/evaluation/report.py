"""Scores, the paired bootstrap against standard prompting, the report's summary and table, and merging.

A report is the JSON-able dict `quality.evaluate` returns: per-question predictions and
scores under "questions", per-method results under "summary".
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .config import METHODS, QualityConfig
from .loaders import QAItem
from .metrics import HUMAN_F1_MIN, drop_em_f1, quac_f1, quac_human_f1, quac_scores, squad_exact_match, squad_f1

_REPORT_KEYS = ("dataset", "model", "config", "summary", "questions")  # what merge_reports reads
_BATCHING = {"standard": "standard_batch_size", "parallel": "docs_per_call", "batch": "batch_rows"}


def score(dataset: str, prediction: str, item: QAItem) -> dict:
    """Per-question scores; for QuAC `counted` says whether the official F1 counts it (human F1 >= 0.4)."""
    if dataset == "squad":
        return {"em": squad_exact_match(prediction, item.answers), "f1": squad_f1(prediction, item.answers)}
    if dataset == "drop":
        em, f1 = drop_em_f1(prediction, item.drop_references)
        return {"em": em, "f1": f1}
    return {"f1": quac_f1(prediction, item.answers), "counted": quac_human_f1(item.answers) >= HUMAN_F1_MIN}


def paired_bootstrap(base, other, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean of other - base and its percentile bootstrap CI, resampling paired questions.

    base, other: [Q] per-question scores of two methods on the same questions.
    """
    diff = np.asarray(other, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    if diff.size == 0:
        return {"mean": 0.0, "lo": 0.0, "hi": 0.0, "resamples": resamples}
    rng = np.random.default_rng(seed)
    chunks = [min(500, resamples - start) for start in range(0, resamples, 500)]  # bounds the index memory
    means = np.concatenate([diff[rng.integers(0, diff.size, (n, diff.size))].mean(1) for n in chunks])
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": float(diff.mean()), "lo": float(lo), "hi": float(hi), "resamples": resamples}


def summarize(dataset: str, records: list[dict], methods, wall: dict, config: QualityConfig) -> dict:
    """Corpus scores, wall time, speedup and the paired comparison with standard, per method."""
    counted = [r for r in records if r["scores"][methods[0]].get("counted", True)]
    summary = {}
    for m in methods:
        row = {"wall_s": wall[m], "f1": float(np.mean([r["scores"][m]["f1"] for r in counted] or [0.0]))}
        row["em"] = None if dataset == "quac" else float(np.mean([r["scores"][m]["em"] for r in records]))
        if dataset == "quac":
            dialogues = {}
            for r in records:
                dialogues.setdefault(r["document"], []).append((r["predictions"][m], r["answers"]))
            row.update({k: v for k, v in asdict(quac_scores(list(dialogues.values()))).items() if k != "f1"})
        if "standard" in methods and m != "standard":
            row["speedup"] = wall["standard"] / wall[m] if wall[m] > 0 else None
            row["f1_minus_standard"] = paired_bootstrap(
                [r["scores"]["standard"]["f1"] for r in counted],
                [r["scores"][m]["f1"] for r in counted],
                config.resamples,
                config.seed,
            )
            row["differ_from_standard"] = sum(r["predictions"][m] != r["predictions"]["standard"] for r in records)
        summary[m] = row
    return summary


def table(report: dict) -> str:
    """The summary as a markdown table (scores times 100, as the official scripts print them)."""
    config = report["config"]
    lines = [
        f"{report['dataset']}: {report['n_questions']} questions, {report['n_documents']} documents; "
        f"{report['model']}, {config['dtype']}, {config['device']}; greedy, max_new_tokens={config['max_new_tokens']}, "
        f"standard_batch_size={config['standard_batch_size']}, docs_per_call={config['docs_per_call']}, "
        f"batch_rows={config.get('batch_rows', 1)}",
        "",
        "| method | EM | F1 | wall s | speedup vs standard | F1 - standard [95% CI] | differ from standard |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for m, row in report["summary"].items():
        em = "-" if row["em"] is None else f"{100 * row['em']:.1f}"
        speed = f"{row['speedup']:.2f}x" if row.get("speedup") else "-"
        ci = row.get("f1_minus_standard")
        ci = f"{100 * ci['mean']:+.2f} [{100 * ci['lo']:+.2f}, {100 * ci['hi']:+.2f}]" if ci else "-"
        differ = f"{row['differ_from_standard']}/{report['n_questions']}" if "differ_from_standard" in row else "-"
        lines.append(f"| {m} | {em} | {100 * row['f1']:.1f} | {row['wall_s']:.1f} | {speed} | {ci} | {differ} |")
    missing = missing_batch_answers(report)
    if missing:
        lines += ["", _BATCH_NOTE.format(missing=missing, n=report["n_questions"])]
    return "\n".join(lines)


# why batch prompting's F1 can be near 0: said beside the table, where it shows
_BATCH_NOTE = (
    'batch prompting: {missing} of {n} answers are missing from the model\'s output (it wrote no "A<n>: ..." line '
    "for them) and score 0; a small model often does not keep that format.  The raw outputs are the report's "
    "batch_outputs."
)


def missing_batch_answers(report: dict) -> int:
    """How many questions batch prompting left unanswered (`parse_batch_answers` found no answer): 0 without it."""
    if "batch" not in report["summary"]:
        return 0
    return sum(not record["predictions"].get("batch", "").strip() for record in report.get("questions", []))


def merge_reports(reports: list[dict]) -> dict:
    """One report from runs of different methods over the same questions (say, batch prompting run
    in a later session): per-question outputs united, the summary and paired CIs recomputed.

    The runs must share dataset, questions (same ids in the same order), model, dtype and
    max_new_tokens; each method must come from one run only.
    """
    base = reports[0]
    ids = [r["id"] for r in base["questions"]]
    same = ("dtype", "max_new_tokens")
    for other in reports[1:]:
        if other["dataset"] != base["dataset"] or [r["id"] for r in other["questions"]] != ids:
            raise ValueError("the reports cover different questions; merge runs over the same ones")
        if other["model"] != base["model"] or any(other["config"][k] != base["config"][k] for k in same):
            raise ValueError(f"the reports differ in model or in {same}; their methods are not comparable")
    seen = [m for r in reports for m in r["summary"]]
    if len(seen) != len(set(seen)):
        raise ValueError(f"a method appears in more than one report: {seen}")
    methods = tuple(m for m in METHODS if m in seen)
    wall = {m: r["summary"][m]["wall_s"] for r in reports for m in r["summary"]}
    records = [dict(q, raw={}, predictions={}, scores={}) for q in base["questions"]]
    for report in reports:
        for record, q in zip(records, report["questions"]):
            for key in ("raw", "predictions", "scores"):
                record[key].update(q[key])
    config = {**base["config"], "methods": methods}
    for report in reports:  # each method's own batching, as it ran
        for m in report["summary"]:
            config[_BATCHING[m]] = report["config"].get(_BATCHING[m], 1)
    config = QualityConfig(**config)
    return {
        **base,
        "config": asdict(config),
        "summary": summarize(base["dataset"], records, methods, wall, config),
        "batch_outputs": next((r["batch_outputs"] for r in reports if r.get("batch_outputs")), None),
        "resumed_calls": {m: r.get("resumed_calls", {}).get(m, 0) for r in reports for m in r["summary"]},
        "run_calls": {m: r.get("run_calls", {}).get(m, 0) for r in reports for m in r["summary"]},
        "questions": records,
        "merged_from": [{"config": r["config"], "environment": r.get("environment")} for r in reports],
    }


def read_report(path: str | Path) -> dict:
    """A report JSON written by `evaluate_quality` (gzipped when the name ends in .gz); ValueError if it is not one."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        report = json.load(f)
    missing = [k for k in _REPORT_KEYS if not isinstance(report, dict) or k not in report]
    if missing:
        what = "not a report that `hf-parallel eval` (evaluate_quality) wrote"
        raise ValueError(f"{what} (it has no {', '.join(missing)})")
    return report
