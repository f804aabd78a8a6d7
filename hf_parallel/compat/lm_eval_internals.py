"""What hf_parallel's harness backend relies on in lm-eval beyond its public API, one named function each.

Each docstring says what it relies on and the version it was checked on; tests/test_compat.py checks each.  It
imports nothing of lm-eval (an optional package, which only `hf_parallel.harness` imports): it is handed lm-eval's
objects.
"""

from __future__ import annotations


def encode_pair(lm, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context, continuation) token ids of a loglikelihood request with a non-empty context, split as `lm` (an
    lm-eval `TemplateLM`, such as HFLM) splits them: the context's trailing spaces moved to the continuation, the
    whole encoded at once (for a causal model) and split where the context's own encoding ends.

    Relies on: `TemplateLM._encode_pair(context, continuation)`, the private method HFLM's `loglikelihood` splits
    each request by (lm-eval 0.4.13)."""
    return lm._encode_pair(context, continuation)
