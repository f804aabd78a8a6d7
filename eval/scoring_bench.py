"""Candidate scoring, side by side on identical inputs: how long, how many tokens computed, same answers?

  alone        one forward per candidate input (prompt + continuation[:-1]; candidates whose
               inputs are equal, e.g. the yes/no spellings of one judgment, share it), logits
               kept for the continuation's rows only
  staged       a prefix cache as Transformers offers it: each group's shared context prefilled
               once into a DynamicCache, deep-copied per candidate input, then the input's
               remaining tokens
  staged_tree  every shared prefix once, in many small forwards: the prefix tree walked
               depth-first on one DynamicCache, cropped back at each branch
  tree         hf_parallel's one-pass scoring: the whole tree in one packed forward
  tree_per_group  one packed forward per group (e.g. per SQuAD paragraph): the dense reference
               attention scores every query against every earlier slot of its row, so
               unrelated documents in one row cost attention work that is then masked away

Workloads
  customer   a customer message judged by 2 questions (4 departments, 3 severity levels): the
             judge's yes/no prompts with the tokenizer's yes/no spellings as continuations
  squad      multiple choice from SQuAD v1.1 dev paragraphs: each question with its gold answer
             and 3 distractors (answers to other questions of the same paragraph)
  synthetic  random tokens on a random-weight model shape: one context, Q questions x C candidates

    python eval/scoring_bench.py --workload customer squad                     # CPU, SmolLM2, fp32
    python eval/scoring_bench.py --device cuda --dtype bfloat16 --model-shape 7b   # synthetic, 4k context
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from hf_parallel.evaluation.loaders import load_squad
from hf_parallel.frontends.judging import (
    ChoiceQuestion,
    ScoreQuestion,
    answer_spellings,
    assemble_answers,
    render_judgments,
)
from hf_parallel.frontends.prompting import render_prompts
from hf_parallel.frontends.scoring import score_tree
from hf_parallel.models.checks import cache_keyword
from hf_parallel.row.layout import Layout, build_layout

ROOT = Path(__file__).resolve().parents[1]
SQUAD = ROOT.parent / "shared" / "data" / "squad-dev-v1.1.json.zip"
SHAPES = {  # random weights with real shapes: timing does not depend on weight values
    "7b": lambda: transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192),
    "tiny": lambda: transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192),
}  # fmt: skip
MESSAGE = (
    "Customer message: Hello, I ordered a pair of running shoes three weeks ago (order 58213). The parcel "
    "only arrived yesterday, two weeks after the promised date, and the box was crushed. Worse, my bank "
    "statement shows that my card was charged twice for the same order, 89.90 each time. I have written "
    "to you twice already without an answer. I want the second charge refunded right away, otherwise I "
    "will dispute it with my bank and stop ordering from your shop."
)
QUESTIONS = [
    ChoiceQuestion("department", "Which department should handle this customer message?", {
        "shipping": "delivery delays, lost or damaged parcels",
        "billing": "charges, double payments, refunds and invoices",
        "returns": "sending a product back for an exchange or a refund",
        "technical support": "problems using the website or the app"}),
    ScoreQuestion("severity", "How severe is the customer's problem?", [
        ("low", "a minor inconvenience, no action needed soon", 1.0),
        ("medium", "a real problem that needs action within days", 2.0),
        ("high", "money lost and the customer is about to leave: urgent", 3.0)]),
]  # fmt: skip


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    continuations: list[list[list[int]]]
    groups: list[list[int]]  # prompt indices that share one context (what `staged` caches)
    gold: list[int] | None = None  # the correct candidate of each prompt (multiple choice)
    n_yes: int = 0  # judge workloads: the first n_yes continuations of each prompt spell "yes"
    notes: dict = field(default_factory=dict)


# ------------------------------------------------------------------ workloads


def customer_workload(tokenizer) -> Workload:
    prompts = render_judgments(tokenizer, MESSAGE, QUESTIONS)
    yes, no = answer_spellings(tokenizer)
    notes = {"questions": [q.name for q in QUESTIONS], "candidates": [len(q.judgments()) for q in QUESTIONS]}
    return Workload("customer", prompts, [yes + no] * len(prompts), [list(range(len(prompts)))], None, len(yes), notes)


def squad_workload(tokenizer, n_questions: int, per_paragraph: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, continuations, groups, gold = [], [], [], []
    for doc in load_squad(SQUAD):
        group = []
        for i, item in enumerate(doc.items):
            options = _squad_options(doc, i, rng)
            if options is None or len(prompts) == n_questions or len(group) == per_paragraph:
                continue
            order = rng.sample(range(4), 4)
            gold.append(order.index(0))
            group.append(len(prompts))
            prompts.append(render_prompts(tokenizer, doc.text, [item.question])[0])
            continuations.append([tokenizer(options[k], add_special_tokens=False)["input_ids"] for k in order])
        if group:
            groups.append(group)
    return Workload("squad", prompts, continuations, groups, gold, notes={"paragraphs": len(groups)})


def _squad_options(doc, i: int, rng: random.Random) -> list[str] | None:
    """The gold answer of question i and 3 other questions' answers from its paragraph (None if too few)."""
    item = doc.items[i]
    golds = {a.strip().lower() for a in item.answers}
    others = list(dict.fromkeys(o.answers[0].strip() for j, o in enumerate(doc.items) if j != i and o.answers))
    others = [o for o in others if o.lower() not in golds]
    if not item.answers or len(others) < 3:
        return None
    return [item.answers[0].strip()] + rng.sample(others, 3)


