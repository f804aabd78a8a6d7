"""Yes/no judgments about one context, all scored in one pass (no generation).

Every option of a `ChoiceQuestion` and every level of a `ScoreQuestion` becomes one
yes/no judgment: context, question and candidate form one prompt (the user turn of
the chat template when there is one), and the answer is read from the token(s) after
it.  All judgments are one prefix tree, scored by `score_tree`: the context is
computed once, each question's instructions once, each candidate's own text once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .prompting import render_all
from .scoring import score_tree

TEMPLATE = "{context}\n\n{question}\n\n{judgment}"
JUDGMENT = 'Does "{label}: {definition}" apply? Answer yes or no.'
JUDGMENT_BARE = 'Does "{label}" apply? Answer yes or no.'
YES_NO = "Answer yes or no."
YES = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO = ("no", "No", "NO", " no", " No", " NO")


@dataclass
class ChoiceQuestion:
    """Pick one of `options` (name -> definition); each option is judged yes/no on its own."""

    name: str
    prompt: str
    options: dict[str, str]

    def __post_init__(self):
        _check_candidates(self.name, "options", list(self.options))

    def judgments(self) -> list[tuple[str, str]]:
        return [(label, _judgment(label, definition)) for label, definition in self.options.items()]


@dataclass
class ScoreQuestion:
    """Rate on `levels`: {level: value} or [(level, description, value)]; each level judged yes/no.

    The answer is the most likely level; `score` the levels' values weighted by their
    P(yes), normalized over the levels.
    """

    name: str
    prompt: str
    levels: dict[str, float] | list[tuple[str, str, float]]

    def __post_init__(self):
        if isinstance(self.levels, dict):
            self.levels = [(level, "", value) for level, value in self.levels.items()]
        self.levels = [(str(level), str(description), float(value)) for level, description, value in self.levels]
        _check_candidates(self.name, "levels", [level for level, _, _ in self.levels])
        if not all(math.isfinite(value) for _, _, value in self.levels):
            raise ValueError(f"question {self.name!r}: every level's value must be a finite number")

    def judgments(self) -> list[tuple[str, str]]:
        return [(level, _judgment(level, description)) for level, description, _ in self.levels]


@dataclass
class YesNoQuestion:
    """One yes/no judgment of `prompt`."""

    name: str
    prompt: str

    def judgments(self) -> list[tuple[str, str]]:
        return [("yes", YES_NO)]


Question = ChoiceQuestion | ScoreQuestion | YesNoQuestion


@dataclass
class Judgment:
    """One candidate's yes/no judgment: P(yes) normalized against P(no)."""

    label: str
    p_yes: float


@dataclass
class Answer:
    """A question's assembled answer; `judgments` in the order of its options or levels.

    answer: the option or level with the highest P(yes); "yes" or "no" for a `YesNoQuestion`.
    score:  `ScoreQuestion`: probability-weighted level value; `YesNoQuestion`: P(yes); else None.
    """

    name: str
    answer: str
    judgments: list[Judgment]
    score: float | None = None


@dataclass
class Usage:
    """input_tokens: every judgment prompt's full length, as if each were sent alone (a logical count).
    computed_tokens: tokens the packed forward actually ran (the prefix tree's size)."""

    input_tokens: int
    output_tokens: int
    computed_tokens: int


@dataclass
class JudgeResult:
    """`judge`'s answers, in the order of the questions, and its token counts; `result[name]` is the answer to
    the question named `name` (KeyError where none is)."""

    answers: list[Answer]  # in the order of the questions
    usage: Usage

    def __getitem__(self, name: str) -> Answer:
        for answer in self.answers:
            if answer.name == name:
                return answer
        raise KeyError(name)


def judge(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    questions: list[Question],
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    attn: str = "auto",
    prefill_chunk: int | None = None,
) -> JudgeResult:
    """Answer every question about `context` by yes/no judgments, all in one packed forward.

    Each judgment prompt is `template` ("{context}\\n\\n{question}\\n\\n{judgment}") as the user
    turn of the chat template (generation prompt added), or followed by "\\nAnswer:" without
    one.  P(yes) sums over the tokenizer's single-token spellings of yes and no ("yes",
    " Yes", ...), normalized against P(no); where either word has no single-token spelling,
    whole spellings are scored as continuations instead.
    """
    _check_questions(context, questions)
    prompts = render_judgments(tokenizer, context, questions, template, use_chat_template, system_prompt)
    yes, no = answer_spellings(tokenizer)
    scores = score_tree(model, prompts, [yes + no] * len(prompts), attn, prefill_chunk)
    usage = Usage(sum(len(p) for p in prompts), 0, scores.computed_tokens)
    return JudgeResult(assemble_answers(questions, scores.token_logprobs, len(yes)), usage)


