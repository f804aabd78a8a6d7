"""Newer model families on the GPU: parallel generation against `model.generate`, and bf16 against the reference.

speed      random bf16 weights with a gpt-oss-20b shape (MoE, attention sinks, sliding-window layers)
           and a Qwen3.5 shape (gated delta nets beside attention); one document, Q questions, A forced
           answer tokens: hf_parallel's default path, `generate` one prompt at a time, and `generate` on
           the prompts as one batch (all prompts have one length: no padding)
agreement  tiny random-weight gpt-oss and Qwen3.5 in bf16: the Triton path's answers against the dense
           reference path's (fp32 equality with `generate` is the GPU tests' business)

python eval/diagnostics/family_bench.py --out results/families
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_parallel

SHAPES = {
    "gpt-oss-20b": lambda: transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4),
    "qwen3.5-9b": lambda: transformers.Qwen3_5TextConfig(),  # the config class's defaults
}


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def prompts_for(vocab: int, doc: int, questions: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    document = [rng.randrange(3, vocab) for _ in range(doc)]
    return [document + [rng.randrange(3, vocab) for _ in range(12)] for _ in range(questions)]


def speed(shape: str, doc: int, questions: int, answer: int) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(SHAPES[shape](), dtype=torch.bfloat16).eval()
    prompts = prompts_for(model.config.vocab_size, doc, questions)
    options = dict(max_new_tokens=answer, min_new_tokens=answer, eos_token_id=None, do_sample=False, pad_token_id=0)

    def parallel():
        return hf_parallel.generate_tokens(model, prompts, max_new_tokens=answer, eos_token_id=[], do_sample=False)

    def alone():
        return [model.generate(torch.tensor([p], device="cuda"), **options) for p in prompts]

    def batch():
        return model.generate(torch.tensor(prompts, device="cuda"), **options)

    row = {"shape": shape, "doc": doc, "questions": questions, "answer_tokens": answer,
           "attn_implementation": model.config._attn_implementation}  # fmt: skip
    for name, fn in (("parallel", parallel), ("generate_batch_of_prompts", batch), ("generate_one_at_a_time", alone)):
        fn() if name == "parallel" else None  # warm-up: kernels compiled, support probed
        row[name + "_s"], _ = timed(fn)
        print(shape, name, round(row[name + "_s"], 2), flush=True)
    row["speedup_vs_one_at_a_time"] = row["generate_one_at_a_time_s"] / row["parallel_s"]
    row["speedup_vs_batch"] = row["generate_batch_of_prompts_s"] / row["parallel_s"]
    return row


def agreement(arch: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (the tiny models), beside hf_parallel
    from tests.helpers.models import random_tokens, tiny_model

    model = tiny_model(arch, dtype=torch.bfloat16).cuda()
    gen = torch.Generator().manual_seed(0)
    doc = random_tokens(200, gen)
    prompts = [doc + random_tokens(3 + i % 9, gen) for i in range(64)]
    got = {attn: hf_parallel.generate_tokens(model, prompts, max_new_tokens=32, eos_token_id=[], attn=attn)
           for attn in ("triton", "reference")}  # fmt: skip
    same = sum(a == b for a, b in zip(got["triton"], got["reference"]))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(*got.values())]
    row = {"arch": arch, "dtype": "bfloat16", "streams": len(prompts), "tokens": 32, "identical": same,
           "first_difference_steps": [f for f in first if f is not None]}  # fmt: skip
    print(row, flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--agreement", nargs="*", default=["gpt_oss", "qwen3_5_text"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "speed": [], "agreement": []}  # fmt: skip
    for arch in args.agreement:
        report["agreement"].append(agreement(arch))
    for shape in args.shapes:
        report["speed"].append(speed(shape, args.doc, args.questions, args.answer))
        torch.cuda.empty_cache()  # the model went with speed's frame
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "families-h200.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
