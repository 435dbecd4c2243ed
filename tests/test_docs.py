"""The repository stands alone: no tracked file points outside it, and doc links resolve.

Outside facts are stated in ``docs/sglang-reference.md`` with their public sources; a path into
the machine the project was written on (a sibling ``shared`` folder, an absolute work path)
means nothing to a reader of the repository. Only ``.ci/run`` and the Makefile may name such a
path (they locate an optional TLC jar).
"""

from __future__ import annotations

import importlib
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
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        if path.name != Path(__file__).name  # this test names the markers too
        and re.search(r"\b(requires_sglang|import_sglang)\b", path.read_text())
    ]
    assert interop, "no interop test file found: the pattern is stale"
    missing = [name for name in interop if f"]({'../' + name})" not in page]
    assert missing == [], f"docs/sglang-interop.md does not list {missing}"


# --- pointers in backticks: a move must not leave a stale one (issue 33.5) ----------------------

#: The pages whose backticked paths and dotted names must exist: what a reader navigates by.
#: CHANGELOG.md is left out on purpose: it names what was, at the time.
POINTER_PAGES = ("README.md", "CONTRIBUTING.md", "docs", "spec")
_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
#: A dotted name of the package: ``statemachine.x.y`` or ``statemachine.x.Y``, maybe called.
_DOTTED = re.compile(r"statemachine(?:\.\w+)+(?:\(\))?")
#: A path: word characters, dots and hyphens in segments joined by '/', or one file name with
#: an extension the repository uses. Globs, placeholders, URLs and options never match.
_PATH = re.compile(
    r"[\w.-]+(?:/[\w.-]+)+/?|[\w.-]+\.(?:py|md|tla|cfg|toml|json|mmd|txt|yaml|yml|sh)"
)


def _pointer_pages() -> list[Path]:
    pages = []
    for name in POINTER_PAGES:
        path = REPO / name
        pages += sorted(path.glob("*.md")) if path.is_dir() else [path] if path.exists() else []
    return pages


_ROOT_ENTRIES = {path.name for path in REPO.iterdir() if not path.name.startswith(".")} | {
    ".ci",
    ".pre-commit-config.yaml",
}
_SUBPACKAGES = {path.name for path in (REPO / "statemachine").iterdir() if path.is_dir()}
#: SGLang's own tree (``sglang/srt/...``, ``sglang/cli/...``), whose first segment is also a
#: subpackage here.
_OUTSIDE = ("sglang/srt", "sglang/cli")
#: Files named as removed, on purpose (docs/formal-model.md says why the interpreter went).
REMOVED = {"statemachine/model/interp.py", "tests/test_model_interp.py"}


def stale_path(span: str, folder: Path | None) -> tuple[str | None, Path | None]:
    """(the problem with ``span`` as a path, or None; the folder a bare file name after it is
    read in). A path is read from the repository's root when its first segment is an entry
    there (``statemachine/...``, ``tests/...``, ``Makefile``), from ``statemachine/`` when it
    is one of its subpackages (``decode/...``: the docs' short form); a bare file name, from
    ``folder`` when one is given (the caller gives one in a table's first cell: a README row
    ``statemachine/prefill/server.py``, ``registry.py``). Anything else (SGLang's files, a
    file a run writes) is not this repository's and is skipped."""
    path = span.rstrip("/")
    if not _PATH.fullmatch(span) or path.startswith((".", *_OUTSIDE)) or path in REMOVED:
        return None, folder
    first = path.split("/")[0]
    if "/" in path or path in _ROOT_ENTRIES:
        if first in _ROOT_ENTRIES:
            target = REPO / path
        elif first in _SUBPACKAGES:
            target = REPO / "statemachine" / path
        else:
            return None, folder
        if not target.exists():
            return f"{span}: no such file or folder", folder
        return None, target if target.is_dir() else target.parent
    if folder is not None and not (folder / path).exists():
        return f"{span}: no such file in {folder.relative_to(REPO)}/", folder
    return None, folder


def stale_dotted(span: str) -> str | None:
    """The problem with ``span`` as a dotted name of the package, or None: its longest
    importable prefix is imported, the rest read with getattr."""
    parts = span.removesuffix("()").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not exc.name.startswith("statemachine"):
                raise  # an extra the dev install should have: not a stale name
            continue
        for attribute in parts[cut:]:
            if not hasattr(owner, attribute):
                return (
                    f"{span}: {type(owner).__name__} {'.'.join(parts[:cut])} has no {attribute!r}"
                )
            owner = getattr(owner, attribute)
        return None
    return f"{span}: no such module"


def line_problems(line: str) -> list[str]:
    """The stale pointers of one line. Bare file names are checked only in a table's first
    cell, against the folder of the path before them there (elsewhere a bare name may be
    SGLang's file, or a file a run writes)."""
    found = []
    cells = line.split("|")
    first_cell = cells[1] if line.startswith("|") and len(cells) > 2 else ""
    for part, in_first_cell in ((first_cell, True), (line.replace(first_cell, "", 1), False)):
        folder: Path | None = None
        for span in (s.strip() for s in _SPAN.findall(part)):
            if _DOTTED.fullmatch(span):
                problem = stale_dotted(span)
            else:
                problem, folder = stale_path(span, folder)
                folder = folder if in_first_cell else None
            if problem:
                found.append(problem)
    return found


def stale_pointers(text: str) -> list[str]:
    """``line: problem`` for every stale pointer of a page's text, fenced code blocks left
    out (examples and program output: tests/test_doc_examples.py covers those)."""
    text = _FENCE.sub(lambda m: "\n" * m.group().count("\n"), text)
    return [
        f"{number}: {problem}"
        for number, line in enumerate(text.splitlines(), 1)
        for problem in line_problems(line)
    ]


@pytest.mark.parametrize("page", _pointer_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_backticked_paths_and_names_exist(page: Path) -> None:
    assert stale_pointers(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("| `statemachine/registration.py` | x |", 1),  # the README row it was written for
        ("| `statemachine/prefill/registration.py`, `rank.py`, `nowhere.py` | `x.py` |", 1),
        ("`decode/source.py` and `decode/gone.py`", 1),
        ("`statemachine/model/tla/` `docs/design.md` `Makefile` `sglang/srt/x.py`", 0),
        ("`statemachine.decode.client.register_rank`", 1),  # moved to prefill.registration
        ("`statemachine.prefill.registration.register_rank()`", 0),
        ("`statemachine.nothing_here`", 1),
        ("`disaggregation/decode.py`, `decode.py`, `demo-report.json`, `*.py`, `--port N`", 0),
    ],
)
def test_the_pointer_check_sees_each_kind(line: str, found: int) -> None:
    page = f"# a page\n\n{line}\n\n```\n`statemachine/in_a_fence.py`\n```\n"
    stale = stale_pointers(page)
    assert len(stale) == found, stale
