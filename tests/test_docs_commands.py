"""Every ``eplb-fsm`` command printed in README.md and docs/*.md runs as written.

Commands come from fenced code blocks (``eplb-fsm ...``, ``$ eplb-fsm ...`` transcripts,
``python -m eplb_fsm ...``, ``... && eplb-fsm ...``) and from markdown table rows (a
backticked command). Each runs in a shell in a scratch folder holding a copy of docs/,
with ``eplb-fsm`` and ``python`` pointing at this source tree; ``/tmp/`` in a command or
in a python block becomes the scratch folder, so runs never collide. A python block of
the page that writes a ``/tmp/...`` folder a later command reads runs first, as written.
A command printed again with the same additions, exit status, transcript and inputs
runs once, where it first appears (docs/benchmarks.md repeats its table every session).
In a block holding a ``$ ...`` transcript only the prompt lines are commands (the rest is
their output). In a table, the command is the row's first cell.

What "works" means: no traceback, and the exit status the docs give: ``exits N`` on the
line (a comment or the table row), or the ``$ echo $?`` line after a transcript; a
replay transcript whose printed verdict is not ``healthy`` must exit non-zero but not 2
(2 is unusable input); anything else must exit 0. A transcript's printed verdict word
(``hang:``, ``healthy:``, ...) must be the one the command prints now.

docs/benchmarks-history.md is an archive: earlier sessions' tables, as they were run then.
Its commands are checked for real verbs and options like every other, but run only where a
living page prints them too (the variants only the archive holds, such as an old session's
``--repeats 201``, are records, not instructions).

A line may shorten a slow command only by saying so itself: ``tests add: ARGS`` in its
comment or table row appends ARGS. Synopses (``[--json]``, ``LOGDIR``, ``--ranks G``) and
commands quoted in prose are not run; every option they name must exist on that verb.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: no single command may take longer than this (seconds)
COMMAND_TIMEOUT_S = 300
_START = re.compile(r"(?:^|&&\s*|\$\s+)((?:eplb-fsm|python -m eplb_fsm)(?:\s.*)?)$")
_ADD = re.compile(r"tests add:\s*`?([^`)]*)`?")
_EXITS = re.compile(r"\bexits (\d+)\b")
_PLACEHOLDER = re.compile(r"\[|\]|\\\||<[^>]*>|\.\.\.|(?<![\w./:=-])[A-Z][A-Z_]*(?![\w-])")


@dataclass
class Command:
    """One command as printed, where it is, and what the docs say it does."""

    page: str
    line: int
    text: str                      # the command as printed (comment removed)
    source: str                    # "code", "table" or "prose"
    added: str = ""                # what the line says the tests add
    exits: int | None = None       # the exit status the docs give
    first_output: str | None = None  # a transcript's first printed line
    after: list[str] = field(default_factory=list)  # python blocks of the page that write what it reads

    @property
    def synopsis(self) -> bool:
        return bool(_PLACEHOLDER.search(self.text))

    @property
    def key(self) -> tuple:
        """What a run of it depends on: two commands with equal keys run the same way."""
        return self.text, self.added, self.exits, self.first_output, tuple(self.after)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _split_comment(line: str) -> tuple[str, str]:
    """``cmd  # comment`` -> (cmd, comment); a '#' inside quotes or a word is not a comment."""
    match = re.search(r"\s#\s", line)
    return (line[: match.start()].rstrip(), line[match.end():]) if match else (line.rstrip(), "")


def _markers(text: str) -> tuple[str, int | None]:
    added = _ADD.search(text)
    exits = _EXITS.search(text)
    return (added.group(1).strip() if added else ""), (int(exits.group(1)) if exits else None)


def _writers(command: str, python_blocks: list[str]) -> list[str]:
    """The python blocks that mention a /tmp/ folder the command reads (they write it)."""
    folders = set(re.findall(r"/tmp/[\w.-]+", command))
    return [code for code in python_blocks if any(f in code for f in folders)]


