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

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from ..decoding.inputs import eos_token_ids
from ..frontends.model_loading import DEFAULT_NAME, load_model
from ..frontends.progress import shown
from .batch_prompting import parse_batch_answers
from .checkpoint import Checkpoint, checkpoint_header
from .config import DOWNLOADS, OFFLINE_DATA, SHARED_DATA, QualityConfig
from .loaders import FORMATS, DatasetFileError, QADocument, load_documents
from .methods import batch_calls, execute, parallel_calls, standard_calls
from .prompts import batch_prompt, postprocess, question_prompts
from .report import score, summarize, table


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
        checkpoint = Checkpoint(config.checkpoint, checkpoint_header(config, items, model_name))
    raw, wall, resumed, ran, batch_raw, load_before = {}, {}, {}, {}, None, os.getloadavg()
    for m in config.methods:
        if m == "standard":
            calls, size = standard_calls(model, tokenizer, prompts, config, eos, pad), len(prompts)
        elif m == "parallel":
            calls, size = parallel_calls(model, tokenizer, per_document, config, eos), len(prompts)
        else:
            calls, size = batch_calls(model, tokenizer, documents, batch_prompts, config, eos, pad), len(documents)
        with tqdm(total=len(items), desc=m, unit="q", disable=not shown(config.progress)) as bar:
            raw[m], wall[m], resumed[m] = execute(m, calls, size, model, bar, checkpoint)
        ran[m] = len(calls) - resumed[m]
        if m == "batch":
            batch_raw = raw[m]
            raw[m] = [a for d, text in zip(documents, batch_raw) for a in parse_batch_answers(text, len(d.items))]
    records = _records(items, raw, config)
    return {
        "dataset": config.dataset,
        "model": model_name or type(model).__name__,
        "config": asdict(config),
        "n_questions": len(items),
        "n_documents": len(documents),
        "environment": _environment(load_before),
        "summary": summarize(config.dataset, records, config.methods, wall, config),
        "resumed_calls": resumed,  # generate calls taken from the checkpoint (their recorded seconds counted)
        "run_calls": ran,  # generate calls this run made
        "batch_outputs": batch_raw,
        "questions": records,
    }


def _records(items, raw: dict, config: QualityConfig) -> list[dict]:
    """Per question: its gold answers, each method's raw output, prediction and scores."""
    records = []
    for i, (document, item) in enumerate(items):
        predictions = {m: postprocess(raw[m][i], config.dataset) for m in config.methods}
        records.append(
            {
                "id": item.id,
                "document": document.id,
                "question": item.question,
                "answers": item.answers,
                "raw": {m: raw[m][i] for m in config.methods},
                "predictions": predictions,
                "scores": {m: score(config.dataset, p, item) for m, p in predictions.items()},
            }
        )
    return records


def _environment(load_before) -> dict:
    """What the timings ran on, and how busy the machine was before and after."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def evaluate_quality(config: QualityConfig, model=None, tokenizer=None) -> dict:
    """Load the data (and `config.model` unless given a model), evaluate, write JSON and table, print the table.

    Data that cannot be read raises `DatasetFileError`; a model that cannot be loaded, `ModelSourceError`;
    a checkpoint of another run, `CheckpointError`.
    """
    documents = _load_documents(config)
    name = type(model).__name__ if model is not None else config.model or DEFAULT_NAME
    if model is None:
        model, tokenizer = load_model(config.model, getattr(torch, config.dtype), config.device, config.progress)
    report = evaluate(model, tokenizer, documents, config, name)
    if config.out:
        write_report(report, Path(config.out))
    print(table(report))
    return report


def _load_documents(config: QualityConfig) -> list[QADocument]:
    """The config's documents; the offline copy, when it is the default and absent, gets its own message."""
    offline = SHARED_DATA / OFFLINE_DATA[config.dataset] if config.dataset in OFFLINE_DATA else None
    if offline is not None and config.data == str(offline) and not offline.exists():
        raise DatasetFileError(
            f"the offline copy of {config.dataset} was not found at {offline} (the folder ../shared/data/ beside "
            f"the repository); download {FORMATS[config.dataset]} from {DOWNLOADS[config.dataset]} and pass "
            "--data FILE, or pass a `datasets` name"
        )
    return load_documents(config.dataset, config.data, config.limit)


def write_report(report: dict, out: Path) -> None:
    """The report as JSON at `out`, its table beside it as .md."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(table(report) + "\n")
