"""What the first call on a new model costs over the calls after it: Triton's kernel builds, CUDA-graph capture and
torch.compile (of the layers' norms and MLPs by default, of the whole step with `compile=True`), each in a fresh
process.

    python eval/diagnostics/first_call.py --model codellama-7b --compile auto false true --out $OUT/first-call.json
    python eval/diagnostics/first_call.py --model codellama-7b --compile auto true --out $OUT/first-call-again.json

Each `--compile` value runs in a process of its own (started by this script), so nothing of one is warm in the next
but what lies on disk: Triton's kernel cache and torch.compile's caches (Inductor's FX graph and AOTAutograd caches,
on by default), which a second run of the script finds.  In each process: `calls` calls of
`hf_parallel.generate_tokens` on the same prompts (benchmark's workload: a War and Peace slice, forced answer
tokens, random bf16 weights of the shape), each timed; the first call's overhead is its time less the best of the
others, with what the first call built (`first_call_builds`: Triton's builds on the calling thread, those on threads
beside it, and Dynamo's compilations, count and seconds).  Prints and writes one JSON row per process.
`--no-prebuild` measures with every kernel built at its first launch, on the calling thread, not on threads before
it (`ModelRunner.prebuild`); `--no-early-import` with Inductor's compiler imported at the first `torch.compile`, not
beside the support probe (`compiled_parts.import_compiler`); `--prefill-apart` with a prefill chunk's q, k and v each
a tensor of its own (`Tuning(prefill_columns=False)`, bench's `pp_prefill_apart`: the rotary embedding compiles a
second graph, for the decode steps' strides); `--profile N` adds the first call's cProfile (top N functions by
cumulative time; it slows Python-heavy work).

The first call imports Inductor, so it also pays Python's compilation of Inductor's modules to bytecode where no
bytecode cache can be written (`PYTHONDONTWRITEBYTECODE=1`, as on some shared machines): each row says whether one
is (`python_bytecode_cache`).  An installed package has its bytecode compiled at install time; to measure as a
user's install runs, give Python a writable cache (`PYTHONPYCACHEPREFIX`) and fill it once with `python -m
compileall` over the installed packages before the first run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMPILE = {"auto": "auto", "layers": "layers", "true": True, "false": False}  # --compile values: generate's option
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name


class CompileTimer:
    """Wall time and count of Triton's kernel builds in this process (`JITFunction._do_compile`: a build from
    source or a load from Triton's disk cache), on the thread that made the timer, by kernel, and on other threads
    (`hf_parallel.kernels.prebuild`'s builders: their seconds overlap each other's and the caller's); and of dynamo's
    compilations (its own `compilation_time_metrics`, whose entries nest, so only the outermost,
    `_compile.compile_inner`, is summed)."""

    def __init__(self):
        import triton

        self.jit = triton.runtime.jit.JITFunction
        self.caller, self.kernels = threading.get_ident(), {}
        self.seconds, self.calls = {"here": 0.0, "beside": 0.0}, {"here": 0, "beside": 0}

    def __enter__(self):
        self.dynamo = len(torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", []))
        self.original = getattr(self.jit, "_do_compile", None)
        if self.original is not None:  # Triton before 3.3: builds not itemized
            timer, original = self, self.original

            def timed(fn, *args, **kwargs):
                where = "here" if threading.get_ident() == timer.caller else "beside"
                if where == "here":
                    timer.kernels[fn.__name__] = timer.kernels.get(fn.__name__, 0) + 1
                start = time.perf_counter()
                try:
                    return original(fn, *args, **kwargs)
                finally:
                    timer.seconds[where] += time.perf_counter() - start
                    timer.calls[where] += 1

            self.jit._do_compile = timed
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            self.jit._do_compile = self.original

    def report(self) -> dict:
        dynamo = torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", [])[self.dynamo :]
        here = {"s": round(self.seconds["here"], 3), "calls": self.calls["here"], "kernels": self.kernels}
        beside = {"s": round(self.seconds["beside"], 3), "calls": self.calls["beside"]}
        return {"triton_builds": here, "triton_builds_on_threads": beside,
                "dynamo_compiles": {"s": round(sum(dynamo), 3), "calls": len(dynamo)}}  # fmt: skip


def one_process(args) -> dict:
    import torch._dynamo.utils
    from bench import BOOK, Workload, book_tokens, build_model, make_prompts

    import hf_parallel

    device, compiled = torch.device(args.device), COMPILE[args.compile[0]]  # a child runs one setting
    if args.no_prebuild:  # the ablation: each kernel built at its first launch, on the calling thread
        from hf_parallel.runner.model_runner import ModelRunner

        ModelRunner.prebuild = lambda self, inputs, decode_streams=0: []
    if args.no_early_import:  # the ablation: Inductor's compiler imported at the first torch.compile, not beside
        from hf_parallel.frontends import generate  # the support probe

        generate.import_compiler = lambda: None
    # the ablation: a prefill chunk's q, k and v tensors of their own (bench's pp_prefill_apart)
    tuning = {"tuning": hf_parallel.Tuning(prefill_columns=False)} if args.prefill_apart else {}
    model = build_model(args.model, device)
    vocab = model.config.vocab_size
    work = Workload("first call", args.doc, args.questions, args.answer_tokens)
    encode = lambda s: [hash(w) % (vocab - 3) + 3 for w in s.split()]  # noqa: E731
    prompts = make_prompts(book_tokens(None, vocab, args.book or BOOK), work, 0, encode, vocab)
    times, builds, profile = [], {}, None
    for call in range(args.calls):
        torch.cuda.synchronize() if device.type == "cuda" else None
        start = time.perf_counter()
        profiled = cProfile.Profile() if args.profile and not call else contextlib.nullcontext()
        with CompileTimer() as timer, profiled as prof:
            out = hf_parallel.generate_tokens(model, prompts, max_new_tokens=args.answer_tokens, eos_token_id=[],
                                              compile=compiled, progress=False, **tuning)  # fmt: skip
            torch.cuda.synchronize() if device.type == "cuda" else None
        times.append(time.perf_counter() - start)
        assert all(len(o) == args.answer_tokens for o in out)
        if not call:
            builds = timer.report()
            if prof is not None:
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.profile)
                profile = text.getvalue()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    steady = min(times[1:])
    return dict(model=args.model, doc=args.doc, questions=args.questions, answer_tokens=args.answer_tokens,
                compile=compiled, prebuild=not args.no_prebuild, early_import=not args.no_early_import,
                prefill_apart=args.prefill_apart, call_s=[round(t, 3) for t in times],
                steady_s=round(steady, 3),
                first_call_overhead_s=round(times[0] - steady, 3), compiled_graphs=graphs, first_call_builds=builds,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                python_bytecode_cache=bool(sys.pycache_prefix) or not sys.dont_write_bytecode,
                **({"first_call_profile": profile} if profile else {}))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="codellama-7b")
    parser.add_argument("--doc", type=int, default=8192)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--compile", nargs="+", choices=sorted(COMPILE), default=["auto", "true"],
                        help="auto: the default; true: compile=True; false: nothing compiled")  # fmt: skip
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--book", type=Path, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0,
                        help="profile the first call (cProfile, which slows Python-heavy work) and keep this many "
                             "of its functions by cumulative time")  # fmt: skip
    parser.add_argument("--no-prebuild", action="store_true",
                        help="the ablation: build each kernel at its first launch, not on threads before it "
                             "(`ModelRunner.prebuild`)")  # fmt: skip
    parser.add_argument("--no-early-import", action="store_true",
                        help="the ablation: import Inductor's compiler at the first torch.compile, not on a thread "
                             "beside the support probe (`compiled_parts.import_compiler`)")  # fmt: skip
    parser.add_argument(
        "--prefill-apart",
        action="store_true",
        help="the ablation: a prefill chunk's q, k and v each a tensor of its own, not columns "
        "of one output (`Tuning(prefill_columns=False)`): rotary compiles twice",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args)), flush=True)
        return
    rows = []
    for value in args.compile:
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--doc", str(args.doc), "--questions",
               str(args.questions), "--answer-tokens", str(args.answer_tokens), "--compile", value, "--calls",
               str(args.calls), "--device", args.device, "--profile", str(args.profile)]  # fmt: skip
        cmd += ["--book", str(args.book)] if args.book else []
        cmd += ["--no-prebuild"] if args.no_prebuild else []
        cmd += ["--no-early-import"] if args.no_early_import else []
        cmd += ["--prefill-apart"] if args.prefill_apart else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        row = (
            json.loads(lines[-1])
            if proc.returncode == 0 and lines
            else dict(compile=COMPILE[value], error=proc.stderr[-2000:])
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
