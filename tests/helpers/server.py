"""The server's model name, documents and questions, and a batch file's requests about them."""

from __future__ import annotations

import random

from hf_parallel.frontends.demo import PASSAGE

NAME = "SmolLM2-135M-Instruct"
DOCUMENTS = [
    PASSAGE,
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",
    "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make oxygen and "
    "energy in the form of sugar. It takes place mostly in the leaves.",
    "The Great Wall of China is a series of fortifications built across the historical northern borders of "
    "ancient Chinese states to protect against nomadic groups from the Eurasian Steppe.",
]
ASKS = ["What is it about?", "Where is it?", "Summarize it in one sentence.", "Name one fact from it.",
        "Who is mentioned?", "What is the main subject?", "Give a title for it.", "What happens in it?"]  # fmt: skip


def batch_lines(tokenizer) -> list[dict]:
    """A batch file's requests: completions and chat about the documents, shuffled, with n and stop."""
    rng, lines = random.Random(3), []
    for i in range(10):
        doc, ask = DOCUMENTS[i % 3], ASKS[i % len(ASKS)]
        if i % 2:
            body = {"model": NAME, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": ask}]}
            url = "/v1/chat/completions"
        else:
            body, url = {"model": NAME, "prompt": f"{doc}\nQuestion: {ask}\nAnswer:"}, "/v1/completions"
        body.update(
            max_tokens=4 + i % 5, temperature=0, **({"n": 2} if i == 4 else {}), **({"stop": "."} if i == 6 else {})
        )
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})
    rng.shuffle(lines)
    return lines
