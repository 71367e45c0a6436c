"""The HTTP server: OpenAI- and Anthropic-compatible routes over the engine, with cache usage,
tenancy, Prometheus metrics, a trace log and backpressure. See :func:`create_app`."""

from __future__ import annotations

from prefixcache.server.app import create_app

__all__ = ["create_app"]
