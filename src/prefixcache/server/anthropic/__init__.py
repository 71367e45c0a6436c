"""The Anthropic Messages API: its route, schemas and prompt rendering (cache_control breakpoints)."""