def synthetic_workload(vocab: int, context: int, questions: int, candidates: int, seed: int) -> Workload:
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    doc = tokens(context)
    prompts = [doc + tokens(24) for _ in range(questions)]
    continuations = [[tokens(1 + (3 * j + q) % 12) for j in range(candidates)] for q in range(questions)]
    return Workload("synthetic", prompts, continuations, [list(range(questions))])


# ------------------------------------------------------------------ methods


def run_alone(model, w: Workload):
    scores, tokens, forwards = [], 0, 0
    for prompt, cands in zip(w.prompts, w.continuations):
        row = [None] * len(cands)
        for seq, members in _distinct_inputs(prompt, cands).items():
            logits = _forward(model, seq, len(seq) - len(prompt) + 1)
            tokens, forwards = tokens + len(seq), forwards + 1
            for j in members:
                row[j] = _logprobs(logits, cands[j])
        scores.append(row)
    return scores, tokens, forwards


def run_staged(model, w: Workload):
    scores, tokens, forwards = [None] * len(w.prompts), 0, 0
    for group in w.groups:
        seqs = [w.prompts[p] + c[:-1] for p in group for c in w.continuations[p]]
        n = min(_common_prefix(seqs), min(len(w.prompts[p]) for p in group) - 1)  # the last prompt token's row
        context = DynamicCache()
        if n:
            _forward(model, seqs[0][:n], 1, context)
            tokens, forwards = tokens + n, forwards + 1
        for p in group:
            prompt, cands, row = w.prompts[p], w.continuations[p], [None] * len(w.continuations[p])
            for seq, members in _distinct_inputs(prompt, cands).items():
                logits = _forward(model, seq[n:], len(seq) - len(prompt) + 1, copy.deepcopy(context))
                tokens, forwards = tokens + len(seq) - n, forwards + 1
                for j in members:
                    row[j] = _logprobs(logits, cands[j])
            scores[p] = row
    return scores, tokens, forwards


