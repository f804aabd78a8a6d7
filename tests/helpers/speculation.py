"""Drafts that prompt lookup would rarely find on a tiny random model: an oracle that knows the answers."""

from __future__ import annotations

from hf_parallel.decoding.drafting import PromptLookup

from .models import VOCAB


class Oracle:
    """Drafts from what each prompt's answer is (`answers`, by prompt), every `every`-th draft token changed;
    `asked` records each draft asked for: (prompt index, tokens it had answered, most tokens asked)."""

    def __init__(self, prompts, answers, every: int = 4):
        self.known = {tuple(p): a for p, a in zip(prompts, answers)}
        self.every = every
        self.asked: list[tuple[int, int, int]] = []

    def install(self, monkeypatch):
        oracle = self

        def draft(lookup, stream, k):
            history = lookup.history[stream]
            for p, (prompt, answer) in enumerate(oracle.known.items()):
                if tuple(history[: len(prompt)]) == prompt:
                    done = len(history) - len(prompt)
                    out = list(answer[done : done + k])
                    oracle.asked.append((p, done, k))
                    break
            for i in range(len(out)):
                if (done + i) % oracle.every == oracle.every - 1:
                    out[i] = (out[i] + 1) % VOCAB
            return out

        monkeypatch.setattr(PromptLookup, "draft", draft)
