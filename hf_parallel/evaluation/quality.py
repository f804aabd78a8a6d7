"""Answer quality of parallel prompting against one-question-at-a-time and batch prompting.

    standard   each question's prompt alone through `model.generate` (left-padded rows of
               `standard_batch_size` independent prompts)
    parallel   `generate_tokens` over all questions of `docs_per_call` documents as streams
    batch      all questions of a document in one prompt, answered in one sequence, parsed back
               (left-padded rows of `batch_rows` documents' sequences)

Standard and parallel see the same token prompts; all methods decode greedily, stop at EOS
and post-process alike (strip, first line).  Scores are the official SQuAD / DROP / QuAC
metrics; each method's F1 minus standard's gets a paired bootstrap 95% CI over questions.
A method's wall time is the sum of its generate calls (answers decoded to text included).
With `checkpoint`, each finished call is appended to a JSON-lines file, and a run started
again with that file skips the calls it holds (their recorded seconds still count).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from ..generation import generate_tokens
from ..inputs import eos_token_ids
from ..prompting import render_prompt, render_prompts
from .batch_prompting import build_batch_prompt, parse_batch_answers
from .datasets import QADocument, QAItem, load_drop, load_quac, load_squad
from .metrics import (
    CANNOTANSWER,
    HUMAN_F1_MIN,
    drop_em_f1,
    quac_f1,
    quac_human_f1,
    quac_scores,
    squad_exact_match,
    squad_f1,
)

DATASETS = {"squad": load_squad, "drop": load_drop, "quac": load_quac}
METHODS = ("standard", "parallel", "batch")
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
OFFLINE_DATA = {"squad": "squad-dev-v1.1.json.zip", "drop": "drop-dev.jsonl.gz"}  # QuAC has no offline copy
ABSTAIN = "I cannot answer"  # QuAC: what the model is asked to say when the text does not tell
INSTRUCTIONS = {  # one wording, adapted to what each dataset's answers are
    "squad": "Answer the question with a short phrase taken from the text.",
    "drop": "Answer the question with a number or a short phrase taken from the text.",
    "quac": "Answer the question with a short phrase taken from the text. "
    f'If the text does not tell, answer "{ABSTAIN}".',
}
# A QuAC prediction that starts like one of these is the abstention CANNOTANSWER.
_ABSTENTION = re.compile(
    r"^\W*(?:i\s+)?(?:cannot|can\s*not|can't|could\s*not|couldn't|am\s+unable\s+to)\s+answer"
    r"|^\W*cannotanswer|^\W*(?:i\s+)?(?:do\s+not|don't)\s+know|^\W*unknown\b"
    r"|^\W*(?:the\s+)?(?:text|passage|document)\s+does\s+not\s+(?:say|tell|mention|state)",
    re.I,
)


@dataclass
class QualityConfig:
    """One evaluation run; the `eval` command's flags map one-to-one onto these fields."""

    dataset: str = "squad"  # squad | drop | quac
    data: str | None = None  # path or HF dataset name; default: the offline copy in ../shared/data/
    methods: tuple[str, ...] = METHODS
    limit: int | None = None  # questions (whole documents, the last one truncated)
    max_new_tokens: int = 32  # per answer; batch prompting gets this times the document's questions
    standard_batch_size: int = 1  # independent prompts per left-padded model.generate call
    docs_per_call: int = 1  # documents packed into one generate_tokens call
    batch_rows: int = 1  # batch-prompting sequences (documents) per left-padded model.generate call
    dtype: str = "float32"
    device: str = "cpu"
    attn: str = "auto"  # generate_tokens' attention path
    resamples: int = 1000  # paired bootstrap resamples
    seed: int = 0
    out: str | None = None  # JSON path (a .md table is written beside it)
    checkpoint: str | None = None  # JSON-lines file of finished generate calls: an interrupted run resumes from it

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {self.dataset!r}")
        if self.data is None and self.dataset not in OFFLINE_DATA:
            raise ValueError(f"{self.dataset} has no offline copy; pass data= (the official val_v0.2.json)")
        self.data = self.data or str(SHARED_DATA / OFFLINE_DATA[self.dataset])
        self.methods = tuple(dict.fromkeys(self.methods))
        if not self.methods or not set(self.methods) <= set(METHODS):
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {self.methods}")
        for name in ("max_new_tokens", "standard_batch_size", "docs_per_call", "batch_rows", "resamples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")


