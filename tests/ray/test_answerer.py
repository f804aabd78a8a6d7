"""`hf_parallel.ray.Answerer`, the Ray Data stage, called as Ray Data's actors call it: a batch in, the batch with
its answers out, in each of map_batches' batch formats; one engine call a batch; bad rows as error rows.

These run in this process, without a cluster (tests/ray/test_ray_corpus.py runs the stage on one).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the Ray stage needs the ray extra: pip install -e '.[ray]'")
pa = pytest.importorskip("pyarrow", reason="Ray Data's batches need pyarrow (the ray extra)")

from hf_parallel import Stats, generate_parallel  # noqa: E402
from hf_parallel.ray import Answerer  # noqa: E402
from tests.helpers.char_tokenizers import char_tokenizer  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402

NEW = 4
ROWS = [
    {"document": "The cat is named Tom. Tom lives in Paris.", "questions": ["What is it?", "Where?"], "n": 0},
    {"document": "Everest is 8849 metres high.", "questions": ["How high?"], "n": 1},
    {"document": "Water boils at 100 degrees.", "questions": ["When?", "Why?", "Who?"], "n": 2},
]
BAD = [
    ({"document": None, "questions": ["Who?"], "n": 3}, "the row has no document"),
    ({"document": " ", "questions": ["Who?"], "n": 4}, "the row's document is empty"),
    ({"document": "A dog.", "questions": [], "n": 5}, "the document has no questions"),
    ({"document": "A dog.", "questions": ["Why?", ""], "n": 6}, "the row's question 1 is empty"),
    ({"document": "word " * 60, "questions": ["Why?"], "n": 7}, "question 0's prompt has 325 tokens; with max_new_"
     "tokens=4 it would exceed the model's 256 positions (max_position_embeddings)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def expected(tiny_dir):
    """Each good row's answers as generate_parallel gives them on the same model."""
    stage = Answerer(str(tiny_dir), max_new_tokens=NEW)
    return [generate_parallel(stage.model, stage.tokenizer, r["document"], r["questions"], max_new_tokens=NEW)
            for r in ROWS]  # fmt: skip


def _numpy(rows: list[dict]) -> dict:
    import numpy as np

    columns = {}
    for name in rows[0]:
        columns[name] = np.empty(len(rows), dtype=object)
        for i, row in enumerate(rows):
            columns[name][i] = row[name]
    return columns


def _pandas(rows: list[dict]):
    import pandas as pd

    return pd.DataFrame(rows)


def _rows(batch) -> list[dict]:
    if isinstance(batch, dict):
        return [dict(zip(batch, values)) for values in zip(*batch.values())]
    if hasattr(batch, "to_pylist"):
        return batch.to_pylist()
    return batch.to_dict("records")


@pytest.mark.parametrize("batch_format", [pa.Table.from_pylist, _numpy, _pandas], ids=["pyarrow", "numpy", "pandas"])
def test_a_batch_is_one_engine_call_and_each_row_gets_generate_parallels_answers(tiny_dir, expected, batch_format):
    calls = Stats()
    stage = Answerer(str(tiny_dir), max_new_tokens=NEW, stats=calls)
    answered = stage(batch_format(ROWS))
    assert calls.calls == 1 and calls.prompts == 6  # the batch's documents share one call, so one packed row
    rows = _rows(answered)
    assert [r["n"] for r in rows] == [0, 1, 2]  # other columns pass through, in order
    assert [list(r["answers"]) for r in rows] == expected
    record = {"model": str(tiny_dir.resolve()), "options": {"dtype": "float32", "max_new_tokens": NEW}}
    for row in rows:
        assert row["error"] is None and {"model": row["model"], "options": row["options"]} == record


def test_bad_rows_become_error_rows_and_the_batch_goes_on(tiny_dir, expected):
    calls = Stats()
    stage = Answerer(str(tiny_dir), max_new_tokens=NEW, stats=calls)
    rows = [BAD[0][0], ROWS[0], *[row for row, _ in BAD[1:]], ROWS[1]]
    passed = {"document": "A.", "questions": ["B?"], "n": 8, "error": "an earlier stage's"}
    answered = stage(pa.Table.from_pylist(rows)).to_pylist()
    assert calls.calls == 1 and calls.prompts == 3  # the good rows only
    assert [(r["n"], r["error"]) for r in answered] == [(3, BAD[0][1]), (0, None), *[(r["n"], e) for r, e in BAD[1:]],
                                                        (1, None)]  # fmt: skip
    assert [r["answers"] for r in answered] == [None, expected[0], *[None] * 4, expected[1]]
    again = stage(pa.Table.from_pylist([{**ROWS[0], "error": None}, passed])).to_pylist()
    assert [(r["answers"], r["error"]) for r in again] == [(expected[0], None), (None, "an earlier stage's")]


def test_columns_are_configurable(tiny_dir, expected):
    stage = Answerer(str(tiny_dir), max_new_tokens=NEW, document_column="context", questions_column="asked",
                     answers_column="replies", error_column="problem")  # fmt: skip
    batch = pa.table({"context": [ROWS[1]["document"]], "asked": [ROWS[1]["questions"]]})
    (row,) = stage(batch).to_pylist()
    assert row["replies"] == expected[1] and row["problem"] is None and "answers" not in row


def test_hf_parallel_imports_no_ray():
    code = "import sys, hf_parallel, hf_parallel.cli; assert 'ray' not in sys.modules, 'ray imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
