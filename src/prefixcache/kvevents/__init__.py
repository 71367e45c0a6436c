"""KV cache events in vLLM's wire format: the publisher a replica runs (``serve
--kv-events-endpoint``) and the subscriber a router runs (``route --kv-events``).

``wire`` (the msgspec structs and hash forms) imports nothing of the project; ``publisher``
reads the cache's block snapshots; ``subscriber`` knows only ``wire``.
"""
