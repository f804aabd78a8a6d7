"""Corpus-scale benchmark: work past one row's memory, continuous refill against static waves.

Random bf16 weights with a real model's shape (timing does not depend on weight values).
Documents are slices of War and Peace; every question has the same number of tokens and
ends with a token that codes its answer length, drawn once per question from a seeded
distribution between 16 and 512 tokens; `ForcedLength` forces EOS there, so every method
decodes exactly the same tokens per stream.

    fits     a workload of the same documents and questions that fits one row
    refill   the large workload with continuous refill (the default)
    waves    the large workload admitted only into an empty row (static waves)
    large    one 8k document with 4,096 questions of 256 tokens, then, in the same process,
             8k x 128 questions x 1,024 tokens (each run alone would need more than the GPU holds,
             or just under it after the first)
    after    8k x 128 questions x 1,024 tokens alone, then 8k x 1,024 questions x 256 tokens (more
             slots than the GPU holds: refilled), then the first again, in the same session
    generate_batch  the first `--gb-docs` documents of `fits` (same prompts, same answer lengths) through
             hf_parallel and through Transformers' continuous batching (`model.generate_batch`'s manager,
             paged attention, prefix block sharing on, each request its own max_new_tokens), side by side

    python eval/corpus_bench.py --model codellama-7b --out results/corpus
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LogitsProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import BOOK  # noqa: E402
from bench import SHAPES as BENCH_SHAPES  # noqa: E402

import hf_parallel  # noqa: E402
from hf_parallel.attention import resolve_backend  # noqa: E402
from hf_parallel.frontends.probe import check_support  # noqa: E402
from hf_parallel.row.layout import build_layout  # noqa: E402
from hf_parallel.runner.sizing import size_row  # noqa: E402

LENGTH_BASE = 1000  # the question's last token is LENGTH_BASE + its answer length
SHAPES = {  # bench's model shapes; a tiny one whose vocabulary holds LENGTH_BASE + every answer length
    "codellama-7b": BENCH_SHAPES["codellama-7b"],
    "qwen2.5-7b": BENCH_SHAPES["qwen2.5-7b"],
    "tiny": lambda: transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384),
}  # fmt: skip


class ForcedLength(LogitsProcessor):
    """EOS exactly at each stream's coded answer length (prompts all of length `prompt_len`)."""

    def __init__(self, prompt_len: int, eos: int):
        self.prompt_len, self.eos = prompt_len, eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        target = input_ids[:, self.prompt_len - 1] - LENGTH_BASE
        done = input_ids.shape[1] - self.prompt_len + 1 >= target  # the token chosen now is the stream's last
        scores[:, self.eos] = torch.where(done, scores.max(dim=-1).values + 1, float("-inf"))
        return scores


def workload(book: list[int], docs: int, doc_len: int, questions: int, lengths, seed: int, vocab: int):
    """Prompts of `docs` documents x `questions` questions (6 tokens each, the last coding its answer's length)."""
    rng = random.Random(seed)
    prompts, targets = [], []
    for _ in range(docs):
        start = rng.randrange(len(book) - doc_len)
        doc = [t % vocab for t in book[start : start + doc_len]]
        for _ in range(questions):
            length = lengths(rng)
            prompts.append(doc + [rng.randrange(3, LENGTH_BASE) for _ in range(5)] + [LENGTH_BASE + length])
            targets.append(length)
    return prompts, targets


def timed(fn, targets) -> tuple[dict, list]:
    """(figures, answers) of one call of `fn`: wall seconds, answer tokens per second, peak GPU memory."""
    cuda = torch.cuda.is_available()
    torch.cuda.synchronize() if cuda else None
    torch.cuda.reset_peak_memory_stats() if cuda else None
    start = time.perf_counter()
    answers = fn()
    torch.cuda.synchronize() if cuda else None
    seconds = time.perf_counter() - start
    assert [len(a) for a in answers] == targets, "every stream must stop at its coded length"
    tokens = sum(targets)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "peak_gib": peak,
            "streams": len(targets)}, answers  # fmt: skip


