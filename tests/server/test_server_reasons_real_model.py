"""Miss reasons with the embedded SmolLM2 behind the live server: a full hit, a system prompt
edited at a known token (the reported index is the planted one, found with the real tokenizer),
expiry on a fake clock, and Anthropic's diagnostics parsed by the official SDK."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "smollm2"
HEAD = "You are the support assistant of a small bicycle shop. Answer in one short sentence. "
TAIL = (
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; closed on Sundays. "
    "We repair brakes, gears, wheels and e-bike motors, and we sell city, road and cargo bikes. "
) * 3
MONDAY = HEAD + "Today is Monday." + TAIL
FRIDAY = HEAD + "Today is Friday." + TAIL
QUESTION = "When are you open on Saturday?"


@pytest.mark.model
def test_reasons_with_the_real_model(serve, real_engine, fake_clock, one_torch_thread):
    server = serve(real_engine, model_name=MODEL)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)

    def messages(system: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]

    def ask(system: str):
        r = oa.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=messages(system))
        return r.usage, r.model_extra["prefixcache"]

    tok = real_engine.tokenizer
    rendered = real_engine.render(messages(FRIDAY), add_generation_prompt=True)
    planted = len(tok.encode(rendered[: rendered.index(" Friday")], add_special_tokens=False))
    n = len(real_engine.render_ids(messages(MONDAY)))
    readable = (n - 1) // 16 * 16

    usage, pc = ask(MONDAY)
    assert pc == {"reason": "new_prefix", "cached_tokens": 0, "cache_missed_tokens": 0}
    usage, pc = ask(MONDAY)
    assert pc == {"reason": "full_hit", "cached_tokens": readable, "cache_missed_tokens": 0}
    usage, pc = ask(FRIDAY)
    assert pc["reason"] == "diverged" and pc["divergence"]["token_index"] == planted
    assert pc["divergence"]["prompt_text"].startswith(" Friday")
    assert pc["divergence"]["cached_text"].startswith(" Monday")
    assert pc["divergence"]["text_before"].endswith("Today is")
    assert pc["cached_tokens"] == planted // 16 * 16 == usage.prompt_tokens_details.cached_tokens
    assert pc["cache_missed_tokens"] == readable - planted // 16 * 16

    fake_clock.advance(real_engine.cache.default_ttl_s + 60)
    usage, pc = ask(MONDAY)
    assert pc == {
        "reason": "expired",
        "cached_tokens": 0,
        "cache_missed_tokens": readable,
        "expired_ago_s": 60.0,
    }

    first = an.messages.create(
        model=MODEL,
        max_tokens=2,
        system=MONDAY,
        messages=[{"role": "user", "content": QUESTION}],
        diagnostics={"previous_message_id": None},
    )
    assert first.diagnostics is None and first.model_extra["prefixcache"]["reason"] == "full_hit"
    second = an.messages.create(
        model=MODEL,
        max_tokens=2,
        system=FRIDAY,
        messages=[{"role": "user", "content": QUESTION}],
        diagnostics={"previous_message_id": first.id},
    )
    reason = second.diagnostics.cache_miss_reason
    assert reason.type == "system_changed"
    assert reason.cache_missed_input_tokens == readable - second.usage.cache_read_input_tokens
    # Structurally the system prompt changed; our cache knows more: this very prompt (Friday's)
    # was cached by the third request and its blocks past the Monday fork expired.
    pc = second.model_extra["prefixcache"]
    assert (pc["reason"], pc["cached_tokens"]) == ("expired", planted // 16 * 16)
    assert pc["cache_missed_tokens"] == readable - planted // 16 * 16
