"""The serving engine in process, without HTTP: SGLang's generated-shared-prefix workload as token ids.

`--groups` system prompts of `--system-len` random token ids, each with `--prompts-per-group` questions of
`--question-len` (shuffled, `--seed`); every request greedy, `--output-len` tokens (no EOS).  Requests go to one
`hf_parallel.engine.serving.Engine` from `--concurrency` closed-loop clients (each sends its next request when its
last one is done), or all at once (`all`).  One untimed warm-up request shares nothing with the workload.  Reports
requests done, wall seconds, output tokens/s, time to first token and latency (p50, p99), the engine's rounds and
its prompt tokens requested and computed; the measured copy bandwidth and matmul rate, and the workload's bound
at them (`bound`: what no engine can beat with that many live streams) with the fraction of it reached.

    python eval/engine_bench.py --model qwen2.5-7b --concurrency 64 all --out results/serve
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import build_model, linear_params, measure_ceilings  # noqa: E402

from hf_parallel.engine.serving import Engine  # noqa: E402


def workload(groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(3, vocab) for _ in range(system_len)]
        prompts += [system + [rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def run(model, prompts: list[list[int]], output_len: int, concurrency: int, max_streams: int, deadline: float) -> dict:
    """One run: the figures of every request sent from `concurrency` clients (0: every request at once)."""
    engine = Engine(model, max_streams=max_streams)
    options = dict(max_new_tokens=output_len, eos_token_id=[], do_sample=False)
    lock, results, queue, finished = threading.Lock(), [], list(range(len(prompts))), threading.Event()

    def submit(i: int) -> None:
        sent, first, tokens = time.perf_counter(), [], [0]

        def on_event(kind, value):
            if kind == "tokens":
                if not first:
                    first.append(time.perf_counter())
                tokens[0] += len(value)
            elif kind in ("done", "error"):
                with lock:
                    results.append((first[0] - sent if first else None, time.perf_counter() - sent, tokens[0],
                                    kind == "error"))  # fmt: skip
                    done = len(results) == len(prompts)
                if done:
                    finished.set()
                elif concurrency:
                    take()

        engine.submit(prompts[i], options, 1, on_event)

    def take() -> None:
        with lock:
            i = queue.pop(0) if queue else None
        if i is not None:
            submit(i)

    warm = threading.Event()
    engine.submit([5] * len(prompts[0]), options, 1, lambda kind, _: warm.set() if kind in ("done", "error") else None)
    warm.wait(600)
    engine.wait_idle(60)
    before = dict(vars(engine.counters))
    start = time.perf_counter()
    for _ in range(concurrency or len(prompts)):
        take()
    finished.wait(deadline)
    wall = time.perf_counter() - start
    counters = {k: v - before[k] for k, v in vars(engine.counters).items()}  # the timed run's alone
    engine.close(30)
    ttft = sorted(r[0] for r in results if r[0] is not None)
    latency = sorted(r[1] for r in results)
    tokens = sum(r[2] for r in results)

    def pct(values, q):
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None

    return {"concurrency": concurrency or "all", "max_streams": max_streams, "requests_done": len(results),
            "errors": sum(r[3] for r in results), "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1), "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "latency_p50_s": pct(latency, 0.5), "latency_p99_s": pct(latency, 0.99), "rounds": counters["rounds"],
            "prompt_tokens": counters["prompt_tokens"], "computed_tokens": counters["computed_tokens"]}  # fmt: skip


def bound(
    config,
    groups: int,
    per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    live: int,
    closed_loop: bool,
    ceilings: dict,
) -> dict:
    """The workload's bound at the measured ceilings, with `live` streams decoding in every round: the prefill's
    FLOPs at the matmul rate, plus each decode round's max(bytes at the copy bandwidth, FLOPs at the matmul rate).

    Prefill: every system prompt once and every question, all linear layers and attention (causal), the LM head for
    each request's last token.  A decode round makes one token for each of `live` streams (the requests' first
    tokens come from their prefill), reading the weights once, the KV of the system prompts its streams share once
    each, and each stream's own KV (its question and, on average, half its answer).  How many system prompts
    `live` streams share: with every request at once an engine may choose them, ceil(live / per_group); from
    closed-loop clients the requests come in the workload's shuffled order, so the expected number of groups among
    `live` requests drawn without replacement.  The attention's own FLOPs are counted; launches, the host and the
    sampling are not, so no engine reaches it."""
    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2  # bf16 K and V
    layer_params, head_params = linear_params(c)
    weights = 2 * (layer_params + head_params)
    attn_flops = lambda q, k: 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * q * k  # noqa: E731
    requests = groups * per_group
    live = min(live, requests)
    prefill_tokens = groups * system_len + requests * question_len
    prefill_flops = (2 * layer_params * prefill_tokens + 2 * head_params * requests
                     + groups * attn_flops(system_len, system_len / 2)
                     + requests * attn_flops(question_len, system_len + question_len / 2))  # fmt: skip
    if closed_loop:  # E[groups among `live` of `requests` drawn at random] = G (1 - C(N - P, L) / C(N, L))
        miss = 1.0
        for i in range(live):
            miss *= max(requests - per_group - i, 0) / (requests - i)
        shared = groups * (1 - miss)
    else:
        shared = -(-live // per_group)
    own = question_len + output_len / 2
    round_bytes = weights + kv_token * (shared * system_len + live * own)
    round_flops = 2 * (layer_params + head_params) * live + attn_flops(live, system_len + own)
    rounds = requests * (output_len - 1) / live
    prefill_s = prefill_flops / ceilings["matmul"]
    decode_s = rounds * max(round_bytes / ceilings["bandwidth"], round_flops / ceilings["matmul"])
    return {"bound_s": round(prefill_s + decode_s, 3), "bound_prefill_s": round(prefill_s, 3),
            "bound_decode_s": round(decode_s, 3), "bound_round_gb": round(round_bytes / 1e9, 2),
            "bound_tokens_per_s": round(requests * output_len / (prefill_s + decode_s), 1)}  # fmt: skip


def concurrency(text: str) -> int:
    return 0 if text == "all" else int(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help="a shape of eval/bench.py (random bf16 weights)")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", type=concurrency, nargs="+", default=[64, 0], help="clients, or all")
    parser.add_argument("--max-streams", type=int, nargs="+", default=[256], help="per run, or one for every run")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args.model, device)
    prompts = workload(args.groups, args.prompts_per_group, args.system_len, args.question_len,
                       model.config.vocab_size, args.seed)  # fmt: skip
    head = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "requests": len(prompts)}  # fmt: skip
    if device.type == "cuda":
        ceilings = measure_ceilings(device)
        head.update(copy_tb_s=round(ceilings["bandwidth"] / 1e12, 2), matmul_tflops=round(ceilings["matmul"] / 1e12))
    else:
        ceilings = None
    print(json.dumps(head), flush=True)
    rows = []
    streams = args.max_streams * len(args.concurrency) if len(args.max_streams) == 1 else args.max_streams
    for clients, max_streams in zip(args.concurrency, streams):
        row = {**head, **run(model, prompts, args.output_len, clients, max_streams, args.deadline)}
        if ceilings:
            live = min(clients or len(prompts), max_streams)
            row.update(
                live_streams=live,
                **bound(
                    model.config,
                    args.groups,
                    args.prompts_per_group,
                    args.system_len,
                    args.question_len,
                    args.output_len,
                    live,
                    bool(clients),
                    ceilings,
                ),
            )
            row["of_bound"] = round(row["output_tokens_per_s"] / row["bound_tokens_per_s"], 3)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"engine-{args.model}.json").write_text(json.dumps({"argv": argv or sys.argv[1:], "rows": rows},
                                                                        indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
