"""`Answerer`: a callable class for Ray Data's `Dataset.map_batches`, one model per actor, each batch of documents
answered in one call of the engine (its documents share the packed row).

```python
import ray
from hf_parallel.ray import Answerer

ds = ray.data.read_parquet("corpus/")  # a "document" and a "questions" column
answered = ds.map_batches(Answerer, fn_constructor_kwargs={"max_new_tokens": 64}, batch_size=32,
                          batch_format="pyarrow", concurrency=4, num_gpus=1)
```

The batch formats of `map_batches`, "pyarrow", "pandas" and "numpy" (its default), come back in the same format,
every column kept and the answer columns added.
"""

from __future__ import annotations

import math
import sys

from ..frontends.corpus import answer_corpus, as_record, prompt_problem, run_record
from ..frontends.model_loading import load_model, placement


class Answerer:
    """Answers each row's questions about its document: a stage for `ray.data.Dataset.map_batches`.

    Ray Data makes one instance per actor, so the model loads once per actor: on the actor's GPU
    where Ray gave it one (`num_gpus=`), else on the CPU.  Each batch is one call of the engine
    (`answer_corpus` with no limit on the tokens per call): the batch's documents share the packed
    row, so `batch_size` trades memory for sharing.

    A row is answered where its document column holds a non-empty string and its questions column a
    non-empty list of non-empty strings whose prompts, with `max_new_tokens` new tokens, fit the
    model's positions.  Any other row gets an error message in `error_column` and no answers, and the
    batch goes on; a row that arrives with an error already (an earlier stage's) passes through as it
    is.  Every row also gets the run's `"model"` and `"options"` (dtype and the options that change
    answers), as the lines of `hf-parallel answer --corpus` record them.

    Args:
        model: a model directory or hub id, as `--model` takes it; None: the embedded SmolLM2.
        dtype: "auto" (bfloat16 on CUDA, float32 on the CPU), "float32", "bfloat16" or "float16".
        device: None: cuda when the actor has a GPU, else cpu; "auto": the model spread over the
            actor's GPUs by accelerate (`device_map="auto"`), for actors of several GPUs.
        document_column: the column of the documents read.
        questions_column: the column of the questions read (a list of strings a row).
        answers_column: the column added: per row, one answer per question (a list of
            `num_return_sequences` answers per question where it is above 1), None for an error row.
        error_column: the column added (or passed through): None, or why the row has no answers.
        template: the prompt's user turn, as for `generate_parallel`.
        use_chat_template: as for `generate_parallel`.
        system_prompt: as for `generate_parallel`.
        progress: the model's loading bars on the actor's stderr.

    Any other keyword argument is a generation option, as for `generate_tokens` (`max_new_tokens`,
    `temperature`, `attn`, `max_memory`, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str | None = None,
        document_column: str = "document",
        questions_column: str = "questions",
        answers_column: str = "answers",
        error_column: str = "error",
        template: str | None = None,
        use_chat_template: bool | None = None,
        system_prompt: str | None = None,
        progress: bool = False,
        **options,
    ):
        import torch  # start-up: the package imports torch only once a stage is made

        spread = device == "auto"
        if spread:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device, dtype = placement(device, dtype)
        where = "auto" if spread and model is not None else device
        self.model, self.tokenizer = load_model(model, getattr(torch, dtype), where, progress)
        self.columns = (document_column, questions_column, answers_column, error_column)
        self.render = {"template": template, "use_chat_template": use_chat_template, "system_prompt": system_prompt}
        self.options = options
        self.record = run_record(model, dtype, options, template, system_prompt)
        self.returns = options.get("num_return_sequences") or 1
        self.device = device

    def __call__(self, batch):
        """The batch (a pyarrow Table, a pandas DataFrame or a dict of numpy arrays) with the answers, error, model
        and options columns added, in the batch's own format."""
        document_column, questions_column, answers_column, error_column = self.columns
        documents, questions = _column(batch, document_column), _column(batch, questions_column)
        errors = _column(batch, error_column)
        answers = [None] * len(documents)
        todo = []  # (row, record) of the rows to answer
        for row, (document, asked, error) in enumerate(zip(documents, questions, errors)):
            if error is None:
                errors[row], record = self._checked(document, asked)
                if record is not None:
                    todo.append((row, record))
        pairs = [(record["document"], record["questions"]) for _, record in todo]
        options = {**self.render, "tokens_per_call": sys.maxsize, "progress": False, **self.options}
        for result in answer_corpus(self.model, self.tokenizer, pairs, **options) if pairs else ():
            answers[todo[result.index][0]] = result.answers
        rows = len(documents)
        added = {
            answers_column: answers,
            error_column: errors,
            "model": [self.record["model"]] * rows,
            "options": [self.record["options"]] * rows,
        }
        return _with_columns(batch, added, self.returns)

    def _checked(self, document, questions) -> tuple[str | None, dict | None]:
        """(None, the record) of a row to answer; (why not, None) of an error row."""
        if hasattr(questions, "tolist"):  # a numpy array (of the "numpy" and "pandas" formats)
            questions = questions.tolist()
        try:
            for name, value in (("document", document), ("questions", questions)):
                if value is None or isinstance(value, float) and math.isnan(value):  # null (pandas: NaN)
                    raise ValueError(f"the row has no {name}")
            _, document, questions = as_record({"document": document, "questions": questions}, "the row")
            if not questions:
                raise ValueError("the document has no questions")
        except (TypeError, ValueError) as error:
            return str(error), None
        record = {"document": document, "questions": questions}
        room = self.options.get("max_new_tokens") if isinstance(self.options.get("max_new_tokens"), int) else 0
        problem = prompt_problem(self.model, self.tokenizer, record, room, **self.render)
        return (problem, None) if problem else (None, record)


def _column(batch, name: str) -> list:
    """A column's values as a list; a column the batch does not have: None each."""
    if isinstance(batch, dict):  # the "numpy" format
        rows = len(next(iter(batch.values()))) if batch else 0
        return list(batch[name]) if name in batch else [None] * rows
    if hasattr(batch, "column_names"):  # a pyarrow Table
        return batch.column(name).to_pylist() if name in batch.column_names else [None] * batch.num_rows
    return batch[name].tolist() if name in batch.columns else [None] * len(batch)  # a pandas DataFrame


def _with_columns(batch, added: dict, returns: int):
    """The batch with the `added` columns (put in place of those of the same names), in the batch's format."""
    if isinstance(batch, dict):
        import numpy as np  # start-up: for the "numpy" format only

        out = dict(batch)
        for name, values in added.items():
            out[name] = np.empty(len(values), dtype=object)
            for i, value in enumerate(values):
                out[name][i] = value
        return out
    if hasattr(batch, "column_names"):
        import pyarrow as pa  # optional: the ray extra

        answers = pa.list_(pa.string()) if returns == 1 else pa.list_(pa.list_(pa.string()))
        answers_column, error_column = list(added)[:2]
        types = {answers_column: answers, error_column: pa.string(), "model": pa.string()}
        for name, values in added.items():
            column = pa.array(values, type=types.get(name))
            if name in batch.column_names:
                batch = batch.set_column(batch.column_names.index(name), name, column)
            else:
                batch = batch.append_column(name, column)
        return batch
    out = batch.copy()
    for name, values in added.items():
        out[name] = values
    return out
