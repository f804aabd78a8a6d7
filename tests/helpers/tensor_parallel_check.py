"""Run under `torchrun --nproc_per_node N`: a model loaded with `tp_plan="auto"` answers with hf_parallel as
`model.generate` answers each prompt alone under the same sharding.  Prints one `VERDICT <rank> ...` line per rank.

usage: torchrun --nproc_per_node 2 tests/helpers/tensor_parallel_check.py MODEL_DIR ATTN [ATTN ...]
"""

from __future__ import annotations

import gc
import os
import sys

if os.environ.get("TRITON_INTERPRET") is None and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the Triton path on the CPU (set before triton loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import hf_parallel  # noqa: E402
from hf_parallel.frontends.probe import check_support  # noqa: E402
from hf_parallel.models.placement import is_tensor_parallel  # noqa: E402

NEW = 6


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(3, vocab, (24,), generator=gen).tolist()
    questions = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 4, 7)]
    return [doc + q for q in questions] + [torch.randint(3, vocab, (9,), generator=gen).tolist()]


def alone(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def local_heads(model) -> tuple[int, int]:
    """(query heads, KV heads) this rank's first attention layer computes: from its local weight shards."""
    attn = model.model.layers[0].self_attn
    local = lambda w: w.to_local().shape[0] if hasattr(w, "to_local") else w.shape[0]  # noqa: E731
    return local(attn.q_proj.weight) // attn.head_dim, local(attn.k_proj.weight) // attn.head_dim


def main(path: str, attns: list[str]) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    rank = dist.get_rank()
    asked = prompts(model.config.vocab_size)
    want = [alone(model, p) for p in asked]
    heads = local_heads(model)
    config = model.config
    for attn in attns:
        got = hf_parallel.generate_tokens(model, asked, max_new_tokens=NEW, eos_token_id=[], attn=attn,
                                          max_memory="256MiB")  # fmt: skip  # the same row on every rank
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, got)
        # the cache holds this rank's KV heads only: K and V of every layer, fp32
        local_slot = config.num_hidden_layers * 2 * heads[1] * config.head_dim * 4
        slot_bytes = check_support(model).slot_bytes
        verdict = "ok" if got == want and all(r == got for r in ranks) and slot_bytes == local_slot else (
            f"mismatch got={got} want={want} ranks={ranks} slot_bytes={slot_bytes} local={local_slot}")  # fmt: skip
        # one write per line: the ranks share one pipe, and print's separate write of the newline interleaves
        line = f"VERDICT {rank} {attn} tp={is_tensor_parallel(model)} heads={heads[0]}/{heads[1]} {verdict}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    dist.barrier()
    del model  # its device mesh holds the group: freed first, the group's threads stop before Python's shutdown
    gc.collect()  # (else gloo aborts as it releases its last work then, about one run in 15 on transformers 5.17)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
