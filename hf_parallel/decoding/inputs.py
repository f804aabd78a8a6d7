"""Checks of what users hand in, made before any model work, each error naming the argument.

One place for the checks that generation, scoring, judging and evaluation share: the
model, token sequences, texts and the EOS tokens.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel


def check_text(name: str, text) -> None:
    """A non-empty string, or a TypeError / ValueError naming `name`."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{name} is empty")


def as_token_lists(name: str, sequences) -> list[list[int]]:
    """`sequences` as lists of ints: a list of token-id lists (or 1-D tensors), or a 2-D tensor, one row each."""
    if isinstance(sequences, torch.Tensor):
        if sequences.dim() != 2:
            raise TypeError(
                f"{name} must be a list of token-id lists or a 2-D tensor; got a {sequences.dim()}-D tensor "
                "(one prompt: wrap it in a list)"
            )
        sequences = list(sequences)
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
        raise TypeError(f"{name} must be a list of token-id lists, got {type(sequences).__name__}")
    return [_as_ids(f"{name}[{i}]", seq) for i, seq in enumerate(sequences)]


def _as_ids(name: str, seq) -> list[int]:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1 or seq.dtype.is_floating_point or seq.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {seq.dim()}-D {seq.dtype}")
        return seq.tolist()
    if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a list of token ids, got {type(seq).__name__} (tokenize text first)")
    if list(map(type, seq)).count(int) == len(seq):  # the common case, in C, no ABC checks (bool is not int's type)
        return list(seq)
    for t in seq:
        if not _is_int(t):
            raise TypeError(f"{name} must hold integer token ids, got {type(t).__name__} {t!r}")
    return [int(t) for t in seq]


def _is_int(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_tokens(model: PreTrainedModel, name: str, tokens: list[int], room: int = 0) -> None:
    """Refuse an empty sequence, ids outside the vocabulary, and `len(tokens) + room` past the model's positions."""
    if len(tokens) == 0:
        raise ValueError(f"{name} is empty")
    if not in_vocabulary(model, [tokens]):
        vocab = model.config.get_text_config().vocab_size
        raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab})")
    check_length(model, name, tokens, room)


def in_vocabulary(model: PreTrainedModel, pieces: list[list[int]]) -> bool:
    """Whether every id of `pieces` lies in the model's vocabulary [0, vocab_size)."""
    vocab = model.config.get_text_config().vocab_size
    return all(min(piece) >= 0 and max(piece) < vocab for piece in pieces if piece)


class TooLong(ValueError):
    """A prompt (with its new tokens) past the model's positions; `code`: the error's name in an API response;
    `by_prompt`: the prompt alone fills the positions (else its new tokens pass them)."""

    code = "context_length_exceeded"

    def __init__(self, message: str, by_prompt: bool):
        super().__init__(message)
        self.by_prompt = by_prompt


def check_length(model: PreTrainedModel, name: str, tokens: list[int], room: int = 0) -> None:
    """Refuse `len(tokens) + room` past the model's positions (`check_tokens` without the ids): `TooLong`."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and len(tokens) + room > limit:
        extra = f"; with max_new_tokens={room} it" if room else ", which"
        raise TooLong(
            f"{name} has {len(tokens)} tokens{extra} would exceed the model's {limit} positions "
            "(max_position_embeddings)",
            len(tokens) >= limit,
        )


def eos_token_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """The EOS tokens answers stop at: the model's generation_config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "neither the model's generation_config nor the tokenizer defines an EOS token, so answers would never "
            "stop; pass eos_token_id=... (or set tokenizer.eos_token)"
        )
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
