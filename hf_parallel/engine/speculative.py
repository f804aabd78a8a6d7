"""Speculative decoding in the packed row: every stream drafts, one forward verifies all drafts.

    draft    each live stream's newest token, then up to k draft tokens (from its own history, `LookupDrafts`,
             or from an assistant model's packed row, `AssistantDrafts`), written at the next
             slots of its own answer region, at its own positions: a stream's draft tokens are its queries,
             and the stream mask is as it is (each sees the document, its own prompt, its accepted answer
             and the draft tokens before it)
    verify   position by position, generate's processors on the history as if the draft so far were accepted,
             then argmax or a draw; a stream keeps its draft while the chosen token equals the draft token and
             no criterion stops it, plus the first token chosen after (one more than it accepted)

A stream decides exactly the tokens it would decode one at a time (greedy), or draws each from exactly the
distribution it would draw from (sampling: the accepted prefix is where independent draws agree with the
draft).  The K/V of rejected draft tokens stays in the stream's own region, past its answer, where no query
looks before the next forward writes over it.  Streams with nothing to draft decode one token, in the same
forward.  Each forward costs one host sync: the host makes the next drafts from the tokens just accepted.
On a GPU the forwards replay CUDA graphs captured per bucket of fed tokens, as decode steps do.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import torch

from ..decoding.drafting import PromptLookup, Speculation
from ..decoding.logits import Processing, layout_prompts
from ..decoding.sampling import Sampler
from .patching import model_lock


class SpeculativeDecode:
    """The decode loop of a `Runner` whose streams draft (`GenerationOptions.speculation`); `run` decodes.

    forwards:        forwards run (the prefill's not counted).
    stream_forwards: the live streams of every forward summed: tokens decided / stream_forwards is the
                     tokens a stream gets per forward it takes part in (one without drafts).
    """

    def __init__(self, runner, speculation: Speculation):
        self.runner, self.speculation = runner, speculation
        layout = runner.layout
        self.n, self.room = layout.num_prompts, layout.max_new_tokens
        self.processing = Processing.for_layout(runner.model, runner.opts, layout, runner.device)
        self.sampler = Sampler(runner.opts, runner.device)
        eos_only = self.processing.eos_only() if not self.sampler.do_sample else None
        self.eos_only = torch.tensor(eos_only, device=runner.device) if eos_only is not None else None
        eos = runner.opts.eos_ids
        if speculation.assistant:
            self.drafter = AssistantDrafts(runner, eos)
        else:
            roots = [layout.ancestors(end)[0] for end in layout.prompt_ends]  # each stream's document
            shared = [(root, layout.segments[root].tokens) for root in roots]
            self.drafter = LookupDrafts(PromptLookup(speculation, layout_prompts(layout), eos, shared))
        self.answer_slots = layout.answer_slots  # [S, room] host
        self.limit = np.full(self.n, speculation.num_tokens)  # each stream's current draft limit
        self.forwards = self.stream_forwards = 0

    def run(self, logits: torch.Tensor) -> list[list[int]]:
        """Every stream's new tokens, from the prefill's logits [S, V] at each prompt's last token."""
        out: list[list[int]] = [[] for _ in range(self.n)]
        live = list(range(self.n))  # the stream of each row
        tokens, stops, alive = self._verify(logits, [[] for _ in live])
        with self.drafter.running():
            while True:
                live = self._accept(live, out, tokens, stops, alive)
                if not live:
                    return out
                limits = [min(self.limit[s], self.room - 1 - len(out[s])) for s in live]
                drafts = self.drafter.drafts(live, out, limits)
                logits = self._forward(live, out, drafts)
                tokens, stops, alive = self._verify(logits, drafts)
                self._adapt(live, drafts, alive)

    def _forward(self, live: list[int], out: list[list[int]], drafts: list[list[int]]) -> torch.Tensor:
        """One forward over each live stream's newest token and its draft; logits [T, V] of every token fed."""
        runner = self.runner
        fed = [[out[s][-1]] + draft for s, draft in zip(live, drafts)]
        slots = torch.cat([self.answer_slots[s, len(out[s]) - 1 : len(out[s]) - 1 + len(f)] for s, f in zip(live, fed)])
        ids = torch.tensor([t for f in fed for t in f], dtype=torch.long)
        slots, ids = slots.to(runner.device), ids.to(runner.device)
        self.forwards += 1
        self.stream_forwards += len(live)
        if runner.captured_steps:  # replayed per bucket of fed tokens (padding repeats the last token at its slot)
            return runner.step(slots, ids, changed=True)
        return runner.forward(runner.plan(slots), ids, torch.arange(len(ids), device=runner.device))

    def _verify(self, logits: torch.Tensor, drafts: list[list[int]]):
        """Each row's chosen token at every position of its draft and one past it ([R, J+1] each, host): the tokens,
        whether a criterion stops the row there, and whether the row is still accepting there (every earlier
        position chose its draft token and did not stop)."""
        device, processing = self.runner.device, self.processing
        lengths = np.array([len(d) for d in drafts])
        width = int(lengths.max(initial=0))
        starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
        draft = torch.full((len(drafts), max(width, 1)), -1, dtype=torch.long)
        for r, d in enumerate(drafts):
            draft[r, : len(d)] = torch.tensor(d, dtype=torch.long)
        draft, has = draft.to(device), torch.as_tensor(lengths).to(device)
        before = processing.lengths if processing.lengths is not None else np.full(len(drafts), processing.length)
        rows = torch.as_tensor(starts[:, None] + np.minimum(np.arange(width + 1)[None], lengths[:, None]))
        if self.eos_only is not None:
            chosen, stopped, alive = self._greedy(logits, rows.to(device), draft[:, :width], has)
        else:
            chosen, stopped, alive = self._processed(logits, rows.to(device), draft[:, :width], has)
        host = torch.stack([chosen, stopped, alive]).cpu().numpy()
        tokens, stops, alive = host[0], host[1].astype(bool), host[2].astype(bool)
        processing.set_lengths(before + alive.sum(1))
        return tokens, stops, alive

    def _processed(self, logits, rows, draft, has):
        """Position by position: generate's processors on each row's history with its draft so far, a choice, and
        generate's criteria; rows leave the accepting set at their first disagreement or stop."""
        processing = self.processing
        accepting = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        chosen, stopped, alive = [], [], []
        for j in range(rows.shape[1]):
            new = self.sampler(processing.scores(logits[rows[:, j]]))
            processing.append(new)
            stop = processing.stopped(new)
            chosen.append(new), stopped.append(stop), alive.append(accepting)
            if j < draft.shape[1]:
                accepting = accepting & ~stop & (has > j) & (new == draft[:, j])
        return torch.stack(chosen, 1), torch.stack(stopped, 1), torch.stack(alive, 1)

    def _greedy(self, logits, rows, draft, has):
        """`_processed` where generate does nothing but argmax and stop at EOS: every position at once."""
        chosen = logits.argmax(-1)[rows]
        stopped = torch.isin(chosen, self.eos_only)
        width = draft.shape[1]
        columns = torch.arange(width, device=rows.device)[None]
        agree = (chosen[:, :width] == draft) & (columns < has[:, None]) & ~stopped[:, :width]
        first = torch.ones(len(rows), 1, dtype=torch.bool, device=rows.device)
        return chosen, stopped, torch.cat([first, agree.cumprod(1).bool()], 1)

    def _accept(self, live, out, tokens, stops, alive) -> list[int]:
        """Record each row's accepted tokens; the streams still live (finished rows leave the processing)."""
        keep = []
        for r, s in enumerate(live):
            accepted = int(alive[r].sum())
            new = tokens[r, :accepted].tolist()
            out[s] += new
            self.drafter.accepted(s, new)
            keep.append(not stops[r, :accepted].any() and len(out[s]) < self.room)
        if not all(keep):
            self.processing.keep(torch.as_tensor(keep, device=self.runner.device))
        return [s for s, k in zip(live, keep) if k]

    def _adapt(self, live: list[int], drafts: list[list[int]], alive: np.ndarray) -> None:
        """Each drafting stream's next draft limit, from how much of this draft it accepted."""
        if not self.speculation.adaptive:
            return
        for r, (s, draft) in enumerate(zip(live, drafts)):
            if draft and alive[r, len(draft)]:  # the whole draft accepted
                self.limit[s] = min(self.limit[s] + 2, self.speculation.num_tokens)
            elif draft:
                self.limit[s] = max(self.limit[s] - 1, 1)


class LookupDrafts:
    """Prompt lookup's drafts: each stream's from its own history (`PromptLookup`)."""

    def __init__(self, lookup: PromptLookup):
        self.lookup = lookup

    def running(self):
        return contextlib.nullcontext()

    def drafts(self, live: list[int], out: list[list[int]], limits: list[int]) -> list[list[int]]:
        return [self.lookup.draft(s, k) for s, k in zip(live, limits)]

    def accepted(self, stream: int, tokens: list[int]) -> None:
        self.lookup.extend(stream, tokens)


class AssistantDrafts:
    """An assistant model's greedy drafts, decoded in a packed row of its own over the runner's layout.

    The assistant's row holds what the assistant has been fed of each stream: its prompt (prefilled once, the
    shared prefixes once), then the answer tokens the main model accepted.  A round feeds each live stream's
    tokens the assistant has not seen (its newest, and any it did not draft itself) and then one token a stream a
    forward, its own argmax, as many times as the longest draft asked; a draft stops at EOS.  The K/V of drafted
    tokens the main model rejects lies past the stream's answer and is written over next round.
    """

    def __init__(self, runner, eos: list[int]):
        opts = replace(runner.opts, cuda_graphs=False, compile=False, speculation=None, assistant_model=None)
        # its support probed and checked by the call (`engine.generate`)
        self.runner = type(runner)(runner.opts.assistant_model, runner.layout, opts, runner.backend,
                                   runner.assistant_support)  # fmt: skip
        self.vocab = runner.model.config.get_text_config().vocab_size  # a draft token the main model has
        self.eos = set(eos)
        self.fed: list[int] = []  # answer tokens of each stream in the assistant's row

    @contextlib.contextmanager
    def running(self):
        """The assistant held and its prompts prefilled for the decode's duration."""
        with model_lock(self.runner.model).held(), self.runner.using_model():
            self.runner.prefill()
            self.fed = [0] * self.runner.layout.num_prompts
            yield

    def drafts(self, live: list[int], out: list[list[int]], limits: list[int]) -> list[list[int]]:
        runner, device = self.runner, self.runner.device
        slots = runner.layout.answer_slots
        drafts = [[] for _ in live]
        rows = [r for r, k in enumerate(limits) if k > 0]
        if not rows:
            return drafts
        new = [out[live[r]][self.fed[live[r]] :] for r in rows]  # what the assistant has not seen
        q_slot = torch.cat([slots[live[r], self.fed[live[r]] : len(out[live[r]])] for r in rows])
        ids = torch.tensor([t for tokens in new for t in tokens], dtype=torch.long)
        keep = torch.tensor(np.cumsum([len(tokens) for tokens in new]) - 1)
        for r in rows:
            self.fed[live[r]] = len(out[live[r]])
        for step in range(max(limits[r] for r in rows)):
            q_slot, ids, keep = q_slot.to(device), ids.to(device), keep.to(device)
            chosen = runner.forward(runner.plan(q_slot), ids, keep).argmax(-1).tolist()
            going = []
            for r, token in zip(rows, chosen):
                if token in self.eos or token >= self.vocab:  # the draft ends before it
                    continue
                drafts[r].append(token)
                if len(drafts[r]) < limits[r]:
                    going.append((r, token))
            if not going:
                break
            rows = [r for r, _ in going]
            q_slot = torch.tensor([int(slots[live[r], len(out[live[r]]) + step]) for r in rows])
            ids = torch.tensor([token for _, token in going], dtype=torch.long)
            keep = torch.arange(len(rows))
        return drafts

    def accepted(self, stream: int, tokens: list[int]) -> None:
        """Nothing: the next round feeds the stream's accepted tokens again (its drafted ones over their own K/V)."""
