"""The engine tests' shared check (``tests/pool_checks.py``): after every test, every engine still
alive proves its KV pool and its cache consistent."""

from __future__ import annotations

from pool_checks import pool_integrity as pool_integrity
