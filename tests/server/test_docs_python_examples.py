"""The README's and docs/server.md's Python examples (the official OpenAI and Anthropic clients)
run as written against ``prefixcache serve``'s app on SmolLM2, from the repository root (they
read ``examples/style_guide.md``); only the address is the test server's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import prefixcache

ROOT = Path(prefixcache.__file__).resolve().parents[2]


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M)


@pytest.mark.model
def test_the_python_examples_run_against_the_server(serve, real_engine, monkeypatch) -> None:
    server = serve(real_engine, model_name="smollm2-135m-instruct")
    monkeypatch.chdir(ROOT)  # as written: from the repository root
    for doc in ("README.md", "docs/server.md"):
        scope: dict[str, object] = {}
        for code in blocks(ROOT / doc, "python"):
            if "127.0.0.1:8000" not in code and "client" not in code:
                continue
            exec(compile(code.replace("http://127.0.0.1:8000", server.url), doc, "exec"), scope)
        assert "client" in scope and "SYSTEM" in scope, doc
