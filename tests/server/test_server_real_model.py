"""The embedded SmolLM2 behind the server: a second request that shares a long system prompt
reads it from the cache, as both APIs' usage fields report."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "smollm2"
# A long shared system prompt (the own runner reads every full 16-token block of it).
SYSTEM = (
    "You are the support assistant of a small bicycle shop. Answer in one short sentence. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; closed on Sundays. "
    "We repair brakes, gears, wheels and e-bike motors, and we sell city, road and cargo bikes. "
) * 12


@pytest.mark.model
def test_shared_system_prompt_is_read_from_the_cache_in_both_apis(serve, real_engine, one_torch_thread):
    assert real_engine.alignment == 16
    server = serve(real_engine, model_name=MODEL)
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)

    def ask(question: str):
        return oa.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )

    first = ask("When are you open on Saturday?")
    assert first.choices[0].message.content.strip()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    written = first.usage.prompt_tokens_details.cache_write_tokens
    assert written == first.usage.prompt_tokens // 16 * 16  # every full block
    second = ask("Do you repair e-bike motors?")
    cached = second.usage.prompt_tokens_details.cached_tokens

    def ids(question: str) -> list[int]:
        return real_engine.render_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

    a, b = ids("When are you open on Saturday?"), ids("Do you repair e-bike motors?")
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert cached == shared // 16 * 16 > 500  # every full block of the shared prefix
    third = an.messages.create(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": "Do you sell cargo bikes?"}]
    )
    u = third.usage
    assert u.cache_read_input_tokens == cached  # same system prompt, same tokens, same blocks
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == real_engine.count_tokens(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell cargo bikes?"}]
    )
    real_engine.cache.check_integrity()
