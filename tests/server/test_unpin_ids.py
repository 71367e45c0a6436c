"""DELETE /v1/cache/pin with token ids outside the vocabulary is a 400 naming the field (it was a
500: a 64-bit id overflowed where the cache packs the tokens); the server keeps serving."""

from __future__ import annotations

import httpx


def test_unpin_with_an_id_outside_the_vocabulary_is_a_400(make_engine, serve) -> None:  # noqa: ANN001
    server = serve(make_engine())
    r = httpx.request("DELETE", server.url + "/v1/cache/pin", json={"prompt_token_ids": [29, 2**63]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_token_ids", r.text
    assert "outside the vocabulary" in r.json()["error"]["message"]
    ok = httpx.request("DELETE", server.url + "/v1/cache/pin", json={"prompt_token_ids": [1]})
    assert ok.status_code == 200 and ok.json() == {"unpinned_tokens": 0}
