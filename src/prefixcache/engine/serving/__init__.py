"""Serving requests: the workers, their requests' state, admission, sampling, the audit.

- ``worker.py``: the worker thread, the bounded queue, a job's stream (both runners).
- ``scheduler.py``: continuous batching over the KV pool (own runner); ``admission.py`` picks
  who runs next; ``sequence.py``: a request's prompt and its choices; ``verify.py``: the live
  exactness audit.
- ``sequential.py``: one request at a time (Hugging Face runner); ``kv.py``: cache blocks <->
  a DynamicCache.
- ``sampling.py``, ``detok.py``, ``guided.py``, ``prompt_logprobs.py``: tokens in, text out.

Nothing here imports :mod:`prefixcache.engine.engine`: the engine builds the workers from a
runner, a pool, a cache and a :class:`~prefixcache.engine.config.WorkerConfig`.
"""