# --------------------------------------------------------------------------- prompts


def question_prompts(tokenizer, dataset: str, document: QADocument) -> list[list[int]]:
    """Each question's complete prompt (token ids), as it would be asked alone."""
    if dataset == "quac":
        return [quac_prompt(tokenizer, document.text, item) for item in document.items]
    template = "{document}\n\n" + INSTRUCTIONS[dataset] + "\nQuestion: {question}"
    return render_prompts(tokenizer, document.text, [item.question for item in document.items], template)


def quac_prompt(tokenizer, document: str, item: QAItem) -> list[int]:
    """A dialogue turn: earlier turns as question/answer pairs, so each turn's prompt extends the last."""
    turns = [(q, ABSTAIN if a == CANNOTANSWER else a.strip()) for q, a in item.history] + [(item.question, None)]
    header = f"{document}\n\n{INSTRUCTIONS['quac']}\n"
    return render_prompt(tokenizer, [(header * (i == 0) + f"Question: {q}", a) for i, (q, a) in enumerate(turns)])


def batch_prompt(tokenizer, document: QADocument) -> list[int]:
    """All of the document's questions in one prompt (the batch-prompting baseline)."""
    text = build_batch_prompt(document.text, [item.question for item in document.items])
    return render_prompt(tokenizer, text, plain_answer="")  # the text ends with "Answers:" already


def postprocess(text: str, dataset: str) -> str:
    """The same for every method: strip, first line; QuAC abstentions become CANNOTANSWER."""
    answer = text.strip().split("\n", 1)[0].strip()
    return CANNOTANSWER if dataset == "quac" and _ABSTENTION.match(answer) else answer


# --------------------------------------------------------------------------- methods


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def _generate_rows(model, prompts: list[list[int]], max_new_tokens: int, eos: list[int], pad: int,
                   stop=None) -> list[list[int]]:  # fmt: skip
    """Plain greedy `model.generate` over left-padded independent prompts; new tokens before EOS.

    stop: optional `StoppingCriteria` for `generate` (per row).
    """
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    extra = {"stopping_criteria": StoppingCriteriaList([stop])} if stop is not None else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad, **extra)  # fmt: skip
    return [_until_eos(row, set(eos)) for row in out[:, width:].tolist()]


class StopAtString(StoppingCriteria):
    """Per row: stop once the row's new text contains its own stop string (rows of one
    `generate` call have different ones, which `generate(stop_strings=...)` cannot say)."""

    def __init__(self, tokenizer, stops: list[str], prompt_width: int, window: int = 12):
        self.tokenizer, self.stops, self.width, self.window = tokenizer, stops, prompt_width, window

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        tail = input_ids[:, max(self.width, input_ids.shape[1] - self.window) :]
        texts = self.tokenizer.batch_decode(tail.tolist(), skip_special_tokens=True)
        return torch.tensor([s in t for s, t in zip(self.stops, texts)], device=input_ids.device)


@dataclass
class GenerateCall:
    """One generate call of a method: the output positions it fills and how many questions it answers."""

    indices: list[int]  # prompts (standard, parallel) or documents (batch prompting)
    questions: int
    run: Callable[[], list[str]]  # the decoded outputs, one per index


