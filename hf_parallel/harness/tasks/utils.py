"""Offline datasets for the hf_parallel harness tasks, read from local files (no hub access).

Each loader is a task's `custom_dataset`: it returns a `datasets.DatasetDict` with a "train" split (the few-shot
pool, which the `first_n` sampler takes in order, so every prompt of a task shares one few-shot prefix) and a
"validation" split (the documents evaluated, a paragraph's or passage's questions together).  The files come from
the folder named by `--metadata '{"data_dir": ...}'`, else the environment variable HF_PARALLEL_DATA, else
`../shared/data/` beside the repository (`hf_parallel.harness.data`); a missing file is a FileNotFoundError naming
where it was looked for.
Metrics are the harness's own: DROP's exact match and F1 (`lm_eval.tasks.drop.utils`), accuracy, perplexity.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zipfile

import datasets
from lm_eval.tasks.drop import utils as drop

from hf_parallel.harness.data import BOOK, DROP, SQUAD, data_file

POOL_DOCUMENTS = 3  # documents whose first question goes to the few-shot pool and not to evaluation
CHOICES = 4  # answer options of a multiple-choice question
BOOK_PASSAGE_CHARS = 1200  # the shortest War and Peace paragraph kept as a perplexity document


def squad(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """SQuAD v1.1 dev: `id`, `title`, `context`, `question`, `answers` (distinct gold texts, first first)."""
    return _split(_squad_paragraphs(data_dir))


def squad_choice(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """SQuAD v1.1 dev as multiple choice: each question's first gold answer among the first answers of three other
    questions of its paragraph (those differing from all its golds); `choices` and the gold's index `label`, placed
    by a hash of the question id.  Questions with fewer than three such distractors are left out."""
    paragraphs = []
    for paragraph in _squad_paragraphs(data_dir):
        firsts = [q["answers"][0] for q in paragraph]
        docs = [_with_choices(q, firsts) for q in paragraph]
        paragraphs.append([d for d in docs if d is not None])
    return _split([p for p in paragraphs if p])


def drop_passages(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """DROP dev (simple-evals' file), a passage's questions together in order of first appearance: `id`,
    `passage`, `question`, `answers` (the gold texts of `ref_text`)."""
    passages: dict[str, list[dict]] = {}
    with gzip.open(data_file(DROP, data_dir), "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines):
            row = json.loads(line)
            passage, question = _drop_prompt(row["context"])
            golds = [g for g in row["ref_text"].split("|") if g.strip()]
            doc = {"id": f"drop-{number}", "passage": passage, "question": question, "answers": golds}
            passages.setdefault(passage, []).append(doc)
    return _split(list(passages.values()))


def book_passages(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    """War and Peace's paragraphs of at least BOOK_PASSAGE_CHARS characters, in book order, as `text`."""
    with gzip.open(data_file(BOOK, data_dir), "rt", encoding="utf-8-sig") as handle:
        book = handle.read().replace("\r\n", "\n")
    paragraphs = (" ".join(p.split()) for p in book.split("\n\n"))
    docs = [{"text": p} for p in paragraphs if len(p) >= BOOK_PASSAGE_CHARS]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(docs)})


def process_answers(doc: dict, results: list[str]) -> dict:
    """DROP's exact match and F1 (the harness's `drop` task's scorer) of the answer against every gold text."""
    return drop.process_results({"answers": [(gold,) for gold in doc["answers"]]}, results)


def _squad_paragraphs(data_dir: str | None) -> list[list[dict]]:
    with zipfile.ZipFile(data_file(SQUAD, data_dir)) as archive:
        articles = json.loads(archive.read("dev-v1.1.json"))["data"]
    return [
        [_squad_doc(article["title"], paragraph["context"], qa) for qa in paragraph["qas"]]
        for article in articles
        for paragraph in article["paragraphs"]
    ]


def _squad_doc(title: str, context: str, qa: dict) -> dict:
    answers = list(dict.fromkeys(a["text"] for a in qa["answers"]))
    return {"id": qa["id"], "title": title, "context": context, "question": qa["question"], "answers": answers}


def _with_choices(doc: dict, firsts: list[str]) -> dict | None:
    golds = {_normal(a) for a in doc["answers"]}
    others = list(dict.fromkeys(a for a in firsts if _normal(a) not in golds))
    if len(others) < CHOICES - 1:
        return None
    label = int(hashlib.sha256(doc["id"].encode()).hexdigest(), 16) % CHOICES
    choices = others[: CHOICES - 1]
    choices.insert(label, doc["answers"][0])
    return {**doc, "choices": choices, "label": label}


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", "", text.lower()).split())


def _drop_prompt(context: str) -> tuple[str, str]:
    """(passage, question) of simple-evals' "Passage: ...\\nQuestion: ...\\nAnswer:"."""
    match = re.fullmatch(r"Passage: (.*)\nQuestion: (.*)\nAnswer:", context, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"a DROP line whose context is not 'Passage: ...\\nQuestion: ...\\nAnswer:': {context[:80]!r}")
    return match.group(1), match.group(2)


def _split(documents: list[list[dict]]) -> datasets.DatasetDict:
    """The first question of each of the first POOL_DOCUMENTS documents as the few-shot pool, the other documents'
    questions to evaluate (a document's together)."""
    pool = [questions[0] for questions in documents[:POOL_DOCUMENTS]]
    evaluated = [q for questions in documents[POOL_DOCUMENTS:] for q in questions]
    return datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(pool), "validation": datasets.Dataset.from_list(evaluated)}
    )