def run_staged_tree(model, w: Workload):
    seqs, seq_of = tree_sequences(w.prompts, w.continuations)
    layout = build_layout(seqs, 0)
    rows, targets, sizes = target_rows(layout, w.continuations, seq_of)
    out = torch.empty(len(rows))
    cache, forwards = DynamicCache(), 0
    for seg in layout.segments:
        if not seg.tokens:
            continue
        _crop(cache, seg.depth)  # pre-order: the cache holds the path to the previous segment; keep the ancestors
        stop = seg.slot_start + len(seg.tokens)
        sel = (rows >= seg.slot_start) & (rows < stop)
        local, inverse = torch.unique(rows[sel] - seg.slot_start, return_inverse=True)  # candidates share rows
        logits = _forward(model, seg.tokens, local if sel.any() else 1, cache).cpu()
        forwards += 1
        if sel.any():
            out[sel] = logits[inverse, targets[sel]] - torch.logsumexp(logits, -1)[inverse]
    flat = iter(out.split(sizes))
    return [[next(flat) for _ in c] for c in w.continuations], layout.num_slots, forwards


def tree_sequences(prompts, continuations) -> tuple[list[list[int]], list[int]]:
    """The distinct token sequences the tree must hold (prompt + continuation[:-1]) and each candidate's one."""
    index: dict[tuple[int, ...], int] = {}
    seq_of = []
    for prompt, cands in zip(prompts, continuations):
        for cont in cands:
            seq_of.append(index.setdefault(tuple(prompt + cont[:-1]), len(index)))
    return [list(s) for s in index], seq_of


def target_rows(layout: Layout, continuations, seq_of):
    """Every (row slot [M], target token [M]) pair read, candidate after candidate, and each one's count."""
    rows, targets, sizes = [], [], []
    flat = (cont for cands in continuations for cont in cands)
    for s, cont in zip(seq_of, flat):
        rows.append(_tail_slots(layout, layout.prompt_ends[s], len(cont)))
        targets.append(torch.tensor(cont))
        sizes.append(len(cont))
    return torch.cat(rows), torch.cat(targets), sizes


def _tail_slots(layout: Layout, seg_id: int, n: int) -> torch.Tensor:
    """Slots [n] of the last `n` tokens of the sequence ending in segment `seg_id`, in order."""
    parts = []
    while n > 0:
        seg = layout.segments[seg_id]
        take = min(n, len(seg.tokens))
        stop = seg.slot_start + len(seg.tokens)
        parts.append(torch.arange(stop - take, stop))
        n, seg_id = n - take, seg.parent
    return torch.cat(parts[::-1])


