"""hf_parallel: Parallel Prompting for HuggingFace Transformers.

Compute a document's KV cache once and decode all its questions at once, as
independent streams of one packed row; each answer is what the model would write if
its question were asked alone.
"""

from transformers import PreTrainedModel

from .attention import AttentionBackend
from .decoding.options import GenerationOptions
from .engine.generate import generate_tokens, stream_tokens
from .frontends.judging import ChoiceQuestion, JudgeResult, ScoreQuestion, YesNoQuestion, judge
from .frontends.prompting import generate_parallel, render_prompt, render_prompts
from .frontends.scoring import score_continuations
from .frontends.session import Session

__all__ = [
    "generate_parallel",
    "generate_tokens",
    "stream_tokens",
    "Session",
    "render_prompt",
    "render_prompts",
    "GenerationOptions",
    "AttentionBackend",
    "score_continuations",
    "judge",
    "ChoiceQuestion",
    "ScoreQuestion",
    "YesNoQuestion",
    "JudgeResult",
]


def _generate_parallel_method(self, document, questions, tokenizer=None, **options):
    """`model.generate_parallel(document, questions, tokenizer=...)`: see `hf_parallel.generate_parallel`."""
    if tokenizer is None:
        raise ValueError("model.generate_parallel needs tokenizer=... to render and decode the prompts")
    return generate_parallel(self, tokenizer, document, questions, **options)


PreTrainedModel.generate_parallel = _generate_parallel_method
