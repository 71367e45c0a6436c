"""``python -m prefixcache.engine.kernels``: build the own CPU kernels now (``make kernels``) and
print the library's path and the kernel set the engine will use; exit 1 when they cannot be built."""

from __future__ import annotations

import sys

from prefixcache.engine.kernels import describe
from prefixcache.engine.kernels.build import BuildError, build


def main() -> int:
    try:
        print(build())
    except BuildError as exc:
        print(f"prefixcache kernels: not built ({exc}); the engine runs the torch path", file=sys.stderr)
        return 1
    print(describe("native"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
