"""Loaders on small fixtures in each official format, and on the real offline files."""

import gzip
import json
import sys
import types
import zipfile

import pytest

from hf_parallel.evaluation.loaders import QAItem, load_drop, load_quac, load_squad
from hf_parallel.evaluation.metrics import drop_em_f1
from tests.helpers.project import SHARED_DATA

DATA = SHARED_DATA


def _qa(qid, question, *answers):
    return {"id": qid, "question": question, "answers": [{"text": a, "answer_start": 0} for a in answers]}


SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "Alpha",
            "paragraphs": [
                {"context": "Alpha one.", "qas": [_qa("a1", "Q a1?", "one", "one."), _qa("a2", "Q a2?", "Alpha")]},
                {"context": "Alpha two.", "qas": [_qa("a3", "Q a3?", "two")]},
            ],
        },
        {
            "title": "Beta",
            "paragraphs": [
                {
                    "context": "Beta.",
                    "qas": [_qa("b1", "Q b1?", "x"), _qa("b2", "Q b2?", "y"), _qa("b3", "Q b3?", "z")],
                },
            ],
        },
    ],
}


def _write_squad(tmp_path):
    path = tmp_path / "dev-v1.1.json"
    path.write_text(json.dumps(SQUAD))
    return path


def _counts(documents):
    return [len(d.items) for d in documents]


def test_squad_json_one_document_per_paragraph(tmp_path):
    docs = load_squad(_write_squad(tmp_path))
    assert [d.id for d in docs] == ["Alpha/0", "Alpha/1", "Beta/0"]
    assert [d.text for d in docs] == ["Alpha one.", "Alpha two.", "Beta."]
    assert docs[0].items[0] == QAItem("a1", "Q a1?", ["one", "one."])
    assert _counts(docs) == [2, 1, 3]


def test_squad_zip_gives_the_same_documents(tmp_path):
    archive = tmp_path / "squad.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("dev-v1.1.json", json.dumps(SQUAD))
    assert load_squad(archive) == load_squad(_write_squad(tmp_path))


@pytest.mark.parametrize(
    "limit, expected", [(0, []), (2, [2]), (3, [2, 1]), (4, [2, 1, 1]), (6, [2, 1, 3]), (99, [2, 1, 3])]
)
def test_limit_keeps_whole_documents_and_truncates_the_last(tmp_path, limit, expected):
    docs = load_squad(_write_squad(tmp_path), limit_questions=limit)
    assert _counts(docs) == expected
    if expected == [2, 1, 1]:
        assert docs[-1].items[0].id == "b1"


