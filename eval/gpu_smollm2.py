"""SmolLM2 on the GPU: the Triton path against plain `model.generate` (fp32) and the reference path (bf16).

    python eval/gpu_smollm2.py --data ../shared/data/squad-dev-v1.1.json.zip --out results/gpu

fp32, greedy: every stream's tokens must equal `model.generate` for its question alone.
bf16: the Triton path's answers are compared with the dense reference's, stream by stream;
close logits can flip a token in bf16 (different summation order), so a small share may differ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_parallel import generate_tokens, render_prompts
from hf_parallel.evaluation.datasets import load_squad
from hf_parallel.models import load_smollm2


def alone(model, prompt, new, eos):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--fp32-paragraphs", type=int, default=4)
    parser.add_argument("--bf16-paragraphs", type=int, default=60)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    docs = load_squad(args.data)
    report = {}
    model, tok = load_smollm2(torch.float32, "cuda")
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
    same = total = 0
    first_diff = []
    for doc in docs[: args.bf16_paragraphs]:
        prompts = render_prompts(tok, doc.text, [q.question for q in doc.items])
        fast = generate_tokens(model, prompts, max_new_tokens=args.new, eos_token_id=eos, attn="triton")
        ref = generate_tokens(model, prompts, max_new_tokens=args.new, eos_token_id=eos, attn="reference")
        same += sum(a == b for a, b in zip(fast, ref))
        total += len(prompts)
        first_diff += [next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
                       for a, b in zip(fast, ref) if a != b]  # fmt: skip
    report["bf16_triton_vs_reference"] = dict(identical=same, streams=total, first_differing_token=first_diff)
    print(report, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "smollm2-h200.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
