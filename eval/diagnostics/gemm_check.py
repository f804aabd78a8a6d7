"""How close a decode step's linear layers come to the copy bandwidth, and what else could run them.

    python eval/diagnostics/gemm_check.py --out $OUT/gemm

A decode step multiplies every weight matrix by a few rows (the live streams), so each linear
layer should take the time its weight takes to read.  For each linear layer of CodeLlama-7B's
and Qwen2.5-7B's shapes (and the fused q|k|v and gate|up shapes), at 64, 128 and 256 rows, this
times, in CUDA graphs over enough copies of the weight to flush the L2:

- `cublas`: `torch.nn.functional.linear`, as the model runs it;
- `cublaslt`: the same with `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `triton`: a skinny GEMM written for this (rows in one tile, the weight streamed in
  BLOCK_N x BLOCK_K tiles, optional split-K reduced in a second pass), the best of a small
  config grid per shape.

Each row gives µs per call and the fraction of the copy bandwidth for the bytes moved (weight,
input and output).  Writes gemm.json and gemm.md under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from bench import SHAPES  # noqa: E402
from gpu_kernel_check import copy_bandwidth, measure  # noqa: E402

MODELS = ("codellama-7b", "qwen2.5-7b")  # the benchmark's 7B shapes
FLUSH_BYTES = 600e6


def linears(shape: str) -> dict[str, tuple[int, int]]:
    """Layer name -> (out features N, in features K) of the benchmark's model `shape` (eval/bench.py)."""
    c = SHAPES[shape]()
    hidden, inter, heads, kv_heads, vocab = (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                             c.num_key_value_heads, c.vocab_size)  # fmt: skip
    dim = getattr(c, "head_dim", None) or hidden // heads
    return {
        "q": (heads * dim, hidden), "k": (kv_heads * dim, hidden), "v": (kv_heads * dim, hidden),
        "o": (hidden, heads * dim), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter),
        "qkv": ((heads + 2 * kv_heads) * dim, hidden), "gate_up": (2 * inter, hidden), "lm_head": (vocab, hidden),
    }  # fmt: skip


@triton.jit
def _skinny_mm(x_ptr, w_ptr, y_ptr, M, N, K, K_PER_SPLIT,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + (k + offs_k)[:, None], mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT == 1:
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


def skinny_mm(x, w, config):
    block_m, block_n, block_k, split, warps, stages = config
    M, K = x.shape
    N = w.shape[0]
    if split == 1:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    else:  # each split's fp32 partial sums, added after
        y = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split)
    _skinny_mm[grid](x, w, y, M, N, K, K // split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                     num_warps=warps, num_stages=stages)  # fmt: skip
    return y if split == 1 else y.sum(0).to(x.dtype)


def configs(M: int, K: int):
    for block_m, block_n, block_k, split, warps, stages in itertools.product(
        sorted({min(M, 64), min(M, 128)}), (32, 64, 128), (128,), (1, 2, 4), (4, 8), (4,)
    ):
        if K % (split * block_k) == 0 and (block_m, block_n) != (128, 128):
            yield block_m, block_n, block_k, split, warps, stages


def time_fns(fns) -> float:
    return measure(fns, replays=3, samples=7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--layers", nargs="+", default=None, help="layer names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gemm"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ceiling = copy_bandwidth()
    print(f"copy bandwidth {ceiling / 1e9:.0f} GB/s", flush=True)
    rows = []
    for shape in args.models:
        for layer, (N, K) in linears(shape).items():
            if args.layers and layer not in args.layers:
                continue
            copies = max(2, math.ceil(FLUSH_BYTES / (2 * N * K)))
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
            for M in args.rows:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                moved = 2 * (N * K + M * K + M * N)
                ref = torch.nn.functional.linear(x.float(), ws[0].float())
                result = {"model": shape, "layer": layer, "N": N, "K": K, "M": M}
                for blas in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(blas)
                    us = time_fns([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws])
                    result[blas] = {"us": round(us, 2), "of_copy_bw": round(moved / (us * 1e-6) / ceiling, 3)}
                torch.backends.cuda.preferred_blas_library("cublas")
                best = None
                for config in configs(M, K):
                    try:
                        err = (skinny_mm(x, ws[0], config).float() - ref).abs().max().item()
                        us = time_fns([lambda w=w, c=config, x=x: skinny_mm(x, w, c) for w in ws])
                    except Exception as exc:  # noqa: BLE001 (a config the compiler refuses)
                        print("  config", config, "failed:", type(exc).__name__, flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, config, err)
                if best:
                    us, config, err = best
                    result["triton"] = {"us": round(us, 2), "of_copy_bw": round(moved / (us * 1e-6) / ceiling, 3),
                                        "config": config, "max_abs_err": round(err, 4)}  # fmt: skip
                rows.append(result)
                print(json.dumps(result), flush=True)
    (args.out / "gemm.json").write_text(json.dumps({"copy_GBps": round(ceiling / 1e9), "rows": rows}, indent=1))
    lines = ["| model | layer | N x K | rows | cuBLAS µs (of bw) | cuBLASLt µs (of bw) | Triton µs (of bw) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        cells = [f"{r[m]['us']} ({r[m]['of_copy_bw']})" if m in r else "" for m in ("cublas", "cublaslt", "triton")]
        lines.append(f"| {r['model']} | {r['layer']} | {r['N']} x {r['K']} | {r['M']} | " + " | ".join(cells) + " |")
    (args.out / "gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
