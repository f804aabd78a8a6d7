"""Scaling benchmark for several GPUs: accelerate's big-model placement, tensor parallelism, data parallelism.

Random weights of real model shapes (timing does not depend on weight values; nothing is downloaded): bf16 on
GPUs, fp32 on the CPU (`--shape tiny`, for the smoke tests).  Prompts are random token ids, seeded: a document of
`--doc` tokens and `--questions` questions of 10-17 tokens each (token values do not change the timing either, and
the script needs no book or tokenizer on the GPU machine); every answer is forced to `--answer` tokens (no EOS).

  --mode placement  python eval/scale_bench.py --mode placement
      The model over every visible GPU as `device_map="auto"` places it (accelerate's balanced map), built on the
      meta device and each tensor made on its GPU, never on the CPU.  One document x --questions, side by side:
      hf_parallel.generate_tokens (the package's defaults) and stock Transformers (eval/bench.py's helpers: the
      document's KV prefilled once and copied into every row, rows in chunks of --stock-chunk, `model.generate`).
  --mode tp         torchrun --nproc_per_node N eval/scale_bench.py --mode tp --checkpoint DIR
      The same under Transformers' tensor parallelism (tp_plan "auto", applied by `from_pretrained`).  A missing
      --checkpoint is written by rank 0 as *sparse* safetensors files of zeros (headers, then holes: almost no
      disk, e.g. 70b: 141 GB apparent size in 5 GiB files, about 100 KB used; the file system must support sparse
      files), and every rank fills its own shards with seeded random values after loading.  hf_parallel gets an explicit
      max_memory (the smallest free memory of the ranks unless --max-memory), so every rank sizes the same row.
  --mode data       accelerate launch --num_processes N eval/scale_bench.py --mode data
      --docs documents x --questions, split over the processes by
      hf_parallel.frontends.data_parallel.balanced_split; each process builds the model on its own device and
      answers its share with one generate_tokens call.  Wall time from a barrier before to a barrier after; runs
      with other N accumulate in one JSON, the table shows the speedup over N=1.  Each process checks its first
      --check-docs documents against stock Transformers.

Roofline (placement, tp): per forward, max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), summed over the
prefill and the decode steps (eval/bench.py's `roofline`: all weights once, the document's KV once and each
stream's own KV per step), each GPU's bandwidth and matmul rate measured here (`measure_ceilings`).  Under
placement the layers run one GPU after another, so the bound is the sum over GPUs of each GPU's share (its layers,
and the embedding and LM head where the LM head is) at its own rates; under tensor parallelism every GPU reads its
1/N at once, so it is the whole over the GPUs' summed rates (communication not counted).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import struct
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import accelerate
import torch
import transformers
from accelerate.utils import gather_object, get_balanced_memory, set_module_tensor_to_device

import hf_parallel
from hf_parallel.frontends.data_parallel import balanced_split, process_state
from hf_parallel.models.placement import eager_only, execution_devices, is_tensor_parallel, loop_device, normal_device
from hf_parallel.runner.sizing import free_memory as device_free_memory

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # weights' shapes; the rope base as the real model's (it changes no timing)
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),  # Llama-3-70B
    "7b": dict(vocab_size=32016, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, rope_theta=1e6),  # CodeLlama-7B (Llama-2-7B + 16 ids)
    # std 0.2: logits far from ties, so fp32 greedy answers of two code paths compare exactly
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, initializer_range=0.2),
}  # fmt: skip
DEFAULTS = {  # mode -> (shape, doc tokens, questions per document)
    "placement": ("70b", 8192, 64),
    "tp": ("70b", 8192, 64),
    "data": ("7b", 2048, 32),
}
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def load_bench():
    """eval/bench.py as a module (eval/ is no package), once: its prefill, stock chunk, ceilings and roofline."""
    if "eval_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("eval_bench", Path(__file__).with_name("bench.py"))
        sys.modules["eval_bench"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["eval_bench"]


bench = load_bench()


# --------------------------------------------------------------------------- the model


def shape_config(shape: str) -> transformers.LlamaConfig:
    """The shape's config; no EOS, so stock generate and hf_parallel (eos_token_id=[]) both force every token."""
    return transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, bos_token_id=None,
                                    eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)  # fmt: skip


