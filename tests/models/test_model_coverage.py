"""Every decoder-only causal LM of the installed transformers, as a tiny random model: fp32 greedy answers
token-identical to plain `model.generate` on each prompt alone, or a refusal naming one of `REASONS` before any work.

CI runs a fixed sample across kinds of model; `pytest --full-sweep` runs every type (under a minute on two idle CPU
cores), and `eval/model_coverage.py` writes the table of outcomes to docs/models.md.
"""

from __future__ import annotations

import pytest

from tests.helpers.model_outcome import KNOWN_BUGS, outcome
from tests.helpers.model_zoo import SKIPS, causal_lm_types

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

SAMPLE = {
    "qwen3": "llama-like, from the generic shrink",
    "mixtral": "mixture of experts",
    "deepseek_v3": "multi-head latent attention and shared experts",
    "cohere2": "sliding-window layers between full ones",
    "mimo_v2_flash": "attention sinks on sliding-window layers",
    "olmo_hybrid": "hybrid: gated delta net layers beside attention",
    "opt": "learned absolute positions",
    "bert": "an encoder's causal LM (is_decoder=True)",
    "bloom": "refused: no position_ids",
    "falcon": "refused by the probe: legacy attention",
    "llama4_text": "refused: chunked attention",
    "git": "refused: attention outside the AttentionInterface",
    "dbrx": "sub-configs without an attention implementation of their own, restored as they were",
    "zamba": "a mixer whose multi-token path drops its start state: found by the probe, run a token at a time",
    "doge": "refused: passes an attention mask of its own",
    "moshi": "refused: a sliding window kept in its cache only",
    "recurrent_gemma": "refused: a recurrent state kept on the module, which would leak between prompts",
    **dict.fromkeys(KNOWN_BUGS, "a known bug, expected to fail"),
}


def pytest_generate_tests(metafunc):
    if "lm" in metafunc.fixturenames:
        full = metafunc.config.getoption("--full-sweep")
        lms = [lm for lm in causal_lm_types()[0] if full or lm.model_type in SAMPLE]
        metafunc.parametrize("lm", [pytest.param(lm, id=lm.model_type, marks=_marks(lm.model_type)) for lm in lms])


def _marks(model_type: str) -> list:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[model_type])] if model_type in KNOWN_BUGS else []


def test_identical_or_refused_by_name(lm):
    found = outcome(lm)
    if found.kind == "skipped":
        pytest.skip(found.detail)
    assert found.ok, f"{lm.model_type} {found.kind}: {found.detail}"


def test_every_named_type_is_discovered():
    """A type renamed or removed upstream must not drop out of CI, the skips or the known bugs unnoticed."""
    types = {lm.model_type for lm in causal_lm_types()[0]}
    assert set(SAMPLE) | set(SKIPS) | set(KNOWN_BUGS) <= types


def test_encoder_decoders_are_left_out():
    """Their ForCausalLM is an encoder-decoder's decoder: the config's `is_encoder_decoder` defaults to True."""
    kept, encoder_decoder = causal_lm_types()
    assert {"bart", "whisper", "musicgen"} <= set(encoder_decoder)
    assert not {lm.model_type for lm in kept} & set(encoder_decoder)
