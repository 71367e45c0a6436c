"""Structured output's cost: the same chat requests with and without a JSON schema, N clients.

    python benchmarks/bench_structured.py --clients 8 --requests 4 --max-tokens 48

Starts one ``prefixcache serve`` (SmolLM2, default settings), warms it, then runs two passes of
``--clients`` concurrent clients, each sending ``--requests`` chat requests one after another
(temperature 0, a shared system prompt, a user question per request, worded apart between the
passes so neither reads the other's prompts from the cache): first with
``response_format`` json_schema (strict, a small object), then without it, with ``max_tokens`` set to
the structured pass's mean answer length (so both passes spread a request's prefill over as many
output tokens). Reports
output tok/s of each pass (completion tokens over the pass's wall time), their ratio, and how many
structured answers parse against the schema. Writes ``structured.md`` and ``structured.json``
under ``--out-dir`` (unless ``--no-write``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a records clerk. You answer with one person's name, age and city. " * 6
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "age", "city"}
        and isinstance(obj["age"], int)
        and 0 <= obj["age"] <= 120
    )


async def _pass(url: str, clients: int, requests: int, max_tokens: int, schema: bool) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as http:
        mark = "" if schema else "."  # the passes' prompts differ: neither reads the other's

        async def client(c: int) -> list[dict[str, Any]]:
            out = []
            for i in range(requests):
                body: dict[str, Any] = {
                    "model": "smollm2-135m-instruct",
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {
                            "role": "user",
                            "content": f"Record {c * requests + i}{mark}: who is it?",
                        },
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                if schema:
                    body["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
                    }
                r = await http.post(url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                out.append(r.json())
            return out

        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - started
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    texts = [r["choices"][0]["message"]["content"] for r in results]
    return {
        "schema": schema,
        "requests": len(results),
        "wall_s": round(wall, 2),
        "completion_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "parsed": sum(_valid(t) for t in texts),
        "finish_stop": sum(r["choices"][0]["finish_reason"] == "stop" for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8, help="Concurrent clients per pass.")
    p.add_argument("--requests", type=int, default=4, help="Requests per client per pass.")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request.")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"), help="Where the outputs go.")
    p.add_argument("--no-write", action="store_true", help="Print only; write no files.")
    args = p.parse_args(argv)
    port = _port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prefixcache.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit("the server did not answer /health within 300 s")
        asyncio.run(_pass(url, 1, 1, 4, True))  # warm-up: the tokenizer's grammar view, the prefix
        structured = asyncio.run(_pass(url, args.clients, args.requests, args.max_tokens, True))
        # The plain pass generates as many tokens per request as the structured one did (a JSON
        # answer stops early; a longer plain answer would spread its prefill over more tokens).
        matched = max(1, round(structured["completion_tokens"] / structured["requests"]))
        plain = asyncio.run(_pass(url, args.clients, args.requests, matched, False))
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    ratio = structured["output_tok_s"] / plain["output_tok_s"] if plain["output_tok_s"] else 0.0
    report = {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "plain_max_tokens": matched,
        "dtype": os.environ.get("PREFIXCACHE_DTYPE", "default"),
        "plain": plain,
        "json_schema": structured,
        "ratio": round(ratio, 3),
    }
    lines = [
        "# Structured output: JSON schema vs none",
        "",
        f"{args.clients} clients x {args.requests} chat requests, max_tokens {args.max_tokens}, "
        "temperature 0.",
        "",
        "| pass | requests | output tok/s | completion tokens | wall s | parse | finish stop |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in (("no schema", plain), ("json_schema", structured)):
        lines.append(
            f"| {name} | {r['requests']} | {r['output_tok_s']} | {r['completion_tokens']} | {r['wall_s']} "
            f"| {r['parsed']}/{r['requests']} | {r['finish_stop']} |"
        )
    lines += [
        "",
        f"The no-schema pass ran with max_tokens {matched} (the structured answers' mean length).",
        "",
        f"json_schema / no schema output tok/s: {ratio:.3f}",
    ]
    print("\n".join(lines))
    if not args.no_write:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "structured.md").write_text("\n".join(lines) + "\n")
        (out / "structured.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
