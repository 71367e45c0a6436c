"""Named hardware/model profiles for the simulator's ``--prefill-tps`` and ``--kv-bytes-per-token``.

Each figure says where it comes from. KV bytes per token follow from a model's architecture
(2 for K and V x layers x KV heads x head dimension x bytes per element): exact. Prefill rates
are either measured on this project's own runs (named and dated below) or, for GPUs, an estimate
from arithmetic (2 x parameters FLOP per token at an assumed utilisation of the chip's dense
bf16 peak), marked ``-est``: a starting point to replace with ``prefixcache bench`` or your own
measurement, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    prefill_tps: float | None  # None: no honest figure (a KV-only model profile)
    kv_bytes_per_token: int
    source: str


def _kv(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def _est_tps(params: float, peak_flops: float, mfu: float) -> float:
    return round(peak_flops * mfu / (2 * params), -2)


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            "smollm2-135m-cpu",
            212.3,
            _kv(30, 3, 64, 4),
            "measured: `prefixcache bench`, SmolLM2-135M-Instruct float32 on the own runner, 2 CPU threads "
            "(benchmarks/results/calibration.json); KV: 30 layers x 3 KV heads x 64 dims x 4 bytes x 2",
        ),
        HardwareProfile(
            "smollm2-135m-cpu-hf",
            298.0,
            _kv(30, 3, 64, 4),
            "measured: `prefixcache bench`, SmolLM2-135M-Instruct float32 on the Hugging Face runner, one "
            "2,112-token pass, 2 CPU threads (benchmarks/results/engine.md); KV as smollm2-135m-cpu",
        ),
        HardwareProfile(
            "llama3-8b",
            None,
            _kv(32, 8, 128, 2),
            "KV only: Llama 3 8B in bf16 (32 layers, 8 KV heads, head dim 128); give --prefill-tps",
        ),
        HardwareProfile(
            "llama3-8b-h100-est",
            _est_tps(8.03e9, 989e12, 0.4),
            _kv(32, 8, 128, 2),
            "ESTIMATE, not measured: 2 x 8.03e9 FLOP/token at 40% of an H100 SXM's 989 TFLOP/s dense bf16; "
            "KV exact (Llama 3 8B, bf16)",
        ),
        HardwareProfile(
            "qwen2.5-7b",
            None,
            _kv(28, 4, 128, 2),
            "KV only: Qwen2.5 7B in bf16 (28 layers, 4 KV heads, head dim 128); give --prefill-tps",
        ),
        HardwareProfile(
            "llama3-70b",
            None,
            _kv(80, 8, 128, 2),
            "KV only: Llama 3 70B in bf16 (80 layers, 8 KV heads, head dim 128); give --prefill-tps",
        ),
    )
}


def profile(name: str) -> HardwareProfile:
    """The named profile; ValueError listing the names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of {', '.join(PROFILES)}") from None


def prefill_tps(text: str) -> tuple[float, str]:
    """``--prefill-tps``: a number (tokens/s) or a profile name -> (rate, where it comes from)."""
    try:
        value = float(text)
    except ValueError:
        p = profile(text)
        if p.prefill_tps is None:
            raise ValueError(
                f"profile {p.name!r} has no prefill figure ({p.source}); give a number of tokens/s"
            ) from None
        return p.prefill_tps, f"profile {p.name} ({p.source})"
    if not value > 0:
        raise ValueError(f"--prefill-tps {text!r}: give a positive number of tokens/s or a profile name")
    return value, "--prefill-tps"


def kv_bytes_per_token(text: str) -> int:
    """``--kv-bytes-per-token``: a whole number of bytes or a profile name."""
    try:
        value = int(text)
    except ValueError:
        return profile(text).kv_bytes_per_token
    if value <= 0:
        raise ValueError(f"--kv-bytes-per-token {text!r}: give a positive number of bytes or a profile name")
    return value
