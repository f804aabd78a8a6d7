"""GPU check of the Triton stream-id kernel: its tests at full size, then decode-step timings.

    PYTHONUNBUFFERED=1 python3 eval/diagnostics/gpu_kernel_check.py --out $OUT

1. `pytest tests/kernels/test_triton_kernel.py` on the GPU (log: pytest.log).
2. One decode step's attention per layer: a CUDA graph over enough layers (each its own K/V)
   that their KV is several times the L2, as in a real step; median over replays, per layer:
   an 8192-token document and P streams, each seeing a 128-slot own region (32 question
   tokens + 96 answer tokens), for CodeLlama-7B (32 heads, MHA, D=128) and Qwen2.5-7B
   (28 query heads, 4 KV heads, D=128), bf16, P = 64 and 256:
     sdpa_dense   the reference path: dense stream mask + SDPA over all kv_len slots
     triton       the kernel, default tile plan and launch config
     triton_interleaved  the paper's layout (CodeLlama P=64 only)
     triton_p1    the kernel with one stream per row tile (every stream reads the document)
     triton_every_block_masked  the ablation of the unmasked blocks (`KernelConfig(whole_blocks=False)`)
     sweep        the kernel over SWEEP's (block_m, block_n, warps, stages) x splits (all in results.json)
   Bytes counted as the minimum a step must move: the document's KV once, each stream's
   own KV, q and o; bandwidth is against the copy bandwidth measured in the same run.
   Also the last 2048-token prefill chunk of the document (causal), kernel configs vs SDPA, and the backend
   as a prefill forward runs it (the document's run through causal SDPA); and the whole 8k document as one
   chunk, the backend against Transformers' own `sdpa` attention, each shape (`--prefill`: only these).
`--own`: only the own plan's streams per tile and launch configs, against long own regions (own.json).
`--dense-document`: only a decode step's document through PyTorch's dense kernels (flash, cuDNN, memory-efficient)
against the packed tiles' shared plan (dense-document.json).
`--whole-blocks`: only the unmasked whole blocks against every block masked, decode and the questions' prefill.
Results: results.json and summary.md under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from hf_parallel.attention.launcher import KernelConfig, default_config, own_launch_config, stream_attention  # noqa: E402
from hf_parallel.attention.reference import reference_attention  # noqa: E402
from hf_parallel.attention.tiles import build_tile_plan  # noqa: E402
from hf_parallel.attention.triton import TritonBackend, own_streams_per_tile  # noqa: E402
from hf_parallel.row.layout import build_layout  # noqa: E402
from hf_parallel.row.plan import AttentionPlan, Row, SlotIds  # noqa: E402

SHAPES = {"codellama-7b": (32, 32, 128), "qwen2.5-7b": (28, 4, 128)}  # heads, KV heads, head dim
DOC, QUESTION, ANSWER = 8192, 32, 96  # own region = QUESTION + ANSWER = 128 slots
L2_FLUSH_BYTES = 400e6  # KV moved per timed graph: several times the H200's 60 MB L2, so no layer finds it warm
MODULE = torch.nn.Module().eval()


def run_tests(out: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests/kernels/test_triton_kernel.py", "-q", "-n", "8", "-p",
           "no:cacheprovider", "--durations=10"]  # fmt: skip
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        log, rc = f"{err.stdout or ''}{err.stderr or ''}\nTIMEOUT after {timeout} s", -1
    (out / "pytest.log").write_text(log if isinstance(log, str) else log.decode())
    tail = [line for line in str(log).splitlines() if line.strip()][-3:]
    print("pytest:", rc, *tail, f"({time.time() - start:.0f} s)", sep="\n  ")
    return {"returncode": rc, "summary": tail, "seconds": round(time.time() - start)}


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def decode_case(shape: str, streams: int, interleaved: bool = False, answer: int = ANSWER, question: int = QUESTION,
                prefill: bool = False, layers: int | None = None):  # fmt: skip
    """Layout, plan, q, per-layer K/V views and counted bytes of one decode step at the last answer step (prefill:
    of the forward that writes every question after the document; layers: K/V copies, default enough to flush L2)."""
    heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(streams)
    doc = torch.randint(3, 30000, (DOC,), generator=gen).tolist()
    prompts = [doc + torch.randint(3, 30000, (question,), generator=gen).tolist() for _ in range(streams)]
    layout = build_layout(prompts, answer, interleaved)
    ids = SlotIds.from_layout(layout, torch.device("cuda"))
    if prefill:
        questions = [layout.segments[layout.segments[a].parent] for a in layout.answer_segs]
        q_slot = torch.cat([torch.arange(s.slot_start, s.slot_start + s.length) for s in questions]).cuda()
    else:
        q_slot = layout.answer_slots[:, answer - 1].cuda().contiguous()
    plan = AttentionPlan.for_slots(q_slot, ids)
    q = torch.randn(1, heads, len(q_slot), dim, device="cuda", dtype=torch.bfloat16)
    step_bytes = 2 * 2 * kv_heads * dim * (DOC + streams * (question + answer)) + 2 * 2 * streams * heads * dim
    layers = layers or max(2, math.ceil(L2_FLUSH_BYTES / step_bytes))
    kv = []
    for _ in range(layers):
        cache = [torch.randn(1, kv_heads, layout.num_slots, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
        kv.append(tuple(c[:, :, : plan.kv_len] for c in cache))
    return layout, plan, q, kv, step_bytes


def measure(fns, replays: int = 5, samples: int = 10) -> float:
    """Microseconds per call: `fns` (one per layer) captured in one CUDA graph, median over samples."""
    for fn in fns:  # compile and warm up outside the graph
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(samples):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / replays / len(fns))
    return statistics.median(times)


def single_call_us(fn) -> float:
    """`triton.testing.do_bench` median of one eager call (L2 flushed; includes the launcher's host time)."""
    return round(triton.testing.do_bench(fn, return_mode="median") * 1e3, 1)


def triton_run(layout, plan, q, kv, block_m=None, streams_per_tile=None, config=None):
    """(tile plan, launch config, one callable per layer) of the kernel on this workload."""
    group = q.shape[1] // kv[0][0].shape[1]
    tiles = build_tile_plan(layout, plan.q_slot, group, block_m, streams_per_tile, device="cuda")
    config = config or default_config(q, kv[0][0], tiles)
    out = torch.empty(1, q.shape[2], q.shape[1], q.shape[3], device="cuda", dtype=q.dtype)
    fns = [lambda k=k, v=v: stream_attention(q, k, v, plan, tiles, config=config, out=out) for k, v in kv]
    return tiles, config, fns


def sdpa_run(plan, q, kv):
    return [lambda k=k, v=v: reference_attention(MODULE, q, k, v, None, pp_plan=plan)[0] for k, v in kv]


def row(name, us, step_bytes, ceiling, err=None, **info) -> dict:
    gbs = step_bytes / (us * 1e-6) / 1e9
    r = {"method": name, "us": round(us, 2), "GB/s": round(gbs), "of_copy_bw": round(gbs * 1e9 / ceiling, 3)}
    if err is not None:
        r["max_abs_err_vs_sdpa"] = round(err, 4)
    r.update(info)
    print("   ", r)
    return r


def bench_workload(shape, streams, ceiling, deadline, sweep: bool) -> list[dict]:
    layout, plan, q, kv, step_bytes = decode_case(shape, streams)
    print(f"{shape} P={streams}: kv_len={plan.kv_len}, counted bytes {step_bytes / 1e6:.1f} MB, {len(kv)} layers")
    want = sdpa_run(plan, q, kv[:1])[0]()  # builds and caches the dense mask
    sdpa = sdpa_run(plan, q, kv)
    rows = [row("sdpa_dense", measure(sdpa), step_bytes, ceiling, do_bench_us=single_call_us(sdpa[0]))]
    configs = {}
    for name, spt in (("triton", None), ("triton_p1", 1)):
        tiles, configs[name], fns = triton_run(layout, plan, q, kv, streams_per_tile=spt)
        err = (fns[0]().float() - want.float()).abs().max().item()
        rows.append(row(name, measure(fns), step_bytes, ceiling, err, tiles=tiles.num_tiles, block_m=tiles.block_m,
                        config=configs[name].__dict__, do_bench_us=single_call_us(fns[0])))  # fmt: skip
    masked = dataclasses.replace(configs["triton"], whole_blocks=False)  # the ablation: every KV block masked
    _, _, fns = triton_run(layout, plan, q, kv, config=masked)
    err = (fns[0]().float() - want.float()).abs().max().item()
    rows.append(row("triton_every_block_masked", measure(fns), step_bytes, ceiling, err))
    group = q.shape[1] // kv[0][0].shape[1]
    shared = build_tile_plan(layout, plan.q_slot, group, device="cuda", part="shared")
    own = build_tile_plan(layout, plan.q_slot, group, None, own_streams_per_tile(group), "cuda", part="own")
    out = torch.empty(1, q.shape[2], q.shape[1], q.shape[3], device="cuda", dtype=q.dtype)
    for overlap in (False, True):  # TritonBackend(own_tiles=...): the shared and own plans, merged
        fns = [functools.partial(stream_attention, q, k, v, plan, shared, out=out, own=own, overlap=overlap)
               for k, v in kv]  # fmt: skip
        err = (fns[0]().float() - want.float()).abs().max().item()
        name = "triton_own_overlap" if overlap else "triton_own_serial"
        rows.append(row(name, measure(fns), step_bytes, ceiling, err, tiles=shared.num_tiles, own_tiles=own.num_tiles,
                        own_block_m=own.block_m))  # fmt: skip
    if streams == 64 and shape == "codellama-7b":
        il_layout, il_plan, il_q, il_kv, _ = decode_case(shape, streams, interleaved=True)
        _, cfg, fns = triton_run(il_layout, il_plan, il_q, il_kv)
        rows.append(row("triton_interleaved", measure(fns), step_bytes, ceiling, config=cfg.__dict__))
        del il_kv
    if sweep:
        rows.append(sweep_configs(layout, plan, q, kv, want, step_bytes, ceiling, deadline))
    return rows


SWEEP = [  # (block_m, block_n, warps, stages), the likeliest first: the sweep stops at its deadline
    (64, 32, 4, 3),
    (64, 32, 4, 4),
    (64, 64, 4, 2),
    (32, 32, 4, 3),
    (32, 64, 4, 2),
    (128, 32, 8, 3),
    (64, 32, 4, 2),
    (32, 32, 4, 4),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
    (128, 32, 4, 3),
    (32, 64, 4, 3),
    (64, 128, 4, 2),
    (64, 128, 8, 2),
    (64, 64, 4, 4),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
]


def sweep_configs(layout, plan, q, kv, want, step_bytes, ceiling, deadline) -> dict:
    results = []
    for block_m, block_n, warps, stages in SWEEP:
        if time.time() > deadline:
            break
        if block_m < q.shape[1] // kv[0][0].shape[1]:
            continue
        tiles, base, _ = triton_run(layout, plan, q, kv[:1], block_m=block_m)
        base = default_config(q, kv[0][0], tiles)
        for splits in sorted({base.num_splits, min(32, 2 * base.num_splits)}):
            cfg = KernelConfig(block_n, splits, warps, stages)
            _, _, fns = triton_run(layout, plan, q, kv, block_m=block_m, config=cfg)
            try:
                err = (fns[0]().float() - want.float()).abs().max().item()
                results.append((measure(fns), err, block_m, tiles.num_tiles, cfg.__dict__))
            except Exception as exc:  # e.g. out of shared memory for the largest tiles
                print("    sweep skip", block_m, cfg, type(exc).__name__, str(exc)[:120])
    results.sort(key=lambda r: r[0])
    for us, err, block_m, n_tiles, cfg in results[:6]:
        print("    sweep", round(us, 2), "us", block_m, n_tiles, cfg, "err", round(err, 4))
    best = results[0] if results else (float("nan"), None, None, None, None)
    return {**row("triton_best_of_sweep", best[0], step_bytes, ceiling, best[1], block_m=best[2], tiles=best[3],
                  config=best[4]),
            "tried": [(round(r[0], 2), round(r[1], 4), r[2], r[3], r[4]) for r in results]}  # fmt: skip


def bench_prefill() -> list[dict]:
    """The last 2048-token chunk of an 8k document (causal), CodeLlama shape: kernel vs dense SDPA."""
    heads, kv_heads, dim = SHAPES["codellama-7b"]
    layout = build_layout([list(range(3, 3 + DOC))], 1)
    ids = SlotIds.from_layout(layout, torch.device("cuda"))
    q_slot = torch.arange(DOC - 2048, DOC, device="cuda")
    plan = AttentionPlan.for_slots(q_slot, ids, DOC)
    q = torch.randn(1, heads, 2048, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, DOC, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * heads * dim * 2048 * (DOC - 1024)  # QK^T and PV over the causal part
    kv = [(k, v)]
    want = sdpa_run(plan, q, kv)[0]()
    rows = []
    us = measure(sdpa_run(plan, q, kv))
    rows.append({"method": "prefill_sdpa_dense", "us": round(us, 1), "TFLOP/s": round(flops / us / 1e6, 1)})
    print("   ", rows[-1])
    # the chunk sees the document causally and nothing else: plain causal SDPA (flash), aligned bottom-right
    from torch.nn.attention.bias import causal_lower_right

    causal = causal_lower_right(2048, DOC)
    flash = [lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)]
    err = (flash[0]().transpose(1, 2).float() - want.float()).abs().max().item()
    us = measure(flash)
    rows.append({"method": "prefill_sdpa_causal", "us": round(us, 1), "TFLOP/s": round(flops / us / 1e6, 1),
                 "err": round(err, 4)})  # fmt: skip
    print("   ", rows[-1])
    # the backend as a forward runs it: its plan finds the document run and sends it through causal SDPA
    backend = TritonBackend()
    backend_plan = backend.plan(Row(layout, ids, DOC, group=heads // kv_heads), q_slot)
    assert backend_plan.runs and backend_plan.run_tiles.num_tiles == 0
    through = [lambda: backend.attention(MODULE, q, k, v, None, pp_plan=backend_plan)[0]]
    err = (through[0]().float() - want.float()).abs().max().item()
    us = measure(through)
    rows.append({"method": "prefill_backend", "us": round(us, 1), "TFLOP/s": round(flops / us / 1e6, 1),
                 "err": round(err, 4)})  # fmt: skip
    print("   ", rows[-1])
    rows += prefill_whole_document()
    for block_m, block_n, warps, stages in [(None, None, None, None), (128, 64, 8, 2), (128, 64, 8, 3),
                                            (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2)]:  # fmt: skip
        config = None if block_n is None else KernelConfig(block_n, 1, warps, stages)
        try:
            _, cfg, fns = triton_run(layout, plan, q, kv, block_m=block_m, config=config)
            err = (fns[0]().float() - want.float()).abs().max().item()
            us = measure(fns)
        except Exception as exc:  # e.g. out of shared memory
            print("    prefill skip", block_m, config, type(exc).__name__, str(exc)[:120])
            continue
        rows.append({"method": "prefill_triton", "block_m": block_m, "us": round(us, 1),
                     "TFLOP/s": round(flops / us / 1e6, 1), "err": round(err, 4), "config": cfg.__dict__})  # fmt: skip
        print("   ", rows[-1])
    return rows


def prefill_whole_document() -> list[dict]:
    """An 8k document's one prefill chunk (8,192 queries, causal), each shape, q/k/v in the layouts a model's
    projections give ([1, N, H, D] transposed): the backend as a forward runs it, against Transformers' own
    `sdpa` attention (what `attn_implementation="sdpa"` runs: causal SDPA, then its output made contiguous)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        layout = build_layout([list(range(3, 3 + DOC))], 1)
        ids = SlotIds.from_layout(layout, torch.device("cuda"))
        q_slot = torch.arange(DOC, device="cuda")
        q = torch.randn(1, DOC, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(1, DOC, kv_heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2))  # fmt: skip
        module = torch.nn.Module().eval()
        module.is_causal, module.num_key_value_groups = True, heads // kv_heads
        flops = 4 * heads * dim * DOC * DOC / 2
        backend = TritonBackend()
        plan = backend.plan(Row(layout, ids, DOC, group=heads // kv_heads), q_slot)
        assert plan.runs and plan.run_tiles.num_tiles == 0
        ways = {"prefill_whole_hf_sdpa": functools.partial(_as_layer_output, sdpa_attention_forward, module, q, k, v),
                "prefill_whole_backend": functools.partial(_as_layer_output, backend.attention, module, q, k, v,
                                                           pp_plan=plan)}  # fmt: skip
        if kv_heads != heads:  # grouped query heads as K/V repeated per query head, not SDPA's enable_gqa
            ways["prefill_whole_sdpa_repeated"] = functools.partial(_as_layer_output, _sdpa_repeated, module, q, k, v)
        outs = {name: fn() for name, fn in ways.items()}
        times = {name: [] for name in ways}
        for _ in range(5):  # alternated, so a drift of the clocks shows in every way alike
            for name, fn in ways.items():
                times[name].append(measure([fn]))
        for name in ways:
            us = statistics.median(times[name])
            err = (outs[name].float() - outs["prefill_whole_hf_sdpa"].float()).abs().max().item()
            rows.append({"method": name, "shape": shape, "us": round(us, 1), "TFLOP/s": round(flops / us / 1e6, 1),
                         "us_all": [round(t, 1) for t in times[name]], "err": round(err, 4)})  # fmt: skip
            print("   ", rows[-1])
    return rows


def _sdpa_repeated(module, q, k, v, mask):
    """Causal SDPA with K/V repeated per query head: [1, N, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2), None


def _as_layer_output(attention, module, q, k, v, **kwargs) -> torch.Tensor:
    """An attention function's output as a model's layer takes it on: [1, N, H * D], contiguous."""
    return attention(module, q, k, v, None, **kwargs)[0].reshape(1, q.shape[2], -1).contiguous()


def keep(rows: list[dict], path: Path) -> None:
    """A sweep's newest row printed, and every row so far written to `path` (a later failure loses none)."""
    print("   ", rows[-1], flush=True)
    path.write_text(json.dumps(rows, indent=1))


def tile_sweep(out: Path, ceiling: float) -> list[dict]:
    """Streams per row tile against the own region's length: per layer µs of one decode step, every shape,
    64-256 streams, answers of 96-992 slots so far (own regions of 128-1024), 1-64 streams a tile."""
    rows = []
    for shape, streams, answer in itertools.product(SHAPES, (64, 128, 256), (96, 480, 992)):
        layout, plan, q, kv, step_bytes = decode_case(shape, streams, answer=answer)
        want = None
        for spt in (None, 32, 16, 8):
            tiles, cfg, fns = triton_run(layout, plan, q, kv, streams_per_tile=spt)
            got = fns[0]().float()
            want = got if want is None else want
            us = measure(fns)
            rows.append({"shape": shape, "streams": streams, "own": QUESTION + answer, "streams_per_tile": spt,
                         "us": round(us, 1), "of_copy_bw": round(step_bytes / (us * 1e-6) / ceiling, 3),
                         "tiles": tiles.num_tiles, "block_m": tiles.block_m, "config": cfg.__dict__,
                         "max_abs_diff_vs_default": round((got - want).abs().max().item(), 4)})  # fmt: skip
            keep(rows, out / "tiles.json")
        del kv
        torch.cuda.empty_cache()
    return rows


WHOLE_BLOCK_CASES = [  # (shape, streams, answer slots so far, the questions' prefill rather than a decode step)
    ("codellama-7b", 64, 96, False), ("codellama-7b", 256, 96, False), ("qwen2.5-7b", 64, 96, False),
    ("qwen2.5-7b", 256, 96, False), ("codellama-7b", 128, 992, False), ("qwen2.5-7b", 128, 992, False),
    ("codellama-7b", 64, 96, True), ("qwen2.5-7b", 64, 96, True),
]  # fmt: skip


def whole_blocks_ab(out: Path, ceiling: float) -> list[dict]:
    """The blocks every row sees whole run unmasked (the default) against every block masked
    (`KernelConfig(whole_blocks=False)`): per layer µs, each the median of 3 measurements alternated with the other."""
    rows = []
    for shape, streams, answer, prefill in WHOLE_BLOCK_CASES:
        layout, plan, q, kv, _ = decode_case(shape, streams, answer=answer, prefill=prefill)
        tiles, cfg, unmasked = triton_run(layout, plan, q, kv)
        runs = {
            True: unmasked,
            False: triton_run(layout, plan, q, kv, config=dataclasses.replace(cfg, whole_blocks=False))[2],
        }
        diff = (runs[True][0]().float() - runs[False][0]().float()).abs().max().item()
        times = {True: [], False: []}
        for _ in range(3):
            for whole, fns in runs.items():
                times[whole].append(measure(fns))
        unmasked, masked = statistics.median(times[True]), statistics.median(times[False])
        rows.append({"shape": shape, "streams": streams, "own_slots": QUESTION + answer,
                     "forward": "questions' prefill" if prefill else "decode step", "tiles": tiles.num_tiles,
                     "config": cfg.__dict__, "unmasked_whole_blocks_us": round(unmasked, 2),
                     "every_block_masked_us": round(masked, 2), "speedup": round(masked / unmasked, 3),
                     "samples_us": {"unmasked_whole_blocks": [round(t, 2) for t in times[True]],
                                    "every_block_masked": [round(t, 2) for t in times[False]]},
                     "max_abs_diff": diff, "copy_GBps": round(ceiling / 1e9)})  # fmt: skip
        keep(rows, out / "whole-blocks.json")
        del kv, runs
        torch.cuda.empty_cache()
    return rows


def question_prefill_sweep(out: Path) -> list[dict]:
    """The forward that prefills P questions of 6 tokens after an 8k document (the document's KV cached): per
    layer µs of the kernel's default tiles and launch against other tile sizes and KV splits."""
    rows = []
    for shape, streams in itertools.product(SHAPES, (64, 256)):
        heads, _, dim = SHAPES[shape]
        layout, plan, q, kv, _ = decode_case(shape, streams, answer=128, question=6, prefill=True, layers=4)
        q_slot = plan.q_slot
        want = None
        flops = 4 * heads * dim * len(q_slot) * DOC
        for block_m, config in [(None, None), (None, (64, 2, 4, 3)), (None, (64, 4, 4, 3)), (128, (64, 1, 8, 3)),
                                (128, (64, 2, 8, 3)), (128, (128, 1, 8, 2)), (64, (128, 1, 4, 2)),
                                (32, (64, 1, 4, 3))]:  # fmt: skip
            cfg = KernelConfig(*config) if config else None
            try:
                tiles, used, fns = triton_run(layout, plan, q, kv, block_m=block_m, config=cfg)
                got = fns[0]().float()
                want = got if want is None else want
                us = measure(fns)
            except Exception as exc:  # e.g. out of shared memory
                print("    skip", block_m, config, type(exc).__name__, str(exc)[:120])
                continue
            rows.append({"shape": shape, "streams": streams, "queries": len(q_slot), "block_m": tiles.block_m,
                         "tiles": tiles.num_tiles, "config": used.__dict__, "us": round(us, 1),
                         "TFLOP/s": round(flops / us / 1e6, 1),
                         "max_abs_diff_vs_default": round((got - want).abs().max().item(), 4)})  # fmt: skip
            keep(rows, out / "question-prefill.json")
        del kv
        torch.cuda.empty_cache()
    return rows


OWN_SWEEP = [(None, None)] + [  # (own streams per tile, (block_n, splits, warps, stages)); None: the default
    (spt, cfg) for spt in (16, 8, 32) for cfg in ((64, 1, 4, 3), (64, 2, 4, 3), (64, 4, 4, 3), (64, 2, 8, 3),
                                                  (64, 2, 4, 4), (32, 2, 4, 3), (128, 2, 8, 2), (32, 4, 4, 4))
]  # fmt: skip


def own_sweep(out: Path, ceiling: float, deadline: float) -> list[dict]:
    """The own plan's tiles and launch (`TritonBackend(own_tiles=...)`, overlapped with the shared plan at its
    default) against own regions of 512 and 1,024 slots: per layer µs of one decode step, CodeLlama's shape
    (the one `own_tiles="auto"` splits), 128 and 256 streams; the one plan and the default split first."""
    rows = []
    for streams, answer in ((128, 480), (128, 992), (256, 480)):
        layout, plan, q, kv, step_bytes = decode_case("codellama-7b", streams, answer=answer)
        group = q.shape[1] // kv[0][0].shape[1]
        shared = build_tile_plan(layout, plan.q_slot, group, device="cuda", part="shared")
        res = {"streams": streams, "own": QUESTION + answer}
        _, _, fns = triton_run(layout, plan, q, kv)
        want = fns[0]().float()
        res["one_plan_us"] = round(measure(fns), 1)
        print("   ", res, flush=True)
        out_t = torch.empty(1, q.shape[2], q.shape[1], q.shape[3], device="cuda", dtype=q.dtype)
        for spt, config in OWN_SWEEP:
            if time.time() > deadline:
                break
            own = build_tile_plan(layout, plan.q_slot, group, None, spt or own_streams_per_tile(group), "cuda",
                                  part="own")  # fmt: skip
            cfg = KernelConfig(*config) if config else own_launch_config(q, kv[0][0], own)
            fns = [functools.partial(stream_attention, q, k, v, plan, shared, out=out_t, own=own, overlap=True,
                                     own_config=cfg) for k, v in kv]  # fmt: skip
            try:
                got = fns[0]().float()
                us = measure(fns)
            except Exception as exc:  # e.g. out of shared memory
                print("    skip", spt, config, type(exc).__name__, str(exc)[:120])
                continue
            rows.append({**res, "own_streams_per_tile": spt, "own_tiles": own.num_tiles, "own_config": cfg.__dict__,
                         "default": config is None, "us": round(us, 1),
                         "of_copy_bw": round(step_bytes / (us * 1e-6) / ceiling, 3),
                         "max_abs_diff_vs_one_plan": round((got - want).abs().max().item(), 4)})  # fmt: skip
            keep(rows, out / "own.json")
        del kv
        torch.cuda.empty_cache()
    return rows


DENSE_CASES = [  # (shape, streams, answer slots so far): 128-token answers at 64 and 256 streams, 1,024 at 128
    ("qwen2.5-7b", 64, 96), ("qwen2.5-7b", 256, 96), ("codellama-7b", 64, 96), ("codellama-7b", 256, 96),
    ("qwen2.5-7b", 128, 992), ("codellama-7b", 128, 992),
]  # fmt: skip
DENSE_KERNELS = ("flash", "cudnn", "efficient")


def dense_document_ab(out: Path, ceiling: float, deadline: float) -> list[dict]:
    """The document of a decode step (8,192 keys every query sees) through PyTorch's dense attention kernels
    against the Triton kernel's packed tiles, per layer µs: the whole attention (one plan; the shared and own
    plans, as `own_tiles` runs them), then the document's part alone (the shared plan; 128-row tiles and 8 warps;
    each dense kernel with a KV head's query heads folded into its rows, also over 2 and 4 KV splits as a batch,
    to see whether filling the GPU pays)."""
    rows = []
    for shape, streams, answer in DENSE_CASES:
        if time.time() > deadline:
            break
        layout, plan, q, kv, step_bytes = decode_case(shape, streams, answer=answer)
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a model's layout: [1, N, H, D] seen as [1, H, N, D]
        heads, kv_heads, dim = SHAPES[shape]
        group = heads // kv_heads
        base = {"shape": shape, "streams": streams, "own": QUESTION + answer}
        doc_flops = 4 * heads * dim * len(plan.q_slot) * DOC
        want = sdpa_run(plan, q, kv[:1])[0]().float()
        shared = build_tile_plan(layout, plan.q_slot, group, device="cuda", part="shared")  # all live: the document
        own = build_tile_plan(layout, plan.q_slot, group, None, own_streams_per_tile(group), "cuda", part="own")
        out_t = torch.empty(1, q.shape[2], heads, dim, device="cuda", dtype=q.dtype)

        case = {"base": base, "want": want, "step_bytes": step_bytes, "doc_flops": doc_flops, "ceiling": ceiling}
        add = functools.partial(_add_dense_row, rows, out / "dense-document.json", case)
        add("triton", triton_run(layout, plan, q, kv)[2])
        add("triton_split", [functools.partial(stream_attention, q, k, v, plan, shared, out=out_t, own=own,
                                               overlap=True) for k, v in kv])  # fmt: skip
        add("document_triton_shared", [functools.partial(stream_attention, q, k, v, plan, shared, out=out_t)
                                       for k, v in kv], whole=False)  # fmt: skip
        wide = build_tile_plan(layout, plan.q_slot, group, 128, device="cuda", part="shared")
        cfg = default_config(q, kv[0][0], wide)
        add("document_triton_shared_128x8", [functools.partial(
            stream_attention, q, k, v, plan, wide, out=out_t, config=KernelConfig(64, cfg.num_splits, 8, 3))
            for k, v in kv], whole=False)  # fmt: skip
        for kernel in DENSE_KERNELS:
            for splits in (1, 2, 4):
                name = f"document_{kernel}" + (f"_{splits}_splits" if splits > 1 else "")
                add(name, [functools.partial(_dense_document, kernel, q, k, v, splits) for k, v in kv], whole=False)
        del kv
        torch.cuda.empty_cache()
    return rows


def _add_dense_row(rows: list[dict], path: Path, case: dict, name: str, fns, whole: bool = True) -> None:
    """`dense_document_ab`'s row of `fns` (whole: the whole attention, `row`'s bandwidth and error against the
    reference; else the document's part, its rate)."""
    try:
        err = (fns[0]().float() - case["want"]).abs().max().item() if whole else None
        us = measure(fns)
    except Exception as exc:  # a kernel that does not take the shape, or is not captured in a graph
        rows.append({**case["base"], "method": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    else:
        if whole:
            rows.append({**case["base"], **row(name, us, case["step_bytes"], case["ceiling"], err)})
        else:
            rows.append({**case["base"], "method": name, "us": round(us, 1),
                         "document_TFLOP/s": round(case["doc_flops"] / us / 1e6)})  # fmt: skip
    keep(rows, path)


def _dense_document(kernel: str, query, key, value, splits: int) -> torch.Tensor:
    """The document's keys (slots [0, DOC)) by PyTorch's dense `kernel`, cut into `splits` equal parts as a batch
    of one call, a KV head's query heads folded into its rows (q [splits, H_kv, group * N, D]): the timing only,
    the parts' outputs and log-sum-exps left unmerged."""
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(1, kv_heads, heads // kv_heads * n, dim).expand(splits, -1, -1, -1)
    part = DOC // splits
    k, v = (t.as_strided((splits, kv_heads, part, dim), (part * t.stride(2), t.stride(1), t.stride(2), 1))
            for t in (key, value))  # fmt: skip
    scale = dim**-0.5
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[0]
    if kernel == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[0]


def write_summary(out: Path, results: dict) -> None:
    lines = [f"# Triton kernel GPU check\n\ndevice: {results['device']}, copy bandwidth "
             f"{results['copy_GBps']} GB/s\n\npytest: {results['tests']}\n",
             "| workload | method | us | GB/s | of copy bw | err | tiles | block_m | config |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, rows in results["decode"].items():
        for r in rows:
            lines.append(f"| {name} | {r['method']} | {r['us']} | {r['GB/s']} | {r['of_copy_bw']} | "
                         f"{r.get('max_abs_err_vs_sdpa', '')} | {r.get('tiles', '')} | {r.get('block_m', '')} | "
                         f"{r.get('config', '')} |")  # fmt: skip
    lines += ["", "prefill:", *[str(r) for r in results.get("prefill", [])]]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_kernel_check")
    parser.add_argument("--test-timeout", type=int, default=170)
    parser.add_argument("--budget", type=int, default=330, help="seconds for the whole script (sweeps stop early)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--tiles", action="store_true", help="only the streams-per-tile sweep (tiles.json)")
    parser.add_argument("--prefill", action="store_true", help="only the document prefill lines (prefill.json)")
    parser.add_argument("--question-prefill", action="store_true",
                        help="only the questions' prefill sweep (question-prefill.json)")  # fmt: skip
    parser.add_argument("--own", action="store_true", help="only the own plan's sweep (own.json)")
    parser.add_argument(
        "--dense-document",
        action="store_true",
        help="only the document through dense kernels against the packed tiles (dense-document.json)",
    )
    parser.add_argument(
        "--whole-blocks",
        action="store_true",
        help="only the unmasked whole blocks against every block masked (whole-blocks.json)",
    )
    args = parser.parse_args()
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiles:
        tile_sweep(args.out, copy_bandwidth())
        return
    if args.question_prefill:
        question_prefill_sweep(args.out)
        return
    if args.whole_blocks:
        whole_blocks_ab(args.out, copy_bandwidth())
        return
    if args.own:
        own_sweep(args.out, copy_bandwidth(), start + args.budget)
        return
    if args.dense_document:
        dense_document_ab(args.out, copy_bandwidth(), start + args.budget)
        return
    if args.prefill:
        (args.out / "prefill.json").write_text(json.dumps(bench_prefill(), indent=1))
        return
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    results["tests"] = "skipped" if args.skip_tests else run_tests(args.out, args.test_timeout)
    results["copy_GBps"] = round(copy_bandwidth() / 1e9)
    print("copy bandwidth", results["copy_GBps"], "GB/s")
    ceiling = results["copy_GBps"] * 1e9
    results["decode"] = {}
    workloads = list(itertools.product(SHAPES, (64, 256)))
    for i, (shape, streams) in enumerate(workloads):
        left = start + args.budget - 45 - time.time()  # keep 45 s for the prefill lines
        deadline = time.time() + left / (len(workloads) - i) - 15  # an even share of what is left to each sweep
        name = f"{shape}/P={streams}"
        results["decode"][name] = bench_workload(shape, streams, ceiling, deadline, not args.no_sweep)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        torch.cuda.empty_cache()
    results["prefill"] = bench_prefill()
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_summary(args.out, results)
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
