"""Every example of README.md and docs/*.md runs as printed, or says why it cannot run here.

A fenced block tagged ``sh``, ``shell``, ``bash``, ``console`` or ``python`` is an example. Just
before it, ``<!-- example: not run (reason) -->`` skips it with that reason (in the pytest
summary). Blocks without a tag, or tagged ``text``/``mermaid``, are output or diagrams and
must not hold a command (checked below, so an example cannot hide there).

One test per page; a page's examples run in order and share what a reader's terminal would:

* ``sh`` lines run in the repository's root, ``pd-bootstrap`` and ``python`` resolved to this
  venv's. A line ending in ``&`` starts a background job, and the next line runs once the job
  printed its first line (each such process says when it is ready: ``listening on``,
  ``READY``, ``etcd serving on``); ``kill %N`` stops the page's Nth job; any job left is
  stopped when the page ends. Any other line must exit 0.
* ``console`` blocks hold ``$ command`` lines, each followed by the output it prints; the
  output must match line by line, with decimals (timings) free to differ.
* ``python`` blocks run in one namespace per page, like a notebook. A comment ``# prints: X``
  at the end of a line says what that line prints; the page's whole stdout must hold each.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from statemachine.prefill.readiness import read_prefixed_line

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"sh", "shell", "bash", "console", "python"}
NOT_EXAMPLES = {"", "text", "mermaid"}
SKIP = re.compile(r"<!-- example: not run \((.+)\) -->")
FENCE = re.compile(r"^```(\w*)\s*$")
COMMANDS = ("$ ", "pd-bootstrap ", "python ", "python3 ", "make ", "pip ")
READY_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 120.0
BIN = Path(sys.executable).parent


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index].rstrip() != "```":
            index += 1
        before = next((s for s in reversed(lines[:start]) if s.strip()), "")
        mark = SKIP.search(before)
        code = "\n".join(lines[start + 1 : index]) + "\n"
        found.append(Block(page, start + 1, fence.group(1), code, mark.group(1) if mark else None))
        index += 1
    return found


def _argv(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv and argv[0] == "pd-bootstrap":
        argv[0] = str(BIN / "pd-bootstrap")
    assert argv and argv[0] not in ("make", "pip"), (
        f"{command!r}: mark the block '<!-- example: not run (reason) -->' or make it runnable"
    )
    return argv


class Page:
    """What a reader's terminal holds while following one page: background jobs and the
    Python namespace."""

    def __init__(self) -> None:
        self.jobs: list[subprocess.Popen[bytes]] = []
        self.namespace: dict[str, Any] = {"__name__": "__doc_example__"}
        self.stdout = io.StringIO()

    def sh(self, block: Block) -> None:
        for command in re.sub(r"\\\n\s*", " ", block.code).splitlines():
            command = command.strip()
            if not command or command.startswith("#"):
                continue
            kill = re.fullmatch(r"kill((?: %\d+)+)(?:\s+#.*)?", command)
            if kill:
                for job in kill.group(1).split():
                    self._stop(self.jobs[int(job[1:]) - 1])
                continue
            body, _, _ = command.partition(" #")
            if body.rstrip().endswith("&"):
                self._background(body.rstrip()[:-1], block)
                continue
            done = subprocess.run(
                _argv(command), cwd=REPO, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
            )
            assert done.returncode == 0, f"{block.where}: {command!r}\n{done.stderr}"

    def _background(self, command: str, block: Block) -> None:
        job = subprocess.Popen(
            _argv(command), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.jobs.append(job)
        assert job.stdout is not None
        try:
            line = read_prefixed_line(
                job.stdout.fileno(), b"", time.monotonic() + READY_TIMEOUT_S, bytearray()
            )
        except TimeoutError:
            line = None
        if line is None:
            self._stop(job)
            assert job.stderr is not None
            raise AssertionError(
                f"{block.where}: {command!r} printed nothing in {READY_TIMEOUT_S} s: "
                f"{job.stderr.read().decode(errors='replace')[-2000:]}"
            )

    def console(self, block: Block) -> None:
        steps = re.split(r"^\$ ", block.code, flags=re.MULTILINE)[1:]
        assert steps, f"{block.where}: a console block needs '$ ' command lines"
        for step in steps:
            command, _, expected = step.partition("\n")
            done = subprocess.run(
                _argv(command), cwd=REPO, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
            )
            assert done.returncode == 0, f"{block.where}: {command!r}\n{done.stderr}"
            assert _masked(done.stdout) == _masked(expected), f"{block.where}: {command!r}"

    def python(self, block: Block) -> None:
        code = compile(block.code, block.where, "exec")
        with contextlib.redirect_stdout(self.stdout):
            exec(code, self.namespace)
        for promised in re.findall(r"#\s*prints:\s*(.+)$", block.code, flags=re.MULTILINE):
            assert promised.strip() in self.stdout.getvalue(), (
                f"{block.where}: promised {promised.strip()!r}, printed:\n{self.stdout.getvalue()}"
            )

    @staticmethod
    def _stop(job: subprocess.Popen[bytes]) -> None:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(timeout=15)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait(timeout=15)
        for stream in (job.stdout, job.stderr):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        for job in reversed(self.jobs):
            self._stop(job)
        manager = self.namespace.get("manager")
        if manager is not None and hasattr(manager, "close"):
            manager.close()


def _masked(text: str) -> list[str]:
    return [re.sub(r"\d+\.\d+", "<n>", line.rstrip()) for line in text.strip().splitlines()]


EXAMPLE_PAGES = [p for p in PAGES if any(b.lang in RUN and not b.skip for b in blocks(p))]
#: Pages whose examples run SGLang 0.5.23's own code: its wheel is imported on CPU with the test
#: stubs first (tests/support/sglang_support.py), and the page skips, saying why, where it cannot
#: run.
NEEDS_SGLANG = {"sglang-decode.md"}
MARKED = [b for p in PAGES for b in blocks(p) if b.lang in RUN and b.skip]


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_examples_run_as_printed(page: Path) -> None:
    if page.name in NEEDS_SGLANG:
        from tests.support.sglang_support import import_sglang

        import_sglang()
    terminal = Page()
    try:
        for block in blocks(page):
            if block.lang not in RUN or block.skip:
                continue
            if block.lang == "console":
                terminal.console(block)
            elif block.lang == "python":
                terminal.python(block)
            else:
                terminal.sh(block)
    finally:
        terminal.close()


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.where)
def test_marked_example_says_why_it_is_not_run(block: Block) -> None:
    """Each example marked not run shows up in the summary with its reason."""
    assert block.skip and len(block.skip) >= 10, f"{block.where}: give a real reason"
    pytest.skip(f"example {block.where} not run: {block.skip}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_is_an_example_or_plainly_not_one(page: Path) -> None:
    """A command in an untagged block would escape the test above: tag it, or mark it."""
    for block in blocks(page):
        assert block.lang in RUN | NOT_EXAMPLES, f"{block.where}: unknown tag {block.lang!r}"
        if block.lang in NOT_EXAMPLES and block.lang != "mermaid":
            first = block.code.lstrip().splitlines()[0] if block.code.strip() else ""
            assert not first.startswith(COMMANDS), (
                f"{block.where}: a command in a '{block.lang}' block"
            )


def test_skip_marks_give_a_reason() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for mark in re.findall(r"<!-- example:[^>]*-->", text):
            assert SKIP.fullmatch(mark), f"{page.name}: {mark!r} (want 'not run (reason)')"


def test_environment_runs_the_venvs_commands() -> None:
    """The examples must run this checkout's commands, not whatever is first on PATH."""
    assert (BIN / "pd-bootstrap").exists(), "pd-bootstrap not installed in this venv"
    assert os.access(sys.executable, os.X_OK)
