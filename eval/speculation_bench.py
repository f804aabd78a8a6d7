"""Prompt-lookup decoding: tokens per forward, exactness, and wall time with and without drafts.

tokens  SQuAD v1.1 dev and DROP dev questions, greedy, up to --max-new-tokens each: tokens per forward of
        `model.generate(prompt_lookup_num_tokens=k)` on each question alone (its forwards counted, the prefill
        included) against hf_parallel's (a stream's tokens over the forwards it took part in, the prefill
        included); every answer of both checked equal to plain greedy `model.generate`.
squad   wall time over SQuAD v1.1 dev (--limit documents, all by default) with and without prompt lookup, side
        by side, --docs-per-call documents a call; answers compared between the two.
copy    random bf16 weights at a real shape (bench.py's SHAPES): documents of War and Peace, every answer forced
        to --answer-tokens tokens.  Random weights copy nothing from the document, so the drafts are built to
        copy: each stream's draft is the answer the model writes (from a run without drafts), each draft token
        replaced by another with probability --reject, which sets the acceptance; the tokens per forward that
        gives is reported beside the time, against the one-token roofline (bench.py's `roofline`).

  python eval/speculation_bench.py tokens --limit 100                     # CPU, the embedded model, fp32
  python eval/speculation_bench.py squad --dtype bfloat16 --device cuda   # the embedded model
  python eval/speculation_bench.py copy --shape qwen2.5-7b --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

import hf_parallel
from hf_parallel.decoding.drafting import PromptLookup
from hf_parallel.evaluation.loaders import load_documents
from hf_parallel.evaluation.prompts import question_prompts
from hf_parallel.frontends.default_model import load_smollm2

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("HF_PARALLEL_DATA") or ROOT.parent / "shared" / "data")
FILES = {"squad": "squad-dev-v1.1.json.zip", "drop": "drop-dev.jsonl.gz"}


class Counted:
    """Tokens decided, streams answered, stream forwards and CUDA graphs captured over the calls it runs (each
    call's `stream_tokens` stats)."""

    def __init__(self):
        self.tokens = self.stream_forwards = self.streams = self.captures = 0

    def generate(self, model, prompts, session=None, **options) -> list[list[int]]:
        streamed = hf_parallel.stream_tokens(model, prompts, session=session, **options)
        answers = dict(streamed)
        stats = streamed.stats
        self.tokens, self.stream_forwards = self.tokens + stats.tokens, self.stream_forwards + stats.stream_forwards
        self.streams, self.captures = self.streams + len(answers), self.captures + stats.captures
        return [answers[i] for i in range(len(answers))]

    @property
    def per_forward(self) -> float:
        return self.tokens / max(self.stream_forwards + self.streams, 1)  # each stream's prefill counted once


def generate_alone(model, prompt, **options) -> tuple[list[int], int]:
    """model.generate on one prompt: its new tokens and how many forwards it ran."""
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **options)
    finally:
        hook.remove()
    return out[0, len(prompt) :].tolist(), calls[0]


def tokens_task(model, tokenizer, args) -> dict:
    results = {}
    for dataset in args.datasets.split(","):
        docs = load_documents(dataset, args.data / FILES[dataset])[: args.limit]
        ref_tokens = ref_forwards = same_ref = same_ours = questions = 0
        counted = Counted()
        for doc in docs:
            prompts = question_prompts(tokenizer, dataset, doc)
            ours = counted.generate(model, prompts, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k,
                                    progress=False, adaptive_drafts=args.adaptive)  # fmt: skip
            for prompt, mine in zip(prompts, ours):
                plain, _ = generate_alone(model, prompt, max_new_tokens=args.max_new_tokens)
                looked, forwards = generate_alone(
                    model, prompt, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k
                )
                ref_tokens, ref_forwards = ref_tokens + len(looked), ref_forwards + forwards
                same_ref += looked == plain
                same_ours += mine == plain
                questions += 1
        results[dataset] = dict(
            documents=len(docs),
            questions=questions,
            generate_tokens_per_forward=ref_tokens / ref_forwards,
            hf_parallel_tokens_per_forward=counted.per_forward,
            generate_identical=same_ref,
            hf_parallel_identical=same_ours,
            tokens=counted.tokens,
        )
        print(dataset, json.dumps(results[dataset]), flush=True)
    return results


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def squad_task(model, tokenizer, args) -> dict:
    docs = load_documents("squad", args.data / FILES["squad"])[: args.limit]
    calls = [docs[i : i + args.docs_per_call] for i in range(0, len(docs), args.docs_per_call)]
    prompts = [[p for doc in call for p in question_prompts(tokenizer, "squad", doc)] for call in calls]
    options = dict(max_new_tokens=args.max_new_tokens, progress=False, adaptive_drafts=args.adaptive, attn=args.attn)

    session = hf_parallel.Session(model)  # captured rounds kept between calls, as a caller of many calls would

    def run(calls=prompts, counted=None, **extra):
        counted = counted or Counted()
        return [counted.generate(model, p, session, **options, **extra) for p in calls]

    run(prompts[:2]), run(prompts[:2], prompt_lookup_num_tokens=args.k)  # warm-up: kernels, captured rounds
    rows = {}
    for _ in range(args.repeats):
        plain_s, plain = timed(run)
        counted = Counted()
        spec_s, spec = timed(lambda c=counted: run(counted=c, prompt_lookup_num_tokens=args.k))
        rows.setdefault("plain_s", []).append(plain_s)
        rows.setdefault("speculative_s", []).append(spec_s)
    answers = [a for call in plain for a in call]
    spec_answers = [a for call in spec for a in call]
    result = dict(
        documents=len(docs),
        questions=len(answers),
        docs_per_call=args.docs_per_call,
        new_tokens=sum(map(len, answers)),
        plain_s=min(rows["plain_s"]),
        speculative_s=min(rows["speculative_s"]),
        speedup=min(rows["plain_s"]) / min(rows["speculative_s"]),
        tokens_per_forward=counted.per_forward,
        captures_in_timed_calls=counted.captures,
        identical=sum(a == b for a, b in zip(answers, spec_answers)),
        times=rows,
    )
    print(json.dumps(result), flush=True)
    return result


