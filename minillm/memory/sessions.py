"""Sessions: a conversation's KV parked in one file, so a later run resumes without recomputing it.

The coldest tier. When a chat ends, the full blocks of its last sequence (found through the prefix
cache) are written to one safetensors file with the token ids they hold; a later run loads them
back into the device pool as cached prefix blocks, so the next prompt — the same history plus a
new turn — hits them, and only the new turn is prefilled.

KV only means something to the model, block size and storage format that wrote it, so the file
records them (the model as a fingerprint of its config and weights) and a mismatch is refused in
one line. A sha256 in the file's metadata covers everything else the file holds: every tensor's
name, dtype, shape and bytes, and every other metadata entry (the conversation in `extra`
included); a file that does not match it is refused too, never loaded as KV.

A session file is written whole or not at all: into a temporary file of its own beside it (two
writers never share one, and a link planted under its name is never followed), fsynced, and
renamed over the old file, so a full disk or a crash leaves the previous session as it was.
Every way a write or a read can fail comes back as one `SessionError` line.

File layout (safetensors; any safetensors reader opens it):
    token_ids             (num_blocks * block_size,) int64: the tokens the blocks hold
    block.{i}.{name}      block i's stored tensors, as the pool's `read_block` gives them
    metadata              format, model, block_size, kv_dtype, kv_key_scales, dtype, sha256, extra (JSON)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minillm.config import ConfigError
from minillm.memory.block_manager import BlockManager

FORMAT = "minillm-session-2"  # 2: the checksum covers dtypes, shapes and metadata too
PLACEHOLDER_SEQ = -1  # the table that holds a session's blocks while they are loaded


class SessionError(ConfigError):
    """A session file that cannot be resumed here (another model or format, or damaged), or
    cannot be written."""


def _require_prefix_cache(manager: BlockManager) -> None:
    if manager.prefix_cache is None:
        raise ConfigError(
            "Sessions are found again through the prefix cache; build the engine with prefix_caching=True."
        )


def session_sha256(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """sha256 of everything a session file holds but this checksum itself: every metadata entry,
    and each tensor's name, dtype and shape (which say how many bytes follow) and its bytes."""
    digest = hashlib.sha256(
        json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode()
    )
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_session(
    path: Path,
    manager: BlockManager,
    tiers,
    token_ids: list[int],
    identity: dict[str, str],
    extra: dict | None = None,
) -> int:
    """Park the cached full blocks of `token_ids` in `path`. Returns how many tokens they hold."""
    _require_prefix_cache(manager)
    blocks = manager.prefix_cache.lookup(token_ids + [0])  # every full block, the last one included
    tensors = {"token_ids": torch.tensor(token_ids[: len(blocks) * manager.block_size], dtype=torch.int64)}
    for index, block in enumerate(blocks):
        pool, local = tiers.store(block)
        for name, tensor in pool.read_block(local).items():
            tensors[f"block.{index}.{name}"] = tensor.detach().to("cpu", copy=True).contiguous()
    metadata = {**identity, "format": FORMAT, "extra": json.dumps(extra or {})}
    metadata["sha256"] = session_sha256(tensors, metadata)
    try:
        write_whole(path, tensors, metadata)
    except (OSError, SafetensorError) as err:
        raise SessionError(
            f"Session file {path} cannot be written ({failure_reason(err)}); "
            "free some space or write it to another folder."
        ) from None
    return len(blocks) * manager.block_size


def write_whole(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` in `path`, or `path` as it was: a temporary file of this write's own, fsynced,
    then renamed over it (the folder fsynced too, so the rename survives a crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".part")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def failure_reason(err: Exception) -> str:
    """The operating system's words for a failed read or write: safetensors wraps them, as in
    'Error while serializing: I/O error: Read-only file system (os error 30)'."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err).rpartition("I/O error: ")[2].partition(" (os error")[0][:80]


def read_session(path: Path, identity: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The file's tensors and extra, or SessionError saying in one line why it cannot be used."""
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, ValueError) as err:
        raise SessionError(
            f"Session file {path} cannot be read ({failure_reason(err)}); delete it to start over."
        ) from None
    if metadata.get("format") != FORMAT:
        raise SessionError(f"{path} is not a {FORMAT} file; delete it to start over.")
    if session_sha256(tensors, metadata) != metadata.get("sha256"):
        raise SessionError(f"Session file {path} is damaged (checksum mismatch); delete it to start over.")
    for key, value in identity.items():
        if metadata.get(key) != value:
            raise SessionError(
                f"Session {path.stem} was written with {key}={metadata.get(key)!r}, this run has "
                f"{value!r}; resume it with the same switches, or start a new session."
            )
    try:
        extra = json.loads(metadata.get("extra", "{}"))
    except json.JSONDecodeError:
        extra = None
    if not isinstance(extra, dict):
        raise SessionError(f"Session file {path} has unreadable metadata; delete it to start over.")
    return tensors, extra


def load_session(
    path: Path, manager: BlockManager, tiers, identity: dict[str, str]
) -> tuple[list[int], dict]:
    """Put a parked session's blocks into the device pool as cached prefix blocks (as many as
    there is room for). Returns (the token ids they hold, the extra dict saved with them)."""
    _require_prefix_cache(manager)
    tensors, extra = read_session(path, identity)
    token_ids = tensors["token_ids"].tolist() if "token_ids" in tensors else []
    fits = min(len(token_ids) // manager.block_size, manager.num_free_blocks)
    manager.grow(PLACEHOLDER_SEQ, fits * manager.block_size)
    tiers.copy(manager.take_copies())  # blocks spilled to make room leave before they are overwritten
    try:
        for index, block in enumerate(manager.table(PLACEHOLDER_SEQ)):
            prefix = f"block.{index}."
            tiers.device.write_block(
                block, {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
            )
    except (KeyError, RuntimeError) as err:  # a well-formed file whose tensors do not fit this pool
        manager.free(PLACEHOLDER_SEQ)
        raise SessionError(
            f"Session file {path} does not hold this pool's blocks ({str(err)[:60]}); "
            "delete it to start over."
        ) from None
    manager.prefix_cache.register(
        PLACEHOLDER_SEQ, manager.table(PLACEHOLDER_SEQ), token_ids, fits * manager.block_size
    )
    manager.free(PLACEHOLDER_SEQ)  # the blocks stay cached, findable by the next prompt
    return token_ids, extra


class Sessions:
    """Sessions over one memory system: its block manager and tiers, and `settle`, what must
    finish before a block is read or written (a prefetch in flight). `KVCacheManager.sessions`."""

    def __init__(self, manager: BlockManager, tiers, settle):
        self._manager, self._tiers, self._settle = manager, tiers, settle

    def save(self, path: Path, token_ids: list[int], identity: dict[str, str], extra: dict | None) -> int:
        """Park the cached KV of `token_ids` in a file; returns the tokens kept."""
        self._settle()
        return save_session(Path(path), self._manager, self._tiers, token_ids, identity, extra)

    def load(self, path: Path, identity: dict[str, str]) -> tuple[list[int], dict]:
        """Load a parked session's KV as cached prefix blocks; returns (its token ids, its extra)."""
        self._settle()
        return load_session(Path(path), self._manager, self._tiers, identity)
