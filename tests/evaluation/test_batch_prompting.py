"""Batch-prompting prompt builder and a parser that must survive malformed output."""

import pytest

from hf_parallel.evaluation.batch_prompting import build_batch_prompt, parse_batch_answers


def test_prompt_numbers_the_questions_and_asks_for_numbered_answers():
    prompt = build_batch_prompt("  The doc.\n", ["Who  wrote\nit?", "When?"])
    assert "The doc." in prompt
    assert "Q1: Who wrote it?\nQ2: When?" in prompt  # one question per line
    assert "A1" in prompt and prompt.endswith("Answers:")
    assert prompt.index("The doc.") < prompt.index("Q1:")


def test_prompt_round_trips_through_the_parser():
    prompt = build_batch_prompt("doc", ["a?", "b?"])
    assert parse_batch_answers(prompt + "\nA1: x\nA2: y", 2) == ["x", "y"]


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("A1: Paris\nA2: London", 2, ["Paris", "London"]),
        ("1. Paris\n2) London\n(3) Rome\n4: Oslo", 4, ["Paris", "London", "Rome", "Oslo"]),
        ("Answer 1: Paris\nAnswer 2: London", 2, ["Paris", "London"]),
        ("Answer to Q2: two\nAnswer to question 1: one", 2, ["one", "two"]),
        ("**A1:** Paris\n- **A2.** London\n> ### A3) Rome", 3, ["Paris", "London", "Rome"]),
        ("A1 - Paris\na2: London", 2, ["Paris", "London"]),
        ("A1: Paris A2: London", 2, ["Paris", "London"]),  # several on one line
    ],
)
def test_numbering_styles(text, n, expected):
    assert parse_batch_answers(text, n) == expected


def test_missing_numbers_are_empty():
    assert parse_batch_answers("A1: Paris\nA3: Rome", 3) == ["Paris", "", "Rome"]
    assert parse_batch_answers("no numbering at all", 2) == ["", ""]


def test_repeated_numbers_keep_the_first():
    assert parse_batch_answers("A1: first\nA2: b\nA1: second", 2) == ["first", "b"]


def test_answers_spanning_lines_are_joined():
    assert parse_batch_answers("A1: the Treaty\nof Paris\nA2: 1783", 2) == ["the Treaty of Paris", "1783"]


def test_extra_text_is_ignored():
    text = "Sure! Here are the answers:\n\nA1: Paris\nA2: London\n\nI hope this helps."
    assert parse_batch_answers(text, 2) == ["Paris", "London"]


def test_question_echoes_and_surplus_numbers_close_answers():
    text = "Q1: Where?\nA1: Paris\nQ2: Who?\nA2: Ann\nA3: not asked"
    assert parse_batch_answers(text, 2) == ["Paris", "Ann"]
    assert parse_batch_answers("1. Paris\n2. London\n3. extra", 2) == ["Paris", "London"]


def test_numbers_in_answers_are_not_markers():
    text = "A1: It began in\n1990. It ended\nA2: a 1:0 win"
    assert parse_batch_answers(text, 2) == ["It began in 1990. It ended", "a 1:0 win"]
    assert parse_batch_answers("A1: A 2 hour delay", 2) == ["A 2 hour delay", ""]


def test_single_question_without_marker_takes_the_whole_output():
    assert parse_batch_answers("  Paris \n", 1) == ["Paris"]


@pytest.mark.parametrize(
    "text", [None, "", "A", "A1:", "*" * 5000, "1" * 5000 + ". x", "A999999999999: x", "\n\n\n", "A0: x\nA-1: y"]
)
def test_never_raises_and_always_returns_n(text):
    assert len(parse_batch_answers(text, 3)) == 3
    assert parse_batch_answers(text, 0) == []
