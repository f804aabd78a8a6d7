"""This tree's `generate_tokens` beside another copy of the package, side by side in one process on one model.

The other copy is a commit's `hf_parallel/` exported under the name `hf_parallel_main` into a folder on
`sys.path` (PKGS below), for instance commit 8d6170d, the last one before the engine core:

    mkdir -p /tmp/pkgs && git archive 8d6170d hf_parallel | tar -x -C /tmp
    mv /tmp/hf_parallel /tmp/pkgs/hf_parallel_main
    BASELINE=/tmp/pkgs python eval/ab_bench.py qwen2.5-7b,codellama-7b 3 row,corpus

(the old package imports itself relatively, so it loads under the other name).  Parts: `row`, one row of
8k-token documents x 64 questions x 128 new tokens (`DOC`, `NEW`), in a `Session` each, warmed up once, then
`repeats` calls of each alternated, with the roofline; `corpus`, 8 documents x 4k tokens x 64 questions with answers
of 16-512 tokens (each stream stops at its coded length, `corpus_bench.ForcedLength`) under `CORPUS_MEMORY`
(default 6GiB), one warm-up on 32 prompts then one timed call each, the tree's first.  The first timed call of a
process builds the kernels that the warm-up's shapes did not (on an H100 about 12 s of the corpus's time), so the
corpus part is fair only with both orders: `ORDER=main,new` times the other copy first.  One JSON line per part on
stdout and `ab-<shapes>.json` under `OUT`.
"""

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "eval"), os.environ.get("BASELINE", str(ROOT / ".devtools" / "pkgs"))]

import bench  # noqa: E402
import corpus_bench  # noqa: E402
import hf_parallel_main  # noqa: E402
import torch  # noqa: E402

import hf_parallel  # noqa: E402

PKGS = {"new": hf_parallel, "main": hf_parallel_main}
PKGS = {k: PKGS[k] for k in os.environ.get("ORDER", "new,main").split(",")}
OUT = Path(os.environ.get("OUT", "/tmp"))


DEVICE = torch.device(os.environ.get("DEVICE", "cuda"))


def one_row(model, shape, repeats):
    vocab = model.config.vocab_size
    book = bench.book_tokens(None, vocab)
    work = bench.Workload("8k x 64q x 128", int(os.environ.get("DOC", 8192)), 64, int(os.environ.get("NEW", 128)))
    prompts = bench.make_prompts(book, work, 0, lambda s: [hash(w) % (vocab - 3) + 3 for w in s.split()], vocab)
    opts = dict(
        max_new_tokens=work.answer_tokens,
        eos_token_id=[],
        prefill_chunk=8192,
        progress=False,
        attn="triton" if DEVICE.type == "cuda" else "reference",
    )
    sessions = {k: p.Session(model) for k, p in PKGS.items()}
    answers, times = {}, {k: [] for k in PKGS}
    for k in PKGS:
        answers[k] = sessions[k].generate_tokens(prompts, **opts)  # warm-up: kernels, captures
    for _ in range(repeats):
        for k in PKGS:
            t, _ = bench.timed(lambda k=k: sessions[k].generate_tokens(prompts, **opts))
            times[k].append(t)
    for s in sessions.values():
        s.release()
    ceilings = bench.measure_ceilings(model.device)
    roof = bench.roofline(model.config, prompts, work, ceilings)
    row = dict(
        shape=shape,
        workload=work.name,
        roofline_s=roof["roofline_s"],
        identical=sum(a == b for a, b in zip(answers["new"], answers["main"])),
        streams=len(prompts),
    )
    for k in PKGS:
        row[f"{k}_best_s"], row[f"{k}_median_s"], row[f"{k}_all"] = min(times[k]), statistics.median(times[k]), times[k]
    row["new_over_main_best"] = row["main_best_s"] / row["new_best_s"]
    row["new_over_main_median"] = row["main_median_s"] / row["new_median_s"]
    print(json.dumps(row), flush=True)
    return row


def corpus(model, shape, docs, questions, memory):
    vocab = model.config.vocab_size
    book = bench.book_tokens(None, vocab)
    doc = int(os.environ.get("DOC", 4096))
    prompts, targets = corpus_bench.workload(book, docs, doc, questions, lambda rng: rng.randint(16, 512), 2, vocab)
    rows = {}
    for k, p in PKGS.items():
        processor = corpus_bench.ForcedLength(len(prompts[0]), 2)
        opts = dict(
            max_new_tokens=512,
            eos_token_id=2,
            do_sample=False,
            progress=False,
            max_memory=memory,
            logits_processor=[processor],
        )
        p.generate_tokens(model, prompts[: questions // 2], **opts)  # warm-up
        t, out = bench.timed(lambda p=p, opts=opts: p.generate_tokens(model, prompts, **opts))
        rows[k] = (t, out)
    ok = all(len(a) == n for a, n in zip(rows["new"][1], targets))
    row = dict(
        shape=shape,
        workload=f"corpus {docs} docs x 4k x {questions}q, answers 16-512, max_memory {memory}",
        new_s=rows["new"][0],
        main_s=rows["main"][0],
        new_over_main=rows["main"][0] / rows["new"][0],
        identical=sum(a == b for a, b in zip(rows["new"][1], rows["main"][1])),
        lengths_right=ok,
        tokens=sum(targets),
    )
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    shapes = sys.argv[1].split(",")
    repeats = int(sys.argv[2])
    parts = sys.argv[3].split(",")
    results = []
    for shape in shapes:
        model = bench.build_model(shape, DEVICE)
        if "row" in parts:
            results.append(one_row(model, shape, repeats))
        if "corpus" in parts:
            results.append(corpus(model, shape, docs=8, questions=64, memory=os.environ.get("CORPUS_MEMORY", "6GiB")))
        del model
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    (OUT / f"ab-{'-'.join(shapes)}.json").write_text(json.dumps(results, indent=1))
