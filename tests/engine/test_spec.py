"""``GenerationSpec``: the engine's arguments as one typed value (what the server hands the engine)."""

from __future__ import annotations

import dataclasses
import inspect

from prefixcache.engine import GenerationSpec
from prefixcache.engine.engine import Engine


def test_the_spec_is_the_engines_arguments_with_its_defaults() -> None:
    params = inspect.signature(Engine.stream_choices).parameters
    kwargs = GenerationSpec().engine_kwargs()
    assert set(kwargs) == set(params) - {"self", "cancel", "return_logits"}
    for name, value in kwargs.items():
        assert value == params[name].default, name
    assert {f.name for f in dataclasses.fields(GenerationSpec)} == set(kwargs)


def test_with_prompt_ids_replaces_the_prompt_source() -> None:
    spec = GenerationSpec(messages=[{"role": "user", "content": "hi"}], max_tokens=3, stop=["x"])
    ids = spec.with_prompt_ids([1, 2, 3])
    assert (ids.messages, ids.prompt, ids.prompt_token_ids) == (None, None, [1, 2, 3])
    assert (ids.max_tokens, ids.stop) == (3, ["x"])


def test_the_engine_runs_a_spec(tiny_engine: Engine) -> None:
    spec = GenerationSpec(prompt_token_ids=list(range(3, 40)), max_tokens=4)
    one = tiny_engine.generate_choices(**spec.engine_kwargs())
    two = tiny_engine.generate_choices(prompt_token_ids=list(range(3, 40)), max_tokens=4)
    assert one.choices[0].tokens == two.choices[0].tokens
    assert one.usage.prompt_tokens == 37
