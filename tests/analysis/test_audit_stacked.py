"""Stacked busters: several variable values above the shared content (``Current time: ...`` then
``Request number N``). Each value is its own finding at its planted token, one row per value;
moving one alone saves nothing while another stays above the shared content, moving all of them
saves the shared content; the report's fix names every one."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from analysis_traces import make_trace
from rich.console import Console

from prefixcache.analysis.audit import AuditConfig, audit
from prefixcache.analysis.report import print_audit
from prefixcache.analysis.trace import ByteTokenizer, load_trace
from prefixcache.analysis.trace.spans import BustingDetector, Pair

SYSTEM = 600


@pytest.mark.parametrize(
    "stack",
    [
        ("timestamp", "counter"),
        ("counter", "uuid"),
        ("timestamp", "counter", "uuid"),
        ("epoch", "hex_id", "counter"),
    ],
)
def test_every_stacked_value_is_a_finding_with_its_own_and_the_joint_saving(
    tmp_path: Path, stack: tuple[str, ...]
) -> None:
    p = make_trace(tmp_path / "t.jsonl", [f"ep:rate=2,system={SYSTEM},bust={'+'.join(stack)}"], 300)
    trace = load_trace(p)
    planted = trace.header["planted"]
    assert [x["kind"] for x in planted] == list(stack)
    [row] = audit(trace, AuditConfig(replay=False)).endpoints
    busting = row["busting"]
    expected_kinds = ["timestamp" if k == "epoch" else k for k in stack]
    assert [(b["kind"], b["start_token"]) for b in busting] == [
        (k, x["start_token"]) for k, x in zip(expected_kinds, planted, strict=True)
    ]
    requests = row["requests"]
    for b in busting:
        others = [(o["kind"], o["start_token"]) for o in busting if o is not b]
        assert [(s["kind"], s["start_token"]) for s in b["stacked_with"]] == others
        # Together they keep out the whole system prompt below them (and a little of their lines).
        assert SYSTEM <= b["tokens_lost_per_request"] <= SYSTEM + 60
        assert b["saving_tokens_if_all_moved_below"] >= SYSTEM * requests * 0.9
        # Alone: the lowest one still has the others above it, the top one only gains the few
        # tokens up to the next value.
        assert b["saving_tokens_if_moved_below"] < 30 * requests
    assert busting[-1]["saving_tokens_if_moved_below"] == 0

    out = io.StringIO()
    print_audit(audit(trace, AuditConfig(replay=False)), Console(file=out, width=80))
    text = " ".join(out.getvalue().split())
    assert f"move all {len(stack)} variable values" in text
    for b in busting:
        assert f"{b['kind']} at token {b['start_token']}" in text
    assert "moving one alone saves" in text


def test_a_single_buster_keeps_its_whole_saving(tmp_path: Path) -> None:
    p = make_trace(tmp_path / "t.jsonl", [f"ep:rate=2,system={SYSTEM},bust=uuid,bust_at=middle"], 300)
    [row] = audit(load_trace(p), AuditConfig(replay=False)).endpoints
    [b] = row["busting"]
    assert b["stacked_with"] == []
    assert b["saving_tokens_if_moved_below"] == b["saving_tokens_if_all_moved_below"] > 0


def test_one_value_whose_first_token_moves_is_one_row() -> None:
    """A tokenizer may glue a value's first characters to the text before it, so the value's first
    token differs by one between prompts: still one finding (the one seen most), not two."""
    tok = ByteTokenizer()
    body = np.frombuffer(bytes(range(97, 123)) * 8, dtype=np.uint8).astype(np.uint32)

    def prompt(lead: str, uuid: str) -> np.ndarray:
        return np.concatenate([np.array(tok.encode(f"Id:{lead}{uuid}\n"), dtype=np.uint32), body])

    uuids = [f"{i:08x}-1111-4222-8333-{i * 7919:012x}" for i in range(1, 12)]
    # Most prompts have the value at token 3, a few at token 4 (one more leading character).
    leads = ["", "", "", " ", "", "", " ", "", "", "", ""]
    pairs = [
        Pair(i, float(i), prompt(leads[i], uuids[i]), prompt(leads[i - 1], uuids[i - 1]), 3)
        for i in range(1, 11)
    ]
    detector = BustingDetector(ByteTokenizer, min_shared=64)
    for pair in pairs:
        detector.add(pair)
    findings = detector.findings()
    assert [(f.kind, f.start_token) for f in findings] == [("uuid", 3)]
    assert len(findings[0].shared_after) == 10
