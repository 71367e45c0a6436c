"""The house's structure measures (issue 23, item 8), checked in ``make lint``. Stdlib only.

    python scripts/check_structure.py            # the repository this script lies in
    python scripts/check_structure.py --root DIR # another tree (DIR/src/prefixcache, DIR/tests)

Over ``src/prefixcache``: no module over 450 lines, no folder over 16 modules (``__init__.py``
not counted), no import cycle between modules (every import counts: lazy ones inside functions,
those under ``TYPE_CHECKING``, ``from x import y`` where ``y`` is a submodule). Over ``tests/``: no
test reaching into a ``_`` attribute of the cache, store, engine, pool or workers (an AST
heuristic: ``<name>._attr`` where the name, or the last attribute before it, names one of those
objects, or ``getattr(<that>, "_attr")``).

A breach that is known and being fixed goes in ``scripts/structure_allow.txt``, one line each:
``KEY | reason``. The check fails on a breach not in the list, on an entry without a reason, and on
an entry that no longer matches a breach (stale: delete it), so the list only shrinks. Keys:

    lines src/prefixcache/analysis/feed.py
    folder src/prefixcache/server
    cycle prefixcache.a.x prefixcache.a.y            (the modules of one cycle, sorted)
    private tests/engine/test_choices.py engine._worker
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

MAX_LINES = 450
MAX_MODULES = 16
PACKAGE = "prefixcache"
# The objects whose private names tests must not touch: a base whose name contains one of these,
# or any base when the name is one the classes of these rooms give their instances.
PRIVATE_OWNERS = ("cache", "store", "engine", "pool", "worker", "match", "tree", "scheduler")
OWNER_ROOMS = ("cache", "engine")


def _modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src/prefixcache``."""
    out: dict[str, Path] = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, name: str, is_package: bool, mods: set[str]) -> Iterator[str]:
    """Every module of ``mods`` one file imports (anywhere in it), relative imports resolved.
    ``from a import b`` is an import of ``a.b`` when that is a module, else of ``a``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in mods else target


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (a package's ``__init__`` is its name)."""
    mods = _modules(src)
    names = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets = _imports(tree, name, path.name == "__init__.py", names)
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def _base_name(node: ast.expr) -> str | None:
    """The name an attribute access is made on: ``x`` in ``x._a``, ``b`` in ``a.b._c``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _base_name(node.func)
    return None


def owner_privates(src: Path) -> set[str]:
    """The private instance names of the owner rooms' classes: ``self._x = ...``, the ``_x``
    entries of ``__slots__`` and ``_x: T`` fields (dataclasses)."""
    names: set[str] = set()
    for room in OWNER_ROOMS:
        for path in sorted((src / PACKAGE / room).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and _private(node.attr)
                ):
                    names.add(node.attr)
                elif isinstance(node, ast.ClassDef):
                    for stmt in node.body:
                        if (
                            isinstance(stmt, ast.AnnAssign)
                            and isinstance(stmt.target, ast.Name)
                            and _private(stmt.target.id)
                        ):
                            names.add(stmt.target.id)
                elif (
                    isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)
                    and isinstance(node.value, (ast.Tuple, ast.List))
                ):
                    for elt in node.value.elts:
                        if (
                            isinstance(elt, ast.Constant)
                            and isinstance(elt.value, str)
                            and _private(elt.value)
                        ):
                            names.add(elt.value)
    return names


def _module_names(tree: ast.AST, mods: Collection[str]) -> set[str]:
    """Names a test file binds to modules (``import a as m``, ``from p import mod``,
    ``m = importlib.import_module(...)``): a module's private helpers are not an object's."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in mods)
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "import_module"
        ):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def _owned(base: str | None, attr: str, privates: set[str]) -> bool:
    if base is None or base in ("self", "cls"):
        return False
    return attr in privates or any(o in base.lower() for o in PRIVATE_OWNERS)


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def private_access(path: Path, privates: set[str], mods: Collection[str] = ()) -> set[str]:
    """``base._attr`` strings of one test file's reaches into private names of the owners."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip = _module_names(tree, mods)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = _base_name(node.value)
            if base not in skip and _owned(base, node.attr, privates):
                found.add(f"{base}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            base = _base_name(node.args[0])
            if base not in skip and _owned(base, node.args[1].value, privates):
                found.add(f"{base}.{node.args[1].value}")
    return found


def breaches(root: Path) -> set[str]:
    """Every breach of the measures in the tree at ``root``, as allowlist keys."""
    src, tests = root / "src", root / "tests"
    out: set[str] = set()
    mods = _modules(src)
    for path in mods.values():
        with path.open(encoding="utf-8") as f:
            if sum(1 for _ in f) > MAX_LINES:
                out.add(f"lines {path.relative_to(root).as_posix()}")
    folders: dict[Path, int] = {}
    for path in mods.values():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    for folder, count in folders.items():
        if count > MAX_MODULES:
            out.add(f"folder {folder.relative_to(root).as_posix()}")
    for comp in cycles(import_graph(src)):
        out.add("cycle " + " ".join(comp))
    if tests.is_dir():
        privates = owner_privates(src)
        for path in sorted(tests.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for access in private_access(path, privates, set(mods)):
                out.add(f"private {rel} {access}")
    return out


def read_allow(path: Path) -> tuple[dict[str, str], list[str]]:
    """(key -> reason, errors) of an allowlist; blank lines and ``#`` lines are skipped."""
    allow: dict[str, str] = {}
    errors: list[str] = []
    if not path.exists():
        return allow, errors
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, reason = line.partition("|")
        key, reason = " ".join(key.split()), reason.strip()
        if not reason:
            errors.append(f"{path.name}:{n}: no reason given for {key!r} (write KEY | reason)")
        allow[key] = reason
    return allow, errors


def check(root: Path, allow_path: Path) -> list[str]:
    """The errors: breaches not allowed, allow entries without a reason, stale allow entries."""
    allow, errors = read_allow(allow_path)
    found = breaches(root)
    for key in sorted(found - allow.keys()):
        errors.append(f"breach: {key}")
    for key in sorted(allow.keys() - found):
        errors.append(f"stale allow entry (no longer a breach: delete it): {key}")
    return errors


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=here.parent, help="tree with src/ and tests/")
    ap.add_argument("--allow", type=Path, help="allowlist (default: ROOT/scripts/structure_allow.txt)")
    args = ap.parse_args(argv)
    allow = args.allow or args.root / "scripts" / "structure_allow.txt"
    errors = check(args.root, allow)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} structure error(s); known breaches go in {allow} as KEY | reason")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
