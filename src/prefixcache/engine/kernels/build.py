"""Build the own CPU kernels from source on this machine, once per (source, compiler, ISA).

    path = build()        # the shared library's path (built now, or found in the cache)

The library is compiled at first use into ``$PREFIXCACHE_HOME/kernels/`` (default
``~/.cache/prefixcache/kernels``) as ``pc_kernels-<isa>-<key>.so``, where ``key`` hashes the C
source, the compiler's version, the flags and the ISA macros ``-march=native`` turns on. So a pip
install (which ships only the source) and ``make install`` (which calls ``build()`` ahead of time)
end up with the same file; a changed source, compiler or CPU gets its own file, and a home shared
by machines of different CPUs keeps one library per ISA. Concurrent builders write to a temporary
file and rename it into place (atomic), so they never load a half-written library. After a new
build the oldest libraries of the same ISA beyond the newest ``KEEP_BUILDS`` are deleted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: Every C file of this folder goes into the one library (pc_kernels.c, the GEMM, the 4-bit kernels).
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
#: No fast-math, no contraction of a*b+c into FMA by the compiler (the source writes its FMAs).
FLAGS = (
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wno-psabi",
)
_ISA_MACROS = (
    "__AMX_TILE__",
    "__AMX_BF16__",
    "__AVX512BF16__",
    "__AVX512F__",
    "__AVX2__",
    "__FMA__",
    "__aarch64__",
    "__ARM_NEON",
)


class BuildError(RuntimeError):
    """The kernels could not be built here (no compiler, a failed compile): the torch path runs."""


def compiler() -> str:
    """The C compiler: ``$CC``, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise BuildError("no C compiler found (set CC, or install gcc)")


def _run(args: list[str], stdin: str = "") -> str:
    try:
        done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{args[0]} failed to run: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BuildError(f"{' '.join(args[:2])}... failed: {' | '.join(tail)}")
    return done.stdout


def native_macros(cc: str) -> list[str]:
    """The ISA macros ``-march=native`` defines here (they select the library's code paths)."""
    out = _run([cc, "-march=native", "-dM", "-E", "-x", "c", "-"], stdin="")
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return [m for m in _ISA_MACROS if m in defined]


def isa_name(macros: list[str]) -> str:
    """The ISA the source compiles for, as ``pc_isa()`` in the library names it."""
    if "__AVX512BF16__" in macros:
        return "avx512bf16"
    if "__AVX512F__" in macros:
        return "avx512"
    if "__AVX2__" in macros and "__FMA__" in macros:
        return "avx2"
    if "__aarch64__" in macros:
        return "neon"
    return "generic"


def source_hash() -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    home = os.environ.get("PREFIXCACHE_HOME") or str(Path.home() / ".cache" / "prefixcache")
    return Path(home) / "kernels"


def build(force: bool = False) -> Path:
    """The library's path, compiling it first when this (source, compiler, ISA) has no build.
    Raises :class:`BuildError` with a one-line reason when it cannot be built."""
    cc = compiler()
    version = _run([cc, "--version"]).splitlines()[0]
    macros = native_macros(cc)
    isa = isa_name(macros)
    key = hashlib.sha256("\n".join([source_hash(), version, *FLAGS, *macros]).encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"pc_kernels-{isa}-{key}.so"
    if target.exists() and not force:
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise BuildError(f"cannot write to {folder}: {exc}") from exc
    try:
        _run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune(folder, isa, keep=target)
    return target


#: Builds of one ISA kept in the cache (other source versions: other checkouts sharing the home).
KEEP_BUILDS = 4


def prune(folder: Path, isa: str, keep: Path, builds: int = KEEP_BUILDS) -> list[Path]:
    """Delete all but the ``builds`` newest libraries of ``isa`` in ``folder`` (never ``keep``, the
    one just built; other ISAs' libraries are left alone: a home shared by machines of different
    CPUs). A process that has one of them loaded keeps its mapping. Returns what was deleted."""
    mine = [p for p in folder.glob(f"pc_kernels-{isa}-*.so") if p != keep and ".tmp" not in p.name]
    mine.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    gone = []
    for old in mine[max(builds - 1, 0) :]:
        try:
            old.unlink()
            gone.append(old)
        except OSError:  # another builder pruned it first, or the folder is read-only: fine
            pass
    return gone