def standard_calls(model, tokenizer, prompts, config: QualityConfig, eos, pad) -> list[GenerateCall]:
    """Each prompt as its own request; rows batched by length so padding stays small."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def call(rows):
        return _decode(tokenizer, _generate_rows(model, [prompts[i] for i in rows], config.max_new_tokens, eos, pad))

    return [GenerateCall(rows, len(rows), lambda rows=rows: call(rows))
            for rows in _slices(order, config.standard_batch_size)]  # fmt: skip


def parallel_calls(model, tokenizer, per_document, config: QualityConfig, eos) -> list[GenerateCall]:
    """All questions of `docs_per_call` documents as streams of one packed row per call."""
    first = np.cumsum([0] + [len(doc) for doc in per_document])  # each document's first prompt

    def call(docs):
        prompts = [p for d in docs for p in per_document[d]]
        answers = generate_tokens(model, prompts, max_new_tokens=config.max_new_tokens, eos_token_id=eos,
                                  do_sample=False, attn=config.attn)  # fmt: skip
        return _decode(tokenizer, [_until_eos(a, set(eos)) for a in answers])

    calls = []
    for docs in _slices(list(range(len(per_document))), config.docs_per_call):
        indices = [int(i) for d in docs for i in range(first[d], first[d + 1])]
        calls.append(GenerateCall(indices, len(indices), lambda docs=docs: call(docs)))
    return calls


def batch_calls(model, tokenizer, documents, prompts, config: QualityConfig, eos, pad) -> list[GenerateCall]:
    """One sequence per document, its raw output text; `parse_batch_answers` splits it into answers.

    Each sequence stops at EOS, after max_new_tokens per question, or when the model starts
    an answer past the last question ("A<n+1>:"), which the parser would drop anyway.
    Sequences are batched `batch_rows` at a time, documents of similar question counts and
    prompt lengths together; a row that stops early is padded while the others go on.
    """
    order = sorted(range(len(documents)), key=lambda i: (len(documents[i].items), len(prompts[i])))

    def call(rows):
        counts = [len(documents[i].items) for i in rows]
        width = max(len(prompts[i]) for i in rows)
        stop = StopAtString(tokenizer, [f"A{n + 1}:" for n in counts], width)
        new = _generate_rows(model, [prompts[i] for i in rows], config.max_new_tokens * max(counts), eos, pad, stop)
        return [tokenizer.decode(tokens[: config.max_new_tokens * n], skip_special_tokens=True)
                for n, tokens in zip(counts, new)]  # fmt: skip

    return [GenerateCall(rows, sum(len(documents[i].items) for i in rows), lambda rows=rows: call(rows))
            for rows in _slices(order, config.batch_rows)]  # fmt: skip


def _slices(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class Checkpoint:
    """A run's finished generate calls, one JSON line each after a header line saying which run it is.

    An interrupted run started again with the same checkpoint file skips the calls it holds; a
    line cut short by the interruption is ignored (that call runs again).
    """

    def __init__(self, path: str | Path, header: dict):
        self.path, self.done = Path(path), {}
        if self.path.exists() and self.path.stat().st_size:
            lines = self.path.read_text().splitlines()
            if _json_line(lines[0]) != header:
                raise ValueError(f"{self.path} is the checkpoint of another run (its first line: {lines[0][:300]}); "
                                 "pass another --checkpoint file or delete it")  # fmt: skip
            for record in filter(None, map(_json_line, lines[1:])):
                self.done[(record["method"], record["call"])] = record
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(header) + "\n")

    def get(self, method: str, call: int, indices: list[int]) -> dict | None:
        record = self.done.get((method, call))
        return record if record is not None and record["indices"] == indices else None

    def add(self, method: str, call: int, indices: list[int], outputs: list[str], seconds: float) -> None:
        record = {"method": method, "call": call, "indices": indices, "outputs": outputs, "seconds": seconds}
        with self.path.open("rb+") as f:
            end = f.seek(0, os.SEEK_END)
            if end and f.seek(end - 1) >= 0 and f.read(1) != b"\n":  # a line cut short by an interruption
                f.write(b"\n")
            f.write((json.dumps(record) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def _json_line(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def execute(method: str, calls: list[GenerateCall], size: int, model, bar, checkpoint: Checkpoint | None = None):
    """Run the calls (those not in the checkpoint); outputs by index, the calls' summed seconds, calls resumed."""
    outputs: list[str | None] = [None] * size
    seconds, resumed = 0.0, 0
    for k, call in enumerate(calls):
        record = checkpoint.get(method, k, call.indices) if checkpoint else None
        if record is not None:
            got, took = record["outputs"], record["seconds"]
            resumed += 1
        else:
            start = _clock(model)
            got = call.run()
            took = _clock(model) - start
            if checkpoint:
                checkpoint.add(method, k, call.indices, got, took)
        for i, text in zip(call.indices, got):
            outputs[i] = text
        seconds += took
        bar.update(call.questions)
    return outputs, seconds, resumed


