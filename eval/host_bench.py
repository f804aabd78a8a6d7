"""The engine core's host time on the CPU: every part of a round but the model's forward, beside another copy.

The model runner's forward is replaced by one that costs nothing: `ModelRunner.forward(inputs)` returns rows of a
tensor of random logits made once per vocabulary ([rows kept, vocab]: a view, sliced at an offset that moves each
call, so that a stream's tokens change round by round and a change of schedule shows as a change of answers).  What
is left is the engine core's round (schedule -> forward -> choose -> update, `hf_parallel/engine/core.py`): the
admission policy, the scheduler's feed, the row's relayout, the choice groups' argmax and EOS test, the read on the
host and the events, plus each call's setup (input checks, prefix tree, sizing, the row's cache).  On the CPU the
"device" work (argmax over the vocabulary, `isin`, the index copies) runs on the host too: with a real vocabulary
(`--vocabs 32000`, Llama's) it is part of the figure (on a slow core, most of it); a small one (256) leaves mostly
the Python.

The forward is replaced on the class, for the duration of one run (`replaced_forward`; the class's own function is
put back after the run, whatever happens), and each package's run replaces its own package's `ModelRunner.forward`.
The model is a tiny random-weight Llama (2 layers, 64 wide, the vocabulary asked for) that goes through the real
setup path: the support probe (each package's, run before any forward is replaced) and the packed row.

Workloads (`--workloads`), each at every `--streams` N, greedy, no EOS (eos_token_id=[]):
    row       `generate_tokens`: one document of 512 tokens and N questions of 8-16 tokens, `--new` new tokens each,
              all at once in one row.
    refill    `generate_tokens` on 2N questions, 16 per document of 256 tokens, under the smallest `max_memory` (to
              5%) whose row (`size_row`) takes N streams and the slots of the first N prompts, so that documents
              wait and join as streams finish.  Answers of 32 to `--new` tokens: one `max_length` for the call and
              questions of different lengths (a stream's limit is max_length less its prompt).
    arrivals  the serving engine (`hf_parallel.frontends.serving.Engine`, max_streams N, a `max_memory` found the same
              way): 2N requests over ceil(N / 16) shared system prompts of 256 tokens, each with a question of 16
              tokens and its own max_new_tokens (16 to `--new`), from N closed-loop clients (each sends its next
              request when its last is done), so that requests arrive while others decode.  The first N are
              queued at once under the engine's lock (`Engine._wake`, a private name), so that both packages run
              the same rounds.  The engine's thread checks each request as it arrives (its options resolved and
              generate's lists prepared): that time counts too, the first N requests' in the setup.

Each (vocabulary, workload, N) runs `--repeats` times per package, alternated (new, main, new, main, ...), after one
untimed run of the workload at 8 streams per package.  Per run: the wall seconds of the call (`generate_tokens`; for
the engine, from the first submit to the last request done, the engine made before), of which the setup (until the
first forward), the rounds (the core's `Stats.rounds`, checked equal to the replaced forward's calls), the streams
fed over all rounds (`Stats.stream_forwards`) and the answer tokens (each answer's length checked).  Reported: ms per
round (wall / rounds) and µs per stream-round (wall / streams fed), median and min over the repeats, the ratio new /
main of the medians (below 1: this tree faster), the mean live streams (streams fed / rounds), and `identical`: the
streams whose tokens agree across every run of both packages.  One table on stdout, `host-bench.json` under `--out`.

The other copy is a commit's `hf_parallel/` exported as `hf_parallel_main` into the folder `BASELINE` names (or
`--baseline`; default `.carry/pkgs`, where `python eval/gpu_check.py prepare --baseline main` puts it), loaded as
`eval/ab_bench.py` loads it.

    python eval/host_bench.py --streams 64 256 512 --out /tmp/host-bench
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]

import torch  # noqa: E402
import transformers  # noqa: E402

import hf_parallel  # noqa: E402

WORKLOADS = ("row", "refill", "arrivals")
CHUNK = 1024  # prompt tokens per round (prefill_chunk)
ROW_DOC, REFILL_DOC, SYSTEM = 512, 256, 256  # document and system prompt lengths
PER_DOC = 16  # questions per document (refill), requests per system prompt at N (arrivals: twice over)
SHORTEST = 32  # refill's shortest answer
STEP = 7  # the replaced forward's offset moves this many rows a round
SPAN = 61  # ... modulo this


@dataclass
class Package:
    """One copy of hf_parallel and the names a run uses."""

    label: str
    module: object
    runner_class: type = field(init=False)

    def __post_init__(self):
        name = self.module.__name__
        self.runner_class = importlib.import_module(f"{name}.runner.model_runner").ModelRunner
        self.check_support = _first(name, "frontends.probe", "runner.probe").check_support
        self.Engine = _first(name, "frontends.serving", "engine.serving").Engine


def _first(package: str, *modules: str):
    """The first of `modules` that `package` has (a module moves between commits)."""
    for module in modules:
        try:
            return importlib.import_module(f"{package}.{module}")
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"{package} has none of {', '.join(modules)}")


def load_packages(baseline: Path) -> list[Package]:
    """This tree's package and `hf_parallel_main` from the folder `baseline`."""
    if not (baseline / "hf_parallel_main" / "__init__.py").is_file():
        sys.exit(
            f"no hf_parallel_main in {baseline}: export one with `python eval/gpu_check.py prepare --baseline main` "
            "(into .carry/pkgs) or as eval/ab_bench.py's docstring says, and name its folder with --baseline"
        )
    if str(baseline) not in sys.path:
        sys.path.insert(0, str(baseline))
    return [Package("new", hf_parallel), Package("main", importlib.import_module("hf_parallel_main"))]


