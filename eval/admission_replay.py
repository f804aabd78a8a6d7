"""Replay continuous refill's admissions on a corpus_bench workload, without a model: decode rounds, live streams.

Every stream decodes one token a round for its coded answer length; the row admits prompts as
`hf_parallel.admission.Admission` decides (the engine's own policy and allocator), with refill
and as static waves.  The counts say what a schedule can gain before any forward runs: rounds
(forwards), mean live streams, rounds that admit prompts (eager forwards with prefill and decode
together), the mean number of cohorts live in a round (streams admitted in one round choose their
tokens together: one pass of generate's processors per cohort and round) and prompt tokens
prefilled (documents copied count again).  A round's admissions are
counted as prefilled in that round, whatever the prefill chunk.

    python eval/admission_replay.py --capacity 40691 --streams 4096 --questions 64   # corpus_bench, 24 GB

`--exact-room` replays both schedules again with each answer's room its own length, an oracle for answer
room that grows as the answer does (the row reserves the longest answer's room for every stream now).
"""

from __future__ import annotations

import argparse

from corpus_bench import workload

from hf_parallel.admission import Admission
from hf_parallel.budget import RowBudget


class ExactRoom(Admission):
    """An oracle: each prompt's answer room is its own answer's length, not the longest (an upper bound for answer
    room that grows as the answer does)."""

    def __init__(self, targets: list[int], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets = targets

    def _place(self, group, live):
        self.room = self.targets[group[0]]
        return super()._place(group, live)


def replay(prompts, targets, groups, capacity: int, streams: int, refill: bool, exact_room: bool = False) -> dict:
    budget = RowBudget(capacity, streams, 0)
    if exact_room:
        admission = ExactRoom(targets, prompts, groups, max(targets), budget, refill)
    else:
        admission = Admission(prompts, groups, max(targets), budget, refill)
    live: dict[int, int] = {}  # stream -> tokens still to decode
    cohort: dict[int, int] = {}  # stream -> the round it was admitted in (the engine's `Cohort`)
    rounds = admitting = prefilled = live_sum = cohort_sum = 0
    while admission.waiting or live:
        admitted = admission.admit(len(live))
        admitting += bool(admitted)
        for node in admission.forest.pending():
            prefilled += len(node.tokens) - node.written
            node.written = len(node.tokens)
        live.update((index, targets[index]) for index, _ in admitted)
        cohort.update((index, rounds) for index, _ in admitted)
        rounds, live_sum, cohort_sum = rounds + 1, live_sum + len(live), cohort_sum + len({cohort[i] for i in live})
        for index in list(live):
            live[index] -= 1
            if not live[index]:
                del live[index]
                admission.release(index)
    return {"rounds": rounds, "mean_live": round(live_sum / rounds, 1), "admitting_rounds": admitting,
            "mean_cohorts": round(cohort_sum / rounds, 1), "prompt_tokens_prefilled": prefilled}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, required=True, help="the row's K/V slots (corpus_bench's budget_slots)")
    parser.add_argument("--streams", type=int, default=4096, help="most live streams (its budget_streams)")
    parser.add_argument("--doc", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--exact-room", action="store_true", help="also replay with each answer's room its own length")
    args = parser.parse_args(argv)
    book = list(range(3, 1_000_003))  # distinct documents; only their lengths matter here
    prompts, targets = workload(book, args.docs, args.doc, args.questions, lambda rng: rng.randint(16, 512), 2,
                                10**9)  # fmt: skip  # corpus_bench's large workload: the same answer lengths
    groups = [list(range(d * args.questions, (d + 1) * args.questions)) for d in range(args.docs)]
    for refill in (True, False):
        print("refill" if refill else "waves", replay(prompts, targets, groups, args.capacity, args.streams, refill))
    if args.exact_room:
        for refill in (True, False):
            got = replay(prompts, targets, groups, args.capacity, args.streams, refill, exact_room=True)
            print("refill" if refill else "waves", "with exact answer room", got)


if __name__ == "__main__":
    main()
