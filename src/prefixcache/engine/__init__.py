"""The engine layer: model runner, KV <-> cache blocks, sampling, chat rendering, the Engine.

Imports torch lazily: ``from prefixcache.engine import Engine`` loads it on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "ChoiceDelta",
    "Completion",
    "DEFAULT_PREFILL_CHUNK",
    "EmptyPromptError",
    "Engine",
    "EngineClosedError",
    "GenerationResult",
    "GenerationSpec",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ModelRunner",
    "PromptDone",
    "PromptTooLongError",
    "QueueFullError",
    "RequestCancelledError",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
    "tiny_llama",
]

if TYPE_CHECKING:  # pragma: no cover
    from prefixcache.engine.config import DEFAULT_PREFILL_CHUNK
    from prefixcache.engine.engine import Engine
    from prefixcache.engine.model import ModelNotFoundError, ModelRunner
    from prefixcache.engine.serving.sampling import SamplingParams
    from prefixcache.engine.serving.worker import RequestCancelledError
    from prefixcache.engine.tiny import tiny_llama
    from prefixcache.engine.types import (
        ChoiceDelta,
        Completion,
        EmptyPromptError,
        EngineClosedError,
        GenerationResult,
        GenerationSpec,
        InvalidRequestError,
        PromptDone,
        PromptTooLongError,
        QueueFullError,
        TokenLogprob,
        Usage,
    )

_WHERE = {
    "DEFAULT_PREFILL_CHUNK": "config",
    "Engine": "engine",
    "ModelNotFoundError": "model",
    "ModelRunner": "model",
    "SamplingParams": "serving.sampling",
    "tiny_llama": "tiny",
    "RequestCancelledError": "serving.worker",
}


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module = importlib.import_module(f"prefixcache.engine.{_WHERE.get(name, 'types')}")
        return getattr(module, name)
    raise AttributeError(f"module 'prefixcache.engine' has no attribute {name!r}")
