"""The host's time in each phase of one call, unprofiled: where a call's wall time goes beyond the GPU's.

    python eval/diagnostics/host_phases.py --model codellama-7b --doc 8192 16384 --questions 64 256 --new-tokens 1 128

Wraps the functions on `generate_tokens`' path (the input checks, the prefix tree, the runner's setup, its plans,
the prefill and decode loops, and the contexts a call enters) with `perf_counter` timers, runs each call
`--repeats` times after a warm-up at full length (through a `Session`, as bench.py's PP rows run), and prints the
phases of the fastest run: each one's total, its count, and when it first started after the call began.  Host time
only: a phase that launches GPU work returns before the GPU has run it, and one that copies from the GPU waits for
it.  Before the first launch the GPU has nothing to do, so everything the host does until the prefill's first
forward is time the GPU idles.  Random-weight 7B shapes on the GPU (bench.py's); `--model tiny` is a small random
Llama (a smoke run, on the CPU too).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from bench import build_model, generate, timed  # noqa: E402

from hf_parallel import Session  # noqa: E402
from hf_parallel.decoding import generate_request, logits, options  # noqa: E402
from hf_parallel.engine import generate as call  # noqa: E402
from hf_parallel.engine import patching, runner  # noqa: E402
from hf_parallel.models import projections  # noqa: E402

FUNCTIONS = (  # (owner, attribute): each call of it is one entry of its phase
    (call, "check_model"), (call, "as_token_lists"), (options.GenerationOptions, "resolve"),
    (generate_request.GenerateRequest, "prepare"), (call, "check_length"), (call, "build_layout"),
    (call, "in_vocabulary"), (call, "check_support"), (call, "row_budget"),
    (runner.Runner, "__init__"), (runner, "placement"), (projections, "sibling_groups"),
    (runner.Runner, "prefill_chunks"), (runner.Runner, "prebuild_prefill"), (runner.Runner, "prebuild_step"),
    (runner.Runner, "prefill"), (runner.Runner, "decode"), (logits.Processing, "for_layout"),
)  # fmt: skip
CONTEXTS = ((runner, "use_model"), (patching, "use_attention"), (patching, "fused"), (patching, "grouped"))


class Phases:
    """Per phase: total seconds, calls, and the first call's start after `begin()`."""

    def __init__(self):
        self.begin()

    def begin(self) -> None:
        self.start, self.total, self.count, self.first = time.perf_counter(), defaultdict(float), defaultdict(int), {}

    def add(self, name: str, start: float, end: float) -> None:
        self.total[name] += end - start
        self.count[name] += 1
        self.first.setdefault(name, start - self.start)

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, start, time.perf_counter())

        return wrapper

    def timed_context(self, name: str, fn):
        @contextlib.contextmanager
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            with contextlib.ExitStack() as stack:
                stack.enter_context(fn(*args, **kwargs))
                self.add(f"{name} enter", start, time.perf_counter())
                try:
                    yield
                finally:
                    start = time.perf_counter()
            self.add(f"{name} exit", start, time.perf_counter())

        return wrapper

    @contextlib.contextmanager
    def installed(self):
        """For the block, every phase's function timed (restored after)."""
        with contextlib.ExitStack() as stack:
            for owner, attr in FUNCTIONS:
                raw = inspect.getattr_static(owner, attr)
                name = f"{owner.__name__.rpartition('.')[2]}.{attr}"  # its owner, then itself
                if isinstance(raw, classmethod):
                    patched = classmethod(self.timed(name, raw.__func__))
                else:
                    patched = self.timed(name, raw)
                stack.enter_context(mock.patch.object(owner, attr, patched))
            for owner, attr in CONTEXTS:
                stack.enter_context(mock.patch.object(owner, attr, self.timed_context(attr, getattr(owner, attr))))
            yield

    def rows(self) -> list[dict]:
        return [dict(phase=k, ms=round(v * 1e3, 2), calls=self.count[k], first_ms=round(self.first[k] * 1e3, 1))
                for k, v in sorted(self.total.items(), key=lambda kv: self.first[kv[0]])]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="codellama-7b", help="a bench.py shape (tiny: a smoke run)")
    parser.add_argument("--doc", type=int, nargs="+", default=[8192])
    parser.add_argument("--questions", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--question-tokens", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write phases.json here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, device)
    attn = "triton" if device.type == "cuda" else "reference"
    vocab, rng, session, report = model.config.vocab_size, random.Random(0), Session(model), []
    for doc_len in args.doc:
        doc = [rng.randrange(3, vocab) for _ in range(doc_len)]
        for n in args.questions:
            prompts = [doc + [rng.randrange(3, vocab) for _ in range(args.question_tokens)] for _ in range(n)]
            run = functools.partial(generate, model, prompts, options=dict(attn=attn), session=session)
            run(max_new_tokens=max(args.new_tokens))  # kernels built, graphs captured, parts compiled
            for tokens in args.new_tokens:
                best = None
                for _ in range(args.repeats):
                    phases = Phases()
                    with phases.installed():  # the call's wall from the GPU idle to the GPU done, as bench.py's
                        wall, _ = timed(lambda p=phases, go=run, t=tokens: (p.begin(), go(max_new_tokens=t)))
                    if best is None or wall < best[0]:
                        best = (wall, phases.rows())
                row = dict(model=args.model, doc=doc_len, questions=n, new_tokens=tokens,
                           wall_ms=round(best[0] * 1e3, 1), phases=best[1])  # fmt: skip
                report.append(row)
                print(f"\n{args.model} {doc_len} x {n}q, {tokens} new tokens: wall {row['wall_ms']} ms (the fastest of "
                      f"{args.repeats}); phases by first start:")  # fmt: skip
                for p in row["phases"]:
                    print(f"  +{p['first_ms']:8.1f} ms  {p['ms']:9.2f} ms  {p['calls']:5d}x  {p['phase']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "phases.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
