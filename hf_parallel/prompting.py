"""Text in, text out: render document + question prompts, generate in parallel, decode."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .generation import generate_tokens

PLAIN_TEMPLATE = "{document}\n\nQuestion: {question}\nAnswer:"
CHAT_TEMPLATE = "{document}\n\n{question}"  # the user turn when the tokenizer has a chat template


def render_prompts(
    tokenizer: PreTrainedTokenizerBase,
    document: str,
    questions: list[str],
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Token ids of each question's complete prompt, exactly as it would be tokenized alone.

    With a chat template (default when the tokenizer has one), document and question
    form the user turn (`template`, default "{document}\\n\\n{question}") and the
    generation prompt is added; otherwise `template` defaults to
    "{document}\\n\\nQuestion: {question}\\nAnswer:".
    """
    if use_chat_template is None:
        use_chat_template = getattr(tokenizer, "chat_template", None) is not None
    if use_chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("use_chat_template=True but the tokenizer has no chat template")
    if system_prompt is not None and not use_chat_template:
        raise ValueError("system_prompt needs a chat template; put it in `template` instead")
    if use_chat_template:
        return [_chat_ids(tokenizer, (template or CHAT_TEMPLATE).format(document=document, question=q), system_prompt)
                for q in questions]  # fmt: skip
    text = template or PLAIN_TEMPLATE
    return [tokenizer(text.format(document=document, question=q))["input_ids"] for q in questions]


def _chat_ids(tokenizer, user: str, system_prompt: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": user}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_parallel(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    document: str,
    questions: list[str],
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    **options,
) -> list[str]:
    """Answer every question about `document`; answers in the order of `questions`.

    The document's KV cache is computed once and all questions are decoded together,
    each as if asked alone.  `options` are generation options (`max_new_tokens`,
    `do_sample`, `temperature`, `top_k`, `top_p`, `eos_token_id`, `min_new_tokens`,
    `seed`, ...), defaulting to the model's generation_config.
    """
    if isinstance(questions, str):
        raise TypeError("questions must be a list of strings, not one string")
    if not questions:
        return []
    if not document or not document.strip():
        raise ValueError("the document is empty")
    for i, q in enumerate(questions):
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"question {i} is empty or not a string: {q!r}")
    options.setdefault("eos_token_id", _eos_ids(model, tokenizer))
    prompts = render_prompts(tokenizer, document, questions, template, use_chat_template, system_prompt)
    answers = generate_tokens(model, prompts, **options)
    return [tokenizer.decode(a, skip_special_tokens=True).strip() for a in answers]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "neither the model's generation_config nor the tokenizer defines an EOS token, so answers would never "
            "stop; pass eos_token_id=... (or set tokenizer.eos_token)"
        )
    return eos