def run(model, prompts, targets, session, answers: bool = False, **options) -> dict:
    """hf_parallel on the prompts, each stream forced to EOS at its coded length (`answers`: with the tokens)."""
    eos = 2
    processor = ForcedLength(len(prompts[0]), eos)
    figures, out = timed(lambda: hf_parallel.generate_tokens(
        model, prompts, max_new_tokens=max(targets), eos_token_id=eos, do_sample=False, logits_processor=[processor],
        session=session, **options), targets)  # fmt: skip
    figures["slots_needed"] = build_layout(prompts, max(targets)).num_slots
    return {**figures, "answers": out} if answers else figures


def run_generate_batch(model, prompts, targets, **batching) -> dict:
    """Transformers' continuous batching on the prompts, greedy, request i stopping after targets[i] tokens (no EOS):
    the tokens hf_parallel decodes under `ForcedLength`.  Needs a manager whose `add_request` takes max_new_tokens.
    `batching`: ContinuousBatchingConfig fields, e.g. `num_blocks` and `max_batch_tokens` (left out, transformers
    sizes the cache from the GPU's free memory, even for a model on the CPU)."""
    config = transformers.GenerationConfig(max_new_tokens=max(targets), do_sample=False, eos_token_id=None,
                                           pad_token_id=0)  # fmt: skip
    if not hasattr(transformers, "ContinuousBatchingConfig"):
        raise RuntimeError(f"transformers {transformers.__version__} has no ContinuousBatchingConfig (5.24 has)")
    cb_config = transformers.ContinuousBatchingConfig(allow_block_sharing=True, **batching)

    def generate():
        with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                       block=True, timeout=5) as manager:  # fmt: skip
            if "max_new_tokens" not in inspect.signature(manager.add_request).parameters:
                raise RuntimeError(f"transformers {transformers.__version__}: add_request takes no max_new_tokens")
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, targets)]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError(f"generate_batch's manager stopped with {len(done)} of {len(ids)} requests done")
        return [done[i].generated_tokens for i in ids]

    figures, answers = timed(generate, targets)
    return {**figures, "answers": answers}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="codellama-7b")
    parser.add_argument("--book", type=Path, default=BOOK)
    parser.add_argument("--doc", type=int, default=4096, help="document tokens")
    parser.add_argument("--questions", type=int, default=128, help="questions per document")
    parser.add_argument("--fit-docs", type=int, default=2)
    parser.add_argument("--large-docs", type=int, default=16)
    parser.add_argument("--max-memory", help="memory budget (default: the GPU's free memory)")
    parser.add_argument("--parts", default="fits,refill,waves,large", help="comma list of the runs")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of refill and of waves each (the later ones as \"refill again\", ...)")  # fmt: skip
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--streams-per-tile", type=int, help="the Triton kernel's streams per row tile (default: as many as fit)"
    )
    parser.add_argument("--tag", default="", help="suffix of the output file's name")
    parser.add_argument("--gb-docs", type=int, default=1, help="documents of the generate_batch comparison")
    parser.add_argument(
        "--own-tiles",
        choices=["auto", "overlap", "serial", "off"],
        default="auto",
        help="TritonBackend(own_tiles=...) (off: None)",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            SHAPES[args.model](), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        ).eval()
    vocab = model.config.vocab_size
    book = [hash(w) % (vocab - 3) + 3 for w in gzip.open(args.book, "rt", encoding="utf-8-sig").read().split()]
    support = check_support(model)
    budget = size_row(model, support, resolve_backend("auto", device).prefill_chunk, args.max_memory)
    report = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "budget_slots": budget.capacity, "budget_streams": budget.streams, "slot_bytes": support.slot_bytes,
              "workload": {"doc": args.doc, "questions": args.questions, "fit_docs": args.fit_docs,
                           "large_docs": args.large_docs, "max_memory": args.max_memory,
                           "streams_per_tile": args.streams_per_tile, "own_tiles": args.own_tiles},
              "runs": {}}  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    variable = lambda rng: rng.randint(16, 512)  # noqa: E731
    fixed = lambda n: lambda rng: n  # noqa: E731
    parts = args.parts.split(",")
    session = hf_parallel.Session(model)
    common = dict(max_memory=args.max_memory)
    if args.streams_per_tile or args.own_tiles != "auto":
        from hf_parallel.attention.triton import TritonBackend

        own = None if args.own_tiles == "off" else args.own_tiles
        common["attn"] = TritonBackend(streams_per_tile=args.streams_per_tile, own_tiles=own)
    if "fits" in parts:
        prompts, targets = workload(book, args.fit_docs, args.doc, args.questions, variable, 1, vocab)
        run(model, prompts[:64], targets[:64], session, **common)  # warm-up: kernels and captured steps
        report["runs"]["fits"] = run(model, prompts, targets, session, **common)
        print("fits", report["runs"]["fits"], flush=True)
    prompts, targets = workload(book, args.large_docs, args.doc, args.questions, variable, 2, vocab)
    for name, refill in (("refill", True), ("waves", False)):
        for again in range(args.repeat if name in parts else 0):  # later runs: kernels compiled, steps captured
            label = name + " again" * again
            report["runs"][label] = run(model, prompts, targets, session, refill=refill, **common)
            print(label, report["runs"][label], flush=True)
    if "large" in parts:
        prompts, targets = workload(book, 1, 8192, 4096, fixed(256), 3, vocab)
        report["runs"]["8k x 4096q x 256a"] = run(model, prompts, targets, session, **common)
        print("8k x 4096q x 256a", report["runs"]["8k x 4096q x 256a"], flush=True)
        prompts, targets = workload(book, 1, 8192, 128, fixed(1024), 4, vocab)
        report["runs"]["8k x 128q x 1024a after"] = run(model, prompts, targets, session, **common)
        print("8k x 128q x 1024a after", report["runs"]["8k x 128q x 1024a after"], flush=True)
    if "after" in parts:  # 8k x 128q x 1,024 tokens alone, after a call that refills (in the same session), again
        long, targets = workload(book, 1, 8192, 128, fixed(1024), 4, vocab)
        refilled = workload(book, 1, 8192, 1024, fixed(256), 3, vocab)
        run(model, *workload(book, 1, 8192, 64, fixed(64), 5, vocab), session, **common)  # warm-up
        for name, (p, t) in (("8k x 128q x 1024a alone", (long, targets)), ("8k x 1024q x 256a", refilled),
                             ("8k x 128q x 1024a after it", (long, targets))):  # fmt: skip
            report["runs"][name] = run(model, p, t, session, **common)
            print(name, report["runs"][name], flush=True)
    if "generate_batch" in parts:  # the first documents of `fits`: the same prompts, the same answer lengths
        prompts, targets = workload(book, args.fit_docs, args.doc, args.questions, variable, 1, vocab)
        prompts, targets = prompts[: args.gb_docs * args.questions], targets[: args.gb_docs * args.questions]
        run(model, prompts[:8], targets[:8], session, **common)  # warm-ups
        run_generate_batch(model, prompts[:8], [min(t, 16) for t in targets[:8]])
        pp = run(model, prompts, targets, session, answers=True, **common)
        batched = run_generate_batch(model, prompts, targets)
        ours, theirs = pp.pop("answers"), batched.pop("answers")
        same = sum(a[: n - 1] == b[: n - 1] for a, b, n in zip(ours, theirs, targets))
        report["runs"]["generate_batch"] = {**batched, "pp": pp, "pp_speedup": batched["seconds"] / pp["seconds"],
                                            "same_answers_but_the_last_token": same}  # fmt: skip
        print("generate_batch", report["runs"]["generate_batch"], flush=True)
    session.release()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"corpus-{args.model}{args.tag}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
