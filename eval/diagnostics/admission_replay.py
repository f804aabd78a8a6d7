"""Replay continuous refill's admissions on a corpus_bench workload, without a model: decode rounds, live streams.

Every stream decodes one token a round for its coded answer length; the row admits prompts as
`hf_parallel.engine.admission.Admission` decides (the engine's own policy and allocator), with refill
and as static waves.  The counts say what a schedule can gain before any forward runs: rounds
(forwards), mean live streams, rounds that admit prompts (eager forwards with prefill and decode
together), the mean number of cohorts live in a round (streams admitted in one round choose their
tokens together: one pass of generate's processors per cohort and round) and prompt tokens
prefilled (documents copied count again).  A round's admissions are
counted as prefilled in that round, whatever the prefill chunk.

    python eval/diagnostics/admission_replay.py --capacity 40691 --streams 4096 --questions 64   # corpus_bench, 24 GB

`--exact-room` replays both schedules again with each answer's room its own length, an oracle for answer
room that grows as the answer does (the row reserves the longest answer's room for every stream now).

Each schedule's bandwidth bound: per round the weights' read (`--weights-gb`), the K/V of the documents some
live stream sees and of every live stream's own question and answer so far (`--slot-bytes` a slot), at
`--bandwidth`; what no schedule can go below, and the part of it that depends on the schedule.

    python eval/diagnostics/admission_replay.py --capacity 228152 --questions 128 --docs 17  # corpus_bench, whole GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from corpus_bench import workload  # noqa: E402

from hf_parallel.engine.admission import Admission  # noqa: E402
from hf_parallel.engine.budget import RowBudget  # noqa: E402


class ExactRoom(Admission):
    """An oracle: each prompt's answer room is its own answer's length, not the longest (an upper bound for answer
    room that grows as the answer does)."""

    def __init__(self, targets: list[int], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets = targets

    def _place(self, group, live):
        self.room = self.targets[group[0]]
        return super()._place(group, live)


def replay(prompts, targets, groups, doc_len: int, capacity: int, streams: int, refill: bool,
           exact_room: bool = False) -> dict:  # fmt: skip
    budget = RowBudget(capacity, streams, 0)
    if exact_room:
        admission = ExactRoom(targets, prompts, groups, max(targets), budget, refill)
    else:
        admission = Admission(prompts, groups, max(targets), budget, refill)
    live: dict[int, int] = {}  # stream -> tokens still to decode
    cohort: dict[int, int] = {}  # stream -> the round it was admitted in (the engine's `Cohort`)
    rounds = admitting = prefilled = live_sum = cohort_sum = own_slots = doc_slots = 0
    group_of = {index: g for g, members in enumerate(groups) for index in members}
    while admission.waiting or live:
        admitted = admission.admit(len(live))
        admitting += bool(admitted)
        for node in admission.forest.pending():
            prefilled += len(node.tokens) - node.written
            node.written = len(node.tokens)
        live.update((index, targets[index]) for index, _ in admitted)
        cohort.update((index, rounds) for index, _ in admitted)
        rounds, live_sum, cohort_sum = rounds + 1, live_sum + len(live), cohort_sum + len({cohort[i] for i in live})
        # this round's reads: each live stream's question and answer so far (the new token's slot included), and
        # each document some live stream sees
        own_slots += sum(len(prompts[i]) - doc_len + targets[i] - left + 1 for i, left in live.items())
        doc_slots += doc_len * len({group_of[i] for i in live})
        for index in list(live):
            live[index] -= 1
            if not live[index]:
                del live[index]
                admission.release(index)
    return {"rounds": rounds, "mean_live": round(live_sum / rounds, 1), "admitting_rounds": admitting,
            "mean_cohorts": round(cohort_sum / rounds, 1), "prompt_tokens_prefilled": prefilled,
            "own_slots_read": own_slots, "document_slots_read": doc_slots}  # fmt: skip


def bound(got: dict, weights_gb: float, slot_bytes: int, bandwidth: float) -> dict:
    """Seconds at the copy bandwidth: the weights' reads, the documents', the streams' own (the same in any
    schedule), and their sum."""
    parts = {"weights_s": got["rounds"] * weights_gb * 1e9 / bandwidth,
             "documents_s": got["document_slots_read"] * slot_bytes / bandwidth,
             "own_s": got["own_slots_read"] * slot_bytes / bandwidth}  # fmt: skip
    return {k: round(v, 1) for k, v in {**parts, "bound_s": sum(parts.values())}.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, required=True, help="the row's K/V slots (corpus_bench's budget_slots)")
    parser.add_argument("--streams", type=int, default=4096, help="most live streams (its budget_streams)")
    parser.add_argument("--doc", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--exact-room", action="store_true", help="also replay with each answer's room its own length")
    parser.add_argument("--weights-gb", type=float, default=13.5, help="bytes of weights a round reads (CodeLlama-7B)")
    parser.add_argument("--slot-bytes", type=int, default=2**19, help="K/V bytes of one slot (CodeLlama-7B, bf16)")
    parser.add_argument("--bandwidth", type=float, default=4.15e12, help="copy bandwidth, bytes/s (H200, measured)")
    args = parser.parse_args(argv)
    ceilings = (args.weights_gb, args.slot_bytes, args.bandwidth)
    book = list(range(3, 1_000_003))  # distinct documents; only their lengths matter here
    prompts, targets = workload(book, args.docs, args.doc, args.questions, lambda rng: rng.randint(16, 512), 2,
                                10**9)  # fmt: skip  # corpus_bench's large workload: the same answer lengths
    groups = [list(range(d * args.questions, (d + 1) * args.questions)) for d in range(args.docs)]
    for exact in (False, True) if args.exact_room else (False,):
        for refill in (True, False):
            got = replay(prompts, targets, groups, args.doc, args.capacity, args.streams, refill, exact)
            name = ("refill" if refill else "waves") + (" with exact answer room" if exact else "")
            print(name, got, "bandwidth bound", bound(got, *ceilings))


if __name__ == "__main__":
    main()