class FreeForward:
    """A forward that costs nothing: `[rows kept, vocab]` rows of `logits`, from an offset that moves each call.
    Counts its calls (the rounds) and the rows it returned."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.calls = self.rows = 0
        self.first: float | None = None  # perf_counter at the first call

    def __call__(self, inputs) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        n = len(inputs.slots) if inputs.keep is None else len(inputs.keep)
        at = self.calls * STEP % SPAN
        if at + n > len(self.logits):
            raise RuntimeError(f"{n} rows asked of a table of {len(self.logits) - SPAN}")
        self.calls += 1
        self.rows += n
        return self.logits[at : at + n]


@contextlib.contextmanager
def replaced_forward(runner_class: type, fake: FreeForward):
    """`runner_class.forward` is `fake` while the block runs; the class's own function after, whatever happens."""
    original = runner_class.__dict__["forward"]

    def forward(self, inputs):
        return fake(inputs)

    runner_class.forward = forward
    try:
        yield fake
    finally:
        runner_class.forward = original


def tiny_model(vocab: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng():  # the same weights each time, torch's global generator left as it was
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@dataclass
class Work:
    """One workload at one size: its prompts, each stream's answer length, and its call's options (for arrivals:
    each request's max_new_tokens, and the engine's options)."""

    name: str
    streams: int
    prompts: list[list[int]]
    targets: list[int]
    options: dict


def row_work(n: int, vocab: int, new: int, seed: int = 0) -> Work:
    rng = random.Random(seed)
    doc = ids(rng, ROW_DOC, vocab)
    prompts = [doc + ids(rng, rng.randint(8, 16), vocab) for _ in range(n)]
    options = dict(max_new_tokens=new, eos_token_id=[], do_sample=False, progress=False, prefill_chunk=CHUNK)
    return Work("row", n, prompts, [new] * n, options)


def refill_work(n: int, vocab: int, new: int, seed: int = 0) -> Work:
    """2N questions, `PER_DOC` per document; a question of q tokens gets new + 8 - q (32 to `new`) by one
    max_length (`max_memory`: `make_work`'s)."""
    rng = random.Random(seed)
    prompts, targets = [], []
    for i in range(2 * n):
        if i % PER_DOC == 0:
            doc = ids(rng, REFILL_DOC, vocab)
        q = rng.randint(8, max(8, new + 8 - SHORTEST))
        prompts.append(doc + ids(rng, q, vocab))
        targets.append(new + 8 - q)
    options = dict(max_length=REFILL_DOC + new + 8, eos_token_id=[], do_sample=False, progress=False,
                   prefill_chunk=CHUNK)  # fmt: skip
    return Work("refill", n, prompts, targets, options)


def arrivals_work(n: int, vocab: int, new: int, seed: int = 0) -> Work:
    """2N requests over ceil(N / PER_DOC) system prompts, shuffled; each request's max_new_tokens in 16..new (the
    engine's `max_memory`: `make_work`'s)."""
    rng = random.Random(seed)
    systems = [ids(rng, SYSTEM, vocab) for _ in range(-(-n // PER_DOC))]
    prompts = [systems[i % len(systems)] + ids(rng, 16, vocab) for i in range(2 * n)]
    rng.shuffle(prompts)
    targets = [rng.randint(min(16, new), new) for _ in prompts]
    options = dict(max_streams=n, prefill_chunk=CHUNK)
    return Work("arrivals", n, prompts, targets, options)


def memory_for(model, profile, streams: int, slots: int, prompts: int) -> int:
    """A small `max_memory` whose row (`size_row`, as a call of `prompts` prompts sizes it) takes `streams` streams
    and `slots` slots: bisected to the byte (the least, but where more streams' working memory leaves fewer slots)."""
    from hf_parallel.runner.sizing import size_row

    def holds(total: int) -> bool:
        try:
            size = size_row(model, profile, CHUNK, total, prompts)
        except ValueError:  # not even one prompt
            return False
        return size.streams >= streams and size.capacity >= slots

    low, high = 0, max(slots * profile.slot_bytes, 1)
    while not holds(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return high


def make_work(name: str, n: int, vocab: int, new: int, model, profile) -> Work:
    """Workload `name` at N = `n` streams; for refill and arrivals with the `max_memory` that holds about N."""
    from hf_parallel.row.layout import build_layout

    if name == "row":
        return row_work(n, vocab, new)
    if name == "refill":
        work = refill_work(n, vocab, new)
        slots = build_layout(work.prompts[:n], new).num_slots
        work.options["max_memory"] = memory_for(model, profile, n, slots, len(work.prompts))
        return work
    work = arrivals_work(n, vocab, new)
    slots = SYSTEM * -(-n // PER_DOC) + n * (16 + new)
    work.options["max_memory"] = memory_for(model, profile, n, slots, n)
    return work


Timed = tuple[float, float, list[list[int]], object]  # start, wall seconds, answers, Stats


def run_generate(pkg: Package, model, work: Work) -> Timed:
    """(start, wall seconds, answers, the call's Stats)."""
    stats = pkg.module.Stats()
    start = time.perf_counter()
    answers = pkg.module.generate_tokens(model, work.prompts, stats=stats, **work.options)
    return start, time.perf_counter() - start, answers, stats


def run_engine(pkg: Package, model, work: Work, deadline: float = 600.0) -> Timed:
    """Every request from `work.streams` closed-loop clients; (start, wall seconds, each request's tokens, the
    core's Stats), timed from the first submit (the engine made before)."""
    engine = pkg.Engine(model, **work.options)
    answers: list[list[int]] = [[] for _ in work.prompts]
    errors: list[BaseException] = []
    left, done = [len(work.prompts)], threading.Event()
    queue = list(range(len(work.prompts)))

    def submit(i: int) -> None:
        def on_event(kind, value):
            if kind == "tokens":
                answers[i].extend(t for _, t in value)
            elif kind in ("done", "error"):
                if kind == "error":
                    errors.append(value)
                left[0] -= 1
                if not left[0]:
                    done.set()
                elif queue:
                    submit(queue.pop(0))

        options = dict(max_new_tokens=work.targets[i], eos_token_id=[], do_sample=False)
        engine.submit(work.prompts[i], options, 1, on_event)

    try:
        start = time.perf_counter()
        with engine._wake:  # the first requests all queued before the engine's next round (the lock is reentrant)
            for _ in range(min(work.streams, len(queue))):
                submit(queue.pop(0))
        if not done.wait(deadline):
            raise TimeoutError(f"the engine did not finish {len(work.prompts)} requests in {deadline} s")
        wall = time.perf_counter() - start
    finally:
        engine.close(30)
    if errors:
        raise errors[0]
    return start, wall, answers, engine.core.stats


def one_run(pkg: Package, model, work: Work, logits: torch.Tensor) -> dict:
    """One timed run of `work` on `pkg` with the forward replaced; its figures and answers."""
    fake = FreeForward(logits)
    with replaced_forward(pkg.runner_class, fake):
        if work.name == "arrivals":
            start, wall, answers, stats = run_engine(pkg, model, work)
        else:
            start, wall, answers, stats = run_generate(pkg, model, work)
    if fake.calls != stats.rounds:
        raise AssertionError(f"{pkg.label}: {fake.calls} forwards but Stats counted {stats.rounds} rounds")
    lengths = [len(a) for a in answers]
    if lengths != work.targets:
        raise AssertionError(f"{pkg.label} {work.name}: answers of other lengths than the workload's")
    return dict(wall_s=wall, rounds=stats.rounds, stream_rounds=stats.stream_forwards, tokens=stats.tokens,
                forward_calls=fake.calls, logits_rows=fake.rows,
                setup_s=fake.first - start if fake.first is not None else None,
                answers=answers)  # fmt: skip


def summarize(work: Work, vocab: int, runs: dict[str, list[dict]]) -> dict:
    """One row of the table from every run of both packages."""
    row = dict(workload=work.name, vocab=vocab, streams=work.streams, prompts=len(work.prompts))
    first = runs["new"][0]
    row.update(rounds=first["rounds"], stream_rounds=first["stream_rounds"], tokens=first["tokens"],
               mean_live=round(first["stream_rounds"] / first["rounds"], 1))  # fmt: skip
    for label, rs in runs.items():
        per_round = [r["wall_s"] / r["rounds"] * 1e3 for r in rs]
        per_stream = [r["wall_s"] / r["stream_rounds"] * 1e6 for r in rs]
        row[f"{label}_ms_round_median"] = round(statistics.median(per_round), 4)
        row[f"{label}_ms_round_min"] = round(min(per_round), 4)
        row[f"{label}_us_stream_round_median"] = round(statistics.median(per_stream), 3)
        row[f"{label}_wall_s"] = [round(r["wall_s"], 4) for r in rs]
        row[f"{label}_setup_ms_median"] = round(statistics.median(r["setup_s"] * 1e3 for r in rs), 3)
        row[f"{label}_rounds"] = sorted({r["rounds"] for r in rs})
    row["ratio_median"] = round(row["new_ms_round_median"] / row["main_ms_round_median"], 3)
    row["ratio_min"] = round(row["new_ms_round_min"] / row["main_ms_round_min"], 3)
    every = [r["answers"] for rs in runs.values() for r in rs]
    row["identical"] = sum(all(a[i] == every[0][i] for a in every) for i in range(len(every[0])))
    return row


def table(rows: list[dict]) -> str:
    """The markdown table: per row both copies' ms per round (median, min), the ratios new / main of the medians
    and of the mins, and this tree's µs per stream-round and setup."""
    head = ("| workload | vocab | streams | new ms/round | main ms/round | ratio new/main (of mins) "
            "| µs per stream-round (new) | setup ms (new) | rounds | mean live | tokens | identical |")  # fmt: skip
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for r in rows:
        new, main = (f"{r[f'{k}_ms_round_median']:.3f} (min {r[f'{k}_ms_round_min']:.3f})" for k in ("new", "main"))
        lines.append(
            f"| {r['workload']} | {r['vocab']} | {r['streams']} | {new} | {main} "
            f"| {r['ratio_median']:.3f} ({r['ratio_min']:.3f}) | {r['new_us_stream_round_median']:.2f} "
            f"| {r['new_setup_ms_median']:.1f} | {r['rounds']} | {r['mean_live']} | {r['tokens']} "
            f"| {r['identical']}/{r['prompts']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 512], help="decoding streams N")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 256],
                        help="the model's vocabulary: a real one (argmax on the host) and a small one")  # fmt: skip
    parser.add_argument("--new", type=int, default=128, help="new tokens per stream (row), the most (refill, arrivals)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per package, alternated")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (0: its default)")
    parser.add_argument("--baseline", type=Path, default=Path(os.environ.get("BASELINE", ROOT / ".carry" / "pkgs")),
                        help="the folder holding hf_parallel_main (default $BASELINE, else .carry/pkgs)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="a folder for host-bench.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    packages = load_packages(args.baseline.resolve())
    marker = args.baseline / "BASELINE"
    head = dict(baseline=marker.read_text().strip() if marker.is_file() else str(args.baseline),
                torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads(),
                new=args.new, repeats=args.repeats)  # fmt: skip
    print(json.dumps(head), flush=True)
    rows = []
    for vocab in args.vocabs:
        model = tiny_model(vocab)
        profile = [pkg.check_support(model) for pkg in packages][0]  # each package probes it, its forward its own
        most = 2 * max(args.streams + [8])
        logits = torch.randn(most + SPAN, vocab, generator=torch.Generator().manual_seed(vocab))
        for name in args.workloads:
            warm = make_work(name, 8, vocab, min(args.new, 16), model, profile)
            for pkg in packages:
                one_run(pkg, model, warm, logits)
            for n in args.streams:
                work = make_work(name, n, vocab, args.new, model, profile)
                runs = {p.label: [] for p in packages}
                for _ in range(args.repeats):
                    for pkg in packages:
                        runs[pkg.label].append(one_run(pkg, model, work, logits))
                rows.append(summarize(work, vocab, runs))
                print(json.dumps(rows[-1]), flush=True)
        del model, logits
    print(table(rows), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host-bench.json").write_text(json.dumps({**head, "argv": argv or sys.argv[1:], "rows": rows},
                                                             indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
