"""Benchmark: Parallel Prompting vs stock Transformers and the bandwidth roofline.

Paired, seeded runs on identical inputs (documents are slices of War and Peace chosen by
the seed; question i is "Summarize the main point of paragraph i."; answers are forced to
`--answer-tokens` tokens, no early EOS) of:

  stock        (stock_full: every chunk run) every question its own row, the document's KV prefilled once
               and copied into each row, `model.generate` greedy, rows chunked to fit memory
  stock_tuned  the same with a static cache and the decode forward compiled (`torch.compile`, CUDA graphs: generate's
               auto-compile on CUDA), every chunk timed (`--stock-tuned per_chunk`: the first two, every chunk counted
               at the faster's time), compilation excluded (reported as warmup_s)
  pp_reference hf_parallel, dense stream mask + SDPA, CUDA graphs
  pp_triton    hf_parallel's default: Triton stream-id kernel (own tiles where "auto" picks them), CUDA graphs, the
               layers' norms and rotary embedding compiled
  pp_unfused   pp_triton with nothing compiled (`compile=False`: the ablation of the layers' compiled parts)
  pp_norms_only  pp_triton with the norms compiled but not the rotary embedding (`Tuning(fuse_rotary=False)`)
  pp_own_off, pp_own_serial, pp_own_overlap  decode with `TritonBackend(own_tiles=...)` set, not "auto": None (one
               plan), or each stream's own keys in small tiles after the packed tiles' launch or beside it on a
               second CUDA stream
  pp_p1        the same kernel with one stream per row tile (each stream reads the document
               itself, as a prefix-caching server does): the ratio isolates reading once
  pp_interleaved  the reference paper's interleaved layout (ablation)
  pp_triton_compiled  pp_triton with the decode step compiled (`compile=True`: the model's own small
               operations fused, the kernel an opaque op), compilation in the untimed warm-up
  pp_ungrouped pp_triton with every projection its own GEMM, not q|k|v as one (`Tuning(group_projections=False)`)
  pp_prefill_apart  pp_triton with a prefill chunk's q, k and v each a tensor of its own, not columns of one
               output (`Tuning(prefill_columns=False)`)
  pp_index_copy  pp_triton with the cache's K/V written by `index_copy_`, not the Triton write
               (`Tuning(triton_writes=False)`)
  pp_synced    pp_triton with each round's tokens read at once, not one round late (`Tuning(read_late=False)`)
  pp_every_dim_dynamic  pp_triton with the layers' compiled parts compiled with every dimension dynamic
               (`dynamic=True`), not only the token count (`Tuning(static_widths=False)`)
  pp_kernel_prefill  pp_triton with the document's prefill through the kernel rather than causal SDPA (ablation)
  pp_own_launch_wide  pp_triton with the own plan launched with at least 2 KV splits and 8 warps, the best of
               `diagnostics/gpu_kernel_check.py --own` in isolation (`TritonBackend(launch_config=...)`)
  pp_every_block_masked  pp_triton with the kernel masking every KV block, not only those some row sees in part
               (`TritonBackend(launch_config=...)`)
  generate_batch  Transformers' continuous batching: `model.generate_batch` on every prompt, paged attention with
               prefix block sharing on (`--generate-batch extrapolate`, the default: timed at 4 and 16 answer
               tokens after an untimed run, extended linearly; `full`: every token)

and the roofline: the time at the measured copy bandwidth and bf16 matmul rate, counting
weights + the document KV once + each stream's own KV per step (and the FLOPs); and the serial bound,
the same with the GEMMs and attention each at its own bound, one after the other (`roofline`).

    python eval/bench.py --model codellama-7b --out results/bench

Stock HF at full size takes minutes per workload, so by default one chunk of each distinct
row count is generated in full and timed, and each chunk counted at its row count's time
(`--stock full` runs every chunk; `--stock extrapolate` times one chunk at 4 and 16 tokens).
"""

from __future__ import annotations

import argparse
import functools
import gc
import gzip
import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import transformers

from hf_parallel import Session, Tuning, generate_tokens
from hf_parallel.attention import launcher
from hf_parallel.attention.triton import TritonBackend
from hf_parallel.frontends.generate import generate_layout
from hf_parallel.models.checks import cache_keyword
from hf_parallel.row.layout import build_layout

