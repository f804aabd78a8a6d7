"""Metric values against hand-derived examples and the official DROP test cases."""

import pytest

from hf_parallel.evaluation.metrics import (
    drop_em_f1,
    drop_normalize_answer,
    get_metrics,
    normalize_answer,
    quac_f1,
    quac_handle_cannot,
    quac_human_f1,
    quac_scores,
    squad_exact_match,
    squad_f1,
)

# ----------------------------------------------------------------------------- SQuAD


def test_squad_normalization_drops_case_punctuation_and_articles():
    assert normalize_answer("The  Cat.") == "cat"
    assert normalize_answer("U.S. an apple") == "us apple"
    assert squad_exact_match("the cat", ["The Cat."]) == 1.0


def test_squad_exact_match_needs_the_whole_answer():
    assert squad_exact_match("Paris France", ["Paris"]) == 0.0
    assert squad_exact_match("Paris", ["Lyon", "paris!"]) == 1.0


def test_squad_f1_partial_overlap():
    # pred {quick, brown, fox}, gold {quick, fox, jumps}: P = R = 2/3, F1 = 2/3.
    assert squad_f1("the quick brown fox", ["quick fox jumps"]) == pytest.approx(2 / 3)
    # Repeated tokens count once per gold occurrence: P = 2/3, R = 1, F1 = 0.8.
    assert squad_f1("x x y", ["x y"]) == pytest.approx(0.8)


def test_squad_f1_takes_the_best_gold():
    # vs "Broncos": P = 1/2, R = 1 -> 2/3; vs "Denver Broncos team": P = 1, R = 2/3 -> 0.8.
    assert squad_f1("Denver Broncos", ["Broncos", "Denver Broncos team"]) == pytest.approx(0.8)


def test_squad_f1_without_overlap_or_prediction_is_zero():
    assert squad_f1("Lyon", ["Paris"]) == 0.0
    assert squad_f1("", ["Paris"]) == 0.0
    assert squad_f1("the", ["a"]) == 0.0  # both normalize to nothing: no common token


def test_squad_needs_a_gold_answer():
    with pytest.raises(ValueError):
        squad_f1("x", [])


# ----------------------------------------------------------------------------- DROP
# The cases marked "official" are those of allennlp-reading-comprehension's
# tests/eval/drop_eval_test.py, which pin the reference implementation.


def test_drop_number_normalization_official():
    assert drop_normalize_answer("12.0") == drop_normalize_answer("12.0  ")
    assert drop_normalize_answer("12.0") == drop_normalize_answer("12.000")
    assert drop_normalize_answer("12.0") == drop_normalize_answer("12")
    assert drop_normalize_answer("12.0") == drop_normalize_answer("  1.2e1  ")
    assert drop_normalize_answer("12.0 persons") == "12.0 persons"
    assert drop_normalize_answer("S.K. Singh") == "sk singh"


def test_drop_numbers_by_hand():
    assert get_metrics("2.0", "2") == (1.0, 1.0)
    assert get_metrics("$1,000", "1000") == (1.0, 1.0)  # punctuation goes, then 1000.0
    # A quirk of the official normalizer: "12.5%" is not a number, so its "." goes too
    # and it becomes 125.0, which no longer matches 12.5.
    assert get_metrics("12.5%", "12.5") == (0.0, 0.0)


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        (["78"], ["78.0"], (1.0, 1.0)),
        (["td"], ["td", "td"], (0.0, 0.5)),
        ("td", ["td", "td"], (0.0, 0.5)),
        (["td", "td"], "td", (0.0, 0.5)),
        (["the", "fat", "cat", "the fat", "fat cat", "the fat cat"], ["cat"], (0.0, 0.17)),
        (["the", "fat", "cat", "the fat", "fat cat", "the fat cat"], ["cat", "cat dog"], (0.0, 0.25)),
        (["the a NOT an ARTICLE the an a"], ["NOT ARTICLE"], (1.0, 1.0)),
        (["John Elton"], ["Elton John"], (0.0, 1.0)),
        (["Per.i.o.d...."], [".P....e.r,,i;;;o...d,,"], (1.0, 1.0)),
        (["78-yard"], ["78 yard"], (1.0, 1.0)),
        (["78"], ["78-yard"], (0.0, 0.67)),
        (["This was a triumph"], ["tHIS Was A TRIUMPH"], (1.0, 1.0)),
        (["Green", "bay", "packers"], ["Green", "bay", "packers"], (1.0, 1.0)),
        ([""], ["army"], (0.0, 0.0)),
        (["packers"], ["Green bay packers"], (0.0, 0.5)),
        (["yard"], ["36 yard td"], (0.0, 0.0)),
        (["23 yards"], ["43 yards"], (0.0, 0.0)),
        (["56 yards"], ["56 yd"], (0.0, 0.5)),
        (["26"], ["26 yard td"], (0.0, 0.5)),
        (["78-yard", "56", "28", "40", "44", "touchdown"], ["78-yard", "56 yard", "1 yard touchdown"], (0.0, 0.28)),
        (["23", "23 yard"], ["23-yard", "56 yards"], (0.0, 0.5)),
        (["John Karman", "Joe Hardy"], ["Joe Karman", "John Hardy"], (0.0, 0.5)),
        (["ottoman", "Kantakouzenous"], ["ottoman", "army of Kantakouzenous"], (0.0, 0.75)),
        (["b"], ["b", "a"], (0.0, 0.5)),
    ],
)
def test_drop_get_metrics_official(predicted, gold, expected):
    assert get_metrics(predicted, gold) == expected


