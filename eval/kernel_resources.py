"""The attention kernel's decode launch built for an NVIDIA GPU that need not be here: its shared memory, its
registers, and how many of its programs one SM holds at once.

`default_config` adds KV splits until a decode step's grid holds twice as many programs as the GPU has SMs, which
is one wave where two programs fit on an SM.  Triton builds for any NVIDIA target on the CPU (with the ptxas it
ships), so this reads the fit off the compiled kernel, for the Triton installed, with no GPU:

    python eval/kernel_resources.py                       # sm_90 (H100, H200): CodeLlama-7B's and Qwen2.5-7B's heads
    python eval/kernel_resources.py --arch 90 80 --stages 2  # and A100 (sm_80), a shallower pipeline than the default

The launch is the launcher's own (`stream_attention`, recorded by `prebuild.collecting`, not made) on a small
decode step: the key and query counts are arguments the kernel is not specialized on, so the build is the one a
full-size step of the same heads gets.  Programs per SM follow the CUDA programming guide's per-SM limits.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_parallel.attention.launcher import default_config, stream_attention  # noqa: E402
from hf_parallel.attention.tiles import build_tile_plan  # noqa: E402
from hf_parallel.kernels import prebuild  # noqa: E402
from hf_parallel.row.layout import build_layout  # noqa: E402
from hf_parallel.row.plan import AttentionPlan, SlotIds  # noqa: E402

SHAPES = {"codellama-7b": (32, 32, 128), "qwen2.5-7b": (28, 4, 128)}  # heads, KV heads, head dim
# per SM: shared memory (bytes), of it reserved per program, 32-bit registers, resident warps
SM_LIMITS = {80: (167_936, 1_024, 65_536, 64), 90: (233_472, 1_024, 65_536, 64)}
SPLITS = 4  # a decode step's KV splits on the grid's shapes (any count above 1 builds the same kernel)
TORCH_TO_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                   torch.int64: "i64", torch.bool: "i1"}  # fmt: skip


def decode_launch(heads: int, kv_heads: int, dim: int, dtype=torch.bfloat16, streams: int = 64, stages=None):
    """(kernel, positional args, keyword args, config) of `stream_attention`'s launch for a decode step of
    `streams` questions on one document, with `default_config`'s tiles and warps and SPLITS KV splits."""
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 30000, (300,), generator=gen).tolist()
    layout = build_layout([doc + torch.randint(3, 30000, (8,), generator=gen).tolist() for _ in range(streams)], 8)
    ids = SlotIds.from_layout(layout, torch.device("cpu"))
    plan = AttentionPlan.for_slots(layout.answer_slots[:, -1], ids)
    query = torch.zeros(1, heads, len(plan.q_slot), dim, dtype=dtype)
    key, value = (torch.zeros(1, kv_heads, plan.kv_len, dim, dtype=dtype) for _ in "kv")
    tiles = build_tile_plan(layout, plan.q_slot, heads // kv_heads)
    config = default_config(query, key, tiles)  # on the CPU: one split (it counts the GPU's SMs)
    config = dataclasses.replace(config, num_splits=SPLITS, num_stages=stages or config.num_stages)
    # the launcher takes CPU tensors only under Triton's interpreter; nothing runs inside `collecting`
    with prebuild.collecting() as launches, mock.patch.dict(os.environ, TRITON_INTERPRET="1"):
        stream_attention(query, key, value, plan, tiles, config=config)
    kernel, _, args, kwargs = launches[0]
    return kernel, args, {**kwargs, "PRECISION": None, "DOT_F32": False}, config  # the GPU's, not the interpreter's


def build(kernel, args, kwargs, arch: int):
    """The kernel compiled for sm_`arch` as a launch with these arguments would build it: Triton's specialization
    (an integer 1 a constant, integers and pointers divisible by 16 marked so, None a constant) by hand, as its JIT
    does it only for a GPU it can see."""
    signature, constexprs, attrs = {}, {}, {}
    values = dict(zip(kernel.arg_names, args))
    for i, param in enumerate(kernel.params):
        name = param.name
        value = kwargs[name] if param.is_constexpr else values[name]
        if param.is_constexpr or value is None or (type(value) is int and value == 1 and not param.do_not_specialize):
            signature[name], constexprs[name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TORCH_TO_TRITON[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name], aligned = "i1", False
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0 and not param.do_not_specialize
        else:
            signature[name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)  # fmt: skip


def resources(compiled, arch: int) -> dict:
    """Shared memory, registers and spills of a compiled kernel, its programs resident per SM, and its fp32
    fused multiply-adds (PTX instructions)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    shared_sm, reserved, registers_sm, warps_sm = SM_LIMITS[arch]
    shared, warps = compiled.metadata.shared, compiled.metadata.num_warps
    per_warp = -(-found["REG"] // 8) * 8 * 32  # registers are allocated 256 to a warp at a time
    fits = min(shared_sm // (shared + reserved), registers_sm // (per_warp * warps), warps_sm // warps)
    return {"shared_bytes": shared, "registers": found["REG"], "stack_bytes": found.get("STACK", 0),
            "local_bytes": found.get("LOCAL", 0), "programs_per_sm": fits,
            "fused_multiply_adds": len(re.findall(r"\bfma\.rn\.f32\b", compiled.asm["ptx"]))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(SM_LIMITS),
                        help="compute capabilities x10")  # fmt: skip
    parser.add_argument("--stages", type=int, help="pipeline stages (default: default_config's)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    for arch, (shape, (heads, kv_heads, dim)) in itertools.product(args.arch, SHAPES.items()):
        kernel, launch_args, kwargs, config = decode_launch(heads, kv_heads, dim, stages=args.stages)
        row = {"shape": shape, "arch": arch, "triton": triton.__version__, "block_m": kwargs["BLOCK_M"],
               "block_n": config.block_n, "warps": config.num_warps, "stages": config.num_stages,
               **resources(build(kernel, launch_args, kwargs, arch), arch)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
