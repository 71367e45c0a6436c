from __future__ import annotations

import hashlib

from prefixcache.cache import Namespace, block_keys, model_fingerprint, pack_tokens, unpack_tokens


def test_keys_are_chained_sha256_over_little_endian_uint32() -> None:
    ns = Namespace.create("model-a", salt=b"s")
    tokens = list(range(10))
    keys = block_keys(tokens, ns, block_size=4)
    assert len(keys) == 2  # the trailing partial block [8, 9] has no key
    root = hashlib.sha256(b"model-a\x00s").digest()
    assert ns.root == root
    k0 = hashlib.sha256(root + b"".join(t.to_bytes(4, "little") for t in range(4))).digest()
    k1 = hashlib.sha256(k0 + b"".join(t.to_bytes(4, "little") for t in range(4, 8))).digest()
    assert keys == [k0, k1]


def test_a_key_depends_on_everything_before_it() -> None:
    ns = Namespace.create("m")
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], ns, 4)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], ns, 4)  # same second block, different first
    assert a[0] != b[0] and a[1] != b[1]
    c = block_keys([1, 2, 3, 4, 5, 6, 7, 9], ns, 4)
    assert a[0] == c[0] and a[1] != c[1]


def test_namespace_separates_model_dtype_block_size_and_salt() -> None:
    tokens = list(range(16))
    base = model_fingerprint("w1", "float32", 16)
    variants = [
        model_fingerprint("w2", "float32", 16),
        model_fingerprint("w1", "bfloat16", 16),
        model_fingerprint("w1", "float32", 32),
        model_fingerprint("w1", "float32", 16, kv_layout="kv2"),
    ]
    k = block_keys(tokens, Namespace.create(base), 16)
    for fp in variants:
        assert block_keys(tokens, Namespace.create(fp), 16) != k
    assert block_keys(tokens, Namespace.create(base, salt=b"tenant-b"), 16) != k
    # The tenant label alone does not change keys: isolation comes from the salt.
    assert block_keys(tokens, Namespace.create(base, tenant="x"), 16) == k


def test_pack_round_trip_and_limit() -> None:
    tokens = [0, 1, 2**31, 2**32 - 1]
    assert unpack_tokens(pack_tokens(tokens)) == tokens
    ns = Namespace.create("m")
    assert block_keys(list(range(64)), ns, 4, limit=3) == block_keys(list(range(64)), ns, 4)[:3]
