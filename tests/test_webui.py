"""The dashboard's page, styles and scripts ship in the wheel (package data), and every file the
pages load is one of them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from prefixcache import webui

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "src" / "prefixcache" / "webui" / "static"


def test_pages_load_only_packaged_assets_from_their_own_origin() -> None:
    for kind in webui.PAGES:
        html = (STATIC / f"{kind}.html").read_text()
        refs = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert refs and all(r.startswith(webui.ASSET_PREFIX) or r == "data:," for r in refs), refs
        for ref in refs:
            if ref.startswith(webui.ASSET_PREFIX):
                assert ref.removeprefix(webui.ASSET_PREFIX) in webui.ASSETS
    for name in webui.ASSETS:
        text = (STATIC / name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
        assert "innerHTML" not in text and "eval(" not in text  # data never becomes markup or code


def test_assets_ship_in_the_wheel(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(src),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("prefixcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"prefixcache/webui/static/{p.name}" for p in STATIC.iterdir()}
    assert shipped == {n for n in names if n.startswith("prefixcache/webui/static/")}
    assert {f"{k}.html" for k in webui.PAGES} | set(webui.ASSETS) == {p.name for p in STATIC.iterdir()}
