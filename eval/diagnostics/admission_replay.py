"""Replay continuous refill's admissions on a corpus_bench workload, without a model: decode rounds, live streams.

Every stream decodes one token a round for its coded answer length; the row admits prompts as
`hf_parallel.engine.policies.Refill` (or `Waves`) decides (the engine's own policy and prefix tree), with refill
and as static waves.  The counts say what a schedule can gain before any forward runs: rounds
(forwards), mean live streams, rounds that admit prompts (eager forwards with prefill and decode
together), the mean number of cohorts live in a round (streams admitted in one round with processors choose
their tokens together: one pass of generate's processors per cohort and round) and prompt tokens
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
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from corpus_bench import workload  # noqa: E402

from hf_parallel.engine.policies import Refill, Waves  # noqa: E402
from hf_parallel.engine.streams import Request  # noqa: E402
from hf_parallel.row.prefix_tree import PrefixTree  # noqa: E402
from hf_parallel.runner.sizing import RowSize  # noqa: E402


def replay(prompts, targets, groups, doc_len: int, capacity: int, streams: int, refill: bool,
           exact_room: bool = False) -> dict:  # fmt: skip
    policy, tree, keys = (
        (Refill if refill else Waves)(RowSize(capacity, streams, 0)),
        PrefixTree(capacity),
        itertools.count(),
    )
    index_of = []  # each stream key's prompt
    for g, members in enumerate(groups):
        for index in members:
            request = Request(prompts[index], None, 1, targets[index] if exact_room else max(targets), document=g)
            request.make_streams(keys)
            policy.add(request)
            index_of.append(index)
    live: dict[int, object] = {}  # stream key -> the stream
    left: dict[int, int] = {}  # stream key -> tokens still to decode
    cohort: dict[int, int] = {}  # stream key -> the round it was admitted in
    rounds = admitting = prefilled = live_sum = cohort_sum = own_slots = doc_slots = 0
    group_of = {index: g for g, members in enumerate(groups) for index in members}
    while policy.waiting() or live:
        admitted = [s for r in policy.admit(tree, len(live)) for s in r.streams]
        admitting += bool(admitted)
        for node in tree.pending():
            prefilled += len(node.tokens) - node.written
            node.written = len(node.tokens)
        for stream in admitted:
            live[stream.key], left[stream.key], cohort[stream.key] = stream, targets[index_of[stream.key]], rounds
        rounds, live_sum, cohort_sum = rounds + 1, live_sum + len(live), cohort_sum + len({cohort[k] for k in live})
        # this round's reads: each live stream's question and answer so far (the new token's slot included), and
        # each document some live stream sees
        own_slots += sum(len(prompts[index_of[k]]) - doc_len + targets[index_of[k]] - left[k] + 1 for k in live)
        doc_slots += doc_len * len({group_of[index_of[k]] for k in live})
        for key in list(live):
            left[key] -= 1
            if not left[key]:
                tree.leave(live.pop(key).key)
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
