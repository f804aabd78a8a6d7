"""The model arguments hf-parallel takes: the harness's HF backend's that apply, and hf_parallel's own."""

from __future__ import annotations

from .requests import ModelArgumentError

# HFLM's arguments that apply here, passed on as they are (max_batch_size: the harness passes it; unused)
PASSED_ON = frozenset(
    "revision subfolder tokenizer use_fast_tokenizer add_bos_token prefix_token_id truncation logits_cache "
    "max_batch_size backend gguf_file".split()
)
OWN = frozenset(
    "pretrained dtype device max_length trust_remote_code batch_size max_call_tokens attn max_memory".split()
)
REFUSED = {
    "parallelize": "a model split over devices is loaded by accelerate's device_map, outside the harness",
    "tp_plan": "tensor parallelism runs under torchrun, outside the harness",
    "peft": "adapters: merge them into the weights first",
    "delta": "delta weights: add them to the weights first",
    "autogptq": "quantized kernels are not served",
    "gptqmodel": "quantized kernels are not served",
    "softmax_dtype": "log-probabilities are always taken in float32",
    "mixed_precision_dtype": "autocast is not applied; load the model in the dtype wanted",
    "think_end_token": "thinking traces are not cut",
    "enable_thinking": "thinking traces are not cut",
}


def check_arguments(kwargs: dict) -> None:
    """Refuse model arguments hf-parallel does not take (beyond its own and PASSED_ON), each by name."""
    for name, value in kwargs.items():
        if name in REFUSED:
            raise ModelArgumentError(f"hf-parallel does not take the model argument {name}={value!r}: {REFUSED[name]}")
        if name not in PASSED_ON:
            raise ModelArgumentError(
                f"unknown model argument {name}={value!r}; hf-parallel takes {', '.join(sorted(OWN | PASSED_ON))}"
            )


def batch_size_notice(batch_size) -> str | None:
    """The one-line notice that `batch_size` is ignored (None for the harness's default, 1): requests per call,
    as `hf` takes it (an integer, "auto" or "auto:N"), mean nothing here, where a call holds every request that
    fits.  ModelArgumentError for a value `hf` would refuse."""
    text = str(batch_size)
    head, _, tail = text.partition(":")
    if not (text.isdigit() and int(text) >= 1) and not (head == "auto" and (not tail or _is_number(tail))):
        raise ModelArgumentError(f"batch_size={batch_size!r}: a number of requests, 'auto' or 'auto:N'")
    if text == "1":
        return None
    return (
        f"hf-parallel takes batch_size={text} and ignores it: a call holds every request that fits, those sharing "
        "a prefix together (max_call_tokens= bounds a call's tokens)"
    )


def call_tokens(max_call_tokens) -> int | None:
    """The most tokens of one call's prefix tree that `max_call_tokens` sets (an integer >= 1); None for None."""
    if max_call_tokens is None:
        return None
    text = str(max_call_tokens)
    if not text.isdigit() or int(text) < 1:
        raise ModelArgumentError(f"max_call_tokens={max_call_tokens!r}: a number of tokens (an integer >= 1)")
    return int(text)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
