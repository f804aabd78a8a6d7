"""`Tuning`: each speed choice, turned off, is honoured where the row is set up, and changes no answer."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from hf_parallel import Engine, Tuning, generate_tokens
from hf_parallel.attention.reference import ReferenceBackend
from hf_parallel.frontends.probe import check_support
from hf_parallel.models.compiled_parts import CompiledPart
from hf_parallel.models.projections import MOST_ROWS
from hf_parallel.runner.patching import use_model
from tests.helpers.models import generate_alone, random_tokens, tiny_model

CHOICES = [f.name for f in fields(Tuning)]


def _set_up(model, tuning: Tuning) -> dict:
    """What `use_model` (parts fused, projections grouped) gives the first layer for the block, under `tuning`."""
    layer = model.model.layers[0]
    wide = torch.randn(1, MOST_ROWS + 1, model.config.hidden_size)
    with torch.no_grad(), use_model(model, ReferenceBackend(), check_support(model), True, True, tuning):
        attn = layer.self_attn
        norm = layer.input_layernorm.forward
        return dict(
            rotary="forward" in vars(attn),  # the attention's forward calling the compiled rotary function
            grouped="forward" in vars(attn.q_proj),
            columns=not attn.q_proj(wide).is_contiguous(),  # a column slice of the group's one output
            static=norm.fn is CompiledPart.compiled.get((type(layer.input_layernorm), False)),
            dynamic=norm.fn is CompiledPart.compiled.get((type(layer.input_layernorm), True)),
        )


def test_the_model_side_choices_are_honoured_and_taken_back():
    model = tiny_model("llama")
    default = _set_up(model, Tuning())
    assert default == dict(rotary=True, grouped=True, columns=True, static=True, dynamic=False)
    assert _set_up(model, Tuning(fuse_rotary=False)) == dict(default, rotary=False)
    assert _set_up(model, Tuning(group_projections=False)) == dict(default, grouped=False, columns=False)
    assert _set_up(model, Tuning(prefill_columns=False)) == dict(default, columns=False)
    assert _set_up(model, Tuning(static_widths=False)) == dict(default, static=False, dynamic=True)
    layer = model.model.layers[0]
    assert not any("forward" in vars(m) for m in (layer.self_attn, layer.self_attn.q_proj, layer.input_layernorm))


@pytest.mark.parametrize("choice", CHOICES)
def test_each_choice_turned_off_answers_as_generate(choice):
    model = tiny_model("qwen2")
    gen = torch.Generator().manual_seed(3)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(4)]
    got = generate_tokens(model, prompts, max_new_tokens=6, eos_token_id=[], tuning=Tuning(**{choice: False}))
    assert got == [generate_alone(model, p, 6, None) for p in prompts]


def test_the_engine_core_reads_rounds_as_the_tuning_says():
    model = tiny_model("llama")
    engines = [Engine(model, max_memory="64MiB"), Engine(model, max_memory="64MiB", tuning=Tuning(read_late=False))]
    try:
        assert [engine.core.read_late for engine in engines] == [True, False]
    finally:
        for engine in engines:
            engine.close()


def test_a_tuning_of_the_wrong_type_is_refused_by_name():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="tuning must be an hf_parallel.Tuning"):
        generate_tokens(model, [[5, 6, 7]], max_new_tokens=2, tuning={"read_late": False})
    with pytest.raises(TypeError, match="Tuning.read_late must be a bool"):
        Tuning(read_late="no")