def extract(page: Path) -> list[Command]:
    """The commands of one markdown page, in page order."""
    rel = str(page.relative_to(REPO))
    lines = page.read_text(encoding="utf-8").splitlines()
    commands: list[Command] = []
    python_blocks: list[str] = []
    i, fence, block = 0, None, []
    while i < len(lines):
        raw = lines[i]
        if raw.lstrip().startswith("```"):
            if fence is None:
                fence, block = raw.strip()[3:].strip(), []
                end = next((j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```")), len(lines))
                transcript = any(line.startswith("$ ") for line in lines[i + 1:end])
            else:
                if fence == "python":
                    python_blocks.append("\n".join(block))
                fence = None
            i += 1
            continue
        if fence is not None:
            block.append(raw)
            line_no, text = i + 1, raw
            while text.endswith("\\") and i + 1 < len(lines):  # a continued shell line
                i += 1
                text = text[:-1].rstrip() + " " + lines[i].strip()
            prompt = text.lstrip().startswith("$")
            match = _START.search(text.strip()) if fence != "python" and (prompt or not transcript) else None
            if match:
                cmd, comment = _split_comment(match.group(1))
                added, exits = _markers(comment)
                c = Command(rel, line_no, cmd, "code", added, exits, after=_writers(cmd, python_blocks))
                if text.lstrip().startswith("$"):  # a transcript: output follows until the next prompt
                    out = []
                    j = i + 1
                    while j < len(lines) and not lines[j].startswith("$") and not lines[j].startswith("```"):
                        out.append(lines[j])
                        j += 1
                    c.first_output = out[0] if out else None
                    if j + 1 < len(lines) and lines[j].strip() == "$ echo $?" and c.exits is None:
                        c.exits = int(lines[j + 1].strip())
                commands.append(c)
            i += 1
            continue
        if raw.lstrip().startswith("|"):
            added, exits = _markers(raw)
            first_cell = re.split(r"(?<!\\)\|", raw.strip())[1]
            for span in re.findall(r"`((?:eplb-fsm|python -m eplb_fsm)\s[^`]*)`", first_cell):
                cmd = span.strip()
                commands.append(Command(rel, i + 1, cmd, "table", added, exits, after=_writers(cmd, python_blocks)))
        i += 1
    # commands quoted in prose (possibly across a line break): checked, not run
    prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for span in re.findall(r"`((?:eplb-fsm|python -m eplb_fsm)\s[^`]*)`", prose):
        text = " ".join(span.split())
        if re.match(r"eplb-fsm \S+:", text):  # a message the command prints, not a command
            continue
        if not any(c.text == text for c in commands):
            commands.append(Command(rel, 0, text, "prose"))
    return commands


ALL = [c for page in PAGES for c in extract(page)]
PRINTED = [c for c in ALL if c.source in ("code", "table") and not c.synopsis]


def _first_of_each(commands: list[Command]) -> list[Command]:
    """The first command of each key, in page order (benchmarks.md repeats its table every session)."""
    first: dict[tuple, Command] = {}
    for c in commands:
        first.setdefault(c.key, c)
    return list(first.values())


#: pages whose printed commands are records of past runs: checked (options), not run
ARCHIVE = {"docs/benchmarks-history.md"}
LIVING = [c for c in PRINTED if c.page not in ARCHIVE]
RUN = _first_of_each(LIVING)
CHECK = [c for c in ALL if c not in PRINTED]


def _parser_for(words: list[str]):
    """The argparse parser of ``eplb-fsm VERB [KIND]`` and the words after it."""
    from eplb_fsm.cli import build_parser

    parser = build_parser()
    for depth in range(2):
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not subs or not words or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


def _words(text: str) -> list[str]:
    text = re.sub(r"^(?:eplb-fsm|python -m eplb_fsm)\s*", "", text)
    text = text.split(" | ")[0]
    return [w for w in shlex.split(re.sub(r"[\[\]]|\\\|", " ", text)) if w != "..."]


def test_the_docs_have_commands():
    """The extraction finds the documented commands (a broken extractor would pass everything)."""
    pages = {c.page for c in RUN}
    assert {"README.md", "docs/elastic.md", "docs/debugging-hangs.md", "docs/machine.md"} <= pages
    assert any(c.text.startswith("eplb-fsm simulate") and "--scale" in c.text for c in RUN if c.page == "README.md")
    assert len(RUN) >= 20 and len(CHECK) >= 10


def test_a_command_printed_twice_runs_once():
    """Each command a living page prints runs once, at its first place: RUN covers every key and repeats none;
    the archive's commands are all checked for options, and run only where a living page prints them too."""
    keys = [c.key for c in RUN]
    assert len(keys) == len(set(keys)) and set(keys) == {c.key for c in LIVING}
    first = {}
    for n, c in enumerate(LIVING):
        first.setdefault(c.key, n)
    assert RUN == [c for n, c in enumerate(LIVING) if first[c.key] == n]
    archived = [c for c in PRINTED if c.page in ARCHIVE]
    assert archived and all(c in ALL for c in archived) and not any(c.page in ARCHIVE for c in RUN)


@pytest.mark.parametrize("command", ALL, ids=str)
def test_documented_commands_name_real_options(command):
    """Every documented command names an existing verb and only that verb's options, by their current names."""
    import argparse

    words = _words(command.text + (f" {command.added}" if command.added else ""))
    parser, rest = _parser_for(words)
    assert parser.prog != "eplb-fsm" or not words or words[0].startswith("-"), f"unknown verb in {command}"
    for word in rest:
        if word.startswith("--"):
            action = parser._option_string_actions.get(word.split("=")[0])
            assert action is not None, f"{command}: {parser.prog} has no option {word}"
            assert action.help != argparse.SUPPRESS, f"{command}: {word} is an old name; use the one --help shows"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder with docs/ copied in and ``eplb-fsm`` / ``python`` wrappers running this tree."""
    root = tmp_path_factory.mktemp("docs-commands")
    shutil.copytree(REPO / "docs", root / "docs")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, target in (("eplb-fsm", f'exec "{sys.executable}" -m eplb_fsm "$@"'),
                         ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{target}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               PYTHONUNBUFFERED="1", COLUMNS="120")
    return {"root": root, "env": env, "ran": set()}


def _local(text: str, root: Path) -> str:
    return text.replace("/tmp/", f"{root}/tmp/")


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", RUN, ids=str)
def test_documented_command_runs_as_written(command, scratch):
    """The command exits with the status its page gives (0 unless it says otherwise), with no traceback."""
    root, env = scratch["root"], scratch["env"]
    (root / "tmp").mkdir(exist_ok=True)
    for n, code in enumerate(command.after):  # the page's python blocks that write its input, once each
        key = (command.page, code)
        if key in scratch["ran"]:
            continue
        scratch["ran"].add(key)
        done = subprocess.run([sys.executable, "-c", _local(code, root)], cwd=root, env=env, capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{command.page} python block {n + 1} failed:\n{done.stderr[-3000:]}"
    line = _local(command.text, root) + (f" {command.added}" if command.added else "")
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", line], cwd=root, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)
    took = time.monotonic() - started
    where = f"{command} (ran: {line!r}, {took:.1f} s, exit {done.returncode})\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, where
    verdict = re.match(r"^([a-z_]+): ", command.first_output or "")
    if command.exits is not None:
        assert done.returncode == command.exits, where
    elif verdict and " replay " in f" {command.text} " and "|" not in command.text and verdict.group(1) != "healthy":
        assert done.returncode not in (0, 2), where
    else:
        assert done.returncode == 0, where
    if verdict:  # the transcript's verdict word is what the command prints now
        assert done.stdout.startswith(verdict.group(0)), f"{where}\nprinted: {done.stdout[:300]}"


def test_the_events_md_header_example_has_a_real_headers_fields(tmp_path):
    """docs/events.md's example header carries the fields, config and versions keys a header written now has."""
    import json

    from eplb_fsm.config import EplbConfig
    from eplb_fsm.fsm.controller import EplbController
    from eplb_fsm.trace import read_trace

    text = (REPO / "docs" / "events.md").read_text()
    examples = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"event":"header"' in line]
    assert len(examples) == 1, "docs/events.md should show one header example"
    ctl = EplbController(EplbConfig(use_async=True), trace_dir=str(tmp_path), liveness_interval_s=0)
    path = ctl.trace.path
    ctl.close()
    real = read_trace(path)[0][0]
    assert real["event"] == "header"
    doc = examples[0]
    assert list(doc) == list(real)
    assert list(doc["config"]) == list(real["config"]) and list(doc["versions"]) == list(real["versions"])