# --------------------------------------------------------------------------- scores


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
    means = np.concatenate(
        [
            diff[rng.integers(0, diff.size, (min(500, resamples - s), diff.size))].mean(1)
            for s in range(0, resamples, 500)
        ]
    )  # fmt: skip  (chunks bound the index memory)
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
            row["f1_minus_standard"] = paired_bootstrap([r["scores"]["standard"]["f1"] for r in counted],
                                                        [r["scores"][m]["f1"] for r in counted],
                                                        config.resamples, config.seed)  # fmt: skip
            row["differ_from_standard"] = sum(r["predictions"][m] != r["predictions"]["standard"] for r in records)
        summary[m] = row
    return summary


def table(report: dict) -> str:
    """The summary as a markdown table (scores times 100, as the official scripts print them)."""
    s, lines = report["summary"], [
        f"{report['dataset']}: {report['n_questions']} questions, {report['n_documents']} documents; "
        f"{report['model']}, {report['config']['dtype']}, {report['config']['device']}; greedy, "
        f"max_new_tokens={report['config']['max_new_tokens']}, standard_batch_size="
        f"{report['config']['standard_batch_size']}, docs_per_call={report['config']['docs_per_call']}, "
        f"batch_rows={report['config'].get('batch_rows', 1)}",
        "",
        "| method | EM | F1 | wall s | speedup vs standard | F1 - standard [95% CI] | differ from standard |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]  # fmt: skip
    for m, row in s.items():
        em = "-" if row["em"] is None else f"{100 * row['em']:.1f}"
        speed = f"{row['speedup']:.2f}x" if row.get("speedup") else "-"
        ci = row.get("f1_minus_standard")
        ci = f"{100 * ci['mean']:+.2f} [{100 * ci['lo']:+.2f}, {100 * ci['hi']:+.2f}]" if ci else "-"
        differ = f"{row['differ_from_standard']}/{report['n_questions']}" if "differ_from_standard" in row else "-"
        lines.append(f"| {m} | {em} | {100 * row['f1']:.1f} | {row['wall_s']:.1f} | {speed} | {ci} | {differ} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- run


def evaluate(model, tokenizer, documents: list[QADocument], config: QualityConfig, model_name: str = "") -> dict:
    """Run every method on `documents`, score them and summarize; the report as a JSON-able dict."""
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    items = [(d, item) for d in documents for item in d.items]
    per_document = [question_prompts(tokenizer, config.dataset, d) for d in documents]
    prompts = [p for doc in per_document for p in doc]
    batch_prompts = [batch_prompt(tokenizer, d) for d in documents] if "batch" in config.methods else []
    checkpoint = None
    if config.checkpoint:  # the header hashes every question id: only when there is a checkpoint
        checkpoint = Checkpoint(config.checkpoint, _checkpoint_header(config, items, model_name))
    raw, wall, resumed, batch_raw, load_before = {}, {}, {}, None, os.getloadavg()
    for m in config.methods:
        if m == "standard":
            calls, size = standard_calls(model, tokenizer, prompts, config, eos, pad), len(prompts)
        elif m == "parallel":
            calls, size = parallel_calls(model, tokenizer, per_document, config, eos), len(prompts)
        else:
            calls, size = batch_calls(model, tokenizer, documents, batch_prompts, config, eos, pad), len(documents)
        with tqdm(total=len(items), desc=m, unit="q") as bar:
            raw[m], wall[m], resumed[m] = execute(m, calls, size, model, bar, checkpoint)
        if m == "batch":
            batch_raw = raw[m]
            raw[m] = [a for d, text in zip(documents, batch_raw) for a in parse_batch_answers(text, len(d.items))]
    records = []
    for i, (document, item) in enumerate(items):
        predictions = {m: postprocess(raw[m][i], config.dataset) for m in config.methods}
        records.append({"id": item.id, "document": document.id, "question": item.question, "answers": item.answers,
                        "raw": {m: raw[m][i] for m in config.methods}, "predictions": predictions,
                        "scores": {m: score(config.dataset, p, item) for m, p in predictions.items()}})  # fmt: skip
    return {
        "dataset": config.dataset, "model": model_name or type(model).__name__, "config": asdict(config),
        "n_questions": len(items), "n_documents": len(documents),
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "summary": summarize(config.dataset, records, config.methods, wall, config),
        "resumed_calls": resumed,  # generate calls taken from the checkpoint (their recorded seconds counted)
        "batch_outputs": batch_raw, "questions": records,
    }  # fmt: skip


def _decode(tokenizer, answers: list[list[int]]) -> list[str]:
    return [tokenizer.decode(a, skip_special_tokens=True) for a in answers]


def _clock(model) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


def _checkpoint_header(config: QualityConfig, items, model_name: str) -> dict:
    """What must match for a checkpoint's calls to be reused: the questions and all that shapes the calls."""
    ids = hashlib.sha1("\n".join(item.id for _, item in items).encode()).hexdigest()
    keep = ("dataset", "max_new_tokens", "standard_batch_size", "docs_per_call", "batch_rows", "dtype", "device",
            "attn")  # fmt: skip
    return {"hf_parallel_quality_checkpoint": 1, "model": model_name, "questions": len(items), "question_ids": ids,
            **{k: getattr(config, k) for k in keep}}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `QualityConfig` field."""
    default = QualityConfig()
    parser.add_argument("--dataset", choices=sorted(DATASETS), default=default.dataset)
    parser.add_argument("--data", help="dataset file or HF name (default: the offline copy in ../shared/data/)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--limit", type=int, help="number of questions (whole documents, the last one cut)")
    parser.add_argument("--max-new-tokens", type=int, default=default.max_new_tokens)
    parser.add_argument("--standard-batch-size", type=int, default=default.standard_batch_size)
    parser.add_argument("--docs-per-call", type=int, default=default.docs_per_call)
    parser.add_argument(
        "--batch-rows",
        type=int,
        default=default.batch_rows,
        help="batch-prompting sequences per left-padded model.generate call",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=default.dtype)
    parser.add_argument("--device", default=default.device, help="cpu or cuda[:N]")
    parser.add_argument("--attn", default=default.attn, help="generate_tokens' attention path")
    parser.add_argument("--resamples", type=int, default=default.resamples)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--out", help="JSON report path; the table goes beside it as .md")
    parser.add_argument(
        "--checkpoint",
        help="JSON-lines file of finished generate calls; run again with the same "
        "file, an interrupted run skips the calls it holds (wall time: the calls' own seconds)",
    )


def run(config: QualityConfig, model=None, tokenizer=None) -> dict:
    """Load the data (and SmolLM2 unless given a model), evaluate, write JSON and table, print the table."""
    documents = DATASETS[config.dataset](config.data, config.limit)
    name = type(model).__name__ if model is not None else "SmolLM2-135M-Instruct"
    if model is None:
        from ..models import load_smollm2

        model, tokenizer = load_smollm2(getattr(torch, config.dtype), config.device)
    report = evaluate(model, tokenizer, documents, config, name)
    text = table(report)
    if config.out:
        out = Path(config.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return report


_BATCHING = {"standard": "standard_batch_size", "parallel": "docs_per_call", "batch": "batch_rows"}


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
    return {**base, "config": asdict(config), "summary": summarize(base["dataset"], records, methods, wall, config),
            "batch_outputs": next((r["batch_outputs"] for r in reports if r.get("batch_outputs")), None),
            "resumed_calls": {m: r.get("resumed_calls", {}).get(m, 0) for r in reports for m in r["summary"]},
            "questions": records, "merged_from": [{"config": r["config"], "environment": r.get("environment")}
                                                  for r in reports]}  # fmt: skip


def read_report(path: str | Path) -> dict:
    """A report JSON written by `run` (gzipped when the name ends in .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def merge_main(argv: list[str] | None = None) -> None:
    """`python eval/quality.py merge A.json B.json --out C.json`: see `merge_reports`."""
    parser = argparse.ArgumentParser(prog="quality.py merge", description=merge_reports.__doc__)
    parser.add_argument("reports", nargs="+", help="report JSONs (.json or .json.gz)")
    parser.add_argument("--out", required=True, help="merged JSON path; the table goes beside it as .md")
    args = parser.parse_args(argv)
    report = merge_reports([read_report(p) for p in args.reports])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(table(report) + "\n")
    print(table(report))


def parse_config(argv: list[str] | None = None, prog: str | None = None) -> QualityConfig:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=formatter)
    add_arguments(parser)
    return QualityConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    run(parse_config(argv, prog))
