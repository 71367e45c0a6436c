"""Subcommands of the prefixcache CLI, one module per layer."""
