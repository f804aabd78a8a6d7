"""Data parallelism over a corpus: under `accelerate launch` each process answers its own share of the
documents, and the shares come back together in input order.

`balanced_split` cuts the documents into one contiguous share per process, balanced by prompt tokens;
every rank computes it alike from the same input, so the split needs no communication.
`answer_share` answers this process's share.  Each process appends its finished documents to a part
file of its own (`part_path`), so that an interrupted run loses nothing; once every process is done,
the main process appends the parts' lines to the output in input order (`merge_parts`).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import PartialState

from .corpus import CorpusAnswer, answer_corpus, as_record, document_tokens
from .jsonlines import append_json_lines, read_json_lines

# How long a process waits at a barrier for the others.  A process whose share is done waits there
# for the slowest one, which on a large corpus can take far longer than torch.distributed's default
# (10 or 30 minutes, by backend), after which the waiting process would fail.
BARRIER_TIMEOUT = timedelta(days=7)


def process_state(cpu: bool | None = None) -> PartialState:
    """accelerate's state of this process: one of several under `accelerate launch`, else alone.

    The first call sets the state up; later ones (or one after the caller's own `Accelerator`)
    return it unchanged.  cpu: processes on the CPU; default: when there is no CUDA device, because
    PartialState's default makes each process on a CPU-only host think it runs alone.
    """
    return PartialState(cpu=not torch.cuda.is_available() if cpu is None else cpu, timeout=BARRIER_TIMEOUT)


def balanced_split(weights: Sequence[int], parts: int) -> list[range]:
    """`parts` contiguous ranges of `weights`' indices, in order, covering each index once.

    Share k ends where the running total comes nearest k/parts of the whole, so each share's
    weight is within the largest weight of the whole's 1/parts.  Deterministic: every rank gets the
    same split from the same weights.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    totals = [0, *itertools.accumulate(weights)]
    ends = [_nearest(totals, totals[-1] * k / parts) for k in range(1, parts)]
    bounds = [0, *ends, len(weights)]
    return [range(start, end) for start, end in zip(bounds, bounds[1:])]


def _nearest(totals: list[int], target: float) -> int:
    """The index of the running total nearest `target` (the earlier on a tie); `totals` ascending."""
    i = bisect.bisect_left(totals, target)
    return i if i == 0 or i == len(totals) or totals[i] - target < target - totals[i - 1] else i - 1


def answer_share(
    model, tokenizer, records: list, state: PartialState, render: dict, **corpus_options
) -> Iterator[CorpusAnswer]:
    """`answer_corpus` over this process's share of `records`, its `CorpusAnswer`s indexed in all of `records`.

    records: as for `answer_corpus`, but a list (every rank splits the same list).  render: the
    template, use_chat_template and system_prompt.  corpus_options: `answer_corpus`'s others.
    """
    rows = [as_record(record, f"record {i}") for i, record in enumerate(records)]
    if state.num_processes == 1:  # alone: the whole corpus, without tokenizing it once more to weigh it
        share = range(len(rows))
    else:
        weights = [document_tokens(tokenizer, document, questions, **render) for _, document, questions in rows]
        share = balanced_split(weights, state.num_processes)[state.process_index]
    mine = [
        {"id": i if rows[i][0] is None else rows[i][0], "document": rows[i][1], "questions": rows[i][2]} for i in share
    ]
    for result in answer_corpus(model, tokenizer, mine, **render, **corpus_options):
        yield CorpusAnswer(share[result.index], result.id, result.document, result.questions, result.answers)


# --------------------------------------------------------------------------- part files


def part_path(path: str | Path, rank: int) -> Path:
    """The file process `rank` appends its finished documents to, next to the output `path`."""
    path = Path(path)
    return path.with_name(f"{path.name}.part-{rank}")


def part_files(path: str | Path) -> list[Path]:
    """The part files of the output `path` that exist, of any rank of any run (their number may differ)."""
    path = Path(path)
    pattern = re.compile(rf"{re.escape(path.name)}\.part-(\d+)")
    ranks = {}
    for file in path.parent.iterdir() if path.parent.is_dir() else []:
        if match := pattern.fullmatch(file.name):
            ranks[file] = int(match[1])
    return sorted(ranks, key=ranks.get)


def merge_parts(path: str | Path, key: Callable[[dict], object], order: Callable[[dict], object]) -> None:
    """Append to `path` the lines of its part files that it does not hold yet, sorted by `order`,
    then remove the parts.

    key: what identifies a line, None for one that is not an answer (dropped); a line already in
    `path` or in an earlier part is skipped (a merge interrupted after its append leaves it twice).
    Only the main process merges, once every process is done with its part.
    """
    parts = part_files(path)
    if not parts:
        return
    held = {key(line) for line in read_json_lines(path) if isinstance(line, dict)}
    new = {}
    for part in parts:
        for line in read_json_lines(part):
            if isinstance(line, dict) and key(line) is not None and key(line) not in held:
                new.setdefault(key(line), line)
    append_json_lines(path, sorted(new.values(), key=order))
    for part in parts:
        part.unlink()