ROOT = Path(__file__).resolve().parents[1]
BOOK = Path(os.environ.get("HF_PARALLEL_DATA") or ROOT.parent / "shared" / "data") / "war-and-peace.txt.gz"
SHAPES = {  # random bf16 weights with real shapes: timing does not depend on weight values
    "codellama-7b": lambda: transformers.LlamaConfig(
        vocab_size=32016, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=16384 + 4096,
        rope_theta=1e6),
    "qwen2.5-7b": lambda: transformers.Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6),
    "tiny": lambda: transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384 + 4096),
}  # fmt: skip


def wide_own_launch(query, key, tiles, own: bool) -> launcher.KernelConfig:
    """The own plan launched with at least 2 KV splits and 8 warps (16-bit), the best of
    `diagnostics/gpu_kernel_check.py --own` in isolation: the ablation of `launcher.own_launch_config`
    (`TritonBackend(launch_config=...)`)."""
    if not own:
        return launcher.default_config(query, key, tiles)
    cfg = launcher.own_launch_config(query, key, tiles)
    if query.dtype == torch.float32:
        return cfg
    return launcher.KernelConfig(cfg.block_n, max(2, cfg.num_splits), 8, cfg.num_stages)


def every_block_masked(query, key, tiles, own: bool) -> launcher.KernelConfig:
    """The kernel masking every KV block, the ones every row sees whole too: the ablation of
    `KernelConfig.whole_blocks` (`TritonBackend(launch_config=...)`)."""
    cfg = (launcher.own_launch_config if own else launcher.default_config)(query, key, tiles)
    return replace(cfg, whole_blocks=False)


METHODS = {  # generate_tokens options, and whether the layout is the paper's interleaved one (an ablation)
    "pp_triton": (dict(attn="triton"), False),
    "pp_unfused": (dict(attn="triton", compile=False), False),
    "pp_norms_only": (dict(attn="triton", tuning=Tuning(fuse_rotary=False)), False),
    "pp_reference": (dict(attn="reference"), False),
    "pp_p1": (dict(attn=TritonBackend(streams_per_tile=1, own_tiles=None)), False),
    "pp_own_off": (dict(attn=TritonBackend(own_tiles=None)), False),
    "pp_own_serial": (dict(attn=TritonBackend(own_tiles="serial")), False),
    "pp_own_overlap": (dict(attn=TritonBackend(own_tiles="overlap")), False),
    "pp_spt16": (dict(attn=TritonBackend(streams_per_tile=16, own_tiles=None)), False),
    "pp_spt32": (dict(attn=TritonBackend(streams_per_tile=32, own_tiles=None)), False),
    "pp_interleaved": (dict(attn="triton"), True),
    "pp_triton_compiled": (dict(attn="triton", compile=True), False),
    "pp_kernel_prefill": (dict(attn=TritonBackend(causal_prefill=False)), False),
    "pp_own_launch_wide": (dict(attn=TritonBackend(launch_config=wide_own_launch)), False),
    "pp_every_block_masked": (dict(attn=TritonBackend(launch_config=every_block_masked)), False),
    "pp_ungrouped": (dict(attn="triton", tuning=Tuning(group_projections=False)), False),
    "pp_prefill_apart": (dict(attn="triton", tuning=Tuning(prefill_columns=False)), False),
    "pp_index_copy": (dict(attn="triton", tuning=Tuning(triton_writes=False)), False),
    "pp_synced": (dict(attn="triton", tuning=Tuning(read_late=False)), False),
    "pp_every_dim_dynamic": (dict(attn="triton", tuning=Tuning(static_widths=False)), False),
}

STOCK_METHODS = ("stock", "stock_full", "stock_tuned", "generate_batch")  # timed by run_stock & co., not run_pp


