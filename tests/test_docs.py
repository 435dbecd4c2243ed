"""The repository stands alone: no tracked file points outside it, and doc links resolve.

Outside facts are stated in ``docs/sglang-reference.md`` with their public sources; a path into
the machine the project was written on (a sibling ``shared`` folder, an absolute work path)
means nothing to a reader of the repository. Only ``.ci/run`` and the Makefile may name such a
path (they locate an optional TLC jar).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {".ci/run", "Makefile"}
# Spelled in pieces, so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "/" + "work/", "shared" + "/reference")
DOC_DIRS = ("docs", "spec")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:  # pragma: no cover
        pytest.skip(f"not a git checkout: {exc}")
    return [name for name in out.decode().split("\0") if name]


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    offenders = []
    for name in _tracked():
        path = REPO / name
        if name in ALLOWED or path.is_symlink() or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for needle in FORBIDDEN:
            for number, line in enumerate(text.splitlines(), 1):
                if needle in line:
                    offenders.append(f"{name}:{number}: {needle!r}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def _markdown() -> list[Path]:
    files = [REPO / "README.md"]
    for folder in DOC_DIRS:
        files += sorted((REPO / folder).glob("*.md"))
    return files


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", _markdown(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_in_docs_resolve(doc: Path) -> None:
    missing = []
    for target in _LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        page = doc.parent / path if path else doc
        if not page.exists() or (anchor and page.suffix == ".md" and anchor not in _anchors(page)):
            missing.append(target)
    assert not missing, f"{doc.name}: links to missing files or headings: {missing}"


def test_reference_page_cites_its_sources() -> None:
    """Each fact section of the reference page names a public source (a PR, issue or file)."""
    text = (REPO / "docs" / "sglang-reference.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    assert len(sections) >= 9
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"#\d{4,5}|\.py`|measured here|repository", section), title


def test_every_sglang_interop_test_file_is_listed() -> None:
    """docs/sglang-interop.md's table names every test file that runs SGLang's own code (those
    marked ``requires_sglang`` or importing it through ``import_sglang``)."""
    page = (REPO / "docs" / "sglang-interop.md").read_text()
    interop = [
        path.relative_to(REPO).as_posix()
        for path in sorted((REPO / "tests").glob("test_*.py"))
        if path.name != Path(__file__).name  # this test names the markers too
        and re.search(r"\b(requires_sglang|import_sglang)\b", path.read_text())
    ]
    assert interop, "no interop test file found: the pattern is stale"
    missing = [name for name in interop if f"]({'../' + name})" not in page]
    assert missing == [], f"docs/sglang-interop.md does not list {missing}"
