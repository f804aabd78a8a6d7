"""Where a corpus call's rounds spend their time: wall time against the GPU's time in the forwards.

    python eval/diagnostics/round_profile.py --model codellama-7b --max-memory 24GB --docs 4 --questions 64 --out $OUT

The workload of `eval/corpus_bench.py` (4k-token documents, answers of 16-512 tokens forced
through EOS) through one call with continuous refill and one in static waves.  Every forward
(captured decode step or eager round) is bracketed by CUDA events, so its GPU time is known
without a profiler's overhead; wall time less that is the host's share of a round (planning,
admission, generate's processors, the round's one sync), and the host's parts are timed on their own
(`HostTimer`: admission, the cohorts' choices, plan refreshes, captures, eager forwards), and so are
the kernel builds inside them (`CompileTimer`: Triton's and dynamo's).  Then
`torch.profiler` over a window of `--profile-rounds` rounds of each gives the GPU time by kernel group
(attention, GEMM, other).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import sys
import threading
import time
from pathlib import Path

import torch
import transformers
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from corpus_bench import BOOK, SHAPES, ForcedLength, workload  # noqa: E402
from profile_step import group_of  # noqa: E402

import hf_parallel  # noqa: E402
from hf_parallel.attention.triton import TritonStaticPlan  # noqa: E402
from hf_parallel.decoding import logits  # noqa: E402
from hf_parallel.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from hf_parallel.engine.refill import Cohort, RefillLoop  # noqa: E402
from hf_parallel.engine.runner import Runner  # noqa: E402


class Patched:
    """While entered, each method of `PARTS` (part name -> (class, method name)) is replaced by `_wrap(part,
    original)`; on exit the originals come back."""

    PARTS: dict[str, tuple[type, str]] = {}

    def __enter__(self):
        self.originals = {part: getattr(*where) for part, where in self.PARTS.items()}
        for part, (owner, name) in self.PARTS.items():
            setattr(owner, name, self._wrap(part, self.originals[part]))
        return self

    def __exit__(self, *exc):
        for part, (owner, name) in self.PARTS.items():
            setattr(owner, name, self.originals[part])

    def _wrap(self, part: str, original):
        raise NotImplementedError


class ForwardTimer(Patched):
    """CUDA events around every captured step's replay and every eager `Runner.forward`: the GPU time of a round's
    forward, the host's work before it (planning) not counted."""

    PARTS = {"forward": (Runner, "forward"), "replay": (torch.cuda.CUDAGraph, "replay")}

    def __init__(self):
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _wrap(self, part, original):
        def timed(obj, *args, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                return original(obj, *args, **kwargs)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return original(obj, *args, **kwargs)
            finally:
                stop.record()
                self.events.append((start, stop))

        return timed

    def gpu_ms(self) -> float:
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events)


