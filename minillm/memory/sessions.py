"""Sessions: a conversation's KV parked in one file, so a later run resumes without recomputing it.

The coldest tier. When a chat ends, the full blocks of its last sequence (found through the prefix
cache) are written to one safetensors file with the token ids they hold; a later run loads them
back into the device pool as cached prefix blocks, so the next prompt — the same history plus a
new turn — hits them, and only the new turn is prefilled.

KV only means something to the model, block size and storage format that wrote it, so the file
records them (the model as a fingerprint of its config and weights) and a mismatch is refused in
one line. The tensors carry a sha256 in the file's metadata; a file that does not match it is
refused too, never loaded as KV.

File layout (safetensors; any safetensors reader opens it):
    token_ids             (num_blocks * block_size,) int64: the tokens the blocks hold
    block.{i}.{name}      block i's stored tensors, as the pool's `read_block` gives them
    metadata              format, model, block_size, kv_dtype, kv_key_scales, dtype, sha256, extra (JSON)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from minillm.config import ConfigError
from minillm.memory.block_manager import BlockManager

FORMAT = "minillm-session-1"
PLACEHOLDER_SEQ = -1  # the table that holds a session's blocks while they are loaded


class SessionError(ConfigError):
    """A session file that cannot be resumed here (another model or format, or damaged)."""


def _require_prefix_cache(manager: BlockManager) -> None:
    if manager.prefix_cache is None:
        raise ConfigError(
            "Sessions are found again through the prefix cache; build the engine with prefix_caching=True."
        )


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
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
    metadata = {
        **identity,
        "format": FORMAT,
        "sha256": tensors_sha256(tensors),
        "extra": json.dumps(extra or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    save_file(tensors, partial, metadata=metadata)
    partial.replace(path)  # a crash mid-write never leaves a half session under the real name
    return len(blocks) * manager.block_size


def read_session(path: Path, identity: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The file's tensors and extra, or SessionError saying in one line why it cannot be used."""
    try:
        tensors = load_file(path)
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            metadata = json.loads(f.read(header_len)).get("__metadata__", {})
    except (OSError, SafetensorError, ValueError) as err:
        raise SessionError(
            f"Session file {path} cannot be read ({str(err)[:80]}); delete it to start over."
        ) from None
    if metadata.get("format") != FORMAT:
        raise SessionError(f"{path} is not a minillm session file; delete it to start over.")
    for key, value in identity.items():
        if metadata.get(key) != value:
            raise SessionError(
                f"Session {path.stem} was written with {key}={metadata.get(key)!r}, this run has "
                f"{value!r}; resume it with the same switches, or start a new session."
            )
    if tensors_sha256(tensors) != metadata.get("sha256"):
        raise SessionError(f"Session file {path} is damaged (checksum mismatch); delete it to start over.")
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
