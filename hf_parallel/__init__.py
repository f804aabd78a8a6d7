"""hf_parallel: Parallel Prompting for HuggingFace Transformers.

Compute a document's KV cache once and decode all its questions at once, as
independent streams of one packed row; each answer is what the model would write if
its question were asked alone.

`import hf_parallel` imports neither torch nor transformers: each public name is imported on
first use (PEP 562), so that the command line starts at once.  Every name a user needs is here:
generation (`generate_parallel`, `generate_tokens`, `stream_tokens`, `Session`, `Stats`), scoring and
judging, attention paths (`TritonBackend`, `ReferenceBackend`), many documents (`answer_corpus`,
`answer_dataset`), models (`load_smollm2`, `load_model`), the serving engine (`Engine`), answer
quality against one question at a time (`evaluate_quality`, which needs the `eval` extra, `QualityConfig`)
and the lm-evaluation-harness backend (`HFParallelLM`, which needs `lm-eval`).  It also adds
`model.generate_parallel(document, questions, tokenizer=...)` to every transformers model, as
soon as transformers defines `PreTrainedModel` (at once where it already has).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .compat.method_on_import import add_method_on_import

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from .attention import AttentionBackend  # noqa: F401
    from .attention.reference import ReferenceBackend  # noqa: F401
    from .attention.triton import TritonBackend  # noqa: F401
    from .decoding.options import GenerationOptions, Tuning  # noqa: F401
    from .engine.stats import Stats  # noqa: F401
    from .evaluation.config import QualityConfig  # noqa: F401
    from .evaluation.quality import evaluate_quality  # noqa: F401
    from .frontends.corpus import CorpusAnswer, answer_corpus  # noqa: F401
    from .frontends.datasets import answer_dataset  # noqa: F401
    from .frontends.default_model import load_smollm2  # noqa: F401
    from .frontends.generate import generate_tokens, stream_tokens  # noqa: F401
    from .frontends.jsonlines import CheckpointError  # noqa: F401
    from .frontends.judging import ChoiceQuestion, JudgeResult, ScoreQuestion, YesNoQuestion, judge  # noqa: F401
    from .frontends.model_loading import load_model  # noqa: F401
    from .frontends.prompting import generate_parallel, render_prompt, render_prompts  # noqa: F401
    from .frontends.scoring import score_continuations  # noqa: F401
    from .frontends.serving import Engine  # noqa: F401
    from .frontends.session import Session  # noqa: F401
    from .harness.model import HFParallelLM  # noqa: F401

_SOURCES = {  # each public name and the module that defines it
    "generate_parallel": ".frontends.prompting",
    "generate_tokens": ".frontends.generate",
    "stream_tokens": ".frontends.generate",
    "Stats": ".engine.stats",
    "Session": ".frontends.session",
    "render_prompt": ".frontends.prompting",
    "render_prompts": ".frontends.prompting",
    "GenerationOptions": ".decoding.options",
    "Tuning": ".decoding.options",
    "AttentionBackend": ".attention",
    "ReferenceBackend": ".attention.reference",
    "TritonBackend": ".attention.triton",  # needs triton
    "score_continuations": ".frontends.scoring",
    "judge": ".frontends.judging",
    "ChoiceQuestion": ".frontends.judging",
    "ScoreQuestion": ".frontends.judging",
    "YesNoQuestion": ".frontends.judging",
    "JudgeResult": ".frontends.judging",
    "answer_corpus": ".frontends.corpus",
    "CorpusAnswer": ".frontends.corpus",
    "answer_dataset": ".frontends.datasets",
    "CheckpointError": ".frontends.jsonlines",
    "load_smollm2": ".frontends.default_model",
    "load_model": ".frontends.model_loading",
    "Engine": ".frontends.serving",
    "QualityConfig": ".evaluation.config",
    "evaluate_quality": ".evaluation.quality",  # needs the `eval` extra (scipy)
    "HFParallelLM": ".harness.model",  # needs lm-eval; importing it registers the harness's model `hf-parallel`
}
__all__ = list(_SOURCES)


def __getattr__(name: str):
    """A public name, imported from its module on first use."""
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name], __name__), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _generate_parallel_method(self, document, questions, tokenizer=None, **options):
    """`model.generate_parallel(document, questions, tokenizer=...)`: see `hf_parallel.generate_parallel`."""
    if tokenizer is None:
        raise ValueError("model.generate_parallel needs tokenizer=... to render and decode the prompts")
    from .frontends.prompting import generate_parallel  # start-up: `import hf_parallel` loads no torch

    return generate_parallel(self, tokenizer, document, questions, **options)


# --------------------------------------------------------------------------- model.generate_parallel

add_method_on_import("generate_parallel", _generate_parallel_method)
