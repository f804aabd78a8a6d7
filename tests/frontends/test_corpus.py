"""`answer_corpus` and `answer_dataset`: many documents with their own questions, answered as
`generate_parallel` answers each document, each document as soon as its last answer is done; the
datasets path resumes from its checkpoint; the JSON-lines helpers of `hf-parallel answer --corpus`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hf_parallel.frontends.corpus as corpus
from hf_parallel import Stats, generate_parallel, generate_tokens
from hf_parallel.frontends.corpus import CorpusAnswer, answer_corpus, finished_answers, read_corpus, read_json_lines
from hf_parallel.frontends.datasets import answer_dataset
from hf_parallel.frontends.jsonlines import CheckpointError
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import tiny_model

NEW = 8
DOCUMENTS = [
    ("The cat is named Tom. Tom lives in Paris with Anna, who is a baker.",
     ["What is the cat called?", "Where does Tom live?", "What is Anna's job?"]),
    ("Mount Everest is 8849 metres high and lies in the Himalayas.", ["How high is Everest?"]),
    ("Water boils at 100 degrees Celsius at sea level.", ["At what temperature does water boil?", "Where?"]),
]  # fmt: skip


@pytest.fixture
def calls():
    """What the generate calls of a test count into, passed on as `stats=`: how many, and their prompts."""
    return Stats()


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), char_tokenizer()


# --------------------------------------------------------------------------- answer_corpus on SmolLM2


@pytest.mark.slow
@pytest.mark.parametrize("tokens_per_call, expected_calls", [(corpus.TOKENS_PER_CALL, 1), (1, 3)])
def test_answer_corpus_answers_each_document_as_generate_parallel(smollm2, calls, tokens_per_call, expected_calls):
    model, tokenizer = smollm2
    records = [DOCUMENTS[0], {"id": "everest", "document": DOCUMENTS[1][0], "questions": DOCUMENTS[1][1]},
               {"document": DOCUMENTS[2][0], "questions": DOCUMENTS[2][1]}]  # fmt: skip
    got = list(answer_corpus(model, tokenizer, records, tokens_per_call=tokens_per_call, max_new_tokens=NEW,
                             stats=calls))  # fmt: skip
    assert calls.calls == expected_calls
    got.sort(key=lambda answer: answer.index)  # yielded as they finish
    assert [(a.index, a.id) for a in got] == [(0, 0), (1, "everest"), (2, 2)]
    for answer, (document, questions) in zip(got, DOCUMENTS):
        assert (answer.document, answer.questions) == (document, questions)
        assert answer.answers == generate_parallel(model, tokenizer, document, questions, max_new_tokens=NEW)


# --------------------------------------------------------------------------- answer_corpus's mechanics (tiny model)


def test_answer_corpus_streams_lazily_in_calls_within_the_token_budget(tiny, calls):
    model, tokenizer = tiny
    read = []

    def records():
        for i, (document, questions) in enumerate(DOCUMENTS):
            read.append(i)
            yield document.lower(), questions

    budget = corpus.prompt_tokens(_prompts(tokenizer, 0)) + corpus.prompt_tokens(_prompts(tokenizer, 1))
    stream = answer_corpus(model, tokenizer, records(), tokens_per_call=budget, max_new_tokens=3, stats=calls)
    first = next(stream)
    assert first.index in (0, 1) and read == [0, 1, 2]  # the third document did not fit: the first call is made
    assert (calls.calls, calls.prompts) == (1, 4)
    rest = [a.index for a in stream]
    assert sorted([first.index, *rest]) == [0, 1, 2] and rest[-1] == 2 and (calls.calls, calls.prompts) == (2, 6)


def test_each_document_is_yielded_as_its_last_stream_finishes_within_the_call(tiny, monkeypatch):
    """One call for all documents; each document comes out right after the stream that completes it, before the
    call yields the next stream, and its answers are generate_parallel's."""
    model, tokenizer = tiny
    events, stream = [], corpus.stream_tokens

    def logged(model, prompts, **options):
        for index, tokens in stream(model, prompts, **options):
            events.append(("stream", index))
            yield index, tokens

    monkeypatch.setattr(corpus, "stream_tokens", logged)
    for answer in answer_corpus(model, tokenizer, DOCUMENTS, max_new_tokens=NEW):
        events.append(("document", answer.index))
        document, questions = DOCUMENTS[answer.index]
        assert answer.answers == generate_parallel(model, tokenizer, document, questions, max_new_tokens=NEW)
    owners = [i for i, (_, questions) in enumerate(DOCUMENTS) for _ in questions]
    streams = [index for kind, index in events if kind == "stream"]
    assert sorted(streams) == list(range(len(owners)))  # one call, every stream once
    for position, (kind, index) in enumerate(events):
        if kind == "document":
            last = max(streams.index(j) for j, owner in enumerate(owners) if owner == index)
            seen = [i for k, i in events[:position] if k == "stream"]
            assert len(seen) == last + 1  # right after its last stream, before the next one


