"""A safetensors file checked before it is loaded: its header against the bytes the file holds.

A safetensors file is an 8-byte little-endian length N, N bytes of a JSON header, then the data:

    {"__metadata__": {"format": "pt"},            (optional: strings to strings)
     "lm_head.weight": {"dtype": "F32", "shape": [97, 64], "data_offsets": [0, 24832]}, ...}

Each tensor's `data_offsets` are its first and one-past-last byte in the data. The `safetensors`
library checks this too, but in its own words (a `SafetensorError` of "InvalidHeaderDeserialization")
and only after it has read a header of up to 100 MB. `check_safetensors` reads at most
`MAX_HEADER_BYTES` and checks each entry itself, so the one line a user reads says which tensor is
wrong and how; the library's own checks remain behind it.
"""

from __future__ import annotations

import json
import os
import reprlib
from pathlib import Path

from minillm.config import FETCH_HINT, ConfigError

# The largest header read. A dense checkpoint's is ~100 bytes a tensor (SmolLM2's 30 KB), and 8 MiB
# of JSON parses into at most ~64 MiB of Python objects.
MAX_HEADER_BYTES = 8 << 20
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def check_safetensors(path: Path) -> None:
    """Refuse, in one ConfigError line, a safetensors file whose header does not fit its bytes."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                raise _refused(
                    path,
                    f"its header of {length:,} bytes is not within its {size:,} bytes and the "
                    f"{MAX_HEADER_BYTES:,} read",
                )
            header = _header(path, file.read(length))
    except OSError as err:  # a folder, unreadable
        raise _refused(path, f"it cannot be read ({err.strerror})") from None
    data_bytes = size - 8 - length
    spans = sorted(_span(path, name, entry, data_bytes) for name, entry in header.items())
    for (begin, end, name), (next_begin, _, next_name) in zip(spans, spans[1:]):
        if next_begin < end:
            raise _refused(path, f"tensors {name!r} and {next_name!r} overlap")


def _header(path: Path, raw: bytes) -> dict:
    """The header's JSON: an object, each key once, its __metadata__ strings to strings."""
    try:
        header = json.loads(raw, object_pairs_hook=lambda pairs: _unique(path, pairs))
    except ConfigError:
        raise
    except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON; too deep; an int of 5,000 digits
        raise _refused(path, f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _refused(path, "its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _refused(path, "its __metadata__ is not an object of strings")
    return header


def _unique(path: Path, pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each there once (json.loads would keep the last silently)."""
    unique = {}
    for key, value in pairs:
        if key in unique:
            raise _refused(path, f"its header names {key!r} twice")
        unique[key] = value
    return unique


def _span(path: Path, name: str, entry: object, data_bytes: int) -> tuple[int, int, str]:
    """(begin, end, name) of one tensor's bytes, once its dtype, shape and offsets agree."""
    fields = entry if isinstance(entry, dict) else {}
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    known = isinstance(dtype, str) and dtype in DTYPE_BYTES  # (a list is not a key: no `in` for it)
    if not known or not _counts(shape) or not (_counts(offsets) and len(offsets) == 2):
        raise _refused(
            path, f"tensor {name!r} lacks a known dtype, a shape or two data_offsets ({reprlib.repr(entry)})"
        )
    begin, end = offsets
    if not begin <= end <= data_bytes or end - begin != _size(shape, DTYPE_BYTES[dtype], data_bytes):
        raise _refused(
            path,
            f"tensor {name!r} ({dtype} {reprlib.repr(shape)}) has bytes [{begin}, {end}), which its "
            f"shape does not fill or its {data_bytes:,} bytes of data do not hold",
        )
    return begin, end, name


def _size(shape: list[int], item_bytes: int, data_bytes: int) -> int:
    """The bytes of a tensor of `shape`, or data_bytes + 1 once past them (a shape of a million
    dims of 2**63 would otherwise multiply out to a number of 63 million bits)."""
    size = item_bytes if 0 not in shape else 0
    for dim in shape:
        size *= dim
        if size > data_bytes:
            return data_bytes + 1
    return size


def _counts(value: object) -> bool:
    """A list of whole numbers >= 0 (not bools)."""
    return isinstance(value, list) and all(type(item) is int and item >= 0 for item in value)


def _refused(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path} is truncated or corrupt: {problem} — {FETCH_HINT}")
