"""Secrets of the tiers (issue 21, item 6): a salt secret shorter than 16 bytes is refused with
a one-line error (exit 2) before the model loads; ``--tier-encrypt`` seals every tier entry
(ChaCha20-Poly1305, keyed from the salt secret like the MAC), so a reader of Redis or of the
disk tier finds no token id in clear, an altered or foreign entry is a corrupt miss, and clear
entries written before still verify."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from prefixcache.cache.keys import pack_tokens
from prefixcache.cache.tiers.codec import CorruptEntry, TensorCodec
from prefixcache.cli import app

runner = CliRunner()
SECRET = "a-deployment-secret-of-32-bytes!"
TOKENS = pack_tokens([7731, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])


class _NoEngine:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("engine-construction-reached")


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefixcache.engine.Engine", _NoEngine)
    for var in ("PREFIXCACHE_API_KEYS", "PREFIXCACHE_API_KEYS_FILE", "PREFIXCACHE_SALT_SECRET"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("how", ["env", "file"])
def test_a_salt_secret_shorter_than_16_bytes_is_refused(no_engine, monkeypatch, tmp_path: Path, how):
    args = ["serve"]
    if how == "env":
        monkeypatch.setenv("PREFIXCACHE_SALT_SECRET", "x")
    else:
        (tmp_path / "salt").write_text("fifteen-bytes!!\n")
        args += ["--salt-secret-file", str(tmp_path / "salt")]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())
    assert "at least 16 random bytes" in text and "engine-construction-reached" not in text
    if how == "env":
        monkeypatch.setenv("PREFIXCACHE_SALT_SECRET", "sixteen-bytes-ok")
    else:
        (tmp_path / "salt").write_text("sixteen-bytes-ok\n")
    assert "engine-construction-reached" in runner.invoke(app, args).output  # 16 bytes: accepted


def _block() -> torch.Tensor:
    return torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) + 0.5


def test_sealed_entries_hide_token_ids_and_open_bit_for_bit():
    sealed = TensorCodec.from_secret(SECRET, encrypt=True)
    clear = TensorCodec.from_secret(SECRET)
    key, payload = b"k" * 32, _block()
    data = sealed.encode(key, None, TOKENS, payload)
    assert data[:4] == b"PXKE" and TOKENS not in data and TOKENS[:8] not in data
    assert payload.numpy().tobytes()[:16] not in data
    entry = sealed.decode(data, key=key, parent=None, tokens=TOKENS)
    assert torch.equal(entry.payload, payload) and entry.tokens == TOKENS
    # A clear entry written before still verifies (by its MAC) with the sealing codec.
    assert torch.equal(sealed.decode(clear.encode(key, None, TOKENS, payload)).payload, payload)
    with pytest.raises(CorruptEntry, match="does not open"):
        clear.decode(data)  # no sealing key: never served
    with pytest.raises(CorruptEntry, match="does not open"):
        TensorCodec.from_secret("another-deployment-secret", encrypt=True).decode(data)
    altered = bytearray(data)
    altered[40] ^= 1
    with pytest.raises(CorruptEntry):
        sealed.decode(bytes(altered))
    assert sealed.encode(key, None, TOKENS, payload) != data  # a fresh nonce every time


def test_the_disk_tier_writes_no_token_id_in_clear(tmp_path: Path):
    from prefixcache.cache.blocks import Block
    from prefixcache.cache.tiers.disk import DiskTier

    folder = tmp_path / "disk"
    for encrypt, expect_clear in ((True, False), (False, True)):
        disk = DiskTier(folder / str(encrypt), codec=TensorCodec.from_secret(SECRET, encrypt=encrypt))
        block = Block(b"k" * 32, None, TOKENS, _block(), 96, b"root", "acme", 0, 60.0, 0.0, 0.0)
        disk.put(block)
        assert disk.flush(10)
        [written] = [p for p in (folder / str(encrypt)).rglob("*") if p.is_file()]
        assert (TOKENS in written.read_bytes()) is expect_clear
        [(payload, _)] = disk.get_many([block.key], [TOKENS], b"root")
        assert torch.equal(payload, block.payload)
        disk.close()
