"""`Stats`: what one packed row's engine did, counted as it runs, for a caller (or a test) to read afterwards.

One `Stats` per row: the admission policy (`engine.policies`) and the engine core (`engine.core`) count into the
same object (the core takes its policy's), and a `generate_tokens` call adds what it checked and built
(`frontends.generate`).  `stream_tokens(...).stats` is a call's, complete once the iterator is exhausted; a caller's
own `Stats`, passed as `stats=` to `generate_tokens` or `stream_tokens` (or to a function that passes generation
options on, such as `answer_corpus`), totals every call it is given to.  Every count is made on the host, once per
round or per call: none inside a forward (per layer).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    """What a row's engine has done (a caller's: what every call it was given to has done).

    calls:           generate calls accepted (their inputs checked).
    prompts:         prompts of those calls.
    rounds:          forwards of the model.
    stream_forwards: streams fed, over all forwards.
    prompt_tokens:   prompt tokens computed (a prefix shared by several prompts once).
    tokens:          answer tokens accepted.
    captures:        CUDA graphs the (last) call's core captured (a kept row's earlier ones not counted).
    cancelled:       requests cancelled.
    failed:          requests failed.
    placements:      tries to place a waiting request's streams in the row's prefix tree (`Refill`, `Arrivals`;
                     a try that frees unused prefixes and tries again counts twice).
    refills:         admission rounds that placed streams beside live ones (continuous refill).
    ids_checked:     prompt token ids a call checked against the vocabulary (a shared prefix's once; every prompt's
                     in full only where some id is outside it).
    row_slots:       slots of the (last) call's row cache (its K/V for every layer).
    row_bytes:       bytes the (last) call's row cache held at its end (K/V and recurrent states).
    """

    calls: int = 0
    prompts: int = 0
    rounds: int = 0
    stream_forwards: int = 0
    prompt_tokens: int = 0
    tokens: int = 0
    captures: int = 0
    cancelled: int = 0
    failed: int = 0
    placements: int = 0
    refills: int = 0
    ids_checked: int = 0
    row_slots: int = 0
    row_bytes: int = 0
