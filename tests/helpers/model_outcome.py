"""What hf_parallel does with one tiny model of the zoo: token-identical answers, a known refusal, a skip or a failure.

`outcome(lm)` refuses or passes the support check, then runs one workload in fp32 greedy: a shared document with
questions of several lengths (one question a prefix of another prompt) and a prompt of its own, EOS tokens taken from
the answers so streams stop at different steps, prefilled whole and in chunks of 7, against plain `model.generate` on
each prompt alone.  The test and `eval/model_coverage.py` share it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from hf_parallel import generate_tokens
from hf_parallel.frontends.probe import check_support
from hf_parallel.models.checks import REASONS

from .model_zoo import SKIPS, CausalLM, build
from .models import generate_alone, random_tokens

NEW = 6
# Failures that look like bugs in hf_parallel, not refusals: expected to fail until fixed (model type -> why).
KNOWN_BUGS: dict[str, str] = {}


@dataclass(frozen=True)
class Outcome:
    kind: str  # "identical" | "refused" | "skipped" | "fails"
    detail: str = ""  # refused: the REASONS key, then the message; skipped, fails: why

    @property
    def ok(self) -> bool:
        return self.kind in ("identical", "refused")


def outcome(lm: CausalLM) -> Outcome:
    """The outcome of `lm`; a type in KNOWN_BUGS that does not answer token-identically fails (detail: what was
    seen, a refusal included)."""
    if lm.model_type in SKIPS:
        return Outcome("skipped", SKIPS[lm.model_type])
    try:
        found = _run(lm)
    except Exception as err:  # noqa: BLE001 - any other exception is a failure, reported with where it came from
        found = Outcome("fails", _describe(err))
    if lm.model_type in KNOWN_BUGS and found.kind != "identical":
        return Outcome("fails", f"{found.kind}: {found.detail}" if found.kind != "fails" else found.detail)
    return found


def _run(lm: CausalLM) -> Outcome:
    model = build(lm)
    try:
        check_support(model)  # the refusal comes here, before any generation
    except NotImplementedError as err:
        reason = next((key for key, text in REASONS.items() if text in str(err)), None)
        return Outcome("refused", f"{reason}: {err}") if reason else Outcome("fails", f"unknown refusal: {err}")
    prompts = workload()
    eos = _eos([generate_alone(model, p, NEW) for p in prompts])
    want = [generate_alone(model, p, NEW, eos) for p in prompts]
    for chunk in (None, 7):
        got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=eos, prefill_chunk=chunk)
        if got != want:
            return Outcome("fails", f"prefill_chunk={chunk}: {_first_difference(got, want)}")
    return Outcome("identical")


def workload() -> list[list[int]]:
    """A 16-token document with questions of 1, 3 and 6 tokens, one question extended by 2 more, and a second root."""
    gen = torch.Generator().manual_seed(0)
    doc = random_tokens(16, gen)
    questions = [random_tokens(n, gen) for n in (1, 3, 6)]
    return [doc + q for q in questions] + [doc + questions[1] + random_tokens(2, gen), random_tokens(9, gen)]


def _eos(free: list[list[int]]) -> list[int]:
    """Two tokens the free-running answers write at different steps, so streams stop at different steps."""
    picks = [answer[step] for answer, step in zip(free[::2], (1, 3)) if len(answer) > step]
    return sorted(set(picks)) or [free[0][0]]


def _first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            step = next((t for t, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return f"prompt {i}, step {step}: got {g[step : step + 1]}, plain generate {w[step : step + 1]} ({g}, {w})"
    return f"{len(got)} answers for {len(want)} prompts"


def _describe(err: BaseException) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1]
    where = frame.filename.split("site-packages/")[-1].split("/work/cov/")[-1]
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} ({where}:{frame.lineno})"