def test_drop_multi_span_alignment_by_hand():
    # Spans align one to one: "Paris" <-> "paris", "Rome" <-> "rome city" (F1 2/3).
    # Mean over the two gold bags = (1 + 2/3) / 2 = 0.83; the span sets differ, so EM 0.
    assert get_metrics(["Rome", "Paris"], ["paris", "rome city"]) == (0.0, 0.83)
    # A joined string is a single bag: {rome, and, paris} vs {paris}: F1 = 2 * (1/3) / (4/3).
    assert get_metrics("Rome and Paris", ["Paris"]) == (0.0, 0.5)


def test_drop_em_f1_max_over_golds_and_blank_golds():
    # Official functional cases (evaluate_json), one question each.
    assert drop_em_f1("1", ["1", "0"]) == (1.0, 1.0)
    assert drop_em_f1("17 August", ["17 August", "August", "17"]) == (1.0, 1.0)
    assert drop_em_f1("span1", [("span1", "span2"), ("span2",)]) == (0.0, 0.5)
    assert drop_em_f1("answer", ["answer1", "answer2"]) == (0.0, 0.0)
    # Blank golds are skipped; nothing left means the question scores zero.
    assert drop_em_f1("", ["   ", "5"]) == (0.0, 0.0)
    assert drop_em_f1("x", ["  "]) == (0.0, 0.0)
    assert drop_em_f1("x", []) == (0.0, 0.0)


# ----------------------------------------------------------------------------- QuAC

RGB = ["red green blue black", "red green", "yellow pink"]


def test_quac_handle_cannot_majority():
    assert quac_handle_cannot(["CANNOTANSWER", "CANNOTANSWER", "x"]) == ["CANNOTANSWER"]
    assert quac_handle_cannot(["CANNOTANSWER", "x"]) == ["CANNOTANSWER"]  # ties: unanswerable
    assert quac_handle_cannot(["CANNOTANSWER", "x", "y"]) == ["x", "y"]


def test_quac_cannotanswer_needs_the_literal_token():
    golds = ["CANNOTANSWER", "CANNOTANSWER", "somewhere"]
    assert quac_f1("CANNOTANSWER", golds) == 1.0
    assert quac_f1("cannot answer", golds) == 0.0
    assert quac_human_f1(golds) == 1.0


def test_quac_human_f1_leave_one_out():
    # f1(r0, r1) = 2/3, every other pair 0: (2/3 + 2/3 + 0) / 3 = 4/9.
    assert quac_human_f1(RGB) == pytest.approx(4 / 9)


def test_quac_model_f1_leave_one_out():
    # Scores vs refs: 2/3, 1, 0; leaving each out gives max 1, 2/3, 1 -> mean 8/9.
    assert quac_f1("red green", RGB) == pytest.approx(8 / 9)
    assert quac_f1("red green", ["red green"]) == 1.0


def test_quac_scores_heq():
    dialogues = [
        [("red green", RGB), ("blue", ["paris", "paris"])],  # F1 8/9 >= 4/9; F1 0 < 1
        [("paris", ["paris", "paris france"]), ("zzz", ["alpha", "beta"])],  # 5/6 >= 2/3; skipped
    ]
    scores = quac_scores(dialogues)
    assert scores.n_questions == 3 and scores.n_dialogues == 2
    assert scores.f1 == pytest.approx((8 / 9 + 0 + 5 / 6) / 3)
    assert scores.unfiltered_f1 == pytest.approx((8 / 9 + 0 + 5 / 6 + 0) / 4)
    assert scores.heq_q == pytest.approx(2 / 3)
    assert scores.heq_d == pytest.approx(1 / 2)
    assert scores.human_f1 == pytest.approx((4 / 9 + 1 + 2 / 3) / 3)
