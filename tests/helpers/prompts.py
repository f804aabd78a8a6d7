"""Random prompt sets: documents with questions, a document that repeats a span, prefix trees."""

from __future__ import annotations

import random

import torch

from .models import random_tokens


def random_tree_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes of random depth: roots, branches, prefixes of others, duplicates."""
    prompts = [[rng.randrange(4) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(1, 12)):
        base = rng.choice(prompts)
        cut = rng.randint(1, len(base))
        prompts.append(base[:cut] + [rng.randrange(4) for _ in range(rng.randint(0, 4))])
    return prompts


def corpus(seed: int, docs: int = 5, questions: int = 6) -> list[list[int]]:
    """`docs` random documents of 20 tokens, each with `questions` random questions of 1 to 5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    documents = [random_tokens(20, gen) for _ in range(docs)]
    return [d + random_tokens(1 + (i * 3) % 5, gen) for d in documents for i in range(questions)]


def prompts_with_repeats(seed: int = 0, questions: int = 5) -> list[list[int]]:
    """A document that repeats a span, and questions of different lengths, some quoting the document."""
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(24, gen)
    doc = doc + random_tokens(4, gen) + doc[3:15]
    return [doc + random_tokens(2 + i, gen) + (doc[5:8] if i % 2 else []) for i in range(questions)]
