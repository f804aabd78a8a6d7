"""Where a Parallel Prompting call spends its GPU time: kernels by category, prefill and decode apart.

    python eval/diagnostics/profile_step.py --model codellama-7b --doc 8192 --questions 64 256 --out $OUT/profile

One warm-up call, then `torch.profiler` over a prefill-only call (max_new_tokens=1) and over a
call of `--new-tokens` tokens; the decode share is the difference.  Decode steps run eagerly
(`cuda_graphs=False`) so every kernel is listed with its own time; the eager steps' host time is
not the captured steps', so compare kernel (device) times only.  Kernels are grouped as
attention (hf_parallel's Triton kernels and the document's causal SDPA), GEMM, and the rest (elementwise,
norms, rotary, sampling).  `--cuda-graphs` profiles the captured steps the default path replays, with each
kernel's launches per decode step.  Prints one table per workload and path, writes profile.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from bench import build_model  # noqa: E402

import hf_parallel  # noqa: E402

GROUPS = (  # (group, substrings of a kernel name), the first match wins
    ("attention", ("stream_attention", "combine_splits", "sdpa", "flash", "fmha")),  # the kernel, and causal SDPA
    (
        "gemm",
        ("gemm", "gemv", "cutlass", "sm90_xmma", "ampere", "matmul", "cublas", "nvjet", "aten::mm", "aten::addmm"),
    ),  # the last two: CPU op names (no kernels there)
)


def group_of(name: str) -> str:
    low = name.lower()
    return next((group for group, keys in GROUPS if any(k in low for k in keys)), "other")


def kernel_times(fn, device: torch.device, counts: dict | None = None) -> dict[str, float]:
    """Device microseconds per kernel name over one call of fn (and into `counts`, its launches)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0 and (device.type != "cuda" or event.device_type == torch.autograd.DeviceType.CUDA):
            times[event.key] += us
            if counts is not None:
                counts[event.key] = counts.get(event.key, 0) + event.count
    return dict(times)


def summarize(prefill: dict[str, float], full: dict[str, float], steps: int, top: int,
              launches: tuple[dict, dict] | None = None) -> dict:  # fmt: skip
    """Per group: prefill ms, decode ms per step (full - prefill, over the decode steps), and the top kernels
    (with `launches`, the prefill's and the full call's launches per kernel: each one's per decode step)."""
    decode = {k: full.get(k, 0.0) - prefill.get(k, 0.0) for k in full}
    out = {"groups": {}, "top_decode_kernels": [], "top_prefill_kernels": []}
    if launches:
        prefill_launches, full_launches = launches
        per_step = {k: (n - prefill_launches.get(k, 0)) / steps for k, n in full_launches.items()}
        out["decode_launches_per_step"] = round(sum(per_step.values()), 1)
    for group in ("attention", "gemm", "other"):
        p = sum(v for k, v in prefill.items() if group_of(k) == group)
        d = sum(v for k, v in decode.items() if group_of(k) == group)
        out["groups"][group] = {"prefill_ms": round(p / 1e3, 2), "decode_ms_per_step": round(d / 1e3 / steps, 3)}
    for key, times, per in (("top_decode_kernels", decode, steps), ("top_prefill_kernels", prefill, 1)):
        for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
            out[key].append({"kernel": name[:120], "group": group_of(name), "ms": round(us / 1e3 / per, 3)})
            if launches and key == "top_decode_kernels":
                out[key][-1]["per_step"] = round(per_step.get(name, 0.0), 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="codellama-7b")
    parser.add_argument("--doc", type=int, default=8192, help="document tokens")
    parser.add_argument("--questions", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--question-tokens", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=17, help="tokens of the profiled call (decode steps + 1)")
    parser.add_argument("--paths", nargs="+", default=["triton"], help="attention paths: reference, triton")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cuda-graphs", action="store_true", help="decode steps captured, as the default path runs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.model, device)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    doc = [rng.randrange(3, vocab) for _ in range(args.doc)]
    report = []
    for n in args.questions:
        prompts = [doc + [rng.randrange(3, vocab) for _ in range(args.question_tokens)] for _ in range(n)]
        for path in args.paths:
            options = dict(attn=path, cuda_graphs=args.cuda_graphs, eos_token_id=[])
            run = functools.partial(hf_parallel.generate_tokens, model, prompts, **options)
            run(max_new_tokens=args.new_tokens)  # warm-up: kernels compiled and autotuned, steps captured
            launches = ({}, {})  # the prefill's and the full call's
            prefill = kernel_times(functools.partial(run, max_new_tokens=1), device, launches[0])
            full = kernel_times(functools.partial(run, max_new_tokens=args.new_tokens), device, launches[1])
            row = dict(model=args.model, doc=args.doc, questions=n, path=path, cuda_graphs=args.cuda_graphs,
                       **summarize(prefill, full, args.new_tokens - 1, args.top, launches))  # fmt: skip
            report.append(row)
            print(f"\n{args.model} {args.doc} x {n}q, {path}:")
            for group, t in row["groups"].items():
                print(f"  {group:9s} prefill {t['prefill_ms']:9.2f} ms   decode {t['decode_ms_per_step']:8.3f} ms/step")
            print(f"  kernel launches per decode step: {row.get('decode_launches_per_step')}")
            for k in row["top_decode_kernels"]:
                print(f"    decode {k['ms']:8.3f} ms/step {k.get('per_step', 0):6.1f}x {k['group']:9s} {k['kernel']}")
            for k in row["top_prefill_kernels"][:6]:
                print(f"    prefill {k['ms']:8.2f} ms  {k['group']:9s} {k['kernel']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
