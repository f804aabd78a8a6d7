"""Random prompt sets shaped as prefix trees."""

from __future__ import annotations

import random


def random_tree_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes of random depth: roots, branches, prefixes of others, duplicates."""
    prompts = [[rng.randrange(4) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(1, 12)):
        base = rng.choice(prompts)
        cut = rng.randint(1, len(base))
        prompts.append(base[:cut] + [rng.randrange(4) for _ in range(rng.randint(0, 4))])
    return prompts
