"""Official answer-quality metrics for SQuAD v1.1, DROP and QuAC, ported faithfully.

All scores are fractions in [0, 1]; the official scripts multiply the corpus means
by 100 only when printing, so multiply by 100 to compare with published numbers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

# --------------------------------------------------------------------------- SQuAD v1.1
# Port of the official "evaluate-v1.1.py" (Rajpurkar et al., SQuAD v1.1,
# https://rajpurkar.github.io/SQuAD-explorer/): normalize_answer, f1_score,
# exact_match_score and metric_max_over_ground_truths.

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (official order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _squad_f1_single(prediction: str, ground_truth: str) -> float:
    """Bag-of-tokens F1 between one prediction and one gold answer."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def _require_golds(ground_truths: Sequence) -> None:
    # The official scripts call max() on the per-gold scores, which fails on an empty
    # list; say why instead of letting max() raise an opaque error.
    if len(ground_truths) == 0:
        raise ValueError("at least one gold answer is needed to score a prediction")


def squad_exact_match(prediction: str, ground_truths: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    _require_golds(ground_truths)
    target = normalize_answer(prediction)
    return float(max(target == normalize_answer(g) for g in ground_truths))


def squad_f1(prediction: str, ground_truths: Sequence[str]) -> float:
    """Token F1 of the prediction, maximised over the gold answers."""
    _require_golds(ground_truths)
    return max(_squad_f1_single(prediction, g) for g in ground_truths)


# --------------------------------------------------------------------------- DROP
# Port of the official DROP evaluation, allenai/allennlp-reading-comprehension
# allennlp_rc/eval/drop_eval.py (OpenAI simple-evals drop_eval.py carries the same code,
# scaled by 100).  The normalizer works token by token so that numbers keep their
# decimal point and "2.0" == "2"; multi-span answers are compared bag by bag after an
# optimal one-to-one alignment.

DropAnswer = str | Sequence[str]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _normalize_number(text: str) -> str:
    return str(float(text)) if _is_number(text) else text


def _remove_punc(text: str) -> str:
    # Numbers keep their punctuation so that "12.5" is not turned into "125".
    return text if _is_number(text) else "".join(ch for ch in text if ch not in _PUNCTUATION)


def _remove_articles(text: str) -> str:
    return re.sub(r"\b(a|an|the)\b", " ", text, flags=re.UNICODE)


def _tokenize(text: str) -> list[str]:
    return re.split(" |-", text)


def drop_normalize_answer(text: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace, per token."""
    parts = [
        " ".join(_remove_articles(_normalize_number(_remove_punc(token.lower()))).split()) for token in _tokenize(text)
    ]
    return " ".join(part for part in parts if part.strip()).strip()


def _answer_to_bags(answer: DropAnswer) -> tuple[list[str], list[set[str]]]:
    """Normalized spans and their token sets; a string is a one-span answer."""
    raw_spans = [answer] if isinstance(answer, str) else list(answer)
    normalized_spans = [drop_normalize_answer(span) for span in raw_spans]
    return normalized_spans, [set(span.split()) for span in normalized_spans]


def _compute_f1(predicted_bag: set[str], gold_bag: set[str]) -> float:
    intersection = len(gold_bag.intersection(predicted_bag))
    precision = intersection / len(predicted_bag) if predicted_bag else 1.0
    recall = intersection / len(gold_bag) if gold_bag else 1.0
    if precision == 0.0 and recall == 0.0:
        return 0.0
    return (2 * precision * recall) / (precision + recall)


def _match_numbers_if_present(gold_bag: set[str], predicted_bag: set[str]) -> bool:
    """False when the gold span holds numbers and the prediction shares none of them."""
    gold_numbers = {word for word in gold_bag if _is_number(word)}
    predicted_numbers = {word for word in predicted_bag if _is_number(word)}
    return (not gold_numbers) or bool(gold_numbers.intersection(predicted_numbers))


def _align_bags(predicted: list[set[str]], gold: list[set[str]]) -> np.ndarray:
    """Per-gold-bag F1 under the optimal 1-1 alignment; padded to the longer side."""
    scores = np.zeros([len(gold), len(predicted)])
    for gold_index, gold_item in enumerate(gold):
        for pred_index, pred_item in enumerate(predicted):
            if _match_numbers_if_present(gold_item, pred_item):
                scores[gold_index, pred_index] = _compute_f1(pred_item, gold_item)
    row_ind, col_ind = linear_sum_assignment(-scores)
    # Unmatched spans on the longer side score 0, which is what penalises length.
    max_scores = np.zeros([max(len(gold), len(predicted))])
    for row, column in zip(row_ind, col_ind):
        max_scores[row] = max(max_scores[row], scores[row, column])
    return max_scores


def get_metrics(predicted: DropAnswer, gold: DropAnswer) -> tuple[float, float]:
    """Official DROP (exact match, F1) of one prediction against one gold answer."""
    predicted_bags = _answer_to_bags(predicted)
    gold_bags = _answer_to_bags(gold)
    same_spans = set(predicted_bags[0]) == set(gold_bags[0])
    exact_match = 1.0 if same_spans and len(predicted_bags[0]) == len(gold_bags[0]) else 0.0
    f1 = float(round(np.mean(_align_bags(predicted_bags[1], gold_bags[1])), 2))
    return exact_match, f1


def drop_em_f1(prediction: DropAnswer, gold_answers: Sequence[DropAnswer]) -> tuple[float, float]:
    """Max (EM, F1) over the gold answers, as the official ``evaluate_json`` does.

    A gold answer is a string or a sequence of spans (a multi-span answer).  Gold answers
    whose first span is blank are skipped, as in both official scorers; with no usable
    gold answer the result is (0.0, 0.0), the official value for an unscored question.
    """
    best_em, best_f1 = 0.0, 0.0
    for gold in gold_answers:
        spans = [gold] if isinstance(gold, str) else list(gold)
        if not spans or spans[0].strip() == "":
            continue
        em, f1 = get_metrics(prediction, gold)
        best_em, best_f1 = max(best_em, em), max(best_f1, f1)
    return best_em, best_f1


# --------------------------------------------------------------------------- QuAC
# Port of the official QuAC scorer (scorer.py from quac.ai, Choi et al. 2018):
# handle_cannot, leave_one_out (human F1), leave_one_out_max (model F1) and the HEQ
# bookkeeping of eval_fn.  Word F1 is the SQuAD one.  The gold answers of the val file
# are several annotators' answers, so human F1 is computed exactly as the scorer does.

CANNOTANSWER = "CANNOTANSWER"
HUMAN_F1_MIN = 0.4  # the scorer drops questions whose human F1 is below this


def quac_handle_cannot(refs: Sequence[str]) -> list[str]:
    """Majority vote on answerability: ['CANNOTANSWER'] or the answer spans alone."""
    num_cannot = sum(1 for ref in refs if ref == CANNOTANSWER)
    if num_cannot >= len(refs) - num_cannot:
        return [CANNOTANSWER]
    return [ref for ref in refs if ref != CANNOTANSWER]


def _quac_span_f1(prediction: str, reference: str) -> float:
    # As compute_span_overlap: an unanswerable reference needs the literal token.
    if reference == CANNOTANSWER:
        return 1.0 if prediction == CANNOTANSWER else 0.0
    return _squad_f1_single(prediction, reference)


def quac_human_f1(gold_answers: Sequence[str]) -> float:
    """Human F1: each reference scored against the best of the others, averaged."""
    refs = quac_handle_cannot(gold_answers)
    if len(refs) == 1:
        return 1.0
    total = 0.0
    for i, ref in enumerate(refs):
        total += max(_squad_f1_single(ref, other) for j, other in enumerate(refs) if j != i)
    return total / len(refs)


def quac_f1(prediction: str, gold_answers: Sequence[str]) -> float:
    """Model F1: max F1 over the references, averaged over leaving each one out.

    ``prediction`` must be the literal ``"CANNOTANSWER"`` to abstain, as in the scorer.
    """
    _require_golds(gold_answers)
    refs = quac_handle_cannot(gold_answers)
    if len(refs) == 1:
        return _quac_span_f1(prediction, refs[0])
    held_out = [max(_quac_span_f1(prediction, r) for j, r in enumerate(refs) if j != i) for i in range(len(refs))]
    return sum(held_out) / len(held_out)


@dataclass
class QuacScores:
    """Corpus-level QuAC scores (fractions; the scorer prints them times 100)."""

    f1: float  # mean model F1 over questions with human F1 >= HUMAN_F1_MIN
    unfiltered_f1: float  # mean model F1 over every question
    heq_q: float  # fraction of counted questions with model F1 >= human F1
    heq_d: float  # fraction of dialogues whose counted questions all reach human F1
    human_f1: float  # mean human F1 over counted questions
    n_questions: int  # counted questions
    n_dialogues: int


def quac_scores(dialogues: Sequence[Sequence[tuple[str, Sequence[str]]]]) -> QuacScores:
    """Score dialogues given as lists of (prediction, gold answers), like ``eval_fn``."""
    counted, unfiltered, human, heq, good_dialogues = [], [], [], 0, 0
    for dialogue in dialogues:
        good = True
        for prediction, golds in dialogue:
            model_f1, hf1 = quac_f1(prediction, golds), quac_human_f1(golds)
            unfiltered.append(model_f1)
            if hf1 < HUMAN_F1_MIN:  # low-agreement question: not scored
                continue
            counted.append(model_f1)
            human.append(hf1)
            heq += model_f1 >= hf1
            good = good and model_f1 >= hf1
        good_dialogues += good

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    return QuacScores(
        f1=mean(counted),
        unfiltered_f1=mean(unfiltered),
        heq_q=heq / len(counted) if counted else 0.0,
        heq_d=good_dialogues / len(dialogues) if dialogues else 0.0,
        human_f1=mean(human),
        n_questions=len(counted),
        n_dialogues=len(dialogues),
    )
