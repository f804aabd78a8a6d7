"""The evaluation's prompts and answer post-processing, the same for every method.

Standard and parallel prompting ask each question with the same token prompt
(`question_prompts`); batch prompting asks all of a document's questions in one
(`batch_prompt`).  `postprocess` turns any method's raw output into the scored answer.
"""

from __future__ import annotations

import re

from ..frontends.prompting import render_prompt, render_prompts
from .batch_prompting import build_batch_prompt
from .loaders import QADocument, QAItem
from .metrics import CANNOTANSWER

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
