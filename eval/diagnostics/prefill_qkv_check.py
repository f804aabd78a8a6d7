"""A prefill chunk's q, k and v as columns of one output, against each a tensor of its own: values and time.

    python eval/diagnostics/prefill_qkv_check.py --out $OUT/prefill-qkv.json

Where a GPU runs the model, `hf_parallel.models.projections` gives an input of more than `MOST_ROWS` rows (a prefill
chunk) each member's own GEMM, its output filling its columns of one tensor (`ProjectionGroup.outputs`), so that the
rotary embedding sees the decode steps' strides and compiles one graph.  For the first decoder layer's q_proj,
k_proj and v_proj of each model shape (random weights, the model's dtype on the device: bf16 on a GPU), at each row
count this checks the outputs bitwise equal to `F.linear`'s, member by member (as `pp_prefill_apart` runs them), and
times both, µs per call (CUDA events, the best of 5 runs of `--reps` calls, the two measured in turn twice).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from bench import SHAPES  # noqa: E402

from hf_parallel.models.projections import ProjectionGroup  # noqa: E402


def members(shape: str, device: torch.device) -> list[torch.nn.Linear]:
    """q_proj, k_proj and v_proj of the first layer of a one-layer model of `shape`."""
    torch.manual_seed(0)
    config = SHAPES[shape]()
    config.num_hidden_layers = 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    attn = model.model.layers[0].self_attn
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def best_us(fn, reps: int, device: torch.device) -> float:
    """µs per call of `fn`: the best of 5 runs of `reps` calls, after 3 untimed."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / reps)
        else:
            began = time.perf_counter()
            for _ in range(reps):
                fn()
            runs.append((time.perf_counter() - began) * 1e6 / reps)
    return min(runs)


def check(shape: str, rows: list[int], reps: int, device: torch.device) -> list[dict]:
    linears = members(shape, device)
    group = ProjectionGroup(linears)
    out = []
    for n in rows:
        x = torch.randn(1, n, linears[0].in_features, device=device, dtype=linears[0].weight.dtype)
        joined = lambda x=x: group.outputs(x)  # noqa: E731
        apart = lambda x=x: [F.linear(x, m.weight, m.bias) for m in linears]  # noqa: E731
        with torch.inference_mode():
            equal = all(torch.equal(a, b) for a, b in zip(joined(), apart()))
            times = [best_us(fn, reps, device) for fn in (joined, apart, apart, joined)]
        out.append(dict(model=shape, rows=n, bias=linears[0].bias is not None, bitwise_equal=equal,
                        us_columns_of_one=[round(times[0], 1), round(times[3], 1)],
                        us_tensors_of_their_own=[round(times[1], 1), round(times[2], 1)]))  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["codellama-7b", "qwen2.5-7b"], choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[300, 8192, 16454])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [row for shape in args.models for row in check(shape, args.rows, args.reps, device)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(device=str(device), rows=rows), indent=1))


if __name__ == "__main__":
    main()