def test_several_answers_per_question_are_grouped_by_question(tiny):
    model, tokenizer = tiny
    options = {"max_new_tokens": 3, "do_sample": True, "num_return_sequences": 2, "seed": 5}
    got = sorted(answer_corpus(model, tokenizer, DOCUMENTS[:2], **options), key=lambda answer: answer.index)
    prompts = [p for d, questions in DOCUMENTS[:2] for p in corpus.render_prompts(tokenizer, d, questions)]
    texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in generate_tokens(model, prompts, **options)]
    pairs = [texts[i : i + 2] for i in range(0, len(texts), 2)]  # generate_tokens: a prompt's answers contiguous
    assert [answer.answers for answer in got] == [pairs[:3], pairs[3:]]


def _prompts(tokenizer, i):
    return corpus.render_prompts(tokenizer, DOCUMENTS[i][0].lower(), DOCUMENTS[i][1])


def test_a_document_without_questions_gets_no_answers_and_no_call(tiny, calls):
    model, tokenizer = tiny
    got = list(answer_corpus(model, tokenizer, [("a doc.", [])], max_new_tokens=2, stats=calls))
    assert got == [CorpusAnswer(0, 0, "a doc.", [], [])] and calls.calls == 0


@pytest.mark.parametrize("records, error, message", [
    ([("a doc.", ["q?"]), ("", ["q?"])], ValueError, "record 1's document is empty"),
    ([("a doc.", "q?")], TypeError, "record 0's questions must be a list of strings, got str"),
    ([("a doc.", ["q?", " "])], ValueError, "record 0's question 1 is empty"),
    ([{"document": "a doc."}], ValueError, "record 0 has no 'questions'"),
    (["a doc."], TypeError, "record 0 must be a (document, questions) pair or a dict, got str"),
])  # fmt: skip
def test_bad_records_are_refused_before_any_model_work(tiny, calls, records, error, message):
    model, tokenizer = tiny
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        answer_corpus(model, tokenizer, records, max_new_tokens=2, stats=calls)
    assert calls.calls == 0


def test_a_prompt_longer_than_the_model_takes_is_named_by_its_record(tiny, calls):
    model, tokenizer = tiny
    records = [{"id": "long", "document": "word " * 60, "questions": ["why?"]}]  # 256 positions
    with pytest.raises(ValueError, match=r"record 0 \(id 'long'\)'s question 0 has \d+ tokens"):
        list(answer_corpus(model, tokenizer, records, max_new_tokens=2, stats=calls))
    with pytest.raises(ValueError, match="tokens_per_call must be an integer >= 1, got 0"):
        answer_corpus(model, tokenizer, records, tokens_per_call=0, stats=calls)
    assert calls.calls == 0


@pytest.mark.parametrize("progress, shown", [(True, True), (False, False), (None, False)])
def test_progress_bar_on_stderr(tiny, capsys, progress, shown):
    model, tokenizer = tiny  # under pytest stderr is not a terminal: progress=None shows no bar
    list(answer_corpus(model, tokenizer, DOCUMENTS[1:], progress=progress, max_new_tokens=2))
    err = capsys.readouterr().err
    assert ("questions: 100%" in err and "3/3" in err) == shown and (err == "") != shown


# --------------------------------------------------------------------------- answer_dataset


