"""More model families against `model.generate` (fp32 greedy): attention modules that do not receive the attention
kwargs, and hybrids whose recurrent layers keep one state per segment of the prefix tree."""

from __future__ import annotations

import pytest
import torch

from hf_parallel import generate_tokens
from hf_parallel.frontends.probe import check_support
from hf_parallel.models.recurrent import SegmentedMixer, is_mixer
from tests.helpers.models import FAMILIES, generate_alone, random_tokens, tiny_model

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

HYBRIDS = ["qwen3_5_text", "qwen3_next", "falcon_h1", "bamba", "jamba", "zamba2", "lfm2", "nemotron_h", "minimax"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    return tiny_model(request.param)


def _tree(gen):
    """A shared system prompt, two documents with questions of several lengths (one a prefix of another, one
    repeated), and a second root."""
    system, other = random_tokens(5, gen), random_tokens(9, gen)
    prompts = []
    for doc in (random_tokens(14, gen), random_tokens(9, gen)):
        questions = [random_tokens(n, gen) for n in (1, 3, 6)]
        prompts += [system + doc + q for q in questions] + [system + doc + questions[1] + random_tokens(2, gen)]
    return prompts + [prompts[0], other + random_tokens(4, gen)]


@pytest.fixture(scope="module")
def tree_alone(family_model):
    """The tree's prompts, EOS tokens that stop streams at different steps, and each prompt's `model.generate`
    answer alone (once per model, for every chunk size)."""
    prompts = _tree(torch.Generator().manual_seed(2))
    free = [generate_alone(family_model, p, 8) for p in prompts]
    eos = sorted({free[0][2], free[4][5]})
    return prompts, eos, [generate_alone(family_model, p, 8, eos) for p in prompts]


@pytest.mark.parametrize("chunk", [None, 7])
def test_tree_with_streams_stopping_at_different_steps(family_model, tree_alone, chunk):
    prompts, eos, alone = tree_alone
    got = generate_tokens(family_model, prompts, max_new_tokens=8, eos_token_id=eos, prefill_chunk=chunk)
    assert got == alone


@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_shared_prefix_state_is_computed_once(arch, monkeypatch):
    """Every recurrent layer runs each token of the prefix tree once: the document once for all questions."""
    model = tiny_model(arch)
    check_support(model)  # the probe forward, once per model, before counting
    gen = torch.Generator().manual_seed(3)
    doc = random_tokens(40, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(6)]
    seen: dict[int, int] = {}
    forward = SegmentedMixer.prefill

    def counting(self, call, layer, hidden, runs):
        seen[self.layer_idx] = seen.get(self.layer_idx, 0) + hidden.shape[1]
        return forward(self, call, layer, hidden, runs)

    monkeypatch.setattr(SegmentedMixer, "prefill", counting)
    generate_tokens(model, prompts, max_new_tokens=3, eos_token_id=[])
    mixers = {m.layer_idx for m in model.modules() if is_mixer(m)}
    tree_tokens = len(doc) + sum(len(p) - len(doc) for p in prompts)
    assert mixers and seen == dict.fromkeys(mixers, tree_tokens)  # not sum(map(len, prompts)) = 6 documents


def test_lfm2_has_a_short_convolution_layer():
    """LFM2's default config makes every layer attention; the family test must exercise a conv layer."""
    model = tiny_model("lfm2")
    assert type(model.model.layers[0].conv).__name__ == "Lfm2ShortConv"
