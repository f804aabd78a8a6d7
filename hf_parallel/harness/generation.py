"""`generate_until` for one group of requests with the same generation kwargs, as the harness's HF backend answers.

The harness's backend (`HFLM.generate_until`) stops a request's generation once one of its stop sequences (the
`until` strings and the EOS token's text) appears in the decoded last `len(tokens of the sequence) + 2` tokens it
generated, or at EOS, or after `max_gen_toks` tokens; it then decodes the new tokens (special tokens skipped)
and cuts the text at the stop sequences.  Here all prompts of a call are answered by `generate_tokens` with the
same sequences as `stop_strings`, and each answer is cut where the harness's own criterion ends it.  `stop_strings`
also matches a sequence that begins in the prompt, which the harness's criterion never sees: a stream that stopped
so, before any of the harness's stops, is answered again alone under the harness's criterion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, StoppingCriteria

from ..decoding.inputs import eos_token_ids
from ..frontends.generate import generate_tokens
from .packing import Packing, calls_by_prefix, tree_tokens


@dataclass(frozen=True)
class Stops:
    """A request group's stop sequences and the window of generated tokens each is looked for in."""

    sequences: tuple[str, ...]
    windows: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer, sequences: list[str]) -> Stops:
        windows = tuple(len(tokenizer.encode(s, add_special_tokens=False)) + 2 for s in sequences)
        return cls(tuple(sequences), windows)

    def hit(self, tokenizer, tokens: list[int]) -> bool:
        """Whether a stop sequence is in the decoded last tokens of `tokens` (the generated ones), as the harness
        looks (special tokens kept)."""
        return any(s in tokenizer.decode(tokens[-w:]) for s, w in zip(self.sequences, self.windows))

    def kept(self, tokenizer, tokens: list[int]) -> int | None:
        """How many of the generated `tokens` the harness generates before a stop sequence ends it; None: none does.

        A window's text lies within the text of the tokens up to it (but for the replacement characters of a
        character cut at its ends, which no stop sequence holds), so no window can hit before the first prefix whose
        text holds a stop sequence, found by bisection; the windows are tried from there."""
        lo, hi = 1, len(tokens) + 1  # the first prefix length whose text holds a stop sequence, or len + 1
        while lo < hi:
            mid = (lo + hi) // 2
            text = tokenizer.decode(tokens[:mid])
            lo, hi = (lo, mid) if any(s in text for s in self.sequences) else (mid + 1, hi)
        return next((k for k in range(lo, len(tokens) + 1) if self.hit(tokenizer, tokens[:k])), None)


class AfterPrompt(StoppingCriteria):
    """The harness's stop criterion for prompts of one length: a stop sequence among the generated tokens."""

    def __init__(self, tokenizer, stops: Stops, prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, stops, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows = input_ids[:, self.prompt_len :].tolist()
        return torch.tensor([self.stops.hit(self.tokenizer, row) for row in rows], device=input_ids.device)


def decoding_options(kwargs: dict) -> dict:
    """`model.generate` options from the harness's normalized gen_kwargs (`until` and `max_gen_toks` taken out), as
    `HFLM._model_generate` passes them: greedy unless do_sample, a zero temperature dropped."""
    options = dict(kwargs)
    options["temperature"] = options.get("temperature", 0.0)
    if options["temperature"] == 0.0 and options.get("do_sample") is None:
        options["do_sample"] = False
    if options.get("do_sample") is False and options["temperature"] == 0.0:
        options.pop("temperature")
    return options


def generate_group(
    model: PreTrainedModel,
    tokenizer,
    prompts: list[list[int]],
    stops: Stops,
    options: dict,
    packing: Packing,
) -> tuple[list[list[int]], int]:
    """Each prompt's new tokens up to where the harness's backend stops, and the prompt tokens the calls computed
    (shared prefixes once); prompts packed into calls as `packing` says (`calls_by_prefix`), `options` given to
    every call."""
    out: list[list[int] | None] = [None] * len(prompts)
    computed = 0
    strings = [s for s in stops.sequences if s]  # "" stops the harness at once, which `kept` finds
    for call in calls_by_prefix(prompts, packing.call_tokens, packing.keys_per_token):
        answers = generate_tokens(
            model, [prompts[i] for i in call], tokenizer=tokenizer, stop_strings=strings or None, **options
        )
        for i, tokens in zip(call, answers):
            out[i] = _as_harness(model, tokenizer, prompts[i], tokens, stops, options)
        computed += tree_tokens([prompts[i] for i in call])
    return out, computed


def _as_harness(model, tokenizer, prompt: list[int], tokens: list[int], stops: Stops, options: dict) -> list[int]:
    """`tokens` cut where the harness's criterion stops, or the prompt answered again alone under that criterion
    where generation stopped at a stop string that began in the prompt."""
    kept = stops.kept(tokenizer, tokens)
    if kept is not None:
        return tokens[:kept]
    finished = bool(tokens) and tokens[-1] in eos_token_ids(model, tokenizer)
    if finished or len(tokens) >= _room(options, prompt):
        return tokens
    criterion = AfterPrompt(tokenizer, stops, len(prompt))
    (tokens,) = generate_tokens(model, [prompt], stopping_criteria=[criterion], **options)
    return tokens


def _room(options: dict, prompt: list[int]) -> int:
    """New tokens a prompt may get under `options` (`max_new_tokens`, or an absolute `max_length`)."""
    if "max_new_tokens" in options:
        return options["max_new_tokens"]
    return options["max_length"] - len(prompt)
