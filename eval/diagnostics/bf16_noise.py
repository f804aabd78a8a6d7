"""How often do two correct bf16 computations of the same greedy answer agree?  SmolLM2 on SQuAD.

    python eval/diagnostics/bf16_noise.py --data ../shared/data/squad-dev-v1.1.json.zip --paragraphs 20 \
        --out results/gpu

For each question, greedy answers (32 new tokens) computed four ways in bf16:
  alone      `model.generate` on the question's prompt alone (the definition of the right answer)
  padded     `model.generate` on all of a paragraph's prompts as one left-padded batch
  reference  hf_parallel's dense-mask path (the paragraph's questions as streams of one row)
  triton     hf_parallel's Triton path (with --triton; on the CPU it needs TRITON_INTERPRET=1, slow)
and the share of streams on which each pair is identical.  In fp32 all four agree (the tests);
in bf16 they differ where the top two logits are within bf16's resolution, so `alone` vs
`padded` — stock Transformers against itself — is the noise floor any other pair can reach.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from gpu_smollm2 import alone as generate_alone  # eval/diagnostics/, beside this script

from hf_parallel import generate_tokens, render_prompts
from hf_parallel.evaluation.loaders import load_squad
from hf_parallel.frontends.default_model import load_smollm2


def _until(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@torch.inference_mode()
def answers(model, prompts: list[list[int]], new: int, eos: int, triton: bool) -> dict[str, list[list[int]]]:
    width = max(map(len, prompts))
    ids = lambda rows: torch.tensor(rows, device=model.device)  # noqa: E731
    out = model.generate(ids([[eos] * (width - len(p)) + p for p in prompts]),
                         attention_mask=ids([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
                         max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    got = {"alone": [generate_alone(model, p, new, eos) for p in prompts],
           "padded": [_until(row, eos) for row in out[:, width:].tolist()]}  # fmt: skip
    for attn in ("reference", "triton") if triton else ("reference",):
        got[attn] = generate_tokens(model, prompts, max_new_tokens=new, eos_token_id=eos, attn=attn)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="SQuAD v1.1 dev (json or zip)")
    parser.add_argument("--paragraphs", type=int, default=20)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--triton", action="store_true", help="also the Triton path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    args = parser.parse_args()
    model, tok = load_smollm2(torch.bfloat16, args.device)
    eos = tok.eos_token_id
    ways = ["alone", "padded", "reference"] + (["triton"] if args.triton else [])
    pairs = list(itertools.combinations(ways, 2))
    same = {f"{a} = {b}": 0 for a, b in pairs}
    streams = 0
    args.out.mkdir(parents=True, exist_ok=True)
    for doc in load_squad(args.data)[: args.paragraphs]:
        prompts = render_prompts(tok, doc.text, [q.question for q in doc.items])
        got = answers(model, prompts, args.new, eos, args.triton)
        streams += len(prompts)
        for a, b in pairs:
            same[f"{a} = {b}"] += sum(x == y for x, y in zip(got[a], got[b]))
        report = dict(device=args.device, dtype="bfloat16", new_tokens=args.new, paragraphs=args.paragraphs,
                      streams=streams, identical=same)  # fmt: skip
        (args.out / f"bf16-noise-{args.device}.json").write_text(json.dumps(report, indent=1))
        print(f"{streams} streams: " + ", ".join(f"{k} {v / streams:.0%}" for k, v in same.items()), flush=True)


if __name__ == "__main__":
    main()
