"""On CUDA: captured decode steps (CUDA graphs, reused across calls) give plain `model.generate`'s tokens."""

from __future__ import annotations

import pytest
import torch

from hf_parallel import generate_tokens

from .conftest import generate_alone, random_tokens, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
ATTNS = ["reference", "triton"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2", "gpt2"])
def cuda_model(request):
    return tiny_model(request.param).cuda()


def _prompts(seed: int, n: int, doc_len: int = 40):
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(doc_len, gen)
    return [doc + random_tokens(1 + (i * 3) % 7, gen) for i in range(n)]


@pytest.mark.parametrize("attn", ATTNS)
def test_graphs_match_generate_across_calls_and_buckets(cuda_model, attn):
    torch.backends.cuda.matmul.allow_tf32 = False
    for seed, n in [(0, 5), (1, 17), (2, 3)]:  # different layouts reuse the model's static row
        prompts = _prompts(seed, n, doc_len=30 + 10 * seed)
        free = [generate_alone(cuda_model, p, 10, None) for p in prompts]
        eos = sorted({free[0][2], free[-1][5]})  # streams leave at different steps: buckets shrink
        got = generate_tokens(cuda_model, prompts, max_new_tokens=10, eos_token_id=eos, attn=attn)
        assert got == [generate_alone(cuda_model, p, 10, eos) for p in prompts]


@pytest.mark.parametrize("attn", ATTNS)
def test_graphs_and_eager_agree(cuda_model, attn):
    prompts = _prompts(5, 9)
    graphs = generate_tokens(cuda_model, prompts, max_new_tokens=12, eos_token_id=[], attn=attn)
    eager = generate_tokens(cuda_model, prompts, max_new_tokens=12, eos_token_id=[], cuda_graphs=False, attn=attn)
    assert graphs == eager


def test_row_is_reused_and_grows(cuda_model):
    generate_tokens(cuda_model, _prompts(6, 4), max_new_tokens=4, eos_token_id=[])
    row = cuda_model._hf_parallel_row
    generate_tokens(cuda_model, _prompts(7, 3), max_new_tokens=4, eos_token_id=[])
    assert cuda_model._hf_parallel_row is row  # same buffers: captured graphs replay
    generate_tokens(cuda_model, _prompts(8, 30), max_new_tokens=80, eos_token_id=[])  # > 2048 slots
    assert cuda_model._hf_parallel_row.capacity > row.capacity


@pytest.mark.parametrize("attn", ATTNS)
def test_compiled_graphs_match_generate(cuda_model, attn):
    """compile=True: captured steps replay a compiled forward (the kernel an opaque op); same tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(7, 6)
    free = [generate_alone(cuda_model, p, 8, None) for p in prompts]
    eos = sorted({free[1][3]})
    got = generate_tokens(cuda_model, prompts, max_new_tokens=8, eos_token_id=eos, compile=True, attn=attn)
    assert got == [generate_alone(cuda_model, p, 8, eos) for p in prompts]
