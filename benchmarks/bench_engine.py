"""Engine benchmark: the same code as `prefixcache bench` (see src/prefixcache/engine/bench.py).

python benchmarks/bench_engine.py --repeats 3 --lengths 256,512,1024,1536,2048
"""

from __future__ import annotations

from prefixcache.cli import app

if __name__ == "__main__":
    app(["bench", *__import__("sys").argv[1:]])
