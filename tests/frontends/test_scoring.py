"""Candidate scoring over one prefix tree == a plain forward of each complete candidate input alone (fp32)."""

from __future__ import annotations

import pytest
import torch

from hf_parallel.frontends.judging import ChoiceQuestion, ScoreQuestion, YesNoQuestion, judge
from hf_parallel.frontends.scoring import score_continuations, score_tree
from tests.helpers.models import random_tokens, tiny_model

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

# fp32 sums of a few log-probabilities; observed differences are ~1e-5 (a different SDPA
# kernel and reduction order than the unmasked plain forward), so 1e-4 leaves margin.
ATOL = 1e-4


def alone(model, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """Per-token log-probabilities [len(cont)] of `cont` after `prompt`, from one plain forward of the whole input."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + cont])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs[torch.arange(len(cont)), torch.tensor(cont)]


def _check(model, prompts, continuations, **options):
    got = score_continuations(model, prompts, continuations, **options)
    per_token = score_continuations(model, prompts, continuations, per_token=True, **options)
    assert [len(g) for g in got] == [len(c) for c in continuations]
    for p, cands in enumerate(continuations):
        for c, cont in enumerate(cands):
            want = alone(model, prompts[p], cont)
            assert got[p][c] == pytest.approx(float(want.sum()), abs=ATOL), (p, c)
            assert per_token[p][c] == pytest.approx(want.tolist(), abs=ATOL), (p, c)
    return got


def _depth2(gen):
    """One context, three questions; candidates that are prefixes of one another, one-token ones, duplicates."""
    context = random_tokens(30, gen)
    prompts = [context + random_tokens(n, gen) for n in (4, 1, 7)]
    a, b = random_tokens(5, gen), random_tokens(1, gen)
    continuations = [
        [a[:1], a[:3], a, b, a[:3]],  # a[:3] twice: a duplicate candidate
        [random_tokens(2, gen), b, random_tokens(6, gen)],
        [b],  # a single one-token candidate
    ]
    return prompts, continuations


def test_depth2_matches_plain_forward(arch_model):
    prompts, continuations = _depth2(torch.Generator().manual_seed(0))
    _check(arch_model, prompts, continuations)


def test_depth3_and_several_contexts_match_plain_forward(arch_model):
    gen = torch.Generator().manual_seed(1)
    system = random_tokens(5, gen)
    prompts, continuations = [], []
    for context_len in (12, 20):  # system -> context -> question -> candidates
        context = system + random_tokens(context_len, gen)
        for question_len in (1, 3):
            prompts.append(context + random_tokens(question_len, gen))
            continuations.append([random_tokens(n, gen) for n in (1, 2, 4)])
    prompts.append(random_tokens(9, gen))  # a context with no shared system prefix: a second root
    continuations.append([random_tokens(3, gen), random_tokens(1, gen)])
    prompts.append(prompts[0])  # the same prompt twice, with other candidates
    continuations.append([continuations[0][2], random_tokens(2, gen)])
    _check(arch_model, prompts, continuations)


def test_prompt_that_extends_another_candidate(llama):
    gen = torch.Generator().manual_seed(2)
    prompt = random_tokens(15, gen)
    cont = random_tokens(6, gen)
    prompts = [prompt, prompt + cont[:3]]  # the second prompt runs through the first one's candidate
    _check(llama, prompts, [[cont, cont[:2]], [cont[3:], random_tokens(2, gen)]])


@pytest.mark.parametrize("chunk", [1, 5, 13])
def test_split_forwards_match_plain_forward(llama, chunk):
    prompts, continuations = _depth2(torch.Generator().manual_seed(3))
    _check(llama, prompts, continuations, prefill_chunk=chunk)


def test_reference_attention_named(llama):
    prompts, continuations = _depth2(torch.Generator().manual_seed(4))
    _check(llama, prompts, continuations, attn="reference")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_triton_path_matches_plain_forward(arch):
    """The Triton kernel (its interpreter on the CPU) over the same tree, whole and split into forwards."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(arch).to(device)
    prompts, continuations = _depth2(torch.Generator().manual_seed(7))
    got = [score_continuations(model, prompts, continuations, attn="triton", prefill_chunk=chunk)
           for chunk in (None, 9)]  # fmt: skip
    model = model.cpu()
    for p, cands in enumerate(continuations):
        for c, cont in enumerate(cands):
            want = float(alone(model, prompts[p], cont).sum())
            assert [g[p][c] for g in got] == pytest.approx([want, want], abs=ATOL), (p, c)


def test_tree_computes_each_shared_prefix_once(llama):
    prompts, continuations = _depth2(torch.Generator().manual_seed(5))
    scores = score_tree(llama, prompts, continuations)
    # the distinct non-empty prefixes of every input that must run (a candidate's last token is only a target)
    inputs = [p + c[:-1] for p, cands in zip(prompts, continuations) for c in cands]
    assert scores.computed_tokens == len({tuple(s[:i]) for s in inputs for i in range(1, len(s) + 1)})
    assert scores.computed_tokens < sum(len(s) for s in inputs)


def test_greedy_flags_and_a_candidate_filling_the_positions(llama):
    """A candidate is greedy where each of its tokens is its row's argmax in a plain forward; the last token of a
    candidate is only a target, so prompt and candidate may together hold one token more than the positions."""
    gen = torch.Generator().manual_seed(7)
    prompt = random_tokens(250, gen)
    with torch.no_grad():
        logits = llama(torch.tensor([prompt])).logits[0]
    argmax = int(logits[-1].argmax())
    continuations = [[[argmax], [(argmax + 1) % 96], random_tokens(7, gen)]]
    scores = score_tree(llama, [prompt], continuations)
    assert scores.greedy == [[True, False, False]]
    for cont, lp in zip(continuations[0], scores.token_logprobs[0]):
        assert float(lp.sum()) == pytest.approx(float(alone(llama, prompt, cont).sum()), abs=ATOL)


def test_bf16_stays_close():
    model = tiny_model("llama", torch.bfloat16)
    prompts, continuations = _depth2(torch.Generator().manual_seed(6))
    got = score_continuations(model, prompts, continuations)
    for p, cands in enumerate(continuations):
        for c, cont in enumerate(cands):
            # bf16 keeps 8 mantissa bits; per-token log-probs of a random model are ~-5, so a
            # few 1e-2 per token is rounding, not a masking error (those are off by whole nats)
            assert got[p][c] == pytest.approx(float(alone(model, prompts[p], cont).sum()), abs=0.1 * len(cont))


@pytest.mark.parametrize(
    "prompts, continuations, message",
    [
        ([[5, 6]], [[]], "no candidate continuations"),
        ([[5, 6]], [[[7], []]], "continuation 1 of prompt 0 is empty"),
        ([[]], [[[7]]], "prompt 0 is empty"),
        ([[5, 6]], [[[7]], [[8]]], "1 prompts but 2"),
        ([[5, 6]], [[[7, 96]]], "outside the vocabulary"),
        # 250 + 7 inputs (the last token only a target) past the 256 positions
        ([[5] * 250], [[[7] * 3, [7] * 8]], "continuation 1 has 257 tokens"),
    ],
)
def test_bad_input_is_refused(llama, prompts, continuations, message):
    with pytest.raises(ValueError, match=message):
        score_continuations(llama, prompts, continuations)


def test_bad_options_are_refused(llama):
    with pytest.raises(ValueError, match="prefill_chunk"):
        score_continuations(llama, [[5]], [[[6]]], prefill_chunk=0)
    with pytest.raises(ValueError, match="unknown attention path"):
        score_continuations(llama, [[5]], [[[6]]], attn="flash")
    assert score_continuations(llama, [], []) == []


# ------------------------------------------------------------------ the judge


class CharTokenizer:
    """One token per character and no chat template: every yes/no spelling takes several tokens."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(ch) % 93 for ch in text]

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text)}


def _p_yes_alone(model, tokenizer, text: str, yes: list[str], no: list[str]) -> float:
    """P(yes) normalized against P(no), each summed over spellings scored as whole continuations alone."""
    prompt = tokenizer(text)["input_ids"]
    totals = [torch.stack([alone(model, prompt, tokenizer.encode(w, add_special_tokens=False)).sum() for w in words])
              for words in (yes, no)]  # fmt: skip
    return float(torch.sigmoid(totals[0].logsumexp(0) - totals[1].logsumexp(0)))


def test_judge_with_multi_token_spellings_matches_plain_forwards(llama):
    tokenizer, context = CharTokenizer(), "Parcel late; charged twice."
    questions = [
        ChoiceQuestion("dept", "Which team?", {"ship": "parcels", "bill": "money", "ret": "returns"}),
        ScoreQuestion("severity", "How bad?", {"low": 1.0, "high": 3.0}),
        YesNoQuestion("angry", "Angry?"),
    ]
    result = judge(llama, tokenizer, context, questions)
    yes, no = ["yes", "Yes", "YES", " yes", " Yes", " YES"], ["no", "No", "NO", " no", " No", " NO"]
    texts = {
        "dept": [f'Does "{k}: {v}" apply? Answer yes or no.' for k, v in questions[0].options.items()],
        "severity": ['Does "low" apply? Answer yes or no.', 'Does "high" apply? Answer yes or no.'],
        "angry": ["Answer yes or no."],
    }
    lengths = 0
    for question, answer in zip(questions, result.answers):
        assert answer.name == question.name
        for judgment, text in zip(answer.judgments, texts[question.name]):
            full = f"{context}\n\n{question.prompt}\n\n{text}\nAnswer:"
            assert judgment.p_yes == pytest.approx(_p_yes_alone(llama, tokenizer, full, yes, no), abs=ATOL)
            lengths += len(full)
    assert [j.label for j in result["dept"].judgments] == ["ship", "bill", "ret"]
    assert result["dept"].answer == max(result["dept"].judgments, key=lambda j: j.p_yes).label
    low, high = (j.p_yes for j in result["severity"].judgments)
    assert result["severity"].score == pytest.approx((low * 1.0 + high * 3.0) / (low + high))
    assert result["angry"].score == result["angry"].judgments[0].p_yes
    assert result.usage.input_tokens == lengths and result.usage.output_tokens == 0
    assert result.usage.computed_tokens < lengths


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ChoiceQuestion("q", "Which?", {"only": "one option"}), "has 1 options"),
        (lambda: ScoreQuestion("q", "How?", [("one", "level", 1.0)]), "has 1 levels"),
        (lambda: ScoreQuestion("q", "How?", {"a": 1.0, "b": float("nan")}), "finite"),
    ],
)
def test_single_candidate_questions_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_judge_bad_input_is_refused(llama):
    question = YesNoQuestion("q", "Why?")
    with pytest.raises(ValueError, match="non-empty list"):
        judge(llama, CharTokenizer(), "context", [])
    with pytest.raises(ValueError, match="unique"):
        judge(llama, CharTokenizer(), "context", [question, question])
    with pytest.raises(ValueError, match="context is empty"):
        judge(llama, CharTokenizer(), "  ", [question])
    with pytest.raises(ValueError, match="no chat template"):
        judge(llama, CharTokenizer(), "context", [question], use_chat_template=True)


# ------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
def test_smollm2_judge_on_a_customer_message(smollm2):
    model, tokenizer = smollm2
    context = "Customer message: My parcel arrived two weeks late, and my card was charged twice for it."
    questions = [
        ChoiceQuestion("department", "Which department should handle this message?",
                       {"shipping": "delivery delays and lost parcels", "billing": "charges, refunds and payments",
                        "returns": "sending a product back"}),
        ScoreQuestion("severity", "How severe is the problem?",
                      [("low", "a minor inconvenience", 1.0), ("medium", "needs action soon", 2.0),
                       ("high", "money lost, urgent", 3.0)]),
    ]  # fmt: skip
    result = judge(model, tokenizer, context, questions)
    # the single-token spellings of yes and no in SmolLM2's vocabulary, looked up independently
    yes = [tokenizer.convert_tokens_to_ids(t) for t in ("yes", "Yes", "Ġyes", "ĠYes")]
    no = [tokenizer.convert_tokens_to_ids(t) for t in ("no", "No", "NO", "Ġno", "ĠNo", "ĠNO")]
    total = 0
    for question, answer in zip(questions, result.answers):
        for judgment, (label, definition) in zip(answer.judgments, _candidates(question)):
            user = f'{context}\n\n{question.prompt}\n\nDoes "{label}: {definition}" apply? Answer yes or no.'
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                last = model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
            want = torch.sigmoid(last[yes].logsumexp(0) - last[no].logsumexp(0))
            assert judgment.label == label and judgment.p_yes == pytest.approx(float(want), abs=ATOL)
            total += len(prompt)
    assert result.usage.input_tokens == total
    assert result.usage.computed_tokens < total / 2  # the message and the chat header are computed once
    weights = [j.p_yes for j in result["severity"].judgments]
    assert result["severity"].score == pytest.approx(sum(w * v for w, v in zip(weights, (1, 2, 3))) / sum(weights))
    assert 1.0 <= result["severity"].score <= 3.0


def _candidates(question):
    if isinstance(question, ChoiceQuestion):
        return list(question.options.items())
    return [(level, description) for level, description, _ in question.levels]
