"""Text in, text out: the one prompt renderer, and `generate_parallel` on top of it.

Every prompt the package builds (questions about a document, judgments, evaluation
prompts, dialogue turns) is written by `prompt_text`, so a prompt is tokenized the
same way wherever it is made: with the tokenizer's chat template when it has one,
else as plain text that ends by asking for the answer.  Many prompts are tokenized together,
`TOKENIZE_BATCH` to a call of the tokenizer (`render_all`), which a fast tokenizer encodes on several threads,
since each of a document's prompts repeats the whole document (docs/benchmarks/kernel.md, "The prompts'
tokenization").
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..decoding.inputs import check_text, eos_token_ids
from .generate import generate_tokens
from .templates import check_template

PLAIN_TEMPLATE = "{document}\n\nQuestion: {question}"  # without a chat template; PLAIN_ANSWER follows
CHAT_TEMPLATE = "{document}\n\n{question}"  # the user turn when the tokenizer has a chat template
PLAIN_ANSWER = "\nAnswer:"  # closes a plain-text user turn
TOKENIZE_BATCH = 64  # texts per call of the tokenizer: enough for every core, while a fast tokenizer's encodings
# (ids, offsets and token strings, until converted) of a long document's prompts stay a bounded batch

Turns = str | Sequence[tuple[str, str | None]]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    turns: Turns,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    plain_answer: str = PLAIN_ANSWER,
) -> list[int]:
    """Token ids of one prompt, ending where the model's answer starts.

    turns: the user's text, or a dialogue `[(user, answer), ..., (user, None)]` whose
        earlier answers are given.
    With a chat template (default when the tokenizer has one) the turns are user and
    assistant messages after an optional system message, generation prompt added.
    Without one, each user text is followed by `plain_answer` and its answer, a turn per line.
    """
    return _tokenized(tokenizer, [prompt_text(tokenizer, turns, use_chat_template, system_prompt, plain_answer)])[0]


def prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    turns: Turns,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    plain_answer: str = PLAIN_ANSWER,
) -> tuple[str, bool]:
    """`render_prompt`'s text before tokenization, and whether the tokenizer adds its special tokens to it (plain
    text: yes; a chat template writes its own)."""
    turns = [(turns, None)] if isinstance(turns, str) else list(turns)
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if use_chat_template is None:
        use_chat_template = has_template
    if use_chat_template and not has_template:
        raise ValueError("use_chat_template=True but the tokenizer has no chat template")
    if not use_chat_template:
        if system_prompt is not None:
            raise ValueError("system_prompt needs a chat template; put it in the template instead")
        text = "\n".join(user + plain_answer + (f" {answer}" if answer is not None else "") for user, answer in turns)
        return text, True
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False


def render_prompts(
    tokenizer: PreTrainedTokenizerBase,
    document: str,
    questions: list[str],
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Token ids of each question's complete prompt, exactly as it would be tokenized alone.

    `template` fills the user turn from "{document}" and "{question}" (default
    "{document}\\n\\n{question}" with a chat template, "{document}\\n\\nQuestion: {question}"
    without one); see `render_prompt` for the rest.  The prompts are tokenized together (`render_all`).
    """
    use_chat = getattr(tokenizer, "chat_template", None) is not None if use_chat_template is None else use_chat_template
    template = check_template(template or (CHAT_TEMPLATE if use_chat else PLAIN_TEMPLATE))
    user_turns = [template.format(document=document, question=q) for q in questions]
    return render_all(tokenizer, user_turns, use_chat_template, system_prompt)


def render_all(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Turns],
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """`render_prompt` of each of `prompts`, tokenized `TOKENIZE_BATCH` to a call of the tokenizer (a batch, which
    a fast tokenizer encodes on several threads): the ids a call of its own gives each."""
    return _tokenized(tokenizer, [prompt_text(tokenizer, turns, use_chat_template, system_prompt) for turns in prompts])


def _tokenized(tokenizer, texts: list[tuple[str, bool]]) -> list[list[int]]:
    """The ids of `prompt_text`s (all with special tokens or all without): several in batches of a Transformers
    tokenizer, else one call each (any object called as one is: `tokenizer(text)`)."""
    if not texts:
        return []
    special = {} if texts[0][1] else {"add_special_tokens": False}
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or len(texts) == 1:
        return [tokenizer(text, **special)["input_ids"] for text, _ in texts]
    ids = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        ids += tokenizer([text for text, _ in texts[start : start + TOKENIZE_BATCH]], **special)["input_ids"]
    return ids


def generate_parallel(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    document: str,
    questions: list[str],
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    **options,
) -> list[str] | list[list[str]]:
    """Answer every question about `document`; answers in the order of `questions`.

    The document's KV cache is computed once and all questions are decoded together,
    each as if asked alone.  `options` are `generate_tokens`'s: what `model.generate`
    takes but beam search (`max_new_tokens`, `do_sample`, `temperature`, `top_p`,
    `repetition_penalty`, `stop_strings`, ...; `tokenizer` is this one), and `seed`,
    `attn`, ..., defaulting to the model's generation_config.  With
    `num_return_sequences=n > 1`, each question gets a list of n answers.
    """
    check_text("document", document)
    if isinstance(questions, str) or not isinstance(questions, Sequence):
        raise TypeError(f"questions must be a list of strings, got {type(questions).__name__}")
    if not questions:
        return []
    for i, q in enumerate(questions):
        check_text(f"question {i}", q)
    options.setdefault("eos_token_id", eos_token_ids(model, tokenizer))
    options.setdefault("tokenizer", tokenizer)
    prompts = render_prompts(tokenizer, document, questions, template, use_chat_template, system_prompt)
    tokens = generate_tokens(model, prompts, **options)
    answers = [tokenizer.decode(a, skip_special_tokens=True).strip() for a in tokens]
    n = len(answers) // len(prompts)  # num_return_sequences: each question's answers are contiguous
    return answers if n == 1 else [answers[i : i + n] for i in range(0, len(answers), n)]
