"""`hf-parallel demo` shows answers a reader can check against its passage: each of the embedded SmolLM2's answers
states the passage's fact, and each is what `model.generate` writes for its question alone."""

from __future__ import annotations

import re

import pytest

from hf_parallel.frontends import demo

# what the passage says, a key fact per question (the reader's check, written from the passage, not the model)
FACTS = {
    "In which city is the Eiffel Tower?": "Paris",
    "For which event was the Eiffel Tower built?": "World's Fair",
    "How tall is the Eiffel Tower?": "330",
    "What kind of tower is the Eiffel Tower?": "wrought-iron",
    "In which country is the Eiffel Tower?": "France",
    "Whose company designed the Eiffel Tower?": "Gustave Eiffel",
    "How much does the Eiffel Tower weigh?": "10,000 tonnes",
    "How many levels of the Eiffel Tower are open to visitors?": "three levels",
    "How much paint is used to repaint the Eiffel Tower?": "60 tonnes",
    "Until when was the Eiffel Tower the tallest structure in the world?": "1930",
}


def test_every_question_has_its_fact_in_the_passage():
    assert list(FACTS) == demo.QUESTIONS and all(fact in demo.PASSAGE for fact in FACTS.values())


@pytest.mark.slow
def test_the_demo_answers_state_the_passages_facts_as_model_generate_does(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(demo, "load_smollm2", lambda *args, **kwargs: smollm2)
    demo.run()
    out = capsys.readouterr().out
    answers = dict(re.findall(r"\nQ: (.*)\nA: (.*)", out))
    assert answers.keys() == FACTS.keys()
    assert [question for question, fact in FACTS.items() if fact not in answers[question]] == []
    assert "answers identical to one-at-a-time: 10/10" in out
