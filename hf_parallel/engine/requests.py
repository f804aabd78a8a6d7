"""One door: every request is checked by `check_request`, once, where it is built, whatever the front end
(`generate_tokens`, the serving engine under `serve` and `batch`, scoring and the harness), so the same bad request
gets the same message everywhere, each refusal written once.

    ValueError           an empty prompt or continuation, ids outside the vocabulary, a prompt past the model's
                         positions (`decoding.inputs.TooLong`, code "context_length_exceeded")
    TypeError            unknown or mistyped options (`GenerationOptions.resolve`)
    NotImplementedError  what hf_parallel cannot do for this model: drafts on layers with a recurrent state
"""

from __future__ import annotations

from transformers import PreTrainedModel

from ..decoding.inputs import check_length, check_tokens
from ..decoding.options import GenerationOptions
from ..runner.patching import ModelProfile


def check_request(
    model: PreTrainedModel,
    profile: ModelProfile | None,
    prompt: list[int],
    opts: GenerationOptions | None = None,
    targets: list[int] | None = None,
    name: str = "the prompt",
    target_name: str = "the continuation",
    both: str = "",
    ids_checked: bool = False,
) -> int:
    """Refuse a request (module docstring) before any work; its streams' most new tokens (generate's, for this prompt).

    opts: a generation request's options; targets: a score request's tokens (its last is only a target, never an
    input); name, target_name, both: what the messages call them, and the two together.  ids_checked: the caller
    has checked the ids already (a document shared by many prompts, once)."""
    if ids_checked:
        if not prompt:
            raise ValueError(f"{name} is empty")
    else:
        check_tokens(model, name, prompt)
    if targets is not None:
        check_tokens(model, target_name, targets)
        check_length(model, both or f"{name} with {target_name}", prompt + targets[:-1])  # the last is not an input
        return 0
    check_drafts(model, profile, opts)
    limit = opts.generate.prepare(model, prompt).max_new_tokens
    check_length(model, name, prompt, limit)
    return limit


def check_drafts(model: PreTrainedModel, profile: ModelProfile | None, opts: GenerationOptions) -> None:
    """Refuse drafts (prompt lookup, an assistant) on a model with layers of a recurrent state."""
    if opts.speculation is not None and profile is not None and profile.recurrent:
        raise NotImplementedError(
            f"speculative decoding: {type(model).__name__} has layers with a recurrent state, which a rejected draft "
            "token would leave advanced; decode without prompt_lookup_num_tokens or assistant_model"
        )