def copy_task(args) -> dict:
    sys.path.insert(0, str(ROOT / "eval"))
    import bench  # noqa: PLC0415 - the sibling script, for its shapes, workload and roofline

    device = torch.device(args.device)
    model = bench.build_model(args.shape, device)
    vocab = model.config.vocab_size
    work = bench.Workload("copy", args.doc_tokens, args.questions, args.answer_tokens, args.documents)
    book = bench.book_tokens(None, vocab, args.data / "war-and-peace.txt.gz")
    prompts = bench.make_prompts(book, work, 0, lambda text: [hash(w) % (vocab - 3) + 3 for w in text.split()], vocab)
    options = dict(
        max_new_tokens=args.answer_tokens,
        eos_token_id=[],
        progress=False,
        adaptive_drafts=args.adaptive,
        attn=args.attn,
    )
    follows = make_copying(model)
    rng = random.Random(0)

    def draft(lookup, stream, k):  # the token that follows each one, each replaced with probability --reject
        out, token = [], lookup.history[stream][-1]
        for _ in range(k):
            token = follows[token]
            out.append(token if rng.random() >= args.reject else (token + 1) % vocab)
        return out

    session = hf_parallel.Session(model)  # captured rounds kept between calls (the warm-ups capture them)
    session.generate_tokens(prompts, **options)  # warm-up: kernels, captured rounds
    lookup_draft, PromptLookup.draft = PromptLookup.draft, draft
    counted = Counted()
    try:
        for _ in range(2):  # warm-up: each bucket of fed tokens the drafts reach captured
            session.generate_tokens(prompts, **options, prompt_lookup_num_tokens=args.k)
        spec_s, spec = timed(
            lambda: counted.generate(model, prompts, session, **options, prompt_lookup_num_tokens=args.k)
        )
    finally:
        PromptLookup.draft = lookup_draft
    plain_s, plain = timed(lambda: session.generate_tokens(prompts, **options))
    ceilings = bench.measure_ceilings(device)
    roof = bench.roofline(model.config, prompts, work, ceilings)
    tokens = sum(map(len, spec))
    result = dict(
        dtype=str(model.dtype).removeprefix("torch."),
        shape=args.shape,
        documents=args.documents,
        doc_tokens=args.doc_tokens,
        questions=args.questions,
        answer_tokens=args.answer_tokens,
        reject=args.reject,
        k=args.k,
        tokens_per_forward=counted.per_forward,
        captures_in_timed_call=counted.captures,
        plain_s=plain_s,
        speculative_s=spec_s,
        speedup=plain_s / spec_s,
        roofline_s=roof["roofline_s"],
        plain_tokens_per_s=tokens / plain_s,
        speculative_tokens_per_s=tokens / spec_s,
        roofline_tokens_per_s=tokens / roof["roofline_s"],
        identical=sum(a == b for a, b in zip(plain, spec)),
        streams=len(prompts),
    )
    print(json.dumps(result), flush=True)
    return result


@torch.inference_mode()
def make_copying(model) -> list[int]:
    """Scale every layer's output projections (attention's and the MLP's) by 1e-6, so that the residual stream is
    the token's embedding and each answer token is, but for rare near ties, a fixed function of the one before it;
    the forward's work is unchanged (the same GEMMs over the same shapes, the same attention).  Returns that
    function as a table: the token the head's argmax gives after each token alone."""
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module.weight.mul_(1e-6)
    embed = model.get_input_embeddings().weight
    norm = model.model.norm
    follows = []
    for rows in embed.split(8192):
        follows += model.lm_head(norm(rows[None]))[0].argmax(-1).tolist()
    return follows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=["tokens", "squad", "copy"])
    parser.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--datasets", default="squad,drop")
    parser.add_argument("--limit", type=int, default=None, help="documents per dataset")
    parser.add_argument("--docs-per-call", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--pretrained", default=None, help="a model folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="qwen2.5-7b")
    parser.add_argument("--documents", type=int, default=1)
    parser.add_argument("--doc-tokens", type=int, default=8192)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--reject", type=float, default=0.3)
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True, help="adaptive_drafts")
    parser.add_argument("--data", type=Path, default=DATA, help="folder of the datasets (default: ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.task == "copy":
        result = copy_task(args)
        args.dtype = result.pop("dtype")
    else:
        dtype = getattr(torch, args.dtype)
        if args.pretrained:
            from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

            model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=dtype).to(args.device).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.pretrained)
        else:
            model, tokenizer = load_smollm2(dtype, args.device)
        result = (tokens_task if args.task == "tokens" else squad_task)(model, tokenizer, args)
    result = dict(task=args.task, device=_device_name(args.device), dtype=args.dtype, k=args.k, attn=args.attn,
                  adaptive=args.adaptive, max_new_tokens=args.max_new_tokens, results=result)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


if __name__ == "__main__":
    main()