def assemble_answers(questions, token_logprobs: list[list[torch.Tensor]], n_yes: int) -> list[Answer]:
    """Answers from each judgment prompt's spelling log-probabilities ([J][yes..., no...] tensors)."""
    p_yes = iter(_p_yes(row, n_yes) for row in token_logprobs)
    return [_assemble(q, [Judgment(label, next(p_yes)) for label, _ in q.judgments()]) for q in questions]


def render_judgments(
    tokenizer, context, questions, template=None, use_chat_template=None, system_prompt=None
) -> list[list[int]]:
    """Token ids of every judgment prompt, question after question, candidate after candidate (tokenized together,
    `render_all`)."""
    texts = [
        (template or TEMPLATE).format(context=context, question=q.prompt, judgment=text)
        for q in questions
        for _, text in q.judgments()
    ]
    return render_all(tokenizer, texts, use_chat_template, system_prompt)


def answer_spellings(tokenizer: PreTrainedTokenizerBase) -> tuple[list[list[int]], list[list[int]]]:
    """Token sequences of the spellings of yes and of no: the single-token ones when both words
    have one, else every spelling (a spelling that extends a shorter one is dropped: its
    probability is already inside the shorter one's)."""
    yes, no = _encodings(tokenizer, YES), _encodings(tokenizer, NO)
    single_yes, single_no = [s for s in yes if len(s) == 1], [s for s in no if len(s) == 1]
    if single_yes and single_no:
        return single_yes, single_no
    if not yes or not no:
        raise ValueError("the tokenizer encodes 'yes' or 'no' to no tokens; cannot judge yes/no")
    return yes, no


def _encodings(tokenizer, words) -> list[list[int]]:
    seqs = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in words} - {()}
    shortest_first = sorted(seqs, key=len)
    kept = [s for i, s in enumerate(shortest_first) if not any(s[: len(t)] == t for t in shortest_first[:i])]
    return [list(s) for s in sorted(kept)]


def _p_yes(logprobs: list[torch.Tensor], n_yes: int) -> float:
    """P(yes) / (P(yes) + P(no)) from the spellings' per-token log-probabilities (yes spellings first)."""
    totals = torch.stack([lp.sum() for lp in logprobs])
    return float(torch.sigmoid(totals[:n_yes].logsumexp(0) - totals[n_yes:].logsumexp(0)))


def _assemble(question: Question, judgments: list[Judgment]) -> Answer:
    if isinstance(question, YesNoQuestion):
        p = judgments[0].p_yes
        return Answer(question.name, "yes" if p >= 0.5 else "no", judgments, p)
    best = max(judgments, key=lambda j: j.p_yes).label  # first of equals, in candidate order
    if isinstance(question, ChoiceQuestion):
        return Answer(question.name, best, judgments)
    weights = torch.tensor([j.p_yes for j in judgments], dtype=torch.float64)
    values = torch.tensor([value for _, _, value in question.levels], dtype=torch.float64)
    return Answer(question.name, best, judgments, float((weights * values).sum() / weights.sum()))


def _judgment(label: str, definition: str) -> str:
    if definition:
        return JUDGMENT.format(label=label, definition=definition)
    return JUDGMENT_BARE.format(label=label)


def _check_candidates(name: str, kind: str, labels: list[str]) -> None:
    if len(labels) < 2:
        raise ValueError(f"question {name!r} has {len(labels)} {kind}; a judgment between candidates needs at least 2")
    if len(set(labels)) != len(labels):
        raise ValueError(f"question {name!r} repeats one of its {kind}")


def _check_questions(context: str, questions) -> None:
    if not isinstance(context, str) or not context.strip():
        raise ValueError("the context is empty")
    kinds = (ChoiceQuestion, ScoreQuestion, YesNoQuestion)
    if isinstance(questions, (str, *kinds)) or not questions:
        raise ValueError("questions must be a non-empty list of ChoiceQuestion, ScoreQuestion or YesNoQuestion")
    for q in questions:
        if not isinstance(q, kinds):
            raise TypeError(f"unknown question type {type(q).__name__}; use one of {[k.__name__ for k in kinds]}")
    names = [q.name for q in questions]
    if len(set(names)) != len(names):
        raise ValueError(f"question names must be unique, got {names}")
