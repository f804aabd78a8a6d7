"""The README as a new user meets it: its set-up commands install what each step needs, and its Python blocks
run offline on the embedded SmolLM2 and print what their `# ->` comments say.

A block that needs the hub or a GPU is skipped, with the reason; the others run in order in one namespace,
as a reader would paste them, with `load_smollm2` returning the session's SmolLM2.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.blocks import fenced_blocks, run_blocks
from tests.helpers.project import ROOT

README = ROOT / "README.md"
NEEDS = {'device_map="cuda"': "needs a GPU and the hub", "load_dataset(": "needs the hub (datasets)"}


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language`, in order."""
    return fenced_blocks(README, language)


def test_the_first_command_installs_what_the_demo_needs_and_the_second_what_the_tests_need():
    demo, tests = blocks("bash")[0].strip().splitlines()
    assert 'pip install -e ".[demo]"' in demo and demo.endswith("python -m hf_parallel demo")
    assert tests == 'pip install -e ".[test]" && python -m pytest -q'
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pytest -q" in ci  # the README's test command
    assert ci.index("python -m pytest -q") < ci.index("python -m pytest -q -m compat -n 2")  # then the oldest's
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".venv-ci/" in ignored and ".venv-ci-min/" in ignored  # where .ci/run installs


def test_the_transformers_floor_is_the_one_pyproject_sets():
    """The README names the oldest transformers that pyproject.toml allows, the one .ci/run tests."""
    floor = re.search(r'"transformers>=([0-9.]+),<6"', (ROOT / "pyproject.toml").read_text()).group(1)
    text = " ".join(README.read_text().split())
    assert f"**Which transformers.** {floor} or any later 5.x" in text and f"on {floor}.0 too" in text


def test_the_cpu_only_torch_command_is_given_beside_the_default():
    text = " ".join(README.read_text().split())
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "On Linux that is the CUDA build" in text and "on macOS and Windows it is a CPU build" in text


@pytest.mark.slow
def test_every_python_block_runs_and_prints_what_it_says(smollm2, monkeypatch):
    monkeypatch.setattr("hf_parallel.load_smollm2", lambda *a, **k: smollm2)
    # test_the_blocks_skipped_need_the_hub_or_a_gpu says which are skipped and why
    runnable = [(i, b) for i, b in enumerate(blocks("python")) if not any(marker in b for marker in NEEDS)]
    assert run_blocks(runnable, "README.md") >= 2


def test_the_blocks_skipped_need_the_hub_or_a_gpu():
    skipped = [block for block in blocks("python") if any(marker in block for marker in NEEDS)]
    reasons = sorted({reason for block in skipped for marker, reason in NEEDS.items() if marker in block})
    assert reasons == ["needs a GPU and the hub"] and len(skipped) == 1


def test_the_readme_is_a_product_page_of_at_most_150_lines():
    """What it is, install, examples, the headline figure and links into the docs site: the rest lives there."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the detail into docs/"
