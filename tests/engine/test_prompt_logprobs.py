"""Engine.prompt_logprobs: every prompt token's logprob, recomputed with the cache bypassed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from prefixcache.engine.engine import Engine
from prefixcache.engine.serving.prompt_logprobs import prompt_logprobs
from prefixcache.engine.serving.sampling import InvalidRequestError, token_logprobs


def test_each_row_is_the_last_row_of_a_cold_run_cut_there_whatever_the_cache_holds(tiny_runner: Any) -> None:
    rng = random.Random(3)
    ids = [rng.randrange(3, 250) for _ in range(90)]
    engine = Engine(tiny_runner, prefill_chunk=16)
    cold = Engine(tiny_runner, prefill_chunk=16, enable_cache=False)
    try:
        before = engine.prompt_logprobs(prompt_token_ids=ids, top=4)
        engine.generate(prompt_token_ids=ids, max_tokens=2)  # now cached: the rows are recomputed anyway
        after = engine.prompt_logprobs(prompt_token_ids=ids, top=4)
        assert before == after and len(before) == len(ids) and before[0] is None
        small = prompt_logprobs(engine.runner, ids, 4, block_size=16, chunk=5)  # other chunks, same bits
        assert [e and (e.logprob, e.top) for e in small] == [e and (e.logprob, e.top) for e in before]
        for k in (1, 15, 16, 33, 89):
            row = cold.generate(prompt_token_ids=ids[:k], max_tokens=1, return_logits=True).first_logits
            lp, best = token_logprobs(row, ids[k], 4)
            assert (before[k].token, before[k].logprob, before[k].top) == (ids[k], lp, best)
            assert before[k].rank == int((row > row[ids[k]]).sum()) + 1
    finally:
        engine.close()
        cold.close()


def test_bad_top_and_the_hf_runner_are_refused(tiny_runner: Any) -> None:
    engine = Engine(tiny_runner, prefill_chunk=16)
    hf = Engine(tiny_runner, prefill_chunk=16, runner="hf")
    try:
        with pytest.raises(InvalidRequestError, match="0 to 20"):
            engine.prompt_logprobs(prompt="hi", top=21)
        with pytest.raises(InvalidRequestError, match="own Llama runner"):
            hf.prompt_logprobs(prompt="hi there")
        assert engine.prompt_logprobs(prompt_token_ids=[5]) == [None]
    finally:
        engine.close()
        hf.close()
