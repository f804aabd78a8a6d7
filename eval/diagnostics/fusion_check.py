"""The layers' compiled parts (`hf_parallel/models/compiled_parts.py`), every dimension dynamic against only the
token count.

    python eval/diagnostics/fusion_check.py > results/gpu/fusion-widths-h200.log

Transformers' Llama rotary embedding (`apply_rotary_pos_emb`) and an RMSNorm, each through `torch.compile` as
compiled_parts.py compiles them (`emulate_precision_casts`), on CodeLlama-7B's and Qwen2.5-7B's widths: first with
`dynamic=True` (every dimension symbolic), then with Dynamo's default and the token count marked dynamic (the
heads, head size and hidden size static), in a process reset between the two.  Each is timed (microseconds,
`triton.testing.do_bench_cudagraph`) on an 8k-token prefill's q and k (tensors of their own) and on a decode
step's of 256, 64 and 128 streams (views of one q|k|v projection, as `hf_parallel/models/projections.py` groups them),
in that order, so the second graph is the one compiled again for the views' strides.  Prints a line per shape
and way: the graphs compiled, then per input its time, the norm's time on [1, n, hidden] and the largest
difference from the eager rotary embedding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the package, from a clone

from hf_parallel.models.compiled_parts import OPTIONS  # noqa: E402

SHAPES = {"codellama": (32, 32, 128), "qwen": (28, 4, 128)}  # heads, KV heads, head size
CASES = ((8192, False), (256, True), (64, True), (128, True))  # tokens, q and k views of one q|k|v output


def inputs(H, Hkv, D, n, strided):
    if strided:
        qkv = torch.randn(1, n, (H + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
        q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    else:
        q = torch.randn(1, n, H * D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, n, Hkv * D, device="cuda", dtype=torch.bfloat16)
    q, k = q.view(1, n, H, D).transpose(1, 2), k.view(1, n, Hkv, D).transpose(1, 2)
    cos = torch.randn(1, n, D, device="cuda", dtype=torch.bfloat16)
    return q, k, cos, cos.clone()


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for name, (H, Hkv, D) in SHAPES.items():
        for variant in ("dynamic=True", "token dim"):
            torch._dynamo.reset()
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            dynamic = True if variant == "dynamic=True" else None
            f = torch.compile(apply_rotary_pos_emb, dynamic=dynamic, options=OPTIONS)
            g = torch.compile(LlamaRMSNorm.forward, dynamic=dynamic, options=OPTIONS)  # as compiled_parts: the class's
            norm, res = LlamaRMSNorm(H * D, eps=1e-6).to("cuda", torch.bfloat16), []
            for n, strided in CASES:
                q, k, c, s = inputs(H, Hkv, D, n, strided)
                x = torch.randn(1, n, H * D, device="cuda", dtype=torch.bfloat16)
                if variant != "dynamic=True":
                    for t, d in ((q, 2), (k, 2), (c, 1), (s, 1), (x, 1)):
                        torch._dynamo.mark_dynamic(t, d)
                want = apply_rotary_pos_emb(q, k, c, s)
                got = f(q, k, c, s)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got))
                g(norm, x)
                us_r = triton.testing.do_bench_cudagraph(lambda: f(q, k, c, s)) * 1e3  # noqa: B023 - called here
                us_n = triton.testing.do_bench_cudagraph(lambda: g(norm, x)) * 1e3  # noqa: B023
                res.append(f"n={n}{'s' if strided else 'c'} rot {us_r:.1f}us norm {us_n:.1f}us err {err:.3g}")
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            print(name, variant, "graphs", graphs, "|", " | ".join(res), flush=True)


if __name__ == "__main__":
    main()
