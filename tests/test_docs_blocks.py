"""Every ``python`` and ``bash`` block of README.md and docs/*.md runs as written.

The blocks of one page run in order, in one temporary working directory, the Python blocks in one namespace: as
a reader who follows the page in one session would run them. A ``bash`` line ``modelmeter ARGS`` (also
``.venv/bin/modelmeter`` and ``python -m modelmeter``) runs through ``modelmeter.cli.main``, a ``pytest`` line in
a child process; each must exit 0 unless the line's comment says ``exits N``. Two comments on the line before a
block change what is done with it:

- ``<!-- file: NAME -->``: the block is the content of the file NAME, written for the blocks after it;
- ``<!-- not run: why -->``: the block is shown, not run: only where running it is impossible here (a download,
  a GPU, a long run, installing packages).

Any other command line in a block that is run is an error: mark the block, or write it as a ``modelmeter`` line.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from modelmeter.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}  # the languages whose blocks run
# Pages whose blocks analyse several real architectures, or one many times (--fit, --sweep): CI runs them
SLOW = {"README.md", "docs/guard.md", "docs/memory.md", "docs/caching.md", "docs/roofline.md", "docs/guide.md"}

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(file|not run):\s*(.+?)\s*-->$")
_EXITS = re.compile(r"#.*\bexits (\d+)\b")
_COMMAND = re.compile(r"^(?:\S*/)?(?:modelmeter|python3? -m modelmeter)\s")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, first line (1-based, the fence), language, text and the comment before it."""

    page: Path
    line: int
    language: str
    text: str
    mark: tuple[str, str] | None

    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    start: int | None = None
    for number, line in enumerate(lines):
        fence = _FENCE.match(line)
        if fence is None:
            continue
        if start is None:
            start, language = number, fence.group(1)
            continue
        mark = _MARK.match(lines[start - 1].strip()) if start else None
        found.append(Block(page, start + 1, language, "\n".join(lines[start + 1:number]) + "\n",
                           (mark.group(1), mark.group(2)) if mark else None))
        start = None
    assert start is None, f"{page}: a code block is never closed"
    return found


def run_command_block(block: Block, capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of a bash block, its commands (``a && b``) in turn: ``modelmeter`` through the command's
    ``main``, ``pytest`` in a child process; the last one with the exit status the line's comment states."""
    for offset, line in enumerate(block.text.splitlines(), start=1):
        commands = _commands(shlex.split(line, comments=True))
        for number, words in enumerate(commands, start=1):
            where = f"{block.where()} (+{offset}): {' '.join(words)}"
            expected = _EXITS.search(line) if number == len(commands) else None
            status, err = _run(words, where, capsys)
            assert status == (int(expected.group(1)) if expected else 0), f"{where}: exit {status}\n{err[-3000:]}"


def _commands(words: list[str]) -> list[list[str]]:
    """``a x && b y`` -> ``[[a, x], [b, y]]``."""
    commands: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            commands.append([])
        else:
            commands[-1].append(word)
    return [command for command in commands if command]


def _run(words: list[str], where: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """One command of a page: its exit status and stderr."""
    if words[0] == "pytest":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *words[1:]],
                              capture_output=True, text=True, env=env, timeout=600)
        return done.returncode, done.stdout + done.stderr
    assert _COMMAND.match(" ".join(words) + " "), f"{where}: not a modelmeter or pytest command: mark the block " \
                                                  "<!-- not run: why -->"
    status = main(words[3:] if words[0].startswith("python") else words[1:])
    return status, capsys.readouterr().err


def page_ids() -> list[str]:
    return [str(page.relative_to(ROOT)) for page in PAGES]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in page_ids()])
def test_page_blocks_run_as_written(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # files the page writes import as its commands would
    page = types.ModuleType("docs_page")  # a module, so the classes a page defines pickle and make dataclasses
    monkeypatch.setitem(sys.modules, page.__name__, page)
    namespace = page.__dict__
    for block in blocks(ROOT / name):
        if block.mark and block.mark[0] == "file":
            Path(block.mark[1]).write_text(block.text)
        elif block.language not in RUN or block.mark:
            continue
        elif block.language == "python":
            exec(compile(block.text, block.where(), "exec"), namespace)
        else:
            run_command_block(block, capsys)


def test_every_page_is_checked_and_marks_are_rare() -> None:
    """The pages are found, ``not run`` stays an exception, and each mark gives its reason and precedes a block."""
    all_blocks = [block for page in PAGES for block in blocks(page)]
    runnable = [block for block in all_blocks if block.language in RUN]
    skipped = [block for block in runnable if block.mark and block.mark[0] == "not run"]
    assert len(PAGES) >= 10 and len(runnable) >= 30
    assert len(skipped) <= len(runnable) // 4, [block.where() for block in skipped]
    marks = sum(bool(_MARK.match(line.strip())) for page in PAGES for line in page.read_text().splitlines())
    assert marks == sum(block.mark is not None for block in all_blocks), "a mark that is not right before a block"


# A line of a block that is a command: a shell prompt, or a command the pages document (a usage synopsis, whose
# options are in brackets, is none)
_SHELL_LINE = re.compile(r"^(?:\$ |(?:\S*/)?(?:modelmeter|python3?|pip|pytest)(?:\s|$)(?!.*\[--))")


def commands_not_run(block: Block) -> list[str]:
    """The command lines of a block that is neither run (``python``, ``bash``) nor marked ``not run``: a command
    written in an output or untagged block escapes the check that it runs as written."""
    if block.language in RUN:
        return []
    return [line for line in block.text.splitlines() if _SHELL_LINE.match(line)]


def test_every_command_of_a_page_is_in_a_block_that_runs_or_says_why_not() -> None:
    hidden = [f"{block.where()}: {line}" for page in PAGES for block in blocks(page)
              for line in commands_not_run(block)]
    assert hidden == [], "write each command in a bash block (marked <!-- not run: why --> where it cannot run)"


def test_the_block_reader_finds_marks_commands_and_exit_statuses(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- not run: a download -->\n```python\nraise SystemExit\n```\n\n```bash\n"
                    "modelmeter list   # the models\n```\n<!-- file: m.py -->\n```python\nx = 1\n```\n")
    first, second, third = blocks(page)
    assert (first.line, first.language, first.mark, first.text) == (3, "python", ("not run", "a download"),
                                                                     "raise SystemExit\n")
    assert (second.mark, third.mark) == (None, ("file", "m.py"))
    wrong = Block(page, 1, "bash", "modelmeter list --format nope\n", None)
    with pytest.raises(AssertionError, match="exit 2"):
        run_command_block(wrong, capsys)
    run_command_block(Block(page, 1, "bash", "modelmeter list --format nope   # exits 2: a usage error\n", None),
                      capsys)
    with pytest.raises(AssertionError, match="not a modelmeter or pytest command"):
        run_command_block(Block(page, 1, "bash", "pip install modelmeter\n", None), capsys)
    output = "$ modelmeter resnet18\nresnet18 on input ...\npython bench.py --repeat 3\nmodelmeter list [--format F]\n"
    assert commands_not_run(Block(page, 1, "", output, None)) == ["$ modelmeter resnet18", "python bench.py --repeat 3"]
    assert commands_not_run(Block(page, 1, "bash", output, None)) == []
