"""Generation past one row's memory: prompts admitted as room frees up, answers streamed as they finish.

Each round is one forward: the next token of every live stream, plus a chunk of the newly
admitted prompts' tokens (each prompt token once; a prefix already in the row is reused).
Its logits give the live streams their next tokens and the prompts completed in it their
first.  Streams admitted in the same round share their step, so they form a `Cohort`
that chooses its tokens through generate's processors together.  A stream that stops
leaves the row at once; waiting prompts take its room (continuous refill) once enough
room is free, so the live streams stay near the row's maximum (`engine.admission`: which
prompts, and where).  With `refill=False` prompts are admitted only into an empty row
(static waves, the baseline).  Rounds with only decode tokens replay captured steps, as a
single row's decode does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..decoding.logits import Processing
from ..decoding.options import GenerationOptions
from ..decoding.sampling import Sampler
from ..row.forest import Node
from .admission import Admission
from .runner import Runner


class Cohort:
    """Streams that started in the same round: their rows, answer slots, processors and tokens so far.

    opts: the streams' options (by default the runner's); room: their most new tokens each.
    """

    def __init__(
        self,
        runner: Runner,
        streams: list[int],
        prompts: list[list[int]],
        starts: list[int],
        room: int,
        sampler: Sampler,
        opts: GenerationOptions | None = None,
    ):
        device = runner.device
        self.streams, self.step, self.room = streams, 0, room
        self.starts = torch.tensor(starts, device=device)
        self.processing = Processing.for_prompts(runner.model, opts or runner.opts, prompts, room, device)
        self.sampler = sampler
        self.out = torch.empty(len(streams), room, dtype=torch.long, device=device)
        self.last: torch.Tensor | None = None

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token from its logits [n, V]; [n] bool, which rows stop with it."""
        new = self.sampler(self.processing.scores(logits))
        self.processing.append(new)
        self.out[:, self.step] = self.last = new
        self.step += 1
        stop = self.processing.stopped(new)
        return stop | (self.step == self.room)

    def slots(self) -> torch.Tensor:
        """[n] the slots the rows' newest tokens are written to."""
        return self.starts + (self.step - 1)

    def drop(self, keep: torch.Tensor, keep_list: list[bool]) -> None:
        """Keep only the rows where `keep` [n] bool (and its host copy `keep_list`) is set."""
        self.streams = [s for s, k in zip(self.streams, keep_list) if k]
        self.starts, self.out = self.starts[keep], self.out[keep]
        self.last = self.last[keep] if self.last is not None else None
        self.processing.keep(keep)


