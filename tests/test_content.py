"""The one content-to-text helper: the prompt view (engine, ops tools) and the routing-key view
(router). Expected strings are what the three helpers it replaced returned."""

from __future__ import annotations

from prefixcache.content import content_text

PARTS = [
    {"type": "text", "text": "see"},
    {"type": "image", "source": {"data": "abc"}},
    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r1"}, "x"]},
    7,
]


def test_the_prompt_view_joins_text_parts_and_drops_the_rest() -> None:
    assert content_text(None) == ""
    assert content_text("plain") == "plain"
    assert content_text(PARTS) == "see7"
    assert content_text(PARTS, 0) == "see"  # upto_block: parts [0, 0]
    assert content_text({"a": 1}) == "{'a': 1}"


def test_the_routing_key_view_keeps_every_part() -> None:
    assert content_text(None, routing_key=True) == ""
    assert content_text("plain", routing_key=True) == "plain"
    assert content_text(PARTS, routing_key=True) == (
        'see\n{"source":{"data":"abc"},"type":"image"}\nr1\nx\n7'
    )
    assert content_text({"b": 1, "a": [1, 2]}, routing_key=True) == '{"a":[1,2],"b":1}'
