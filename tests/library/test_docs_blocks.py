"""The docs site as a reader meets it: every Python block of `docs/` runs offline on the embedded SmolLM2 and
prints what its `# ->` comments say, and every import in the README's and the docs' blocks names only what
`hf_parallel` itself exports (or the standard library, torch, transformers, datasets).

A block whose first line is `# needs ...` (a GPU, the hub, a running server) is skipped, with that reason; the
others of a page run in order in one namespace, as a reader would paste them, in an empty folder, with
`hf_parallel.load_smollm2` returning the session's SmolLM2.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

import hf_parallel
from tests.helpers.blocks import EXTRAS, fenced_blocks, refused_imports, run_blocks
from tests.helpers.project import ROOT

DOCS = ROOT / "docs"
NEEDS = re.compile(r"# needs (.+)")
REASONS = {
    "a GPU and the hub",
    "the hub",
    "the hub (datasets)",
    "a running server",
    "several processes",
    "a Ray cluster",
}
# what only the hub or a GPU gives: a block with one of these must say so in its first line
HUB_OR_GPU = ('device_map="cuda"', 'device="cuda"', "load_dataset(", "from_pretrained(", "urlopen(")


def python_blocks(path: Path) -> list[str]:
    """The page's fenced Python blocks, in order."""
    return fenced_blocks(path, "python")


def need(block: str) -> str | None:
    """Why the block cannot run here (its first line, `# needs ...`), else None."""
    found = NEEDS.match(block)
    return found.group(1).strip() if found else None


def code(block: str) -> str:
    """The block without its comments."""
    tokens = tokenize.generate_tokens(io.StringIO(block).readline)
    return " ".join(token.string for token in tokens if token.type != tokenize.COMMENT)


PAGES = sorted(path for path in DOCS.rglob("*.md") if python_blocks(path))


def test_the_pages_with_python_blocks_are_found():
    names = {path.relative_to(DOCS).as_posix() for path in PAGES}
    assert {"quickstart.md", "guides/python-api.md", "guides/scoring.md", "guides/corpus.md"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(DOCS).as_posix())
def test_every_python_block_runs_and_prints_what_it_says(page, smollm2, monkeypatch, tmp_path):
    monkeypatch.setattr(hf_parallel, "load_smollm2", lambda *a, **k: smollm2)
    monkeypatch.chdir(tmp_path)  # blocks that write a file write it here
    # test_a_block_skipped_says_why_in_its_first_line says which are skipped and why
    runnable = [(i, block) for i, block in enumerate(python_blocks(page)) if not need(block)]
    assert run_blocks(runnable, page.name) >= 1


def test_a_block_skipped_says_why_in_its_first_line():
    for page in PAGES:
        for block in python_blocks(page):
            reason = need(block)
            assert reason is None or reason in REASONS, f"{page.name}: an unknown reason {reason!r}"
            if any(marker in code(block).replace(" ", "") for marker in HUB_OR_GPU):
                assert reason, f"{page.name}: a block that needs the hub or a GPU does not say so:\n{block}"


def test_every_import_in_the_readme_and_the_docs_is_a_public_name():
    blocks = [("README.md", block) for block in python_blocks(ROOT / "README.md")]
    blocks += [(page.relative_to(ROOT).as_posix(), block) for page in PAGES for block in python_blocks(page)]
    assert len(blocks) >= 10
    refused = [(where, name) for where, block in blocks for name in refused_imports(block)]
    assert refused == []


def test_the_extras_public_names_are_their_packages():
    import hf_parallel.ray  # imports no ray itself

    assert EXTRAS == {"hf_parallel.ray": hf_parallel.ray.__all__}


def test_the_import_check_refuses_a_submodule_and_an_unknown_name():
    block = "import hf_parallel\nfrom hf_parallel.frontends.corpus import answer_corpus\nfrom hf_parallel import x\n"
    block += "import hf_parallel.engine\nimport numpy\nimport json, torch\nfrom transformers import AutoTokenizer\n"
    assert refused_imports(block) == [
        "from hf_parallel.frontends.corpus import answer_corpus",
        "from hf_parallel import x",
        "import hf_parallel.engine",
        "numpy",
    ]