class RefillLoop:
    """Every prompt's new tokens, through one row of `budget` (module docstring); `run` yields them as they finish."""

    def __init__(self, runner: Runner, prompts, admission: Admission, room: int):
        """prompts: every prompt's tokens, by index (a list, or a mapping that grows); admission: which of them
        enter the row when (`engine.admission`); room: the most new tokens of any stream."""
        self.runner, self.prompts, self.room = runner, prompts, room
        self.opts: GenerationOptions = runner.opts
        self.sampler = Sampler(runner.opts, runner.device)  # one for the call: a seed gives one sequence of draws
        self.admission = admission
        self.forest = admission.forest
        self.starting: list[tuple[int, Node]] = []  # admitted streams whose first logits are not computed yet
        self.cohorts: list[Cohort] = []
        self.started: list[tuple[int, Node, int]] = []
        self.changed = True  # the row's layout changed since the last forest snapshot's captured step
        self.live_changed = True  # the live streams changed since the last captured step

    @property
    def live(self) -> int:
        return sum(len(c.streams) for c in self.cohorts) + len(self.starting)

    def run(self) -> Iterator[tuple[int, list[int]]]:
        """(prompt index, new tokens) of every prompt as its stream finishes, round after round; ValueError (from
        `Admission.admit`) for a prompt that does not fit an empty row."""
        while self.admission.waiting or self.starting or self.cohorts:
            self._admit()
            logits = self._forward()
            yield from self._choose(logits)

    # -- admission --

    def _admit(self) -> None:
        admitted = self.admission.admit(self.live)
        if admitted:
            self.starting += admitted
            self.changed = True
            self._snapshot()

    def _snapshot(self) -> None:
        self.runner.relayout(self.forest.snapshot(self.room))

    # -- one round --

    def _forward(self) -> torch.Tensor:
        """One forward over the live streams' newest tokens and a chunk of pending prompt tokens; its logits."""
        runner, device = self.runner, self.runner.device
        decode = [c for c in self.cohorts if c.last is not None]
        slots = [c.slots() for c in decode]
        tokens = [c.last for c in decode]
        n_decode = sum(len(c.streams) for c in decode)
        extra_slots, extra_tokens, start_rows = self.prompt_tokens()
        if not extra_slots and not self.changed:  # only decode tokens: the captured step, as a row's decode
            changed, self.live_changed = self.live_changed, False
            return runner.step(torch.cat(slots), torch.cat(tokens), changed)
        slots.append(torch.tensor(extra_slots, dtype=torch.long, device=device))
        tokens.append(torch.tensor(extra_tokens, dtype=torch.long, device=device))
        keep = torch.cat(
            [
                torch.arange(n_decode, device=device),
                n_decode + torch.tensor(start_rows, dtype=torch.long, device=device),
            ]
        )
        self.changed, self.live_changed = False, True  # the next captured step must refresh its plan
        return runner.forward(runner.plan(torch.cat(slots)), torch.cat(tokens), keep)

    def prompt_tokens(self) -> tuple[list[int], list[int], list[int]]:
        """(slots, token ids) of up to a chunk of pending prompt tokens, parents first, and for each starting
        stream whose prompt is then complete the index of its last token among them (a last token written in an
        earlier round is queried again: the same K/V rewritten to the same slot)."""
        budget = self.opts.prefill_chunk_for(self.runner.backend)
        slots, tokens = [], []
        for node in self.forest.pending():
            take = min(len(node.tokens) - node.written, budget - len(slots))
            if take <= 0:
                break
            slots += range(node.slot + node.written, node.slot + node.written + take)
            tokens += node.tokens[node.written : node.written + take]
            node.written += take
        where = {s: i for i, s in enumerate(slots)}
        rows, still = [], []
        for index, answer in self.starting:
            end = answer.parent
            if not _complete(end):
                still.append((index, answer))
                continue
            last = end.slot + len(end.tokens) - 1
            if last not in where:
                where[last] = len(slots)
                slots.append(last)
                tokens.append(end.tokens[-1])
            rows.append((index, answer, where[last]))
        self.starting, self.started = still, rows
        return slots, tokens, [r for _, _, r in rows]

    def _choose(self, logits: torch.Tensor) -> Iterator[tuple[int, list[int]]]:
        """Every live stream's next token; the finished streams leave the row and are yielded."""
        at, stops = 0, []
        live = [c for c in self.cohorts if c.last is not None]
        if self.started:
            fresh = self._start(self.started)
            self.cohorts += fresh
            live += fresh
        for cohort in live:
            n = len(cohort.streams)
            stops.append(self._choose_rows(cohort, logits[at : at + n]))
            at += n
        if not live:
            return
        flags = torch.cat(stops)
        host = torch.cat([flags.long(), torch.cat([c.last for c in live])]).tolist()  # the one host sync of a round
        done, tokens = host[: len(flags)], host[len(flags) :]
        self._chosen(live, tokens)
        at = 0
        for cohort in live:
            rows = done[at : at + len(cohort.streams)]
            at += len(rows)
            if any(rows):
                yield from self._finish(cohort, [bool(f) for f in rows])
        self.cohorts = [c for c in self.cohorts if c.streams]

    def _start(self, started: list[tuple[int, Node, int]]) -> list[Cohort]:
        """The cohorts of the streams whose first logits this round computed, rows in `started` order."""
        prompts = [self.prompts[i] for i, _, _ in started]
        starts = [a.slot for _, a, _ in started]
        return [Cohort(self.runner, [i for i, _, _ in started], prompts, starts, self.room, self.sampler)]

    def _choose_rows(self, cohort: Cohort, logits: torch.Tensor) -> torch.Tensor:
        """The cohort's next tokens from its rows' logits; [n] bool, which rows stop."""
        return cohort.choose(logits)

    def _chosen(self, live: list[Cohort], tokens: list[int]) -> None:
        """The round's new token of every row of the `live` cohorts, in their order, on the host."""

    def _finish(self, cohort: Cohort, flags: list[bool]) -> Iterator[tuple[int, list[int]]]:
        rows = [i for i, f in enumerate(flags) if f]
        answers = cohort.out[rows, : cohort.step].tolist()
        for row, tokens in zip(rows, answers):
            index = cohort.streams[row]
            self.admission.release(index)
            yield index, tokens
        self._drop(cohort, [not f for f in flags])

    def _drop(self, cohort: Cohort, keep: list[bool]) -> None:
        cohort.drop(torch.tensor(keep, device=self.runner.device), keep)
        self.live_changed = True


def _complete(node: Node | None) -> bool:
    """Whether every token of `node` and of its ancestors is written."""
    while node is not None:
        if node.written < len(node.tokens):
            return False
        node = node.parent
    return True
