"""SmolLM2 on the GPU: the Triton path against plain `model.generate` (fp32) and the reference path (bf16).

    python eval/diagnostics/gpu_smollm2.py --data ../shared/data/squad-dev-v1.1.json.zip --out results/gpu

fp32, greedy: every stream's tokens must equal `model.generate` for its question alone.
bf16: the Triton path's answers (the defaults: the layers' norms and MLPs compiled on CUDA) are compared with the
dense reference's with nothing compiled (the specification), stream by stream, and so are those of the Triton
path with nothing compiled (`compile=False`), which separates the kernel's share of the differences from the
compiled parts'; close logits can flip a token in bf16 (different summation order), so a small share may differ.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from hf_parallel import generate_tokens, render_prompts
from hf_parallel.evaluation.loaders import load_squad
from hf_parallel.frontends.default_model import load_smollm2


def alone(model, prompt, new, eos):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def explain(model, prompt, fast, ref) -> dict:
    """Where two answers part, and how close the choice was: the top-2 logit gap of a plain forward
    over the prompt and the common prefix (a near tie that bf16 summation order can flip)."""
    i = next(i for i, (x, y) in enumerate(zip(fast + [-1], ref + [-2])) if x != y)
    logits = model(torch.tensor([prompt + fast[:i]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2)
    pick = lambda seq: logits[seq[i]].item() if i < len(seq) else None  # noqa: E731
    return {
        "first_differing_token": i,
        "top2_gap": (top.values[0] - top.values[1]).item(),
        "triton_logit": pick(fast),
        "reference_logit": pick(ref),
        "top1": top.indices[0].item(),
        "triton_token": fast[i] if i < len(fast) else None,
        "reference_token": ref[i] if i < len(ref) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--fp32-paragraphs", type=int, default=4)
    parser.add_argument("--bf16-paragraphs", type=int, default=200)
    parser.add_argument("--docs-per-call", type=int, default=20)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float("inf"),
        help="stop the bf16 comparison after this many seconds (the report says how many streams)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (cpu only for a quick check, TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    docs = load_squad(args.data)
    report = {}
    model, tok = load_smollm2(torch.float32, args.device)
    eos = tok.eos_token_id
    same = total = 0
    for doc in docs[: args.fp32_paragraphs]:
        prompts = render_prompts(tok, doc.text, [q.question for q in doc.items])
        got = generate_tokens(model, prompts, max_new_tokens=args.new, eos_token_id=eos, attn="triton")
        same += sum(g == alone(model, p, args.new, eos) for g, p in zip(got, prompts))
        total += len(prompts)
    report["fp32_triton_vs_generate"] = dict(identical=same, streams=total)
    print(report, flush=True)
    model = model.to(torch.bfloat16)
    same = unfused_same = total = 0
    diffs = []
    docs = docs[: args.bf16_paragraphs]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for start in range(0, len(docs), args.docs_per_call):
        if time.perf_counter() - started > args.budget_s:
            break
        prompts = [p for doc in docs[start : start + args.docs_per_call]
                   for p in render_prompts(tok, doc.text, [q.question for q in doc.items])]  # fmt: skip
        run = functools.partial(generate_tokens, model, prompts, max_new_tokens=args.new, eos_token_id=eos)
        fast, unfused, ref = run(attn="triton"), run(attn="triton", compile=False), run(attn="reference", compile=False)
        same += sum(a == b for a, b in zip(fast, ref))
        unfused_same += sum(a == b for a, b in zip(unfused, ref))
        total += len(prompts)
        diffs += [explain(model, p, a, b) for p, a, b in zip(prompts, fast, ref) if a != b]
        done = min(start + args.docs_per_call, len(docs))
        report["bf16_triton_vs_reference"] = dict(identical=same, streams=total, paragraphs=done,
                                                  unfused_identical=unfused_same, differences=diffs)  # fmt: skip
        (args.out / f"smollm2-{args.device}.json").write_text(json.dumps(report, indent=1))  # after each call
    print({k: v for k, v in report.get("bf16_triton_vs_reference", {}).items() if k != "differences"}, flush=True)


if __name__ == "__main__":
    main()
