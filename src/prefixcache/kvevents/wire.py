"""The KV event wire format of ``vllm.distributed.kv_events``, written for prefixcache.

Matched against vLLM's main branch after the map-encoding change (vLLM PR 42892, released in
0.26) and the replay topic frame (PR 45177, also 0.26):

* a message on the PUB socket is three frames: ``topic``, the batch's sequence number as 8 bytes
  big-endian, and the msgpack payload;
* the payload is an :class:`EventBatch`, a positional array ``[ts, events, data_parallel_rank]``
  (``array_like``);
* each event is a msgpack *map* tagged by its class name under the key ``"type"``, with
  ``omit_defaults`` (fields that have a default and hold it are left out; fields without a
  default, such as ``lora_id``, ``medium`` and ``lora_name``, are always sent, possibly nil);
* a block hash is an ``int`` (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64
  bits of the digest, i.e. its last 8 bytes read big-endian) or the whole digest as ``bytes``.

The replay socket (ROUTER) takes ``[empty, start_seq (8 bytes big-endian)]`` from a REQ or DEALER
client and answers one ``[empty, topic, seq, payload]`` per buffered batch from ``start_seq`` on,
then ``[empty, b"", END_SEQ, b""]`` (``END_SEQ`` is -1 as a signed 8-byte big-endian integer).

These structs are prefixcache's own; a subscriber written for vLLM decodes the stream with
vLLM's structs unchanged (``tests/kvevents`` decodes it with structs declared in the test).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec

#: The replay stream's end marker: -1 as a signed 8-byte big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The most batches our publisher sends for one replay request (a subscriber asks on after one).
REPLAY_WINDOW = 1_000

#: ``medium`` of blocks in the engine's KV pool, by device (vLLM's names).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

ExternalBlockHash = int | bytes


class HashFormat(StrEnum):
    """How a block key goes on the wire: ``int`` (low 64 bits, vLLM's default) or ``bytes``
    (the whole 32-byte SHA-256 key)."""

    INT = "int"
    BYTES = "bytes"


def external_hash(key: bytes, fmt: HashFormat = HashFormat.INT) -> ExternalBlockHash:
    """A block key as it goes on the wire (see :class:`HashFormat`)."""
    if fmt is HashFormat.BYTES:
        return bytes(key)
    return int.from_bytes(key[-8:], "big")


def hash_as_int(value: ExternalBlockHash) -> int:
    """Any wire hash as the 64-bit integer a subscriber indexes by (bytes: the last 8 bytes
    big-endian, which is what the int form of the same digest is)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return int(value) & ((1 << 64) - 1)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag (``"type"``) is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks ``block_hashes`` (a chain, parent first) now held; ``parent_block_hash`` is the
    first one's parent (None at a prompt's first block); ``token_ids`` are every block's tokens
    in order (``block_size`` each)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(type=KVEventBatch)
