"""The remote KV tier's keys and values: how a block is named in the shared store, and what is
checked before a block read back may reach attention (`remote.py` moves them).

Keys. Block i of a prompt is named by a sha256 chain,
    digest_i = sha256(namespace || digest_{i-1} || block i's token ids as little-endian int32),
with digest_{-1} 32 zero bytes; its Redis key is b"minillm:kv:" + hex(digest_i). The namespace is
the sha256 of the engine's identity (model fingerprint, block size, dtype, KV format): KV means
something only to the model and format that wrote it, so another model's blocks are never even
asked for. The prefix cache's own keys (Python's hash(), different in every process) cannot serve
here; these are the same in every process and on every machine.

Values. A small header (magic, namespace, parent digest, a CRC-32 of the payload, the block's
token ids), then the payload: the block's stored form exactly as the pool holds it (quantized
numbers with their scales), as safetensors bytes. Why compare token ids when the key is already a
sha256 of them? The store is outside us: another program, a bug, a flipped bit can leave any bytes
under a key, and wrong KV must never reach attention (the prefix cache's and the disk tier's rule).
A value is installed only if its namespace, tokens and parent digest are the ones asked for, its
payload matches its checksum and its tensors the pool's layout; anything else is refused, counted
(one warning per kind of failure) and recomputed.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

KEY_PREFIX = b"minillm:kv:"
MAGIC = b"MKV1"  # the value format's name and version
ROOT = bytes(32)  # the parent digest of a prompt's first block
HEADER = struct.Struct("<4s32s32sII")  # magic, namespace, parent digest, payload CRC-32, token count
REFUSALS = ("malformed", "namespace", "tokens", "parent", "checksum", "layout")


def namespace_of(identity: dict[str, str]) -> bytes:
    """What every key of this engine's blocks starts from: the sha256 of what its KV depends on."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def chained(namespace: bytes, parent: bytes, tokens) -> bytes:
    """The digest of a block holding `tokens` after the block whose digest is `parent`."""
    return hashlib.sha256(namespace + parent + struct.pack(f"<{len(tokens)}i", *tokens)).digest()


def block_digests(namespace: bytes, token_ids: list[int], block_size: int, count: int) -> list[bytes]:
    """The digests of the first `count` full blocks of `token_ids`."""
    digests, parent = [], ROOT
    for index in range(count):
        parent = chained(namespace, parent, token_ids[index * block_size : (index + 1) * block_size])
        digests.append(parent)
    return digests


def store_key(digest: bytes) -> bytes:
    return KEY_PREFIX + digest.hex().encode()


def checksum(payload: bytes) -> int:
    """Corruption detection, not security (the key chain is sha256 already), so the fastest of
    the three at hand: on a 0.7 MB block zlib's CRC-32 ran about 2.4x sha256's speed and 4.5x
    blake2b's (one measurement on a shared 2-core development machine; the ranking is the point)."""
    return zlib.crc32(payload)


def encode_value(namespace: bytes, parent: bytes, tokens, payload: bytes) -> bytes:
    head = HEADER.pack(MAGIC, namespace, parent, checksum(payload), len(tokens))
    return head + struct.pack(f"<{len(tokens)}i", *tokens) + payload


class Refused(Exception):
    """A value that must not be installed; `reason` is one of REFUSALS."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def decode_value(value: bytes, namespace: bytes, parent: bytes, tokens) -> bytes:
    """The payload of a value read back, once everything in its header is what was asked for and
    the payload matches its checksum; else Refused."""
    if len(value) < HEADER.size:
        raise Refused("malformed")
    magic, their_namespace, their_parent, crc, count = HEADER.unpack_from(value)
    if magic != MAGIC or len(value) < HEADER.size + 4 * count:
        raise Refused("malformed")
    if their_namespace != namespace:
        raise Refused("namespace")
    if list(struct.unpack_from(f"<{count}i", value, HEADER.size)) != list(tokens):
        raise Refused("tokens")
    if their_parent != parent:
        raise Refused("parent")
    payload = value[HEADER.size + 4 * count :]
    if checksum(payload) != crc:
        raise Refused("checksum")
    return payload
