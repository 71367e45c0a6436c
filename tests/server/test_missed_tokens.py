"""``cache_missed_tokens`` defined once (docs/server.md): the readable tokens the cached prompt
this request left and this request could have shared (the fewer of the two), less those it read.
The issue's case: a base prompt, then ``Rule 2:`` changed to ``Rule two:`` (the prompt grows by
two tokens) said 464, one prefill chunk less the 48 read, while a same-length edit said 720; now
both say the figure of the definition, and Anthropic's ``cache_missed_input_tokens`` too."""

from __future__ import annotations

import anthropic
import openai
import pytest

from prefixcache.cache import FakeClock
from prefixcache.cache.reasons import missed_tokens

MODEL = "test-model"
RULES = "".join(f"Rule {n}: keep block {n} exactly as it was computed before. " for n in range(2, 14))
SYSTEM = "You answer questions about caching. " + RULES


def test_rule_two_edit_counts_what_the_cached_prompt_held(serve, make_engine) -> None:
    check_rule_two(serve(make_engine(clock=FakeClock(1000.0), prefill_chunk=512), model_name=MODEL), SYSTEM)


@pytest.mark.model
def test_rule_two_edit_on_smollm2(serve, real_engine) -> None:
    """The issue's case as it was met: SmolLM2, whose tokens make 'Rule two:' one token longer."""
    preamble = "You answer questions about caching, briefly and exactly, and about nothing else. " * 3
    system = preamble + "".join(
        f"Rule {n}: keep block {n} exactly as it was computed before. " for n in range(2, 50)
    )
    check_rule_two(serve(real_engine, model_name=MODEL), system)


def check_rule_two(server, system: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def chat(system: str) -> tuple[int, dict]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Go."}]
        r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages)
        return r.usage.prompt_tokens, r.model_extra["prefixcache"]

    base, _ = chat(system)
    assert base > 512 + 16  # the base prompt is committed in two prefill chunks
    results = [chat(system.replace("Rule 2:", edit)) for edit in ("Rule two:", "Rule X:")]
    (longer, grown), (same, kept) = results
    assert longer != base  # an edit that changes the prompt's length (the other may keep it)
    cached = grown["cached_tokens"]
    for tokens, pc in results:
        assert pc["reason"] == "diverged" and pc["cached_tokens"] == cached > 0
        readable = (min(base, tokens) - 1) // 16 * 16
        assert pc["cache_missed_tokens"] == missed_tokens(base, tokens, cached, 16) == readable - cached
        assert pc["cache_missed_tokens"] > 512 - cached  # not cut at the first prefill chunk

    # Anthropic's diagnostics for the same edit: the same figure.
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    turn = [{"role": "user", "content": "Go."}]
    first = claude.messages.create(
        model=MODEL, max_tokens=1, system=system, messages=turn, diagnostics={"previous_message_id": None}
    )
    second = claude.messages.create(
        model=MODEL,
        max_tokens=1,
        system=system.replace("Rule 2:", "Rule deux:"),  # (not yet cached)
        messages=turn,
        diagnostics={"previous_message_id": first.id},
    )
    reason = second.diagnostics.cache_miss_reason
    pc = second.model_extra["prefixcache"]
    assert reason.type == "system_changed"
    assert reason.cache_missed_input_tokens == pc["cache_missed_tokens"] > 0
