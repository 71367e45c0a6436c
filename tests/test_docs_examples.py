"""The README's and the docs' examples run as written.

* Every ``$ prefixcache ...`` command of a ``console`` block in README.md and docs/ops.md runs in
  a fresh folder, in order, and exits 0 without a traceback. By default traces are made smaller
  (``-n 20000`` becomes ``-n 2000``); ``make docs-check`` (``DOCS_CHECK_FULL=1``) runs them as
  written and checks that the first line the docs show under a command is what it prints.
* The Python examples: tests/server/test_docs_python_examples.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import prefixcache

ROOT = Path(prefixcache.__file__).resolve().parents[2]
SRC = str(ROOT / "src")
FULL = os.environ.get("DOCS_CHECK_FULL") == "1"
DOCS = ("README.md", "docs/ops.md")


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M)


def console_examples() -> list[tuple[str, str, list[str]]]:
    """(doc, command, the output lines the doc shows under it) for every ``$ prefixcache`` line."""
    out: list[tuple[str, str, list[str]]] = []
    for doc in DOCS:
        for block in blocks(ROOT / doc, "console"):
            lines = block.splitlines()
            i = 0
            while i < len(lines):
                line = lines[i]
                if not line.startswith("$ prefixcache"):
                    if out and out[-1][0] == doc:
                        out[-1][2].append(line)
                    i += 1
                    continue
                command = line[2:]
                while command.endswith("\\"):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                out.append((doc, command, []))
                i += 1
    return out


def test_the_docs_show_the_commands_this_checks() -> None:
    commands = [c for _, c, _ in console_examples()]
    assert any(c.startswith("prefixcache audit traffic.jsonl") for c in commands)
    assert any("quiet.jsonl --sweep" in c for c in commands)
    assert sum(c.startswith("prefixcache trace import") for c in commands) == 1


def test_every_console_example_runs(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    # The import example's input: a real Mooncake trace's format (the test fixture).
    shutil.copy(ROOT / "tests/analysis/fixtures/mooncake.jsonl", work / "conversation_trace.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXCACHE_")}
    env |= {"PYTHONPATH": SRC, "PREFIXCACHE_HOME": str(tmp_path / "home"), "COLUMNS": "100"}
    failures = []
    for doc, command, shown in console_examples():
        argv = shlex.split(command, comments=True)
        if not FULL:
            argv = ["2000" if a == "20000" else a for a in argv]
        r = subprocess.run(
            [sys.executable, "-m", "prefixcache", *argv[1:]],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode != 0 or "Traceback" in r.stdout + r.stderr:
            failures.append(f"{doc}: {command}\n{r.stderr[-2000:]}")
            continue
        if FULL and shown and not shown[0].startswith(("  ...", "│", "┃")):
            first = " ".join(shown[0].split())
            if first not in " ".join(r.stdout.split()):
                failures.append(f"{doc}: {command}\nthe doc shows {first!r}; it printed:\n{r.stdout[:1500]}")
    assert not failures, "\n\n".join(failures)
    assert (work / "docs/img/sweep_ttl.png").stat().st_size > 0  # the README's picture, regenerated
    assert (work / "audit.html").stat().st_size > 0
