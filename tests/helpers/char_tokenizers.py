"""Real fast tokenizers over the tiny models' vocabulary, built offline: one token per character."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .models import VOCAB

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """One token per (lower-cased) character, ids below the tiny models' vocabulary; EOS = 2 as in LlamaConfig."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,;:?!'\"-()\n")
    vocab = {token: i for i, token in enumerate(specials + chars)}
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        unk_token="<unk>", additional_special_tokens=["<|im_start|>"])  # fmt: skip
    tokenizer.chat_template = CHATML if chat else None
    return tokenizer


def ascii_tokenizer() -> PreTrainedTokenizerFast:
    """Every id of the tiny vocabulary a character (letters, digits, punctuation, space, newline); no special tokens."""
    chars = string.ascii_letters + string.digits + string.punctuation + " \n"
    assert len(chars) == VOCAB
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)
