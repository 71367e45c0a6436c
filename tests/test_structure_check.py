"""scripts/check_structure.py on synthetic trees: each kind of breach is found, the allowlist
silences a known one, and an allow entry that no longer matches is an error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_structure.py"


@pytest.fixture(scope="module")
def cs():
    spec = importlib.util.spec_from_file_location("check_structure", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_structure"] = mod
    spec.loader.exec_module(mod)
    return mod


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"src/prefixcache/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_clean_tree_passes(cs, tmp_path):
    _tree(tmp_path, {"src/prefixcache/a.py": "import os\n", "src/prefixcache/b.py": "from . import a\n"})
    assert cs.breaches(tmp_path) == set()
    assert cs.check(tmp_path, tmp_path / "allow.txt") == []


def test_a_cycle_is_found_through_lazy_and_type_checking_imports(cs, tmp_path):
    _tree(
        tmp_path,
        {
            "src/prefixcache/pkg/__init__.py": "",
            "src/prefixcache/pkg/x.py": "def f():\n    from prefixcache.pkg import y\n",
            "src/prefixcache/pkg/y.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .z import Z\n"
            ),
            "src/prefixcache/pkg/z.py": "from prefixcache.pkg.x import f\n",
            "src/prefixcache/pkg/w.py": "from prefixcache.pkg import x\n",
        },
    )
    assert cs.breaches(tmp_path) == {"cycle prefixcache.pkg.x prefixcache.pkg.y prefixcache.pkg.z"}


def test_an_oversize_module_and_a_crowded_folder_are_found(cs, tmp_path):
    files = {f"src/prefixcache/many/m{i}.py": "" for i in range(17)}
    files["src/prefixcache/many/__init__.py"] = ""
    files["src/prefixcache/big.py"] = "x = 1\n" * 451
    files["src/prefixcache/fits.py"] = "x = 1\n" * 450
    _tree(tmp_path, files)
    assert cs.breaches(tmp_path) == {
        "lines src/prefixcache/big.py",
        "folder src/prefixcache/many",
    }


def test_a_test_reaching_into_privates_is_found(cs, tmp_path):
    _tree(
        tmp_path,
        {
            "src/prefixcache/cache/__init__.py": "",
            "src/prefixcache/cache/store.py": (
                "class Match:\n    _held: object = None\n\n"
                "class Store:\n    def __init__(self):\n        self._lru = {}\n"
            ),
            "src/prefixcache/analysis.py": "def _helper():\n    pass\n",
            "tests/test_x.py": (
                "import prefixcache.analysis as mod\n"
                "def test(engine, m, st):\n"
                "    engine._worker.steps\n"  # an owner's name
                "    m._held\n"  # a private field of the cache room
                "    getattr(st, '_lru')\n"
                "    mod._helper()\n"  # a module's helper: not an object's private
                "    engine.__class__\n"  # dunders are public
                "    m.public\n"
            ),
        },
    )
    assert cs.breaches(tmp_path) == {
        "private tests/test_x.py engine._worker",
        "private tests/test_x.py m._held",
        "private tests/test_x.py st._lru",
    }


def test_the_allowlist_silences_a_known_breach_and_reports_stale_and_reasonless_lines(cs, tmp_path):
    _tree(tmp_path, {"src/prefixcache/big.py": "x = 1\n" * 451})
    allow = tmp_path / "allow.txt"
    allow.write_text("# known\nlines src/prefixcache/big.py | being split\n")
    assert cs.check(tmp_path, allow) == []
    allow.write_text(
        "lines src/prefixcache/big.py | being split\n"
        "lines src/prefixcache/gone.py | was split\n"
        "folder src/prefixcache\n"
    )
    assert cs.check(tmp_path, allow) == [
        "allow.txt:3: no reason given for 'folder src/prefixcache' (write KEY | reason)",
        "stale allow entry (no longer a breach: delete it): folder src/prefixcache",
        "stale allow entry (no longer a breach: delete it): lines src/prefixcache/gone.py",
    ]
    assert cs.main(["--root", str(tmp_path), "--allow", str(allow)]) == 1


def test_the_repository_passes_with_its_allowlist(cs):
    assert cs.main([]) == 0
