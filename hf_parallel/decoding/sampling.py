"""Each live stream's next token from its processed scores: greedy argmax, or a draw as `generate` makes it."""

from __future__ import annotations

import torch

from .options import GenerationOptions


class Sampler:
    """Picks one token per row of processed scores [N, V] (float32, as generate processes them).

    Sampling draws `softmax` then `torch.multinomial`, one independent draw per row, as `model.generate`
    does.  Without a `seed`, draws come from torch's global generator, as generate's do, so
    `torch.manual_seed` before a call makes it reproducible.
    """

    def __init__(self, opts: GenerationOptions, device: torch.device):
        self.do_sample = opts.do_sample
        self.generator = None
        if self.do_sample and opts.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(opts.seed)

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).flatten()
