"""MkDocs hook: the repository's files that the docs link to (results, eval/README.md, the notebook) go into the
site as they are, under `repo/`, so that every such link is checked by `mkdocs build --strict` and works offline.

A link from a page to `../results/x.md` (a file outside `docs/`) resolves to the file copied to `repo/results/x.md`;
a link to a file the repository lacks stays unresolved, which `--strict` turns into an error.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from griffe import Extension
from mkdocs.structure.files import File, Files, InclusionLevel

LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


class RepositoryFile(File):
    """A file of the repository outside `docs/`, copied into the site as it is (never rendered as a page)."""

    def is_documentation_page(self) -> bool:
        return False


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"])
    root = docs.parent
    seen = set()
    for page in list(files.documentation_pages()):
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            src_uri = posixpath.normpath(posixpath.join(posixpath.dirname(page.src_uri), target))
            if not src_uri.startswith("../") or src_uri in seen or not (docs / src_uri).is_file():
                continue
            seen.add(src_uri)
            path = (docs / src_uri).resolve().relative_to(root.resolve()).as_posix()
            file = RepositoryFile(
                src_uri,
                str(docs),
                config["site_dir"],
                False,
                dest_uri=f"repo/{path}",
                inclusion=InclusionLevel.INCLUDED,
            )
            files.append(file)
    return files


class PlainBrackets(Extension):
    """Griffe extension: a docstring's `[P][C]` (a shape, as in `[P][C_p]`) is text, not a Markdown reference link."""

    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = obj.docstring.value.replace("][", r"]\[")
