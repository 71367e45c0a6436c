"""The kernels' build cache (engine/kernels/build.py): a new build prunes the oldest libraries of
its own ISA beyond the newest few, never the one just built and never another ISA's."""

from __future__ import annotations

import os
from pathlib import Path

from prefixcache.engine.kernels.build import KEEP_BUILDS, prune


def _lib(folder: Path, name: str, age_s: int) -> Path:
    p = folder / name
    p.write_bytes(b"\x7fELF")
    t = 1_000_000_000 - age_s
    os.utime(p, (t, t))
    return p


def test_a_new_build_keeps_the_newest_of_its_isa_and_every_other_isa(tmp_path: Path) -> None:
    olds = [_lib(tmp_path, f"pc_kernels-avx2-{i:016x}.so", age_s=100 * (i + 1)) for i in range(6)]
    other = _lib(tmp_path, "pc_kernels-avx512bf16-00000000000000aa.so", age_s=10_000)
    half = _lib(tmp_path, "pc_kernels-avx2-00000000000000bb.tmp.so", age_s=10_000)  # a builder's temp
    new = _lib(tmp_path, "pc_kernels-avx2-ffffffffffffffff.so", age_s=0)
    gone = prune(tmp_path, "avx2", keep=new)
    # the just-built one plus the KEEP_BUILDS - 1 newest of the others stay
    assert sorted(gone) == sorted(olds[KEEP_BUILDS - 1 :])
    assert all(p.exists() for p in olds[: KEEP_BUILDS - 1])
    assert new.exists() and other.exists() and half.exists()
    assert prune(tmp_path, "avx2", keep=new) == []  # nothing more to prune