def empty_model(config, dtype: torch.dtype):
    """Parameters on the meta device; buffers (the rotary inv_freq) are computed for real, on the CPU."""
    with accelerate.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def fill_random(tensor: torch.Tensor, seed: int, std: float) -> None:
    """Norm weights (1-D) ones, as the model initializes them; matrices N(0, std), seeded, made where they live."""
    if tensor.dim() == 1:
        tensor.fill_(1.0)
        return
    tensor.normal_(0.0, std, generator=torch.Generator(tensor.device).manual_seed(seed))


def mapped_device(device_map: dict, name: str) -> torch.device:
    """Where `device_map` puts the parameter or module `name`: its longest entry that is `name` or holds it."""
    key = max((k for k in device_map if k in ("", name) or name.startswith(f"{k}.")), key=len)
    return normal_device(device_map[key])


def build_model(config, device_map: dict, dtype: torch.dtype, hooks: bool = True):
    """The random model placed by `device_map`, every parameter made on its device (a 70b never touches the CPU).

    hooks: dispatch with accelerate's hooks even on one device (a CPU map exercises the multi-GPU code path).
    """
    model = empty_model(config, dtype)
    for seed, (name, param) in enumerate(list(model.named_parameters())):
        value = torch.empty(param.shape, dtype=dtype, device=mapped_device(device_map, name))
        fill_random(value, seed, config.initializer_range)
        set_module_tensor_to_device(model, name, value.device, value=value, clear_cache=False)
    model = accelerate.dispatch_model(model, device_map, skip_keys=model._skip_keys_device_placement,
                                      force_hooks=hooks)  # fmt: skip  # as from_pretrained(device_map=...) does
    check_rotary(model)
    return model


def check_rotary(model) -> None:
    """The rotary inverse frequencies (buffers the meta init leaves real) are Llama's default, on their device."""
    rotary, c = model.model.rotary_emb, model.config
    dim = c.hidden_size // c.num_attention_heads
    theta = c.rope_parameters["rope_theta"]
    want = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim)
    if rotary.inv_freq.is_meta or not torch.allclose(rotary.inv_freq.float(), want, rtol=1e-5):
        raise RuntimeError(f"rotary inv_freq not computed: {rotary.inv_freq[:4]} vs {want[:4]}")


def auto_map(model, devices: list[torch.device], dtype: torch.dtype) -> dict:
    """`device_map="auto"` over `devices`: accelerate's balanced map (as from_pretrained infers it), or, on the CPU,
    every block its own entry on "cpu" (the hooks of a multi-device map on the one device there is)."""
    if devices == [torch.device("cpu")]:
        blocks = [f"model.{n}" for n, _ in model.model.named_children() if n != "layers"]
        blocks += [f"model.layers.{i}" for i in range(len(model.model.layers))]
        return {name: "cpu" for name in [*blocks, "lm_head"]}
    free = {d.index: int(torch.cuda.mem_get_info(d)[0] * 0.9) for d in devices}  # no "cpu": nothing offloaded
    split = model._no_split_modules
    memory = get_balanced_memory(model, free, no_split_module_classes=split, dtype=dtype)
    device_map = accelerate.infer_auto_device_map(model, memory, no_split_module_classes=split, dtype=dtype)
    if any(not isinstance(d, int) for d in device_map.values()):
        raise SystemExit(f"the model does not fit the GPUs' memory ({free}): {device_map}")
    return device_map


