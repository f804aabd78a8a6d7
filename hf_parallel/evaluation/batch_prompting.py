"""The "batch prompting" baseline: all questions in one prompt, answers in one output.

``build_batch_prompt`` numbers the questions Q1..Qn and asks for lines "A1: ...";
``parse_batch_answers`` recovers the n answers from whatever the model wrote.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_INSTRUCTION = (
    "Read the document, then answer every question below. Keep each answer short "
    "(a few words, taken from the document where possible). Write one answer per line, "
    'in the same order as the questions, in the form "A<number>: <answer>" '
    "(A1 answers Q1, A2 answers Q2, and so on)."
)


def build_batch_prompt(document: str, questions: Sequence[str]) -> str:
    """One prompt holding the document and the questions numbered "Q1: ...".

    It ends with "Answers:" so that the model's continuation starts with "A1:".
    """
    numbered = "\n".join(f"Q{i}: {' '.join(q.split())}" for i, q in enumerate(questions, 1))
    return f"{_INSTRUCTION}\n\nDocument:\n{document.strip()}\n\nQuestions:\n{numbered}\n\nAnswers:"


# A marker opens an answer ("A1:", "Answer 1:", "1.", "**A1.**", "(1)") or a question
# echo ("Q1:", "Question 1:"), which closes the previous answer but is not one.
# One symbol per repetition: "(x+)*" would backtrack exponentially on "*****...".
_DECORATION = r"[ \t]*(?:[-*>#•][ \t]*)*"  # bullets, quotes, headings, bold
_LINE_MARKER = re.compile(
    r"^" + _DECORATION + r"(?:"
    r"(?P<word>answers?|ans\.?|a|questions?|q)[ \t]*(?:to[ \t]+q(?:uestion)?[ \t]*)?#?[ \t]*"
    r"(?P<num>\d{1,9})\**[ \t]*[:.)\]-]"
    r"|\(?(?P<bare>\d{1,9})\**[ \t]*[:.)\]]\**(?=[ \t]|$)"
    r")\**",
    re.I | re.M,
)
# Within a line only the unambiguous forms count ("... A2: x"), so that ordinary
# text such as "a 1:0 lead" or "page 3." is never split.
_INLINE_MARKER = re.compile(r"(?<=\s)(?:(?P<word>[AQ])|(?i:answer)[ \t]?)(?P<num>\d{1,9})[ \t]*:")


_MAX_BARE = 100  # a bare "N." above this is a year or a count, not a numbering
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def _markers(text: str, n: int) -> list[tuple[int, int, int | None]]:
    """(start, end, answer number or None for a question echo), sorted by position."""
    found = []
    for pattern in (_LINE_MARKER, _INLINE_MARKER):
        for match in pattern.finditer(text):
            bare = match.groupdict().get("bare")
            number = int(match["num"] or bare or 0)
            if bare and number > _MAX_BARE:
                continue  # "1990." at a line start is text, not answer 1990
            is_answer = not (match["word"] or "").lower().startswith("q") and 1 <= number <= n
            # Question echoes and surplus answers ("A7:" of 5) only close the answer before.
            found.append((match.start(), match.end(), number if is_answer else None))
    found.sort()
    # A line marker and an inline one can overlap; keep the first of each overlap.
    kept: list[tuple[int, int, int | None]] = []
    for marker in found:
        if not kept or marker[0] >= kept[-1][1]:
            kept.append(marker)
    return kept


def _clean(segment: str) -> str:
    """One answer: cut at a blank line (trailing chatter), lines joined, bold removed."""
    segment = _PARAGRAPH_BREAK.split(segment.lstrip(" \t\r\n"), maxsplit=1)[0]
    return " ".join(segment.replace("**", " ").split())


def parse_batch_answers(text: str, n: int) -> list[str]:
    """Exactly ``n`` answers, numbered 1..n, from a model's batch output.

    Never raises: a missing number gives "", a repeated number keeps its first
    answer, an answer runs until the next marker (so it may span lines) or a blank
    line (so trailing chatter is dropped), and text before the first marker is
    ignored.  With ``n == 1`` and no marker at all, the whole output is the answer.
    """
    if n <= 0:
        return []
    text = text if isinstance(text, str) else ""
    answers = [""] * n
    seen = [False] * n
    markers = _markers(text, n)
    for index, (_, end, number) in enumerate(markers):
        if number is None or seen[number - 1]:
            continue
        stop = markers[index + 1][0] if index + 1 < len(markers) else len(text)
        answers[number - 1] = _clean(text[end:stop])
        seen[number - 1] = True
    if n == 1 and not markers:
        answers[0] = _clean(text)
    return answers
