"""What the audit's and the simulator's reports share: percent text, the Agg figure and its PNG
bytes, the JSON form of a result. matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["fig", "pct", "png", "save_png", "to_json"]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fig(w: float = 9, h: float = 3.6) -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=100, layout="constrained")


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def save_png(fig: Figure, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(png(fig))
    return p


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o))