def layers_per_device(config, device_map: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in range(config.num_hidden_layers):
        device = str(mapped_device(device_map, f"model.layers.{i}"))
        counts[device] = counts.get(device, 0) + 1
    return counts


# --------------------------------------------------------------------------- the workload and its methods


def make_documents(vocab: int, docs: int, doc_len: int, questions: int, seed: int) -> list[list[list[int]]]:
    """Per document its prompts: the document's random ids, then question i's (10 + i % 8 of them)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(docs):
        doc = torch.randint(3, vocab, (doc_len,), generator=gen).tolist()
        out.append([doc + torch.randint(3, vocab, (10 + i % 8,), generator=gen).tolist() for i in range(questions)])
    return out


def timed(fn, devices) -> tuple[float, object]:
    """Seconds `fn` takes, every GPU of `devices` synchronized before and after (a placed model's forward ends on
    its last GPU; under torchrun each rank synchronizes only its own, the others' belong to the other ranks)."""
    synchronize(devices)
    start = time.perf_counter()
    out = fn()
    synchronize(devices)
    return time.perf_counter() - start, out


def synchronize(devices) -> None:
    for device in devices:
        torch.cuda.synchronize(device) if device.type == "cuda" else None


def run_parallel(model, prompts, answer: int, **options) -> tuple[float, list[list[int]]]:
    """hf_parallel.generate_tokens, timed after one untimed run of the same prompts: Triton's compilation and
    autotuning, CUDA graph capture and the allocator's growth are not what is measured."""
    run = lambda: hf_parallel.generate_tokens(model, prompts, max_new_tokens=answer, eos_token_id=[], **options)  # noqa: E731
    run()
    return timed(run, execution_devices(model))


def run_stock(model, prompts, doc_len: int, answer: int, rows: int) -> tuple[float, list[list[int]]]:
    """Stock Transformers, timed: the document prefilled once, then every chunk of `rows` rows generated in full.

    One chunk runs first, untimed (a shape's first run was 1.6-1.9x slower on the H200: the allocator growing).
    """
    chunks = [prompts[i : i + rows] for i in range(0, len(prompts), rows)]
    chunk = lambda cache, c: bench.generate_chunk(model, cache, c, doc_len, answer)[:, -answer:].tolist()  # noqa: E731
    prefill = lambda: bench.prefill_document(model, prompts[0][:doc_len], loop_device(model))  # noqa: E731
    chunk(prefill(), chunks[0])

    def go():
        cache = prefill()
        return [tokens for c in chunks for tokens in chunk(cache, c)]

    return timed(go, execution_devices(model))


def release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def roofline(config, prompts, doc_len: int, answer: int, parts: list[tuple[int, bool, dict]]) -> dict:
    """eval/bench.py's roofline summed over `parts` run one after another: (layers, holds the LM head, ceilings).

    A part's bytes are its layers' weights and KV (and, with the LM head, the LM head's weights and the embedding
    rows looked up)."""
    work = bench.Workload("scale", doc_len, len(prompts), answer)
    total = dict(roofline_s=0.0, roofline_prefill_s=0.0, roofline_decode_s=0.0, serial_s=0.0)
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    for layers, head, ceilings in parts:
        part = SimpleNamespace(**{f: getattr(config, f) for f in fields}, num_hidden_layers=layers,
                               vocab_size=config.vocab_size if head else 0)  # fmt: skip
        for key, value in bench.roofline(part, prompts, work, ceilings).items():
            total[key] += value
    return total


def pipelined_parts(config, device_map: dict, ceilings: dict) -> list[tuple[int, bool, dict]]:
    head = str(mapped_device(device_map, "lm_head"))
    layers = layers_per_device(config, device_map)
    return [(layers.get(d, 0), d == head, ceilings[d]) for d in sorted({*layers, head})]


def measure_ceilings(device: torch.device) -> dict:
    """eval/bench.py's measured copy bandwidth and bf16 matmul rate of `device`, made the current device: its CUDA
    events time the current device's stream (on another GPU they would time nothing)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return bench.measure_ceilings(device)


def summed(ceilings: list[dict]) -> dict:
    return dict(bandwidth=sum(c["bandwidth"] for c in ceilings), matmul=sum(c["matmul"] for c in ceilings))


def attempt(fn) -> tuple[float, list | None, str | None]:
    """(seconds, answers, None), or (nan, None, the error) when the method fails: one method's failure must not
    lose the other's figures on a machine with several GPUs that is hard to get."""
    try:
        return (*fn(), None)
    except Exception as err:  # noqa: BLE001  # reported in the JSON and the table; the traceback on stderr
        traceback.print_exc()
        release_memory()
        return float("nan"), None, f"{type(err).__name__}: {err}"


def method_row(run: tuple, tokens: int, bound: dict) -> dict:
    seconds, _, error = run
    row = dict(wall_s=seconds, tokens_per_s=tokens / seconds, roofline_fraction=bound["roofline_s"] / seconds)
    return row if error is None else dict(row, error=error)


def compare(report: dict, pp: tuple, stock: tuple, bound: dict, tokens: int) -> dict:
    """The two methods side by side: times, the roofline fraction, the speedup and how many answers agree."""
    pp_out, stock_out = pp[1] or [], stock[1]
    equal = sum(a == b for a, b in zip(pp_out, stock_out)) if pp[1] is not None and stock_out is not None else None
    methods = dict(hf_parallel=method_row(pp, tokens, bound), stock=method_row(stock, tokens, bound))
    return dict(report, **bound, methods=methods, speedup=stock[0] / pp[0], answers_equal=equal,
                answers=len(pp_out), answer_tokens=tokens,
                distinct_tokens=len({t for a in pp_out for t in a}))  # fmt: skip  # > 1: not a degenerate model


# --------------------------------------------------------------------------- modes


def devices_here() -> list[torch.device]:
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]


def model_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32  # fp32 on the CPU: exact comparisons


def placement(args) -> dict:
    devices = devices_here()
    ceilings = {str(d): measure_ceilings(d) for d in devices}  # before the model fills the memory
    config, dtype = shape_config(args.shape), model_dtype()
    device_map = auto_map(empty_model(config, dtype), devices, dtype)
    model = build_model(config, device_map, dtype)
    prompts = make_documents(config.vocab_size, 1, args.doc, args.questions, args.seed)[0]
    pp = attempt(lambda: run_parallel(model, prompts, args.answer, **args.options))
    release_memory()
    stock = attempt(lambda: run_stock(model, prompts, args.doc, args.answer, args.stock_chunk))
    bound = roofline(config, prompts, args.doc, args.answer, pipelined_parts(config, device_map, ceilings))
    report = dict(common(args, dtype, devices), ceilings=ceilings, hf_parallel_eager=eager_only(model),
                  layers_per_device=layers_per_device(config, device_map),
                  roofline_model="pipelined: sum over GPUs of (their layers' bytes / their bandwidth)")  # fmt: skip
    return compare(report, pp, stock, bound, len(prompts) * args.answer)


def common(args, dtype, devices) -> dict:
    return dict(mode=args.mode, shape=args.shape, dtype=str(dtype).removeprefix("torch."),
                gpus=torch.cuda.device_count(), devices=[str(d) for d in devices], doc=args.doc,
                questions=args.questions, answer=args.answer, stock_chunk=args.stock_chunk, seed=args.seed,
                hf_parallel_options={k: str(v) for k, v in args.options.items()}, torch=torch.__version__,
                transformers=transformers.__version__, accelerate=accelerate.__version__)  # fmt: skip


def write_sparse_checkpoint(config, path: Path, dtype: torch.dtype, shard_bytes: int = 5 * 2**30) -> None:
    """A checkpoint of zeros that takes almost no disk: safetensors files of at most `shard_bytes` of tensors (as
    save_pretrained shards; one 141 GB file could not even be mapped on a host with less memory), each a header
    then a hole.  config.json comes last, so a checkpoint with one is complete."""
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list] = [[]]
    for name, tensor in empty_model(config, dtype).state_dict().items():
        if shards[-1] and sum(_bytes(t) for _, t in shards[-1]) + _bytes(tensor) > shard_bytes:
            shards.append([])
        shards[-1].append((name, tensor))
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_sparse_file(path / file, shard, dtype)
        weight_map |= {name: file for name, _ in shard}
    total = sum(_bytes(t) for shard in shards for _, t in shard)
    index = dict(metadata=dict(total_size=total), weight_map=weight_map)
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(path)