def method_list(text: str) -> list[list[str]]:
    """--methods, `METHOD[@W1|W2],...`: [METHOD] or [METHOD, "W1|W2"] each; a method neither in METHODS nor in
    STOCK_METHODS is a usage error before any model loads."""
    methods = [m.split("@", 1) for m in text.split(",")]
    unknown = [m for m, *_ in methods if m not in METHODS and m not in STOCK_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown methods {unknown}: each is one of {[*STOCK_METHODS, *METHODS]}")
    return methods


@dataclass
class Workload:
    name: str
    doc_tokens: int
    questions: int  # per document
    answer_tokens: int
    documents: int = 1


def grids(kind: str, scale: float) -> list[Workload]:
    s = lambda n: max(8, int(n * scale))  # noqa: E731
    if kind == "grid":
        return [Workload(f"{d // 1024}k x {q}q", s(d), q, 128) for d in (8192, 16384) for q in (64, 128, 256)]
    if kind == "answers":
        return [Workload(f"8k x 128q x {a}a", s(8192), 128, a) for a in (128, 256, 512, 1024)]
    if kind == "docs":
        return [Workload(f"{n} docs x 4k x 64q", s(4096), 64, 128, n) for n in (1, 4, 16)]
    raise ValueError(kind)


def book_tokens(tokenizer, vocab: int, book: Path = BOOK) -> list[int]:
    text = gzip.open(book, "rt", encoding="utf-8-sig").read().replace("\r\n", "\n")
    if tokenizer is None:  # no tokenizer carried: words hashed into the vocabulary (timing is the same)
        return [hash(w) % (vocab - 3) + 3 for w in text.split()]
    return [t % vocab for t in tokenizer(text)["input_ids"]]


def make_prompts(book: list[int], work: Workload, seed: int, encode, vocab: int) -> list[list[int]]:
    """The seed picks each document's slice of the book; question i is the paragraph-i template."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(work.documents):
        start = int(torch.randint(0, len(book) - work.doc_tokens, (1,), generator=gen))
        doc = book[start : start + work.doc_tokens]
        prompts += [doc + [t % vocab for t in encode(f"Summarize the main point of paragraph {i + 1}.")]
                    for i in range(work.questions)]  # fmt: skip
    return prompts


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - start, out


def generate(model, prompts, max_new_tokens: int, options: dict, interleaved: bool = False,
             session: Session | None = None) -> list[list[int]]:  # fmt: skip
    """`generate_tokens` as a user calls it, its input checks and memory plan included (the interleaved layout, an
    ablation it does not take, through `generate_layout`); a `Session` keeps the row (and its captured rounds)
    between the warm-up and the timed runs."""
    options = dict(options, max_new_tokens=max_new_tokens, eos_token_id=[], prefill_chunk=8192, progress=False)
    if not interleaved:
        return generate_tokens(model, prompts, session=session, **options)
    return generate_layout(model, build_layout(prompts, max_new_tokens, interleaved), session=session, **options)


SESSIONS: dict = {}  # model -> its Session: one row kept between a method's runs, released by free_memory


def run_pp(model, prompts, work: Workload, method: tuple, repeats: int = 2) -> dict:
    options, interleaved = method
    session = SESSIONS.setdefault(id(model), Session(model))

    def run(n):
        return generate(model, prompts, n, options, interleaved, session)

    warmup_s, _ = timed(lambda: run(work.answer_tokens))  # kernels, graph capture (and compilation) at full size
    prefill_s = min(timed(lambda: run(1))[0] for _ in range(repeats))
    runs = [timed(lambda: run(work.answer_tokens)) for _ in range(repeats)]
    assert all(len(o) == work.answer_tokens for _, out in runs for o in out)
    total_s = min(t for t, _ in runs)  # best of the repeats, each listed in total_s_all
    return dict(
        total_s=total_s,
        prefill_s=prefill_s,
        decode_s=total_s - prefill_s,
        total_s_all=[t for t, _ in runs],
        warmup_s=warmup_s,
    )


def run_stock(model, prompts, work: Workload, rows: int, mode: str = "per_chunk") -> dict:
    """Stock Transformers: the document prefilled once, its KV copied into each row of a chunk.

    mode  full       every chunk generated and timed, after one untimed full-length run of each row count
          per_chunk  one chunk of each distinct row count generated in full (all answer tokens, once untimed, then)
                     timed; the total counts each chunk at the time of its row count (chunks of one
                     row count differ only in their question tokens)
          extrapolate  one chunk timed at 4 and 16 answer tokens, extended linearly (quick, noisy)
    """
    if mode not in ("full", "per_chunk", "extrapolate"):
        raise ValueError(f"mode must be full, per_chunk or extrapolate, got {mode!r}")
    doc_len = work.doc_tokens
    per_doc = work.questions
    device = model.device
    doc_prefill_s, caches = timed(lambda: [prefill_document(model, prompts[d * per_doc][:doc_len], device)
                                           for d in range(work.documents)])  # fmt: skip
    chunks = [(d, prompts[d * per_doc + i : d * per_doc + min(i + rows, per_doc)])
              for d in range(work.documents) for i in range(0, per_doc, rows)]  # fmt: skip
    run = lambda d, c, n: timed(lambda: generate_chunk(model, caches[d], c, doc_len, n))[0]  # noqa: E731
    by_rows: dict[int, list] = {}  # row count -> its chunks
    for d, c in chunks:
        by_rows.setdefault(len(c), []).append((d, c))
    if mode in ("full", "per_chunk"):  # warm-up: each row count once at full length, untimed (the first run of a
        for group in by_rows.values():  # shape ran 1.6-1.9x slower on the H200; likely the allocator growing)
            run(*group[0], work.answer_tokens)
    else:  # both timed lengths once untimed: the first run at a length pays the allocator's growth
        run(*chunks[0], 4), run(*chunks[0], 16)
    if mode == "full":
        chunk_s = sum(run(d, c, work.answer_tokens) for d, c in chunks)
        return dict(total_s=doc_prefill_s + chunk_s, prefill_s=doc_prefill_s, extrapolated=False)
    if mode == "per_chunk":
        measured = {n: run(*group[0], work.answer_tokens) for n, group in by_rows.items()}
        chunk_s = sum(measured[n] * len(group) for n, group in by_rows.items())
        return dict(total_s=doc_prefill_s + chunk_s, prefill_s=doc_prefill_s, extrapolated=False, per_chunk=True,
                    chunk_rows=rows, measured_chunk_s=measured,
                    chunk_counts={n: len(group) for n, group in by_rows.items()})  # fmt: skip
    d, chunk = chunks[0]
    short, long = 4, 16
    t_short, t_long = run(d, chunk, short), run(d, chunk, long)
    per_token = (t_long - t_short) / (long - short)
    chunk_s = t_short + per_token * (work.answer_tokens - short)
    return dict(total_s=doc_prefill_s + len(chunks) * chunk_s, prefill_s=doc_prefill_s, extrapolated=True,
                chunk_rows=len(chunk), measured_chunk_s={short: t_short, long: t_long})  # fmt: skip


def run_stock_tuned(model, prompts, work: Workload, rows: int, compile: bool | None = None,
                    mode: str = "full") -> dict:  # fmt: skip
    """`run_stock` with a static cache and the decode forward compiled; chunks timed after a warm-up.

    Chunks are balanced (as many as `run_stock`'s, of at most `rows` rows) and one StaticCache (doc + longest question
    + answer tokens) serves them all, a short last chunk padded with dummy rows: the decode shapes and the cache's
    addresses never change, so one compiled graph (and one CUDA graph) serves every chunk. `compile=None` compiles
    where generate auto-compiles (CUDA).

    mode  full       every chunk timed
          per_chunk  the first two chunks timed (every answer token) and every chunk counted at the faster's time:
                     they run one shape through one graph, and differ only in their question tokens"""
    if mode not in ("full", "per_chunk"):
        raise ValueError(f"mode must be full or per_chunk, got {mode!r}")
    compile = model.device.type == "cuda" if compile is None else compile
    doc_len = work.doc_tokens
    per_doc = work.questions
    device = model.device
    torch._dynamo.reset()  # this workload's graphs only: the recompile limit, no stale CUDA graph pools
    doc_prefill_s, caches = timed(lambda: [prefill_document(model, prompts[d * per_doc][:doc_len], device)
                                           for d in range(work.documents)])  # fmt: skip
    rows = math.ceil(per_doc / math.ceil(per_doc / rows))  # as many chunks as `rows` makes, the fewest dummy rows
    chunks = [(d, prompts[d * per_doc + i : d * per_doc + min(i + rows, per_doc)])
              for d in range(work.documents) for i in range(0, per_doc, rows)]  # fmt: skip
    width = max(len(p) for p in prompts) - doc_len
    cache = transformers.StaticCache(config=model.config, max_cache_len=doc_len + width + work.answer_tokens)

    def run(d, chunk, n):
        return generate_chunk_static(model, caches[d], chunk, doc_len, n, cache, rows, width, compile)

    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    try:
        graphs_before = graphs()
        warmup_s = timed(lambda: [run(*chunks[0], 4) for _ in range(2)])[0]  # compile, CUDA graph capture, replay
        graphs_warm = graphs()
        measured = [timed(lambda d=d, c=c: run(d, c, work.answer_tokens))[0]
                    for d, c in (chunks if mode == "full" else chunks[:2])]  # fmt: skip
        chunk_s = sum(measured) if mode == "full" else min(measured) * len(chunks)
        graphs_timed = graphs() - graphs_warm
    finally:
        torch._dynamo.reset()  # frees the CUDA graph pools before the next method
    extra = dict(per_chunk=True, measured_chunk_s=measured) if mode == "per_chunk" else {}
    return dict(total_s=doc_prefill_s + chunk_s, prefill_s=doc_prefill_s, extrapolated=False,
                compiled=graphs_warm > graphs_before, warmup_s=warmup_s, chunk_rows=rows, chunks=len(chunks),
                dummy_rows=len(chunks) * rows - len(prompts), graphs_compiled_in_timing=graphs_timed,
                **extra)  # fmt: skip


def run_generate_batch(model, prompts, work: Workload, mode: str = "extrapolate") -> dict:
    """`model.generate_batch` (continuous batching, paged attention, prefix block sharing) on every prompt, greedy,
    every answer forced to its length; transformers 5.17 takes the sharing switch on the generation config, 5.24
    on a ContinuousBatchingConfig."""

    def run(n: int) -> float:
        config = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)  # fmt: skip
        kwargs = {}
        if "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
            kwargs["continuous_batching_config"] = transformers.ContinuousBatchingConfig(allow_block_sharing=True)
        else:
            for name in ("allow_block_sharing", "allow_prefix_sharing"):
                setattr(config, name, True)
        seconds, out = timed(lambda: model.generate_batch(inputs=prompts, generation_config=config, **kwargs))
        lengths = {len(o.generated_tokens) for o in out.values()}
        assert len(out) == len(prompts) and lengths == {n}, (len(out), lengths)
        return seconds

    run(4)  # warm-up: the paged cache, kernels (and graphs)
    if mode == "full":
        return dict(total_s=run(work.answer_tokens), extrapolated=False)
    short, long = 4, 16
    t_short, t_long = run(short), run(long)
    total = t_short + (t_long - t_short) / (long - short) * (work.answer_tokens - short)
    return dict(total_s=total, extrapolated=True, measured_s={short: t_short, long: t_long})


def stock_rows(config, work: Workload, most: int, budget_bytes: float = 64e9) -> int:
    """Rows per stock chunk: at most `most`, and the copied document KV within `budget_bytes`."""
    head_dim = config.hidden_size // config.num_attention_heads
    per_row = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * (work.doc_tokens + 1200)
    return max(1, min(most, int(budget_bytes // per_row)))


def prefill_document(model, doc: list[int], device):
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([doc], device=device), use_cache=True, logits_to_keep=1,
              **{cache_keyword(model): cache})  # fmt: skip
    return cache


def generate_chunk(model, doc_cache, prompts, doc_len: int, new_tokens: int):
    """Rows = doc + [pad]*k + question (questions differ in length; pads are masked out)."""
    width = max(len(p) for p in prompts) - doc_len
    ids, mask = [], []
    for p in prompts:
        pad = width - (len(p) - doc_len)
        ids.append(p[:doc_len] + [0] * pad + p[doc_len:])
        mask.append([1] * doc_len + [0] * pad + [1] * (len(p) - doc_len))
    cache = transformers.DynamicCache(config=model.config)
    for layer, src in enumerate(doc_cache.layers):  # the document's KV copied into every row
        cache.update(src.keys.expand(len(prompts), -1, -1, -1).contiguous(),
                     src.values.expand(len(prompts), -1, -1, -1).contiguous(), layer)  # fmt: skip
    device = model.device
    with torch.inference_mode():
        return model.generate(torch.tensor(ids, device=device), attention_mask=torch.tensor(mask, device=device),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=None, **{cache_keyword(model): cache})  # fmt: skip


def generate_chunk_static(model, doc_cache, prompts, doc_len: int, new_tokens: int, cache=None, rows=None,
                           width=None, compile: bool = False):  # fmt: skip
    """`generate_chunk` with a StaticCache (reset and reused when given): rows padded to `width` question tokens and
    with dummy rows to `rows` (their outputs dropped); `compile` lets generate compile the decode forward."""
    width = width or max(len(p) for p in prompts) - doc_len
    real = len(prompts)
    prompts = prompts + prompts[-1:] * ((rows or real) - real)
    ids, mask = [], []
    for p in prompts:
        pad = width - (len(p) - doc_len)
        ids.append(p[:doc_len] + [0] * pad + p[doc_len:])
        mask.append([1] * doc_len + [0] * pad + [1] * (len(p) - doc_len))
    if cache is None:
        cache = transformers.StaticCache(config=model.config, max_cache_len=doc_len + width + new_tokens)
    cache.reset()  # zeroes the states and their length in place: the addresses a CUDA graph captured stay
    for layer, src in enumerate(doc_cache.layers):  # the document's KV written to positions [0, doc_len) of every row
        cache.update(src.keys.expand(len(prompts), -1, -1, -1), src.values.expand(len(prompts), -1, -1, -1), layer)
    options = {} if compile else dict(disable_compile=True)
    if compile and model.device.type != "cuda":  # generate compiles on CUDA by itself; elsewhere only when forced
        options = dict(compile_config=transformers.CompileConfig(mode="default"))
        options["compile_config"]._compile_all_devices = True
    device = model.device
    with torch.inference_mode():
        out = model.generate(torch.tensor(ids, device=device), attention_mask=torch.tensor(mask, device=device),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **{cache_keyword(model): cache}, **options)  # fmt: skip
    return out[:real]


def free_memory(model) -> None:
    """Drop the previous run's static row and cached blocks, so every run starts from the same memory."""
    session = SESSIONS.pop(id(model), None)
    if session is not None:
        session.release()
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured here and now."""
    if device.type != "cuda":
        return dict(bandwidth=50e9, matmul=1e12, measured=False)
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_s = _median_time(lambda x=x, y=y: y.copy_(x))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_s = _median_time(lambda: a @ a)
    del x, y
    return dict(bandwidth=2 * 2 * 1024**3 / copy_s, matmul=2 * 8192**3 / mm_s, measured=True)


def _median_time(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def roofline(config, prompts, work: Workload, ceilings: dict) -> dict:
    """Lower bounds on time at the measured ceilings, summed over the call's forwards (the prefill as one).

    roofline: per forward max(bytes / bandwidth, FLOPs / matmul rate).  Bytes: the linear layers' weights and the
    LM head's, read once per forward (of the embedding table only the rows looked up), and the KV: the prefill
    writes every prompt token's, a decode step reads the document's once and each stream's own.  FLOPs: the
    linear layers' over every token of the forward, the LM head's over the rows whose logits are kept (each
    prompt's last token, every stream in a step), and attention's.
    serial: the same bytes and FLOPs, but the weights' GEMMs and attention each at their own bound, one after the
    other, as a decoder layer runs them: a bound for any implementation that does not overlap the two.  It
    exceeds the roofline where one is bound by its arithmetic and the other by its reads (256-row GEMMs beside
    attention's KV reads)."""
    c = config
    head_dim = c.hidden_size // c.num_attention_heads
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2  # bf16 K and V
    layer_params, head_params = linear_params(c)
    weights = 2 * (layer_params + head_params)
    attn_flops = lambda q, k: 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * q * k  # noqa: E731
    bandwidth, matmul = ceilings["bandwidth"], ceilings["matmul"]
    doc, n = work.doc_tokens, len(prompts)
    q_lens = [len(p) - doc for p in prompts]
    new_prompt_tokens = work.documents * doc + sum(q_lens)

    def forward(tokens: int, logits: int, kv_bytes: float, flops_attention: float) -> tuple[float, float]:
        """(roofline, serial) seconds of one forward over `tokens` keeping `logits` rows."""
        gemm_bytes = weights + (2 * c.hidden_size * tokens if head_params else 0)  # + the embedding rows looked up
        gemm_flops = 2 * layer_params * tokens + 2 * head_params * logits
        both = max((gemm_bytes + kv_bytes) / bandwidth, (gemm_flops + flops_attention) / matmul)
        gemms = max(gemm_bytes / bandwidth, gemm_flops / matmul)
        attention = max(kv_bytes / bandwidth, flops_attention / matmul)
        return both, gemms + attention

    prefill_attention = work.documents * attn_flops(doc, doc / 2) + sum(attn_flops(q, doc + q / 2) for q in q_lens)
    prefill, serial_prefill = forward(new_prompt_tokens, n, kv_token * new_prompt_tokens, prefill_attention)
    decode = serial_decode = 0.0
    for t in range(1, work.answer_tokens):
        own = sum(q + t for q in q_lens)
        both, serial = forward(n, n, kv_token * (work.documents * doc + own), attn_flops(n, doc) + attn_flops(1, own))
        decode, serial_decode = decode + both, serial_decode + serial
    return dict(roofline_s=prefill + decode, roofline_prefill_s=prefill, roofline_decode_s=decode,
                serial_s=serial_prefill + serial_decode)  # fmt: skip


def linear_params(c):
    """[the decoder layers' linear weights, the LM head's] in parameters, of a model config."""
    head_dim = c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return [c.num_hidden_layers * (attn + mlp), c.vocab_size * c.hidden_size]  # layers + lm head


def build_model(shape: str, device):
    torch.manual_seed(0)
    config = SHAPES[shape]()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(
        {r["model"] + " | " + r["workload"] for r in results},
        key=lambda s: [r["model"] + " | " + r["workload"] for r in results].index(s),
    )
    methods = [m for m in ["stock", "stock_tuned", "generate_batch", "pp_reference", "pp_interleaved", "pp_p1",
                           "pp_spt32", "pp_spt16", "pp_own_off", "pp_own_serial", "pp_own_overlap", "pp_kernel_prefill",
                           "pp_own_launch_wide", "pp_every_block_masked", "pp_ungrouped", "pp_prefill_apart",
                           "pp_prefill_synced", "pp_unfused", "pp_norms_only", "pp_triton", "pp_triton_compiled",
                           "roofline"]
               if any(r["method"] == m for r in results)]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        vals = [
            next(
                (r["total_s"] for r in results if r["method"] == method and r["model"] + " | " + r["workload"] == n),
                float("nan"),
            )
            for n in names
        ]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=method)
    ax.set_yscale("log")
    ax.set_ylabel("wall time (s, log)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=60, ha="right", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: list[dict]) -> str:
    rows = ["| model | workload | method | total s | decode s | vs stock | vs stock tuned | vs generate_batch | vs P=1 "
            "| roofline s | roofline / time | serial bound s | serial bound / time |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in results:
        vs = functools.partial(_ratio, results, r)
        stock = vs("stock_full") if vs("stock_full") != "-" else vs("stock")  # every chunk run, where there is one
        how = " (extrap.)" if r.get("extrapolated") else " (per chunk)" if r.get("per_chunk") else ""
        serial = r.get("serial_s", math.nan)  # results from before the serial bound have none
        rows.append(f"| {r['model']} | {r['workload']} | {r['method']}{how} "
                    f"| {r['total_s']:.2f} | {r.get('decode_s', float('nan')):.2f} | {stock} | {vs('stock_tuned')} "
                    f"| {vs('generate_batch')} "
                    f"| {vs('pp_p1')} | {r['roofline_s']:.2f} | {r['roofline_s'] / r['total_s']:.2f} "
                    f"| {serial:.2f} | {serial / r['total_s']:.2f} |")  # fmt: skip
    return "\n".join(rows)


def _ratio(results, r, method) -> str:
    other = next((o for o in results if o["method"] == method and o["workload"] == r["workload"]
                  and o["model"] == r["model"]), None)  # fmt: skip
    return f"{other['total_s'] / r['total_s']:.1f}x" if other else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="codellama-7b")
    parser.add_argument("--workloads", default="grid,answers,docs", help="comma list of grid, answers, docs")
    parser.add_argument(
        "--methods",
        default="stock,pp_reference,pp_triton,pp_p1,pp_interleaved",
        type=method_list,
        help="comma list; METHOD@W1|W2 runs METHOD only on the named workloads",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=float("inf"),
        help="skip the runs left after this many seconds (the table and plot are still written)",
    )
    parser.add_argument(
        "--stock",
        choices=["per_chunk", "full", "extrapolate"],
        default="per_chunk",
        help="how `stock` is timed (see run_stock); `stock_full` always runs every chunk",
    )
    parser.add_argument("--stock-rows", type=int, default=16, help="rows per stock generate call")
    parser.add_argument(
        "--stock-tuned",
        choices=["full", "per_chunk"],
        default="full",
        help="how `stock_tuned` is timed (see run_stock_tuned)",
    )
    parser.add_argument(
        "--generate-batch",
        choices=["extrapolate", "full"],
        default="extrapolate",
        help="how `generate_batch` is timed (see run_generate_batch)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="scale document lengths (for quick checks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--book", type=Path, default=BOOK, help="War and Peace (gzip); default ../shared/data/")
    parser.add_argument("--tokenizer", default=None, help="folder of a tokenizer (else words hashed into ids)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    parser.add_argument("--tag", default="")
    parser.add_argument("--plot", type=Path, help="only redraw the table and plot of a results JSON")
    args = parser.parse_args(argv)
    if args.plot:
        results = json.loads(args.plot.read_text())["results"]
        print(table(results))
        plot(results, args.plot.with_suffix(".png"))
        return
    device = torch.device(args.device)
    model = build_model(args.model, device)
    vocab = model.config.vocab_size
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
    encode = (lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]) if tokenizer else (
        lambda s: [hash(w) % (vocab - 3) + 3 for w in s.split()])  # fmt: skip
    book = book_tokens(tokenizer, vocab, args.book)
    ceilings = measure_ceilings(device)
    print(
        f"ceilings: copy {ceilings['bandwidth'] / 1e12:.2f} TB/s, bf16 matmul {ceilings['matmul'] / 1e12:.0f} TFLOP/s"
    )
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{args.model}{args.tag}"
    methods = args.methods
    started = time.perf_counter()
    for kind in args.workloads.split(","):
        for work in grids(kind, args.scale):
            prompts = make_prompts(book, work, args.seed, encode, vocab)
            bound = roofline(model.config, prompts, work, ceilings)
            for method, *only in methods:
                if (only and work.name not in only[0].split("|")) or time.perf_counter() - started > args.deadline_s:
                    continue
                free_memory(model)
                try:
                    rows = stock_rows(model.config, work, args.stock_rows)  # the stock methods' chunk
                    if method in ("stock", "stock_full"):
                        res = run_stock(model, prompts, work, rows, "full" if method == "stock_full" else args.stock)
                    elif method == "stock_tuned":
                        res = run_stock_tuned(model, prompts, work, rows, mode=args.stock_tuned)
                    elif method == "generate_batch":
                        res = run_generate_batch(model, prompts, work, args.generate_batch)
                    else:
                        res = run_pp(model, prompts, work, METHODS[method])
                except Exception as err:  # report and go on: one failure must not lose the other figures
                    res = dict(error=f"{type(err).__name__}: {err}", total_s=float("nan"))
                    torch.cuda.empty_cache() if device.type == "cuda" else None
                row = dict(model=args.model, workload=work.name, method=method, kind=kind, **asdict(work), **res,
                           **bound, seed=args.seed)  # fmt: skip
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
                (args.out / f"{stem}.json").write_text(json.dumps(dict(ceilings=ceilings, results=results), indent=1))
    print(table(results))
    (args.out / f"{stem}.md").write_text(table(results) + "\n")
    try:
        plot(results, args.out / f"{stem}.png")
    except ImportError as err:  # no matplotlib on this machine: `--plot JSON` draws it elsewhere
        print(f"no plot: {err}")


if __name__ == "__main__":
    main()