def test_missing_file_is_not_taken_for_a_dataset_name(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_squad(tmp_path / "nope")  # a Path is always a path
    with pytest.raises(FileNotFoundError):
        load_drop(str(tmp_path / "drop-dev.jsonl.gz"))


def test_dataset_name_needs_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes "import datasets" fail
    with pytest.raises(ImportError, match="datasets"):
        load_squad("squad")


def _fake_datasets(monkeypatch, rows):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_squad_from_a_hub_name_groups_rows_by_context(monkeypatch):
    rows = [
        {"id": i, "title": "T", "context": c, "question": f"q{i}", "answers": {"text": [f"a{i}"], "answer_start": [0]}}
        for i, c in [("1", "C1"), ("2", "C1"), ("3", "C2")]
    ]
    calls = _fake_datasets(monkeypatch, rows)
    docs = load_squad("squad")
    assert calls == [("squad", "validation")]
    assert [(d.text, [i.id for i in d.items]) for d in docs] == [("C1", ["1", "2"]), ("C2", ["3"])]


def test_drop_from_a_hub_name_takes_each_span_as_a_gold(monkeypatch):
    rows = [
        {
            "section_id": "s1",
            "query_id": "q1",
            "passage": "P",
            "question": "Who?",
            "answers_spans": {"spans": ["Ann", "Bob", "Ann"], "types": ["span"] * 3},
        }
    ]
    _fake_datasets(monkeypatch, rows)
    (doc,) = load_drop("ucinlp/drop")
    assert doc.id == "s1" and doc.items[0].answers == ["Ann", "Bob"]


# ----------------------------------------------------------------------------- DROP


def _drop_line(passage, question, ref_text):
    context = f"Passage: {passage}\nQuestion: {question}\nAnswer:"
    return json.dumps({"context": context, "completion": " " + ref_text.split("|")[0], "ref_text": ref_text})


def test_drop_simple_evals_groups_by_passage(tmp_path):
    path = tmp_path / "drop.jsonl.gz"
    lines = [
        _drop_line("Passage A. Two lines?", "How many?", "2|two"),
        _drop_line("Passage B.", "When?", "  2015|  2015"),
        _drop_line("Passage A. Two lines?", "Who?", "Ann and Bob|Bob and Ann| "),
    ]
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    docs = load_drop(path)
    assert [d.text for d in docs] == ["Passage A. Two lines?", "Passage B."]
    assert [[i.id for i in d.items] for d in docs] == [["drop-0", "drop-2"], ["drop-1"]]
    assert docs[0].items[1] == QAItem("drop-2", "Who?", ["Ann and Bob", "Bob and Ann"])
    assert docs[1].items[0].answers == ["2015"]
    assert docs[0].items[0].drop_references == ["2", "two"]


def test_drop_simple_evals_takes_the_last_block_of_a_few_shot_context(tmp_path):
    context = "Passage: Old.\nQuestion: Old?\nAnswer: 1\n\nPassage: New.\nQuestion: New?\nAnswer:"
    path = tmp_path / "drop.jsonl"
    path.write_text(json.dumps({"context": context, "completion": " 2", "ref_text": "2"}) + "\n")
    (doc,) = load_drop(path)
    assert (doc.text, doc.items[0].question) == ("New.", "New?")


def test_drop_simple_evals_rejects_an_unknown_context(tmp_path):
    path = tmp_path / "drop.jsonl"
    path.write_text(json.dumps({"context": "Just text", "completion": "x", "ref_text": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        load_drop(path)


def _answer(number="", spans=(), day="", month="", year=""):
    return {"number": number, "date": {"day": day, "month": month, "year": year}, "spans": list(spans)}


DROP_OFFICIAL = {
    "nfl_1": {
        "passage": "Passage one.",
        "qa_pairs": [
            {
                "query_id": "q1",
                "question": "How many?",
                "answer": _answer(number="1"),
                "validated_answers": [_answer(number="0")],
            },
            {
                "query_id": "q2",
                "question": "When?",
                "answer": _answer(day="17", month="August"),
                "validated_answers": [_answer(spans=["August"]), _answer(number="17"), _answer()],
            },
        ],
    },
    "hist_2": {
        "passage": "Passage two.",
        "qa_pairs": [
            {
                "query_id": "q3",
                "question": "Who?",
                "answer": _answer(spans=["span1", "span2"]),
                "validated_answers": [_answer(spans=["span2"])],
            },
        ],
    },
}


def test_drop_official_json(tmp_path):
    path = tmp_path / "drop_dataset_dev.json"
    path.write_text(json.dumps(DROP_OFFICIAL, indent=1))
    docs = load_drop(path)
    assert [(d.id, d.text) for d in docs] == [("nfl_1", "Passage one."), ("hist_2", "Passage two.")]
    assert _counts(docs) == [2, 1]
    q1, q2 = docs[0].items
    assert q1.answers == ["1", "0"]
    assert q2.answers == ["17 August", "August", "17"]  # the blank validated answer is gone
    q3 = docs[1].items[0]
    assert q3.answers == ["span1 and span2", "span2"]
    assert q3.answer_spans == (("span1", "span2"), ("span2",))
    # Scores of the official scorer's own functional tests.
    assert drop_em_f1("1", q1.drop_references) == (1.0, 1.0)
    assert drop_em_f1("17 August", q2.drop_references) == (1.0, 1.0)
    assert drop_em_f1("span1", q3.drop_references) == (0.0, 0.5)


# ----------------------------------------------------------------------------- QuAC


def _quac_qa(qid, question, orig, *answers):
    return {
        "id": qid,
        "question": question,
        "followup": "y",
        "yesno": "x",
        "answers": [{"text": a, "answer_start": 0} for a in answers],
        "orig_answer": {"text": orig, "answer_start": 0},
    }


QUAC = {
    "data": [
        {
            "title": "T",
            "section_title": "S",
            "background": "B",
            "paragraphs": [
                {
                    "id": "D1",
                    "context": "Some text here. CANNOTANSWER",
                    "qas": [
                        _quac_qa("D1_q#0", "First?", "Some text", "Some text", "text"),
                        _quac_qa("D1_q#1", "Second?", "CANNOTANSWER", "CANNOTANSWER", "CANNOTANSWER"),
                        _quac_qa("D1_q#2", "Third?", "here", "here"),
                    ],
                },
                {"id": "D2", "context": "Other. CANNOTANSWER", "qas": [_quac_qa("D2_q#0", "Only?", "Other", "Other")]},
            ],
        }
    ]
}


def test_quac_dialogues_with_history(tmp_path):
    path = tmp_path / "val_v0.2.json"
    path.write_text(json.dumps(QUAC))
    docs = load_quac(path)
    assert [(d.id, d.text) for d in docs] == [("D1", "Some text here."), ("D2", "Other.")]
    first, second, third = docs[0].items
    assert first.history == () and first.answers == ["Some text", "text"]
    assert second.history == (("First?", "Some text"),)
    assert third.history == (("First?", "Some text"), ("Second?", "CANNOTANSWER"))
    assert docs[1].items[0].history == ()  # history never crosses dialogues
    assert _counts(load_quac(path, limit_questions=2)) == [2]


# ----------------------------------------------------------------------------- real files


def _real(name):
    path = DATA / name
    if not path.exists():
        pytest.skip(f"offline copy {path} is absent (only this project's machines have ../shared/data)")
    return path


def test_real_squad_dev_counts():
    docs = load_squad(_real("squad-dev-v1.1.json.zip"))
    assert (len(docs), sum(_counts(docs))) == (2067, 10570)
    assert all(item.answers for doc in docs for item in doc.items)


def test_real_drop_dev_counts():
    docs = load_drop(_real("drop-dev.jsonl.gz"))
    assert (len(docs), sum(_counts(docs))) == (579, 9536)
    assert all(item.answers for doc in docs for item in doc.items)
    assert len({doc.text for doc in docs}) == 579