class HostTimer(Patched):
    """Wall time and calls of the host's parts of a round (nested parts count in each): the engine's admission
    (with the row's snapshot), each cohort's choice of tokens (generate's processors, launched), a captured step's
    plan refresh, a step's capture (its warm-up forward included) and the eager forwards (admitting rounds)."""

    PARTS = {
        "admit": (RefillLoop, "_admit"),
        "choose": (Cohort, "choose"),
        "plan_update": (TritonStaticPlan, "update"),
        "capture": (DecodeGraphs, "_capture"),
        "eager_forward": (Runner, "forward"),
    }

    def __init__(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.calls = dict.fromkeys(self.PARTS, 0)

    def _wrap(self, part, original):
        def timed(obj, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        return timed

    def report(self) -> dict:
        return {f"host_{part}": {"s": round(self.seconds[part], 3), "calls": self.calls[part]} for part in self.PARTS}


class CompileTimer(HostTimer):
    """Wall time and count of Triton's kernel builds in this process (`JITFunction._do_compile`: a build from
    source or a load from Triton's disk cache), on the thread that made the timer, by kernel, and on other threads
    (`hf_parallel.kernels.prebuild`' builders: their seconds overlap each other's and the caller's); and of dynamo's
    compilations (its own `compilation_time_metrics`, whose entries nest, so only the outermost,
    `_compile.compile_inner`, is summed)."""

    PARTS = {"triton_build": (triton.runtime.jit.JITFunction, "_do_compile")}
    if not hasattr(triton.runtime.jit.JITFunction, "_do_compile"):  # Triton before 3.3: builds not itemized
        PARTS = {}

    def __init__(self):
        super().__init__()
        self.kernels: dict[str, int] = {}
        self.caller = threading.get_ident()
        self.seconds["triton_build_beside"], self.calls["triton_build_beside"] = 0.0, 0

    def __enter__(self):
        self.dynamo = len(torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", []))
        return super().__enter__()

    def _wrap(self, part, original):
        here, beside = super()._wrap(part, original), super()._wrap(f"{part}_beside", original)

        def named(obj, *args, **kwargs):
            if threading.get_ident() != self.caller:
                return beside(obj, *args, **kwargs)
            self.kernels[obj.__name__] = self.kernels.get(obj.__name__, 0) + 1
            return here(obj, *args, **kwargs)

        return named

    def report(self) -> dict:
        dynamo = torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", [])[self.dynamo :]
        builds = {"s": round(self.seconds.get("triton_build", 0.0), 3), "calls": self.calls.get("triton_build", 0)}
        beside = {"s": round(self.seconds["triton_build_beside"], 3), "calls": self.calls["triton_build_beside"]}
        return {"triton_builds": {**builds, "kernels": self.kernels}, "triton_builds_on_threads": beside,
                "dynamo_compiles": {"s": round(sum(dynamo), 3), "calls": len(dynamo)}}  # fmt: skip


@contextlib.contextmanager
def gathered():
    """generate's processors of a group holding every row run as for several groups: the rows' scores gathered,
    processed and scattered back (the ablation of `Processing`'s whole-group calls)."""
    saved = logits.whole_group
    logits.whole_group = lambda rows: None
    try:
        yield
    finally:
        logits.whole_group = saved


def timed_call(model, prompts, targets, **options) -> dict:
    processor = ForcedLength(len(prompts[0]), 2)
    torch.cuda.synchronize()
    with ForwardTimer() as timer, HostTimer() as host, CompileTimer() as builds:
        start = time.perf_counter()
        out = hf_parallel.generate_tokens(model, prompts, max_new_tokens=max(targets), eos_token_id=2,
                                          logits_processor=[processor], progress=False, **options)  # fmt: skip
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        gpu = timer.gpu_ms() / 1e3
    assert [len(a) for a in out] == targets
    rounds = len(timer.events)
    return {"wall_s": round(wall, 3), "forward_gpu_s": round(gpu, 3), "rounds": rounds,
            "wall_ms_per_round": round(1e3 * wall / rounds, 2), "gpu_ms_per_round": round(1e3 * gpu / rounds, 2),
            "tokens_per_s": round(sum(targets) / wall), **host.report(), **builds.report()}  # fmt: skip


def profiled_rounds(model, prompts, targets, rounds: int, skip: int, **options) -> dict:
    """GPU ms per round by kernel group over rounds [skip, skip + rounds) of a streamed call."""
    processor = ForcedLength(len(prompts[0]), 2)
    with ForwardTimer() as timer:
        answers = hf_parallel.stream_tokens(model, prompts, max_new_tokens=max(targets), eos_token_id=2,
                                            logits_processor=[processor], progress=False, **options)  # fmt: skip
        prof, first, start = None, 0, 0.0
        for _ in answers:
            if prof is None and len(timer.events) >= skip:
                torch.cuda.synchronize()
                prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                prof.__enter__()
                first, start = len(timer.events), time.perf_counter()
            if prof is not None and len(timer.events) - first >= rounds:
                break
        torch.cuda.synchronize()
        wall, done = time.perf_counter() - start, len(timer.events) - first
        prof.__exit__(None, None, None)
        answers.close()
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            groups[group_of(event.key)] = groups.get(group_of(event.key), 0.0) + event.device_time_total
    return {"profiled_rounds": done, "wall_ms_per_round_profiled": round(1e3 * wall / done, 2),
            **{f"{g}_ms_per_round": round(us / 1e3 / done, 2) for g, us in sorted(groups.items())}}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="codellama-7b")
    parser.add_argument("--book", type=Path, default=BOOK)
    parser.add_argument("--doc", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--max-memory", default="24GB", help="the row's budget; \"gpu\": the GPU's free memory")
    parser.add_argument("--profile-rounds", type=int, default=100)
    parser.add_argument(
        "--modes",
        default="refill,waves",
        help="refill, waves, refill-gathered (refill, each cohort's processors on gathered rows)",
    )
    parser.add_argument("--repeat", type=int, default=1, help='timed runs of each mode (the later as "refill again")')
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="", help="suffix of the output file's name")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - {"refill", "refill-gathered", "waves"}
    if unknown:  # any other name would run as refill
        parser.error(f"--modes takes refill, refill-gathered and waves; not {', '.join(sorted(unknown))}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(SHAPES[args.model](), dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    book = [hash(w) % (vocab - 3) + 3 for w in gzip.open(args.book, "rt", encoding="utf-8-sig").read().split()]
    prompts, targets = workload(book, args.docs, args.doc, args.questions, lambda rng: rng.randint(16, 512), 2, vocab)
    common = dict(max_memory=None if args.max_memory == "gpu" else args.max_memory)
    timed_call(model, prompts[:64], targets[:64], **common)  # warm-up
    report = {"model": args.model, "docs": args.docs, "questions": args.questions, "max_memory": args.max_memory}
    for mode in args.modes.split(","):
        options = dict(common, refill=mode != "waves")
        for again in range(args.repeat):  # later runs: kernels compiled, steps captured
            label = mode + " again" * again
            with gathered() if mode == "refill-gathered" else contextlib.nullcontext():
                report[label] = timed_call(model, prompts, targets, **options)
            print(label, json.dumps(report[label]), flush=True)
        if args.profile_rounds:
            report[mode].update(profiled_rounds(model, prompts, targets, args.profile_rounds, 200, **options))
            print(mode, json.dumps(report[mode]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"round-profile-{args.model}{args.tag}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
