"""Request traces: the JSONL format, version 1 (written by :mod:`.writer`, read by :mod:`.reader`
and :mod:`.load`).

Format (one JSON object per line, UTF-8; unknown fields are ignored, so it can grow):

* Request lines (``"type"`` absent or ``"request"``)::

    {"v": 1, "ts": 1764412800.25,          # seconds (any origin; only differences matter)
     "tenant": "acme",                      # optional, default "default"
     "endpoint": "support-bot",             # optional, default "default"
     # the prompt, one of (first present wins):
     "tokens": [1, 2, 3],                   # token ids
     "parts": ["sys-v1", [17, 42]],         # segment refs (str) and literal token runs (list)
     "prompt": "text",                      # raw text, tokenized on load
     "messages": [{"role": "user", "content": "hi"}],  # OpenAI/Anthropic shape, rendered + tokenized
     "block_keys": ["9f2c...", ...],        # hex chained block keys only (privacy mode), with
     "block_size": 16, "prompt_tokens": 812,  # the block size and the prompt length
     # optional measurements (what the server saw):
     "cached_tokens": 768, "cache_write_tokens": 32, "ttft_s": 0.41, "output_tokens": 120,
     "ttl": 300}                            # the TTL the request asked for (seconds)

* Segment lines define a named token run that later ``parts`` refer to (synthetic traces use them
  so a shared system prompt is written, stored and hashed once)::

    {"v": 1, "type": "segment", "id": "sys-v1", "tokens": [...]}

* An optional header line: ``{"v": 1, "type": "header", "tokenizer": "bytes", ...}``; its
  ``tokenizer`` names the tokenizer that produced the token ids (decoding for the audit's span
  classification uses it unless ``--tokenizer`` says otherwise).

A segment must appear before the first request that refers to it. Lines with ``"v"`` other than
1 are rejected with an error naming the line.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FORMAT_VERSION", "TOKEN_DTYPE", "TraceFormatError"]

FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint32


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""
