"""Shared fixtures of every test package (kept stable: other teams build on these names).

- ``fake_clock``: a :class:`prefixcache.cache.FakeClock` at t=0 (``.now``, ``.advance(s)``, callable).
- ``tiny_runner`` (session): a random 2-layer Llama + byte-level chat tokenizer; loads in ~1 s.
- ``tiny_engine``: a fresh Engine over ``tiny_runner``, cache on, block 16, prefill_chunk 16,
  its cache on ``fake_clock`` (``tiny_engine.clock is fake_clock``).
- ``real_runner`` (session): the embedded SmolLM2-135M-Instruct, loaded once per session
  (the first load ever converts the GGUF, ~30 s; later loads a few seconds). Tests that use it
  carry ``@pytest.mark.model``.
- ``real_engine``: a fresh Engine over ``real_runner``, default settings (prefill_chunk 512),
  its cache on ``fake_clock``.
- ``require_binary`` (session): ``require_binary(name, install)`` -> the binary's path. Without
  it the test skips, except under CI (``$CI`` set), where it fails: a CI run that cannot test
  the shared tier or the HTML report must go red, not green with skips.
- ``redis_server_bin``, ``chromium_bin`` (session): ``require_binary`` of the two the suite needs.
- ``browse``: ``browse(url, budget_ms=5000, dark=False)`` -> a :class:`PageDom` of the page as
  headless Chromium left it after ``budget_ms`` of virtual time (scripts run, fetches answered):
  ``.by_id(id)`` -> (text, attributes), ``.rows(tbody_id)`` -> each row's cell texts.
  ``browse.screenshot(url, path, dark=False)`` writes a PNG instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from prefixcache.cache import FakeClock

#: Binaries the suite needs, and how to get them (``.ci/run`` installs both).
INSTALL_HINTS = {
    "redis-server": "apt-get install redis-server",
    "chromium": "apt-get install chromium",
}


def find_required_binary(name: str, install: str) -> str:
    """The path of ``name`` on PATH. Missing: ``pytest.fail`` when ``$CI`` is set (the message
    names the binary and how to install it), ``pytest.skip`` otherwise."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} is not on PATH: install it ({install}; .ci/run does)"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set and {message}: the tests that need it cannot be skipped in CI", pytrace=False)
    pytest.skip(message)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The dtype the engines under test compute in (``$PREFIXCACHE_DTYPE`` or the machine's), and
    the CPU with the flags that pick the kernels' paths: a failure seen on one machine kind only
    says which kind it was."""
    from prefixcache.engine.model import DTYPE_ENV, default_dtype, machine_dtype

    source = f"${DTYPE_ENV}" if os.environ.get(DTYPE_ENV, "").strip() else "this machine's default"
    lines = [f"prefixcache dtype: {default_dtype()} ({source}; the machine's: {machine_dtype()})"]
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return lines
    rows = info.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in rows if ln.startswith("model name")), "?")
    words = set(next((ln for ln in rows if ln.startswith("flags")), "").split())
    picked = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in words]
    lines.append(f"cpu: {model}; {os.cpu_count()} cores; flags: {' '.join(picked) or 'none of avx2/avx512'}")
    return lines


@pytest.fixture(scope="session")
def require_binary() -> Callable[[str, str], str]:
    return find_required_binary


@pytest.fixture(scope="session")
def redis_server_bin() -> str:
    return find_required_binary("redis-server", INSTALL_HINTS["redis-server"])


@pytest.fixture(scope="session")
def chromium_bin() -> str:
    return find_required_binary("chromium", INSTALL_HINTS["chromium"])


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock(0.0)


@pytest.fixture(scope="session")
def tiny_runner() -> Any:
    from prefixcache.engine.model import ModelRunner

    return ModelRunner.tiny(seed=0)


@pytest.fixture
def tiny_engine(tiny_runner: Any, fake_clock: FakeClock) -> Iterator[Any]:
    from prefixcache.engine.engine import Engine

    engine = Engine(tiny_runner, prefill_chunk=16, clock=fake_clock)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def real_runner() -> Any:
    from prefixcache.engine.model import ModelRunner

    return ModelRunner.load()


@pytest.fixture
def real_engine(real_runner: Any, fake_clock: FakeClock) -> Iterator[Any]:
    from prefixcache.engine.engine import Engine

    engine = Engine(real_runner, clock=fake_clock)
    yield engine
    engine.close()


class PageDom(HTMLParser):
    """The text and attributes of every element with an id, and the rows of every ``tbody``."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.html = html
        self.ids: dict[str, tuple[str, dict[str, str]]] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self._open: list[tuple[str, str | None, dict[str, str], list[str]]] = []  # tag, id, attrs, text
        self._tbody: str | None = None
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag in ("meta", "link", "input", "br", "img"):
            if "id" in a:
                self.ids[a["id"]] = ("", a)
            return
        self._open.append((tag, a.get("id"), a, []))
        if tag == "tbody" and "id" in a:
            self._tbody = a["id"]
            self.tables[self._tbody] = []
        elif tag == "tr" and self._tbody is not None:
            self.tables[self._tbody].append([])
        elif tag == "td" and self._tbody is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            t, ident, attrs, text = self._open.pop()
            joined = "".join(text)
            if self._open:
                self._open[-1][3].append(joined)
            if ident is not None:
                self.ids[ident] = (" ".join(joined.split()), attrs)
            if t == tag:
                break
        if tag == "td" and self._cell is not None and self._tbody is not None:
            self.tables[self._tbody][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tbody":
            self._tbody = None

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1][3].append(data)
        if self._cell is not None:
            self._cell.append(data)

    def by_id(self, ident: str) -> tuple[str, dict[str, str]]:
        return self.ids[ident]

    def value(self, ident: str) -> float:
        """The ``data-value`` of the element ``ident`` (the number behind its formatted text)."""
        return float(self.ids[ident][1]["data-value"])

    def rows(self, tbody: str) -> list[list[str]]:
        return self.tables[tbody]


class Browser:
    """Headless Chromium runs of one test (each with a fresh profile: no storage carries over)."""

    def __init__(self, binary: str, tmp: Path) -> None:
        self.binary = binary
        self.tmp = tmp
        self.runs = 0

    def _run(self, url: str, extra: list[str], budget_ms: int, dark: bool) -> str:
        self.runs += 1
        profile = self.tmp / f"chromium-{self.runs}"
        cmd = [
            self.binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            *(["--force-dark-mode", "--blink-settings=preferredColorScheme=0"] if dark else []),
            *extra,
            url,
        ]
        env = {**os.environ, "HOME": str(self.tmp)}
        done = subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=env, text=True)
        return done.stdout

    def __call__(self, url: str, budget_ms: int = 5000, dark: bool = False) -> PageDom:
        return PageDom(self._run(url, ["--dump-dom"], budget_ms, dark))

    def screenshot(self, url: str, path: Path, dark: bool = False, size: str = "1400,1500") -> None:
        self._run(url, [f"--screenshot={path}", f"--window-size={size}", "--hide-scrollbars"], 5000, dark)


@pytest.fixture
def browse(chromium_bin: str, tmp_path: Path) -> Browser:
    return Browser(chromium_bin, tmp_path)
