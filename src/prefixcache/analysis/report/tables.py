"""Report tables that fit: on a terminal, in a file, in a pipe.

:class:`ReportTable` takes columns and rows like ``rich.table.Table`` and prints them in one of
:data:`FORMATS` (``--format`` of ``audit``, ``simulate`` and ``bench``):

* ``table``: a rich table when every cell fits the console's width whole; otherwise the rows
  stacked, one block per row with ``column: value`` lines. No cell is ever cut to ``4,6…``.
* ``markdown``: a GitHub table, one line per row whatever the width.
* ``csv``: the title as a ``#`` line, then a header and one line per row.

:func:`report_console` picks the width: the terminal's on a terminal, ``$COLUMNS`` when set,
else 100 (a file or a pipe, where rich would assume 80 and wrap).
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

FORMATS = ("table", "markdown", "csv", "json")
#: Width of a report written to a file or a pipe (no terminal to measure).
FILE_WIDTH = 100


def report_console(*, stderr: bool = False, width: int | None = None) -> Console:
    """A console for reports: the terminal's width, ``$COLUMNS``, or :data:`FILE_WIDTH`."""
    stream = sys.stderr if stderr else sys.stdout
    if width is None and not os.environ.get("COLUMNS") and not stream.isatty():
        width = FILE_WIDTH
    return Console(stderr=stderr, width=width, soft_wrap=False)


def plain(cell: Any) -> str:
    """A cell's text without rich markup."""
    if isinstance(cell, Text):
        return cell.plain
    try:
        return Text.from_markup(str(cell)).plain
    except Exception:  # not markup after all: the text as it is
        return str(cell)