def write_sparse_file(file: Path, tensors: list, dtype: torch.dtype) -> None:
    """One safetensors file of zeros: its header, then a hole as long as the tensors (read back as zeros)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in tensors:
        header[name] = dict(dtype=SAFETENSORS_DTYPES[dtype], shape=list(tensor.shape),
                            data_offsets=[offset, offset + _bytes(tensor)])  # fmt: skip
        offset += _bytes(tensor)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def checkpoint_ready(path: Path, shape: str) -> bool:
    """Whether `path` holds a complete checkpoint (its config.json is written last) of `shape`."""
    if not (path / "config.json").exists():
        return False
    saved = transformers.AutoConfig.from_pretrained(path)
    if any(getattr(saved, k) != v for k, v in SHAPES[shape].items() if k != "rope_theta"):  # rope: rope_parameters
        raise SystemExit(f"{path} holds a checkpoint of another shape than {shape}; give another --checkpoint")
    return True


def load_tensor_parallel(path: Path, dtype: torch.dtype):
    """from_pretrained with tp_plan "auto": through DistributedConfig where this transformers has it (5.24 deprecates
    the plain kwarg), else `tp_plan=` (5.17)."""
    if hasattr(transformers, "DistributedConfig"):
        plan = dict(distributed_config=transformers.DistributedConfig(tp_plan="auto"))
    else:
        plan = dict(tp_plan="auto")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **plan).eval()


def randomize_shards(model, config, dtype: torch.dtype) -> None:
    """Seeded random values in each rank's local shard, in place: a replicated tensor the same on every rank (the
    ranks must agree on it), a sharded one different per rank."""
    full = {name: tuple(t.shape) for name, t in empty_model(config, dtype).state_dict().items()}
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731  # a DTensor's shard aliases it
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            sharded = tuple(local(param).shape) != full[name]
            fill_random(local(param), i * world + rank if sharded else i * world, config.initializer_range)
            if not local(param).any():
                raise RuntimeError(f"{name}: the random values did not reach the parameter (still the zeros loaded)")


def start_ranks() -> torch.device:
    """This rank's device, its process group started (NCCL on GPUs, gloo on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def tensor_parallel(args) -> dict | None:
    dist = torch.distributed
    device = start_ranks()
    config, dtype = shape_config(args.shape), model_dtype()
    if dist.get_rank() == 0 and not checkpoint_ready(args.checkpoint, args.shape):
        write_sparse_checkpoint(config, args.checkpoint, dtype)
    dist.barrier()
    ceilings = [None] * dist.get_world_size()
    dist.all_gather_object(ceilings, measure_ceilings(device))  # before the model fills the memory
    model = load_tensor_parallel(args.checkpoint, dtype)
    randomize_shards(model, config, dtype)
    prompts = make_documents(config.vocab_size, 1, args.doc, args.questions, args.seed)[0]
    max_memory = args.max_memory or same_memory(device)
    dist.barrier()
    pp = attempt(lambda: run_parallel(model, prompts, args.answer, **args.options, max_memory=max_memory))
    release_memory()
    dist.barrier()
    stock = attempt(lambda: run_stock(model, prompts, args.doc, args.answer, args.stock_chunk))
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, pp[1])
    bound = roofline(config, prompts, args.doc, args.answer, [(config.num_hidden_layers, True, summed(ceilings))])
    report = dict(common(args, dtype, [device]), ranks=dist.get_world_size(), max_memory=max_memory,
                  ceilings=ceilings, tensor_parallel=is_tensor_parallel(model),
                  ranks_agree=all(o == pp[1] for o in outs),
                  roofline_model="tensor parallel: all bytes / the GPUs' summed bandwidth")  # fmt: skip
    report = compare(report, pp, stock, bound, len(prompts) * args.answer)
    main_rank = dist.get_rank() == 0
    model = None  # its device mesh holds the group: see leave_group
    leave_group()
    return report if main_rank else None


