"""Per-stream next-token choice: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .options import GenerationOptions


class Sampler:
    """Picks one token per row of logits [N, V]; every stream is at the same step.

    Without a `seed`, samples come from torch's global generator, as `model.generate`'s do,
    so `torch.manual_seed` before a call makes it reproducible.
    """

    def __init__(self, opts: GenerationOptions, device: torch.device):
        self.opts = opts
        self.eos = torch.tensor(opts.eos_token_id, dtype=torch.long, device=device)
        self.generator = None
        if opts.do_sample and opts.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(opts.seed)
        self.warpers = _warpers(opts) if opts.do_sample else []

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        if step < self.opts.min_new_tokens and self.eos.numel():
            logits = logits.index_fill(1, self.eos, float("-inf"))
        if not self.opts.do_sample:
            return logits.argmax(dim=-1)
        for warp in self.warpers:
            logits = warp(None, logits)
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).flatten()

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.eos)


def _warpers(opts: GenerationOptions) -> list:
    warpers = []
    if opts.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(opts.temperature))
    if opts.top_k:
        warpers.append(TopKLogitsWarper(opts.top_k))
    if opts.top_p < 1.0:
        warpers.append(TopPLogitsWarper(opts.top_p))
    return warpers