def shorten_left(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, dropping from the left (the end of a path or an
    endpoint name is what tells it apart): ``…/chat/completions``."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1 :]


class ReportTable:
    """Columns and rows, printed to fit (see the module)."""

    def __init__(self, title: str | None = None, *, show_header: bool = True) -> None:
        self.title = title
        self.show_header = show_header
        self.columns: list[tuple[str, str]] = []  # (header, justify)
        self.rows: list[list[str]] = []

    def add_column(self, header: str, justify: str = "left") -> None:
        self.columns.append((header, justify))

    def add_row(self, *cells: Any) -> None:
        while len(self.columns) < len(cells):  # (a headerless table: columns as rows need them)
            self.add_column("")
        self.rows.append([str(c) for c in cells])

    # ------------------------------------------------------------------ output
    def emit(self, console: Console, fmt: str = "table") -> None:
        if fmt == "markdown":
            self._write(console, self.markdown())
        elif fmt == "csv":
            self._write(console, self.csv())
        else:
            self._table(console)

    def markdown(self) -> str:
        heads = [h for h, _ in self.columns]
        out = [f"**{self.title}**", ""] if self.title else []
        if self.show_header:
            out.append("| " + " | ".join(heads) + " |")
        else:
            out.append("|" + " |" * len(heads))
        out.append("|" + "|".join("---:" if j == "right" else "---" for _, j in self.columns) + "|")
        for row in self.rows:
            out.append("| " + " | ".join(plain(c).replace("|", "\\|") for c in row) + " |")
        return "\n".join(out) + "\n"

    def csv(self) -> str:
        buf = io.StringIO()
        if self.title:
            buf.write(f"# {self.title}\n")
        w = csv.writer(buf, lineterminator="\n")
        if self.show_header:
            w.writerow([h for h, _ in self.columns])
        for row in self.rows:
            w.writerow([plain(c) for c in row])
        return buf.getvalue()

    def _cell_widths(self) -> list[int]:
        return [
            max([1, *(max((len(x) for x in plain(row[i]).splitlines()), default=0) for row in self.rows)])
            for i in range(len(self.columns))
        ]

    def _widths(self, split_headers: bool) -> list[int]:
        """Each column's width with every cell whole (headers on one line, or wrapped to the
        column's widest cell)."""
        widths = []
        for (h, _), cells in zip(self.columns, self._cell_widths(), strict=True):
            lines = _wrap(h, cells) if split_headers else [h]
            head = max(len(x) for x in lines) if self.show_header else 0
            widths.append(max(head, cells))
        return widths

    def width_needed(self, split_headers: bool = False) -> int:
        """Characters of the rich table with every cell whole (borders and padding included)."""
        widths = self._widths(split_headers)
        return sum(widths) + 3 * len(widths) + 1

    def _table(self, console: Console) -> None:
        """One table if it fits (headers wrapped a word a line if need be); else the columns in
        several tables, each led by the first column; else the rows stacked."""
        width = console.width
        if self.width_needed() <= width:
            self._rich(console, list(range(len(self.columns))), self.title, split_headers=False)
            return
        split = self._widths(True)
        if sum(split) + 3 * len(split) + 1 <= width:
            self._rich(console, list(range(len(self.columns))), self.title, split_headers=True)
            return
        groups: list[list[int]] = []
        used = split[0] + 4 + 1  # the leading column, its borders and padding
        group: list[int] = []
        for i in range(1, len(self.columns)):
            if group and used + split[i] + 3 > width:
                groups.append(group)
                group, used = [], split[0] + 4 + 1
            group.append(i)
            used += split[i] + 3
        groups.append(group)
        if len(self.columns) < 2 or any(split[0] + split[g[0]] + 7 > width for g in groups if g):
            self._stacked(console)
            return
        for n, g in enumerate(groups):
            title = self.title if n == 0 else (f"{self.title} (continued)" if self.title else None)
            self._rich(console, [0, *g], title, split_headers=True)

    def _rich(self, console: Console, columns: list[int], title: str | None, *, split_headers: bool) -> None:
        t = Table(title=title, title_justify="left", show_header=self.show_header)
        cells = self._cell_widths()
        for i in columns:
            header, justify = self.columns[i]
            head = "\n".join(_wrap(header, cells[i])) if split_headers else header
            t.add_column(head, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        for row in self.rows:
            t.add_row(*(row[i] for i in columns))
        console.print(t)

    def _stacked(self, console: Console) -> None:
        """One block per row: its first cell as the heading, then ``column: value`` lines."""
        if self.title:
            console.print(f"[bold]{escape(self.title)}[/bold]")
        heads = [h for h, _ in self.columns]
        pad = max((len(h) for h in heads[1:]), default=0)
        for row in self.rows:
            console.print(f"  [bold]{row[0]}[/bold]" if self.show_header else f"  {row[0]}: {row[1]}")
            if not self.show_header:
                continue
            for h, c in zip(heads[1:], row[1:], strict=True):
                console.print(f"    {escape(h) + ':':<{pad + 1}} {c}")
        console.print()

    @staticmethod
    def _write(console: Console, text: str) -> None:
        console.file.write(text)
        console.file.write("\n")
        console.file.flush()


def _wrap(header: str, width: int) -> list[str]:
    """A header in lines of at most ``width`` characters (a longer word keeps its own line)."""
    import textwrap

    return textwrap.wrap(header, max(width, 1), break_long_words=False, break_on_hyphens=False) or [""]


def tables_from_markdown(text: str) -> list[str | ReportTable]:
    """``text`` (Markdown) as its plain lines and its pipe tables, in order: a Markdown report
    (``bench``'s) printed in any of the formats."""
    out: list[str | ReportTable] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.startswith("|") and nxt.startswith("|") and set(nxt.replace("|", "").strip()) <= set("-: "):
            t = ReportTable()
            cells = _split_row(line)
            aligns = _split_row(nxt)
            for h, a in zip(cells, aligns + [""] * len(cells), strict=False):
                t.add_column(h, "right" if a.endswith(":") else "left")
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                row = _split_row(lines[i])
                t.add_row(*(row + [""] * len(cells))[: len(cells)])
                i += 1
            out.append(t)
            continue
        out.append(line)
        i += 1
    return out


def _split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def emit_markdown(console: Console, text: str, fmt: str) -> None:
    """A Markdown report in ``fmt``: as written (``markdown``), or its tables as tables or CSV."""
    if fmt == "markdown":
        ReportTable._write(console, text.rstrip("\n"))
        return
    for part in tables_from_markdown(text):
        if isinstance(part, ReportTable):
            part.emit(console, fmt)
        elif fmt != "csv" or part.strip():
            console.print(escape(part) if fmt == "table" else part, markup=fmt == "table", highlight=False)


def check_format(fmt: str, allowed: Sequence[str] = FORMATS) -> str:
    if fmt not in allowed:
        raise ValueError(f"{fmt!r}: choose one of {', '.join(allowed)}")
    return fmt