def squad_like(datasets):
    """Rows of one question each, the documents repeated and interleaved."""
    rows = [(0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (2, 1)]
    return datasets.Dataset.from_dict({"context": [DOCUMENTS[d][0] for d, _ in rows],
                                       "question": [DOCUMENTS[d][1][q] for d, q in rows],
                                       "id": [f"r{i}" for i in range(len(rows))]}), rows  # fmt: skip


@pytest.mark.slow
def test_answer_dataset_adds_each_rows_answer_in_order(smollm2, calls):
    datasets = pytest.importorskip("datasets", reason="the datasets integration needs `pip install datasets`")
    model, tokenizer = smollm2
    dataset, rows = squad_like(datasets)
    answered = answer_dataset(model, tokenizer, dataset, max_new_tokens=NEW, stats=calls)
    assert answered.column_names == ["context", "question", "id", "answer"] and answered["id"] == dataset["id"]
    expected = [generate_parallel(model, tokenizer, d, qs, max_new_tokens=NEW) for d, qs in DOCUMENTS]
    assert list(answered["answer"]) == [expected[d][q] for d, q in rows]
    assert (calls.calls, calls.prompts) == (1, len(rows))  # one call; each question once


@pytest.mark.slow
def test_answer_dataset_resumes_from_its_checkpoint(smollm2, calls, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the datasets integration needs `pip install datasets`")
    model, tokenizer = smollm2
    dataset, _ = squad_like(datasets)
    checkpoint = tmp_path / "answers.jsonl"
    options = dict(tokens_per_call=1, max_new_tokens=NEW, stats=calls)  # one Stats over the runs: their calls' total
    whole = answer_dataset(model, tokenizer, dataset, answer_column="a", **options)
    assert calls.calls == 3
    stream = corpus.stream_tokens

    def interrupted(model, prompts, **options):  # the second call is interrupted
        if calls.calls == 4:
            raise KeyboardInterrupt
        return stream(model, prompts, **options)

    monkeypatch.setattr(corpus, "stream_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        answer_dataset(model, tokenizer, dataset, checkpoint=checkpoint, **options)
    assert [r and r.get("row") for r in read_json_lines(checkpoint)[1:]] == [0]  # document 0: rows 0, 1, 3
    monkeypatch.setattr(corpus, "stream_tokens", stream)
    resumed = answer_dataset(model, tokenizer, dataset, checkpoint=checkpoint, **options)  # its stats= counts more
    assert calls.calls == 4 + 2 and list(resumed["answer"]) == list(whole["a"])
    again = answer_dataset(model, tokenizer, dataset, checkpoint=checkpoint, max_new_tokens=NEW, stats=calls)
    assert calls.calls == 6 and list(again["answer"]) == list(whole["a"])  # all taken from the checkpoint
    with pytest.raises(CheckpointError, match="is the checkpoint of another run"):
        answer_dataset(model, tokenizer, dataset, checkpoint=checkpoint, max_new_tokens=NEW + 1)


def test_answer_dataset_refuses_wrong_columns(tiny):
    datasets = pytest.importorskip("datasets", reason="the datasets integration needs `pip install datasets`")
    model, tokenizer = tiny
    dataset, _ = squad_like(datasets)
    with pytest.raises(ValueError, match=r"no column 'passage'; its columns: \['context', 'question', 'id'\]"):
        answer_dataset(model, tokenizer, dataset, document_column="passage")
    with pytest.raises(ValueError, match="already has a column 'id'; pass another answer_column="):
        answer_dataset(model, tokenizer, dataset, answer_column="id")
    blank = dataset.add_column("blank", [" "] * len(dataset))
    with pytest.raises(ValueError, match="row 0's blank is empty"):
        answer_dataset(model, tokenizer, blank, question_column="blank")


def test_the_package_imports_without_datasets():
    code = ("import sys; sys.modules['datasets'] = None; import hf_parallel, hf_parallel.frontends.corpus, "
            "hf_parallel.frontends.datasets, hf_parallel.cli")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- the JSON-lines files


def test_read_corpus_keeps_good_lines_and_names_bad_ones(tmp_path):
    lines = [
        {"id": "a", "document": "Doc a.", "questions": ["Q1?", "Q2?"]},
        "",
        "{not json",
        {"document": "Doc b.", "questions": ["Q?"]},
        {"id": "c", "document": "Doc c.", "questions": []},
        ["Doc d.", ["Q?"]],
        {"id": "a", "document": "Doc e.", "questions": ["Q?"]},
        {"id": 1.5, "document": "Doc f.", "questions": ["Q?"]},
        {"id": 7, "document": " ", "questions": ["Q?"]},
        {"id": 8, "questions": ["Q?"]},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    records, problems = read_corpus(path)
    assert records == [{"line": 1, "id": "a", "document": "Doc a.", "questions": ["Q1?", "Q2?"]},
                       {"line": 4, "id": None, "document": "Doc b.", "questions": ["Q?"]}]  # fmt: skip
    assert problems == [
        (3, "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        (5, "the document has no questions"),
        (6, 'expected a JSON object with "document" and "questions", got list'),
        (7, 'its id "a" is line 1\'s too'),
        (8, "its id must be a string or an integer, got 1.5"),
        (9, "the line's document is empty"),
        (10, "the line has no 'document'"),
    ]


def test_an_output_file_cut_short_is_cut_at_its_last_whole_line(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = json.dumps({"line": 1, "questions": ["Q?"], "answers": ["A."]}) + "\n"
    out.write_text(whole + '{"line": 2, "questio')
    assert finished_answers(out) == {("line", 1): json.loads(whole)} and out.read_text() == whole
    out.write_text(whole + '{"line": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not an answer line of `hf-parallel answer --corpus`"):
        finished_answers(out)
    assert finished_answers(tmp_path / "absent.jsonl") == {}