def leave_group() -> None:
    """Every process leaves the group together.  A process that exits while gloo still talks to it aborts the other,
    and so does one whose group outlives `destroy_process_group`, held by a tensor-parallel model's device mesh:
    gloo's threads then release their last work during Python's shutdown, and abort ("terminate called without an
    active exception"; about one run in 15 on transformers 5.17).  So the caller drops its model first, and the
    collection here frees the mesh (none in 40 runs aborted so)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        gc.collect()  # the model's device mesh, in reference cycles
        torch.distributed.destroy_process_group()


def same_memory(device: torch.device) -> int:
    """80% of the smallest free memory of the ranks' devices: every rank must size the same row."""
    free = torch.tensor([device_free_memory(device)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN)
    return int(free.item() * 0.8)


def data_parallel(args) -> dict | None:
    state = process_state()
    config, dtype = shape_config(args.shape), model_dtype()
    model = build_model(config, {"": state.device}, dtype, hooks=False)  # this process's own copy, on its device
    docs = make_documents(config.vocab_size, args.docs, args.doc, args.questions, args.seed)
    weights = [sum(map(len, d)) - (len(d) - 1) * args.doc for d in docs]  # prompt tokens, the document once
    mine = balanced_split(weights, state.num_processes)[state.process_index]
    prompts = [p for d in mine for p in docs[d]]
    answer = lambda p: hf_parallel.generate_tokens(model, p, max_new_tokens=args.answer, eos_token_id=[],  # noqa: E731
                                                   **args.options)  # fmt: skip
    if prompts:  # warm-up on one document, untimed: compilation, autotuning, the first CUDA graphs
        answer(docs[mine[0]])
    state.wait_for_everyone()
    start = time.perf_counter()
    own_s, out = timed(lambda: answer(prompts) if prompts else [], [state.device])
    state.wait_for_everyone()
    wall = time.perf_counter() - start
    checked = list(mine[: args.check_docs])
    equal = sum(check_document(model, docs[d], out, k, args) for k, d in enumerate(checked))
    rows = gather_object([dict(process=state.process_index, device=str(state.device), docs=len(mine),
                               prompts=len(prompts), own_s=own_s, checked=len(checked) * args.questions,
                               equal=equal)])  # fmt: skip
    leave_group()
    if not state.is_main_process:
        return None
    tokens = args.docs * args.questions * args.answer
    return dict(common(args, dtype, [state.device]), processes=state.num_processes, docs=args.docs, wall_s=wall,
                answer_tokens=tokens, tokens_per_s=tokens / wall, per_process=rows,
                answers_checked=sum(r["checked"] for r in rows),
                answers_equal=sum(r["equal"] for r in rows))  # fmt: skip


def check_document(model, prompts, out, position: int, args) -> int:
    """How many of the document's answers (the `position`-th document of this share) stock Transformers gives too."""
    start = position * args.questions
    _, stock = run_stock(model, prompts, args.doc, args.answer, args.stock_chunk)
    return sum(a == b for a, b in zip(out[start : start + args.questions], stock))


# --------------------------------------------------------------------------- reports


def write_report(report: dict, out: Path) -> str:
    """The JSON and a Markdown table under `out`; data-mode runs of other process counts are kept beside this one."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"scale-{report['mode']}-{report['shape']}"
    if report["mode"] == "data":
        old = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").exists() else {}
        runs = {r["processes"]: r for r in old.get("runs", [])} | {report["processes"]: report}
        stem.with_suffix(".json").write_text(json.dumps(dict(runs=[runs[n] for n in sorted(runs)]), indent=1))
        table = data_table([runs[n] for n in sorted(runs)])
    else:
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        table = method_table(report)
    stem.with_suffix(".md").write_text(table + "\n")
    return table


def method_table(r: dict) -> str:
    rows = [f"{r['mode']} {r['shape']} ({r['dtype']}, {len(r['ceilings'])} device(s)): 1 doc x {r['doc']} tokens x "
            f"{r['questions']} questions x {r['answer']} answer tokens; roofline {r['roofline_s']:.2f} s "
            f"({r['roofline_model']})", "",
            "| method | wall s | answer tokens/s | roofline / wall | answers = stock |",
            "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, m in r["methods"].items():
        failed = f" (failed: {m['error'][:200]})" if "error" in m else ""
        rows.append(f"| {name}{failed} | {m['wall_s']:.2f} | {m['tokens_per_s']:.0f} | {m['roofline_fraction']:.2f} "
                    f"| {agreement(r)} |")  # fmt: skip
    return "\n".join(rows)


def agreement(r: dict) -> str:
    return "-" if r["answers_equal"] is None else f"{r['answers_equal']}/{r['answers']}"


def data_table(runs: list[dict]) -> str:
    one = next((r for r in runs if r["processes"] == 1), None)
    rows = ["| processes | docs | wall s | answer tokens/s | speedup vs 1 | slowest / fastest process "
            "| answers = stock |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in runs:
        own = [p["own_s"] for p in r["per_process"]]
        speedup = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one else "-"
        spread = max(own) / max(min(own), 1e-9)
        rows.append(f"| {r['processes']} | {r['docs']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | {speedup} "
                    f"| {spread:.2f} | {r['answers_equal']}/{r['answers_checked']} |")  # fmt: skip
    return "\n".join(rows)


def summary(r: dict) -> str:
    if r["mode"] == "data":
        return (f"data {r['shape']} x{r['processes']}: {r['wall_s']:.2f} s, {r['tokens_per_s']:.0f} answer tokens/s; "
                f"answers = stock {r['answers_equal']}/{r['answers_checked']}")  # fmt: skip
    pp, stock = r["methods"]["hf_parallel"], r["methods"]["stock"]
    return (f"{r['mode']} {r['shape']} on {len(r['ceilings'])} device(s): hf_parallel {pp['wall_s']:.2f} s "
            f"({pp['tokens_per_s']:.0f} tok/s, {pp['roofline_fraction']:.2f} of roofline), "
            f"stock {stock['wall_s']:.2f} s ({stock['tokens_per_s']:.0f} tok/s), {r['speedup']:.1f}x; "
            f"answers = stock {agreement(r)}")  # fmt: skip


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(DEFAULTS), required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: 70b (placement, tp), 7b (data)")
    parser.add_argument("--doc", type=int, help="document tokens; default 8192 (placement, tp), 2048 (data)")
    parser.add_argument("--questions", type=int, help="per document; default 64 (placement, tp), 32 (data)")
    parser.add_argument("--answer", type=int, default=128, help="forced answer tokens")
    parser.add_argument("--docs", type=int, default=256, help="documents (data mode)")
    parser.add_argument("--stock-chunk", type=int, default=16, help="rows per stock generate call")
    parser.add_argument("--check-docs", type=int, default=1, help="documents per process checked against stock (data)")
    parser.add_argument("--checkpoint", type=Path, help="tp: the checkpoint to load (written here if absent)")
    parser.add_argument("--max-memory", help="tp: hf_parallel's max_memory per rank; default 80%% of the least free")
    parser.add_argument("--attn", choices=["auto", "reference", "triton"], help="hf_parallel's; default its own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "scale")
    args = parser.parse_args(argv)
    shape, doc, questions = DEFAULTS[args.mode]
    args.shape, args.doc, args.questions = args.shape or shape, args.doc or doc, args.questions or questions
    args.options = {} if args.attn is None else dict(attn=args.attn)  # generate_tokens' own options
    if args.mode == "tp" and args.checkpoint is None:
        parser.error("--mode tp needs --checkpoint DIR (written there if absent)")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    started = time.perf_counter()
    run = dict(placement=placement, tp=tensor_parallel, data=data_parallel)[args.mode]
    report = run(args)
    if report is None:  # not the main process
        return None
    report["script_s"] = time.perf_counter() - started
    print(write_report(report, args.out))
    print(summary(report), flush=True)
    return report


if __name__ == "__main__":
    main()
