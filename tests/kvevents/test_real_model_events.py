"""``prefixcache serve --kv-events-endpoint`` with the real SmolLM2: a subscriber that knows only
msgspec, pyzmq and vLLM's event structs decodes every event of a run (requests through the
official OpenAI client, one streamed, evictions, a flush), in order, with no gap; the replayed
stream is byte for byte the live one; and the stored hashes are exactly the prompts' blocks that
each response says it wrote."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from prefixcache.commands.cluster import free_port, wait_ready

from .vllm_structs import BlockRemoved, BlockStored, Subscriber, events_of

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
SYSTEMS = [
    "You are the support assistant of Acme Corp. Answer briefly, politely and in plain English. " * 3,
    "You are a terse librarian. Recommend exactly one book and give no explanation at all. " * 3,
]


def header_hashes(resp: httpx.Response) -> tuple[int, int, list[int]]:
    tokens, block_size, hashes = resp.headers["x-prefixcache-blocks"].split(" ")
    return int(tokens), int(block_size), [int(h, 16) for h in hashes.split(",")]


def test_a_real_run_decodes_in_order_with_no_gap_and_replays_identically(tmp_path) -> None:  # noqa: ANN001
    from openai import OpenAI

    port, pub, replay = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "prefixcache",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--capacity",
        "6MB",  # about 8 blocks of SmolLM2 in float32: the second system prompt evicts
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
        "--kv-events-topic",
        "kv@replica-0",
        "--log-level",
        "warning",
    ]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", b"kv@replica-0")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 300)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        want = {"x-prefixcache-want-blocks": "1"}
        expected: list[int] = []  # every block each request says it wrote, in order
        asks = [(SYSTEMS[0], "Hi"), (SYSTEMS[0], "What is your refund policy?"), (SYSTEMS[1], "Hi")]
        for system, user in asks:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                max_tokens=2,
                temperature=0,
                extra_headers=want,
            )
            usage = raw.parse().usage
            tokens, block_size, hashes = header_hashes(raw.http_response)
            assert tokens == usage.prompt_tokens and block_size == 16
            assert len(hashes) == tokens // 16
            details = raw.http_response.json()["usage"]["prompt_tokens_details"]  # (our extra field)
            cached, written = details["cached_tokens"], details["cache_write_tokens"]
            expected += hashes[cached // 16 : (cached + written) // 16]
        # Streamed: the header is there too (computed before the response starts).
        messages = [{"role": "system", "content": SYSTEMS[1]}, {"role": "user", "content": "Another?"}]
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            headers=want,
            json={
                "model": MODEL,
                "messages": messages,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=120,
        ) as resp:
            tokens, _, hashes = header_hashes(resp)
            lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
        import json

        usage = next(json.loads(line[6:])["usage"] for line in reversed(lines) if '"usage"' in line)
        cached, written = (
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["prompt_tokens_details"]["cache_write_tokens"],
        )
        assert tokens == usage["prompt_tokens"]
        expected += hashes[cached // 16 : (cached + written) // 16]
        flushed = httpx.delete(url + "/v1/cache", timeout=30).json()["flushed_blocks"]
        assert flushed > 0

        # Read until the stream shows the flush: every stored block removed again.
        deadline = time.monotonic() + 30
        while True:
            stream = sub.replay(0)
            events = events_of(stream)
            stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
            removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
            if stored and sorted(stored) == sorted(removed):
                break
            assert time.monotonic() < deadline, "the flush's BlockRemoved never came"
            sub.receive(200)
        live = sub.stream(len(stream))  # what arrived live, the startup batch filled from replay
        assert [seq for seq, _ in stream] == list(range(len(stream)))  # no gap
        assert live == stream  # replayed == live, byte for byte
        assert type(events[0]).__name__ == "AllBlocksCleared"  # at startup, seq 0
        assert stored == expected  # exactly the blocks the responses wrote, in order
        last_store = max(i for i, e in enumerate(events) if isinstance(e, BlockStored))
        evicted = [h for e in events[:last_store] if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert evicted, f"the small budget evicted nothing ({len(stored)} stored, {flushed} flushed)"
        after = [h for e in events[last_store:] if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert len(after) == flushed
        seen: set[int] = set()
        for e in events:  # every store continues a block held at that moment (or starts a prompt)
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in seen
                assert len(e.token_ids) == 16 * len(e.block_hashes) and e.medium == "CPU"
                seen.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= seen
                seen.difference_update(e.block_hashes)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f"prefixcache_kv_events_stored_blocks_total {float(len(stored))}" in metrics
        assert "prefixcache_kv_events_dropped_total 0.0" in metrics
    finally:
        sub.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_anchors_name_blocks_that_later_prompts_sharing_the_chunk_hold(real_engine) -> None:  # noqa: ANN001
    """The router's proportional anchors, on SmolLM2's real tokenizer and chat template: every
    anchor learned from one prompt is a block of every other prompt that shares its routing
    chunk (so it is held exactly when that shared prefix is), and most shared chunks get one."""
    from prefixcache.router.affinity import prefix_key
    from prefixcache.router.kv_index import BlockAnchors
    from prefixcache.router.proxy import rendered_chars
    from prefixcache.server.compat.kv_blocks import blocks_header

    words = [
        "account",
        "billing",
        "invoice",
        "refund",
        "policy",
        "customer",
        "order",
        "shipping",
        "warranty",
        "return",
    ]
    systems = [" ".join(words[(i + j) % len(words)] for j in range(n)) for i, n in ((0, 120), (3, 250))]
    users = ["Hi", "Where is my parcel? It was due on Monday.", "Cancel my plan " * 20]
    bodies = [
        {"model": MODEL, "messages": [{"role": "system", "content": s}, {"role": "user", "content": u}]}
        for s in systems
        for u in users
    ]
    ns = real_engine.namespace()
    views = []
    for b in bodies:
        ids = real_engine.render_ids(b["messages"])
        keys = real_engine.cache.block_keys(ids, ns)
        views.append((prefix_key(b).chunks, rendered_chars(b), blocks_header(len(ids), 16, keys), keys))
    checked = 0
    for i, (chunks, chars, header, _) in enumerate(views):
        anchors = BlockAnchors(256)
        assert anchors.learn(chunks, chars, header, 0.0) > 0
        for j, (other_chunks, _, _, other_keys) in enumerate(views):
            held = {int.from_bytes(k[-8:], "big") for k in other_keys}
            for chunk in set(chunks) & set(other_chunks):
                anchor = anchors.get(chunk)
                if anchor is not None and i != j:
                    assert anchor[0] in held, f"prompt {i}'s anchor for a chunk prompt {j} shares"
                    checked += 1
    assert checked >= 20
