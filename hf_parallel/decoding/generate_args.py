"""What `model.generate` builds for one prompt asked alone: its logits processors, stopping criteria and config.

generate's documented `custom_generate=<callable>` hook runs all of generate's own preparation (kwargs merged
over `generation_config=` over the model's generation_config, validation and its warnings, the length
arithmetic, the processor and criteria lists with the user's lists merged in, the model's own overrides) and
then hands the result to the callable instead of decoding; no forward runs.  Some constructor arguments
depend on the prompt's length (MinNewTokens, MinLength, MaxLength, SuppressTokensAtBegin, ...) and a few
hold the prompt itself (the Encoder* processors, PrefixConstrained), so a request is prepared once per
prompt length, or once per prompt where a processor holds the prompt.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import logits_process
from transformers.generation.stopping_criteria import EosTokenCriteria
from transformers.utils import logging

from ..compat.transformers_internals import eos_token_ids

# processors that hold their prompt's tokens or hand the row's batch index to user code: one group per prompt
HOLDS_PROMPT = tuple(
    getattr(logits_process, name)
    for name in (
        "EncoderRepetitionPenaltyLogitsProcessor",
        "EncoderNoRepeatNGramLogitsProcessor",
        "PrefixConstrainedLogitsProcessor",
    )
)
# processors that keep state across calls on fixed batch rows (one call per step, rows never leaving)
STATEFUL = tuple(
    getattr(logits_process, name)
    for name in (
        "UnbatchedClassifierFreeGuidanceLogitsProcessor",
        "SynthIDTextWatermarkLogitsProcessor",
    )
)


@dataclass
class Prepared:
    """generate's processors, criteria and prepared config for one prompt alone (`max_length` absolute); `eos`:
    the ids its EOS criteria stop at, read once on the host (a criterion holds them on the model's device)."""

    processors: list
    criteria: list
    config: GenerationConfig
    prompt_len: int
    eos: tuple[int, ...] = ()

    @property
    def max_new_tokens(self) -> int:
        """New tokens this prompt may get, as generate's MaxLengthCriteria counts them."""
        return self.config.max_length - self.prompt_len

    @property
    def holds_prompt(self) -> bool:
        return any(type(p) in HOLDS_PROMPT for p in self.processors)


@dataclass
class GenerateArgs:
    """One call's `model.generate` options, kept verbatim so that generate itself prepares each prompt.

    kwargs:           GenerationConfig-named options, exactly as a user would pass them to generate.
    generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn: generate's arguments.
    stop_criterion:   the StopStringCriteria for `stop_strings`, built once per call: generate drops its
                      `tokenizer` argument before calling a `custom_generate` callable, so `kwargs` carries
                      stop_strings=None and the criterion is added to every prompt's criteria here.
    """

    kwargs: dict[str, Any] = field(default_factory=dict)
    generation_config: GenerationConfig | None = None
    logits_processor: list = field(default_factory=list)
    stopping_criteria: list = field(default_factory=list)
    prefix_allowed_tokens_fn: Callable | None = None
    stop_criterion: Any = None
    _prepared: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _warned: bool = field(default=False, init=False, repr=False, compare=False)

    def config(self, model: PreTrainedModel) -> GenerationConfig:
        """The merged config generate decodes with (validated by generate; its length warnings left to `prepare`)."""
        return self._capture(model, [0], quiet=True).config

    def prepare(self, model: PreTrainedModel, prompt) -> Prepared:
        """generate's lists for `prompt` (token ids) alone; one capture per length (per prompt where needed)."""
        got = self._prepared.get(len(prompt))
        if got is None:
            got = self._prepared[len(prompt)] = self._capture(model, prompt, quiet=self._warned)
        if not got.holds_prompt:
            return got
        key = tuple(int(t) for t in prompt)
        if key not in self._prepared:
            self._prepared[key] = self._capture(model, prompt, quiet=True)
        return self._prepared[key]

    def _capture(self, model: PreTrainedModel, prompt, quiet: bool) -> Prepared:
        box = {}

        def decoding_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **_):
            box.update(processors=list(logits_processor), criteria=list(stopping_criteria), config=generation_config)
            return input_ids

        ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device)[None]
        with _quiet(quiet):  # generate's warnings once per call, not once per prompt length
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=self.generation_config,
                logits_processor=LogitsProcessorList(self.logits_processor),
                stopping_criteria=StoppingCriteriaList(self.stopping_criteria),
                prefix_allowed_tokens_fn=self.prefix_allowed_tokens_fn,
                custom_generate=decoding_loop,
                **self.kwargs,
            )
        self._warned |= not quiet
        if not box:
            raise NotImplementedError(
                "model.generate did not reach its decoding loop with these options "
                "(cache_implementation='paged' hands it to continuous batching)"
            )
        stateful = [type(p).__name__ for p in box["processors"] if type(p) in STATEFUL]
        if stateful:
            raise NotImplementedError(
                f"{stateful[0]} keeps state over fixed batch rows; parallel generation does not support it"
            )
        criteria = box["criteria"] + ([self.stop_criterion] if self.stop_criterion is not None else [])
        eos = {t for c in criteria if type(c) is EosTokenCriteria for t in eos_token_ids(c)}
        return Prepared(box["processors"], criteria, box["config"], len(prompt), tuple(sorted(eos)))


@contextlib.contextmanager
def _quiet(quiet: bool):
    """Silence transformers' logger and Python warnings while `quiet` (restored afterwards)."""
    if not quiet:
        yield
        return
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)
