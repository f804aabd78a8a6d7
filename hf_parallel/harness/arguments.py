"""The model arguments hf-parallel takes: the harness's HF backend's that apply, and hf_parallel's own."""

from __future__ import annotations

from .requests import ModelArgumentError

# HFLM's arguments that apply here, passed on as they are (max_batch_size: the harness passes it; unused)
PASSED_ON = frozenset(
    "revision subfolder tokenizer use_fast_tokenizer add_bos_token prefix_token_id truncation logits_cache "
    "max_batch_size backend gguf_file".split()
)
OWN = frozenset("pretrained dtype device max_length trust_remote_code batch_size attn max_memory".split())
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


def budget_tokens(batch_size) -> int | None:
    """The most tokens per call that `batch_size` sets: an integer above 1; None for 1 and "auto" ("auto:N")."""
    text = str(batch_size)
    if text.startswith("auto"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise ModelArgumentError(f"batch_size={batch_size!r}: a number of tokens per call (an integer) or 'auto'")
    return int(text) if int(text) > 1 else None
