"""Cost model (bytes and seconds per token) and pricing profiles (dollars per token class).

The simulator stands this model in for the model runner: a block costs
``block_size * kv_bytes_per_token`` bytes of cache, a prefill costs ``tokens / prefill_tps``
seconds. Prices are per million tokens; a profile turns token counts into dollars:

* ``anthropic``: cache writes 1.25x the base input price (2x for the 1h TTL class), cache
  reads 0.1x (Anthropic's published prompt-caching multipliers).
* ``openai``: no write surcharge; cached input tokens 0.5x. OpenAI's discount depends on the
  model (0.5x on the GPT-4o family, 0.25x on GPT-4.1, 0.1x on GPT-5); 0.5x is the conservative
  figure used here; pass another with :func:`pricing_profile`'s ``read_mult``.
* ``self-hosted``: dollars are prefill seconds x a GPU-hour price (cached tokens cost nothing
  to compute; output is priced as decode seconds at ``decode_tps``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: SmolLM2-135M in float32: 2 (K and V) x 30 layers x 3 KV heads x 64 head dims x 4 bytes.
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
DEFAULT_PREFILL_TPS = 450.0
#: Where ``prefixcache bench`` leaves its calibration for the simulator, whatever its ``--out``.
CALIBRATION_NAME = "calibration.json"


def user_calibration() -> Path:
    """``$PREFIXCACHE_HOME/calibration.json`` (default ``~/.cache/prefixcache``): what
    ``prefixcache bench`` measured on this machine."""
    home = os.environ.get("PREFIXCACHE_HOME") or Path.home() / ".cache" / "prefixcache"
    return Path(home) / CALIBRATION_NAME


def shipped_calibration() -> Path:
    """The calibration shipped in the package (measured by ``prefixcache bench`` for the release)."""
    return Path(__file__).with_name("data") / CALIBRATION_NAME


def default_calibration() -> Path:
    """The simulator's calibration when none is given, independent of the working directory:
    this machine's (:func:`user_calibration`) if ``prefixcache bench`` wrote one, else the
    shipped one."""
    mine = user_calibration()
    return mine if mine.is_file() else shipped_calibration()


PROFILES = ("anthropic", "openai", "self-hosted")


#: A cache write asked to live this long or longer is the 1 h TTL class (priced
#: ``write_long_mult``: 2x the base input price at anthropic).
LONG_TTL_S = 3600


@dataclass(frozen=True, slots=True)
class CostModel:
    """What a token costs the simulated replica: cache bytes and prefill seconds."""

    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN
    prefill_tps: float = DEFAULT_PREFILL_TPS
    decode_tps: float = 25.0
    source: str = "default"  # where prefill_tps came from
    kv_source: str = "default"  # where kv_bytes_per_token came from

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def prefill_s(self, tokens: float) -> float:
        return tokens / self.prefill_tps


def load_calibration(path: str | Path | None = None) -> dict[str, float]:
    """Measured figures from ``prefixcache bench`` (``calibration.json``), tolerant of its shape.

    Returns the numbers found under keys that mention prefill/decode and tokens per second, and
    a KV bytes-per-token figure if present; an empty dict when the file is missing or unreadable.
    """
    p = Path(path) if path is not None else default_calibration()
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("ignoring calibration %s: %s", p, exc)
        return {}
    found: dict[str, float] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}".lower())
        elif isinstance(obj, int | float) and not isinstance(obj, bool) and math.isfinite(obj) and obj > 0:
            rate = any(s in path for s in ("tps", "tok_s", "tokens_per_s", "tok/s", "per_s"))
            if "prefill" in path and rate:
                found.setdefault("prefill_tps", float(obj))
            elif "decode" in path and rate:
                found.setdefault("decode_tps", float(obj))
            elif "kv" in path and "byte" in path and "token" in path:
                found.setdefault("kv_bytes_per_token", float(obj))

    walk(data, "")
    return found


def cost_model(prefill_tps: float | None = None, calibration: str | Path | None = None) -> CostModel:
    """An explicit ``prefill_tps`` wins; then the calibration file (None: :func:`default_calibration`);
    then the defaults."""
    calibration = calibration if calibration is not None else default_calibration()
    cal = load_calibration(calibration)
    kv = int(cal.get("kv_bytes_per_token", SMOLLM2_KV_BYTES_PER_TOKEN))
    kv_source = "calibration" if "kv_bytes_per_token" in cal else "default"
    decode = cal.get("decode_tps", 25.0)
    if prefill_tps is not None:
        return CostModel(kv, float(prefill_tps), decode, source="--prefill-tps", kv_source=kv_source)
    if "prefill_tps" in cal:
        source = _calibration_source(Path(calibration))
        return CostModel(kv, cal["prefill_tps"], decode, source=source, kv_source=kv_source)
    return CostModel(kv, DEFAULT_PREFILL_TPS, decode, source="default", kv_source=kv_source)


def _calibration_source(path: Path) -> str:
    if path.resolve() != shipped_calibration().resolve():
        return str(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return "shipped calibration"
    runner, dtype, threads = d.get("runner", "?"), d.get("dtype", "?"), d.get("threads", "?")
    return f"shipped calibration: {runner}, {dtype}, {threads} threads"


@dataclass(frozen=True, slots=True)
class Pricing:
    """Dollars per million tokens, with cache multipliers on the base input price."""

    name: str
    input_per_mtok: float
    output_per_mtok: float
    write_mult: float = 1.0  # a cache write (5 min class)
    write_long_mult: float = 1.0  # a cache write (1 h class)
    read_mult: float = 1.0  # a cache read
    gpu_hour: float = 0.0  # self-hosted: dollars per GPU-hour


def pricing_profile(name: str, *, gpu_hour: float = 2.0, read_mult: float | None = None) -> Pricing:
    """``anthropic`` | ``openai`` | ``self-hosted``. Base prices are Sonnet-/GPT-4o-class list
    prices ($3 and $2.50 per Mtok input); only the ratios matter when comparing layouts."""
    if name == "anthropic":
        return Pricing(name, 3.0, 15.0, 1.25, 2.0, 0.1 if read_mult is None else read_mult)
    if name == "openai":
        return Pricing(name, 2.5, 10.0, 1.0, 1.0, 0.5 if read_mult is None else read_mult)
    if name == "self-hosted":
        return Pricing(name, 0.0, 0.0, gpu_hour=gpu_hour)
    raise ValueError(f"unknown pricing profile {name!r}; choose one of {', '.join(PROFILES)}")


@dataclass(slots=True)
class TokenTotals:
    """Token classes of a run (all requests together)."""

    prompt: int = 0
    cached: int = 0  # read from the cache
    written: int = 0  # stored in the cache, 5 min class
    written_long: int = 0  # stored, 1 h class (or longer)
    output: int = 0
    keep_warm_reads: int = 0  # cache reads by keep-warm pin requests

    @property
    def uncached(self) -> int:
        return self.prompt - self.cached


@dataclass(frozen=True, slots=True)
class CostBreakdown:
    profile: str
    input_usd: float
    cache_write_usd: float
    cache_read_usd: float
    output_usd: float
    keep_warm_usd: float
    total_usd: float
    no_cache_usd: float  # the same traffic with caching off

    @property
    def saving(self) -> float:
        return 1 - self.total_usd / self.no_cache_usd if self.no_cache_usd else 0.0

    def as_dict(self) -> dict[str, float | str]:
        d = asdict(self)
        d["saving"] = self.saving
        return d


def price(t: TokenTotals, p: Pricing, model: CostModel) -> CostBreakdown:
    """Dollars for these token totals under profile ``p`` (contract in the module docstring)."""
    if p.name == "self-hosted":
        per_s = p.gpu_hour / 3600
        inp = model.prefill_s(t.uncached) * per_s
        out = t.output / model.decode_tps * per_s
        kw = model.prefill_s(0) * per_s  # a refresh computes one token: negligible
        no_cache = model.prefill_s(t.prompt) * per_s + out
        return CostBreakdown(p.name, inp, 0.0, 0.0, out, kw, inp + out + kw, no_cache)
    m = p.input_per_mtok / 1e6
    writes = t.written + t.written_long
    plain = max(t.uncached - writes, 0)
    inp = plain * m
    wr = (t.written * p.write_mult + t.written_long * p.write_long_mult) * m
    rd = t.cached * p.read_mult * m
    out = t.output * p.output_per_mtok / 1e6
    kw = t.keep_warm_reads * p.read_mult * m
    return CostBreakdown(p.name, inp, wr, rd, out, kw, inp + wr + rd + out + kw, t.prompt * m + out)


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"``, ``"inf"`` -> bytes (inf -> 2**62). ValueError, saying what
    to write, for anything else (a negative or unknown unit included)."""
    s = text.strip().lower().replace(" ", "")
    if s in ("inf", "unbounded", "none"):
        return 1 << 62
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "k": 1e3,
        "m": 1e6,
        "g": 1e9,
        "b": 1,
    }
    number, mult = s, 1.0
    for u, m in units.items():
        if s.endswith(u):
            number, mult = s[: -len(u)], float(m)
            break
    try:
        value = float(number) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a size: write e.g. 16GiB, 512MiB, 2GB, 1e9 or inf")
    return int(value)


def parse_duration(text: str) -> float:
    """``"300"``, ``"5m"``, ``"1h"``, ``"90s"`` -> seconds (more than 0). ValueError, saying what to
    write, for anything else."""
    s = text.strip().lower()
    mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, m = (s[:-1], mult[s[-1]]) if s and s[-1] in mult else (s, 1)
    try:
        value = float(number) * m
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a duration above 0: write e.g. 300, 90s, 5m or 1h")
    return value


def break_even_reuse(write_mult: float, read_mult: float) -> float:
    """p* = (w - 1) / (w - r): the share of cacheable prompt tokens that must be read from the
    cache (rather than written to it) for caching to cost no more than sending them uncached,
    with writes at ``w`` and reads at ``r`` times the base input price (docs/ops.md derives it).
    0.0 without a write surcharge (``w <= 1``): caching then never costs more."""
    if write_mult <= 1.0:
        return 0.0
    return (write_mult - 1.0) / (write_mult - read_mult)