def run_tree(model, w: Workload, attn: str, prefill_chunk: int | None):
    scores = score_tree(model, w.prompts, w.continuations, attn, prefill_chunk)
    chunk = prefill_chunk or scores.computed_tokens
    return scores.token_logprobs, scores.computed_tokens, -(-scores.computed_tokens // chunk)


def run_tree_per_group(model, w: Workload, attn: str, prefill_chunk: int | None):
    scores, tokens, forwards = [None] * len(w.prompts), 0, 0
    for group in w.groups:
        part = Workload(w.name, [w.prompts[p] for p in group], [w.continuations[p] for p in group], [group])
        row, n, f = run_tree(model, part, attn, prefill_chunk)
        tokens, forwards = tokens + n, forwards + f
        for p, r in zip(group, row):
            scores[p] = r
    return scores, tokens, forwards


def _distinct_inputs(prompt, cands) -> dict[tuple[int, ...], list[int]]:
    inputs: dict[tuple[int, ...], list[int]] = {}
    for j, cont in enumerate(cands):
        inputs.setdefault(tuple(prompt + cont[:-1]), []).append(j)
    return inputs


def _forward(model, ids, keep, cache: DynamicCache | None = None) -> torch.Tensor:
    """Plain forward of `ids` (after `cache`, extended in place); float logits [K, V] of the kept rows."""
    kwargs = {} if cache is None else {cache_keyword(model): cache, "use_cache": True}
    if isinstance(keep, torch.Tensor):
        keep = keep.to(model.device)
    out = model(input_ids=torch.tensor([list(ids)], device=model.device), logits_to_keep=keep, **kwargs)
    return out.logits[0].float()


def _logprobs(logits: torch.Tensor, cont: list[int]) -> torch.Tensor:
    """log p of each token of `cont` [len] from the rows before them (the last len(cont) rows of `logits`)."""
    logits = logits[-len(cont) :]
    picked = logits[torch.arange(len(cont), device=logits.device), torch.tensor(cont, device=logits.device)]
    return (picked - torch.logsumexp(logits, -1)).cpu()


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` tokens: a negative count removes tokens in 5.17 and 5.24 alike (5.24 refuses a size)."""
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())


def _common_prefix(seqs) -> int:
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        n = next((i for i in range(n) if s[i] != seqs[0][i]), n)
    return n


# ------------------------------------------------------------------ measure and report


def measure(model, w: Workload, args) -> dict:
    methods = {
        "alone": lambda wl: run_alone(model, wl),
        "staged": lambda wl: run_staged(model, wl),
        "staged_tree": lambda wl: run_staged_tree(model, wl),
        "tree": lambda wl: run_tree(model, wl, args.attn[0], args.prefill_chunk),
        "tree_per_group": lambda wl: run_tree_per_group(model, wl, args.attn[0], args.prefill_chunk),
    }
    for attn in args.attn[1:]:  # the same one-pass tree through another attention path
        methods[f"tree_{attn}"] = lambda wl, attn=attn: run_tree(model, wl, attn, args.prefill_chunk)
    if len(w.groups) == 1:
        del methods["tree_per_group"]
    if args.methods:
        methods = {k: v for k, v in methods.items() if k == "alone" or k in args.methods or k.startswith("tree_")}
    warm = Workload(w.name, w.prompts[:1], w.continuations[:1], [[0]], n_yes=w.n_yes)
    report = {"workload": w.name, "prompts": len(w.prompts), "candidates": sum(map(len, w.continuations)), **w.notes}
    results = {}
    for name, fn in methods.items():
        with torch.inference_mode():
            fn(warm)  # first-call costs (allocations, kernel selection) are not what we compare
            times = []
            for _ in range(args.repeats):
                _sync(model)
                start = time.perf_counter()
                scores, tokens, forwards = fn(w)
                _sync(model)
                times.append(time.perf_counter() - start)
        results[name] = scores
        # best of the repeats: the CPU is shared, and other processes only ever add time
        report[name] = {"wall_s": min(times), "wall_s_all": times, "tokens": tokens, "forwards": forwards}
        print(f"{w.name:10s} {name:12s} {min(times):9.3f} s  {tokens:8d} tokens  {forwards:5d} forwards", flush=True)
    _compare(report, results, w)
    return report


def _compare(report: dict, results: dict, w: Workload) -> None:
    base = results["alone"]
    for name, scores in results.items():
        sums = [[float(t.sum()) for t in row] for row in scores]
        diffs = [abs(a - float(b.sum())) for r, rb in zip(sums, base) for a, b in zip(r, rb)]
        entry = report[name]
        entry["max_abs_diff_vs_alone"] = max(diffs)
        entry["argmax_agrees_with_alone"] = sum(_argmax(r) == _argmax([float(t.sum()) for t in rb])
                                                for r, rb in zip(sums, base)) / len(sums)  # fmt: skip
        if w.gold is not None:
            means = [[float(t.mean()) for t in row] for row in scores]
            entry["accuracy_sum"] = sum(_argmax(r) == g for r, g in zip(sums, w.gold)) / len(w.gold)
            entry["accuracy_mean"] = sum(_argmax(r) == g for r, g in zip(means, w.gold)) / len(w.gold)
        if w.n_yes:
            answers = assemble_answers(QUESTIONS, scores, w.n_yes)
            entry["answers"] = {a.name: {"answer": a.answer, "score": a.score,
                                         "p_yes": {j.label: round(j.p_yes, 6) for j in a.judgments}}
                                for a in answers}  # fmt: skip


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def markdown(reports: list[dict], header: str) -> str:
    lines = [header, "", "| workload | method | wall s (best of repeats) | speedup vs alone | tokens computed | "
             "forwards | max abs diff vs alone | same pick as alone | accuracy (sum / mean logprob) |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in reports:
        for name in [k for k, v in r.items() if isinstance(v, dict) and "wall_s" in v]:
            e = r[name]
            acc = f"{e['accuracy_sum']:.3f} / {e['accuracy_mean']:.3f}" if "accuracy_sum" in e else ""
            lines.append(f"| {r['workload']} ({r['prompts']} prompts, {r['candidates']} candidates) | {name} | "
                         f"{e['wall_s']:.3f} | {r['alone']['wall_s'] / e['wall_s']:.2f}x | {e['tokens']} | "
                         f"{e['forwards']} | {e['max_abs_diff_vs_alone']:.2e} | {e['argmax_agrees_with_alone']:.0%} | "
                         f"{acc} |")  # fmt: skip
    for r in reports:
        if "answers" in r["tree"]:
            lines += ["", f"Assembled answers ({r['workload']}):", ""]
            lines += [
                f"- {m}: "
                + "; ".join(
                    f"{q} = {a['answer']}" + (f" ({a['score']:.3f})" if a["score"] else "")
                    for q, a in r[m]["answers"].items()
                )
                for m in ("alone", "staged", "staged_tree", "tree")
                if m in r
            ]
    return "\n".join(lines) + "\n"


def load_model(args):
    dtype = getattr(torch, args.dtype)
    if args.model_shape:
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(SHAPES[args.model_shape](), dtype=dtype)
        return model.eval(), None
    from hf_parallel.frontends.default_model import load_smollm2

    return load_smollm2(dtype, args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workload",
        nargs="+",
        default=None,
        choices=["customer", "squad", "synthetic"],
        help="default: customer squad with SmolLM2, synthetic with --model-shape",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--model-shape",
        choices=sorted(SHAPES),
        default=None,
        help="random weights of this shape instead of SmolLM2 (synthetic workload only)",
    )
    parser.add_argument("--squad-questions", type=int, default=100)
    parser.add_argument("--per-paragraph", type=int, default=5, help="most SQuAD questions taken from one paragraph")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument(
        "--attn", nargs="+", default=["auto"], help="attention path of the tree method; more paths add tree_<path> rows"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="only these methods (alone always runs: it is the baseline of the comparison)",
    )
    parser.add_argument("--prefill-chunk", type=int, default=None, help="most prompt tokens per forward of the tree")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (torch.set_num_threads); 1 keeps timings stable on a shared CPU",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "scoring")
    args = parser.parse_args()  # fmt: skip
    workloads = args.workload or (["synthetic"] if args.model_shape else ["customer", "squad"])
    if args.model_shape is None and "synthetic" in workloads:
        parser.error("the synthetic workload needs --model-shape")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    reports = []
    for name in workloads:
        if name == "customer":
            w = customer_workload(tokenizer)
        elif name == "squad":
            w = squad_workload(tokenizer, args.squad_questions, args.per_paragraph, args.seed)
        else:
            w = synthetic_workload(model.config.vocab_size, args.context_tokens, args.questions, args.candidates,
                                   args.seed)  # fmt: skip
        reports.append(measure(model, w, args))
    tag = f"{args.model_shape or 'smollm2'}-{args.device}-{args.dtype}"
    args.out.mkdir(parents=True, exist_ok=True)
    setup = {k: str(v) for k, v in vars(args).items()}
    setup.update(torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads())
    (args.out / f"{'-'.join(workloads)}-{tag}.json").write_text(json.dumps({"setup": setup, "reports": reports},
                                                                           indent=1))  # fmt: skip
    header = f"# Candidate scoring, {tag}\n\n`python eval/scoring_bench.py {_argv()}`"
    (args.out / f"{'-'.join(workloads)}-{tag}.md").write_text(markdown(reports, header))
    print(markdown(reports, header))


def _argv() -> str:
    import sys

    return " ".join(sys.argv[1:])


if __name__ == "__main__":
    main()
