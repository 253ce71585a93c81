"""A GGUF file checked before anything trusts it: every length, count and offset against the bytes there.

GGUF (llama.cpp's format) is a header, then the tensors' bytes. Little-endian (a file written
big-endian says so by its version, which then reads byte-swapped), the header is:

    "GGUF"  version (uint32: 2 or 3)  tensor count (uint64)  metadata count (uint64)
    each metadata entry: key (string), value type (uint32), value
    each tensor: name (string), n_dims (uint32), n_dims dims (uint64, innermost first),
                 type (uint32, a GGML quantization), offset (uint64, into the data)
    padding to general.alignment (32 when the file names none), then the data

A string is a uint64 length and that many UTF-8 bytes; an array is an item type (uint32), a
uint64 count and the items, which may be arrays themselves.

`gguf.GGUFReader` believes all of it: a string length of 2**63 becomes a slice past the end, a
count of 2**63 a loop without end, a tensor whose dims multiply past 2**64 wraps numpy's product.
So `check_gguf` walks the header first with its own cursor over a read-only map of the file,
and checks every length and count against the bytes left before it reads what they count. One
`ConfigError` line names the file and the first thing wrong. A file it passes, GGUFReader reads
without an error, and every tensor it lists `gguf.dequantize` can decode.

What the header cannot show is the numbers themselves: a scale of NaN or inf in a block makes
every weight it scales NaN. The loader checks each tensor after dequantizing it and refuses
non-finite values, as `weights.check_state` does for a safetensors checkpoint.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import _type_traits

from minillm.config import ConfigError

VERSIONS = (2, 3)  # the versions GGUFReader reads (1 had 32-bit counts)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535  # the spec's bound on a metadata key
MAX_NAME_BYTES = 64  # the spec's bound on a tensor name (GGML_MAX_NAME)
MAX_STRING_BYTES = 1 << 24  # one metadata string; a chat template is ~10 KB, a token a few bytes
MAX_ARRAY_DEPTH = 2  # an array of arrays, no deeper
RESERVED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # GGUFReader's names for the header
SCALARS = {  # value type -> struct format
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "B",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# the tensor types gguf.dequantize decodes (it raises NotImplementedError for the others)
DECODED_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, metadata count
MIN_ENTRY_BYTES = 8 + 4 + 1  # a metadata entry: an empty key, a type, a one-byte value
MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # a tensor: an empty name, n_dims 1, one dim, type, offset


class _Cursor:
    """A position in the mapped file; each read first checks that the bytes are there."""

    def __init__(self, path: Path, data: mmap.mmap, order: str):
        self.path, self.data, self.order, self.pos = path, data, order, 0

    def refuse(self, problem: str) -> ConfigError:
        return _refused(self.path, problem)

    def left(self) -> int:
        return len(self.data) - self.pos

    def skip(self, size: int, what: str) -> int:
        """Step over `size` bytes, returning where they start."""
        if size > self.left():
            raise self.refuse(f"{what} needs {size:,} bytes but {self.left():,} are left in the file")
        start, self.pos = self.pos, self.pos + size
        return start

    def number(self, fmt: str, what: str) -> int | float:
        start = self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.data, start)[0]

    def string(self, what: str, limit: int) -> str:
        size = self.number("Q", f"the length of {what}")
        if size > limit:
            raise self.refuse(f"{what} is {size:,} bytes long, more than the {limit:,} allowed")
        start = self.skip(size, what)
        try:
            return self.data[start : start + size].decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} is not UTF-8 text") from None

    def count(self, item_bytes: int, what: str) -> int:
        """A uint64 count of items of at least `item_bytes` each, checked against the bytes left."""
        count = self.number("Q", f"the count of {what}")
        if count * item_bytes > self.left():
            raise self.refuse(
                f"{what} counts {count:,} items, more than the {self.left():,} bytes left could hold"
            )
        return count


def check_gguf(path: str | Path) -> None:
    """Refuse, in one ConfigError line, a GGUF file GGUFReader would misread, crash on or hang on."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_size < HEADER_BYTES:  # (and mmap cannot map an empty file)
                raise _refused(path, "it is too short for a header")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check_header(_Cursor(path, data, "<"))
    except OSError as err:  # missing, a folder, unreadable
        raise _refused(path, f"it cannot be read ({err.strerror})") from None


def _check_header(cursor: _Cursor) -> None:
    _check_preamble(cursor)
    tensor_count = cursor.count(MIN_TENSOR_BYTES, "the tensor list")
    entry_count = cursor.count(MIN_ENTRY_BYTES, "the metadata")
    alignment = _check_metadata(cursor, entry_count)
    tensors = [_tensor_info(cursor) for _ in range(tensor_count)]
    data_start = -(-cursor.pos // alignment) * alignment  # the header, padded to the alignment
    _check_tensor_data(cursor, tensors, data_start, alignment)


def _check_preamble(cursor: _Cursor) -> None:
    """The magic, and the version, which also says the byte order (GGUFReader's test: a version
    whose low 16 bits are 0 was written the other way round)."""
    if cursor.data[:4] != b"GGUF":
        raise cursor.refuse("it does not start with the magic bytes 'GGUF'")
    cursor.pos = 4
    version = cursor.number("I", "the version")
    if version & 0xFFFF == 0:
        cursor.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in VERSIONS:
        raise cursor.refuse(f"its version is {version}; minillm reads versions 2 and 3")


def _check_metadata(cursor: _Cursor, entry_count: int) -> int:
    """Each metadata entry, each key once; returns the data's alignment (general.alignment)."""
    keys: set[str] = set()
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(entry_count):
        key = cursor.string("a metadata key", MAX_KEY_BYTES)
        if key in keys or key in RESERVED_KEYS:  # GGUFReader files the header's own fields as GGUF.*
            raise cursor.refuse(f"the metadata key {key!r} appears twice")
        keys.add(key)
        value_type = _value_type(cursor, f"the value type of {key!r}")
        value = _check_value(cursor, value_type, key, depth=0)
        if key == "general.alignment":
            if value_type != GGUFValueType.UINT32 or value == 0 or value & (value - 1):
                raise cursor.refuse(f"general.alignment is {value!r}, not a uint32 power of two")
            alignment = value
    return alignment


def _value_type(cursor: _Cursor, what: str) -> GGUFValueType:
    raw = cursor.number("I", what)
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cursor.refuse(f"{what} {raw} is not a GGUF value type") from None


def _check_value(cursor: _Cursor, value_type: GGUFValueType, key: str, depth: int):
    """Step over one value; returns it for a scalar (general.alignment is read so), else None."""
    if value_type in SCALARS:
        return cursor.number(SCALARS[value_type], f"the value of {key!r}")
    if value_type == GGUFValueType.STRING:
        cursor.string(f"the string of {key!r}", MAX_STRING_BYTES)
        return None
    if depth >= MAX_ARRAY_DEPTH:
        raise cursor.refuse(f"the value of {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    item_type = _value_type(cursor, f"the array item type of {key!r}")
    if item_type in SCALARS:  # fixed-size items: stepped over at once
        size = struct.calcsize(SCALARS[item_type])
        cursor.skip(cursor.count(size, f"the array of {key!r}") * size, f"the array of {key!r}")
        return None
    inner_types = set()
    for _ in range(cursor.count(8 if item_type == GGUFValueType.STRING else 12, f"the array of {key!r}")):
        if item_type == GGUFValueType.ARRAY:  # GGUFReader flattens an array of arrays: one item type
            start = cursor.pos
            inner_types.add(_value_type(cursor, f"an inner array item type of {key!r}"))
            cursor.pos = start
        _check_value(cursor, item_type, key, depth + 1)
    if len(inner_types) > 1:
        raise cursor.refuse(f"the inner arrays of {key!r} hold items of different types")
    return None


def _tensor_info(cursor: _Cursor) -> tuple[str, int, int]:
    """One tensor's name, offset and size in bytes, each part of its entry checked."""
    name = cursor.string("a tensor name", MAX_NAME_BYTES)
    n_dims = cursor.number("I", f"the n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.refuse(f"tensor {name!r} has {n_dims} dimensions; GGML tensors have 1 to {MAX_DIMS}")
    dims = [cursor.number("Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
    raw_type = cursor.number("I", f"the type of tensor {name!r}")
    tensor_type = GGMLQuantizationType(raw_type) if raw_type in DECODED_TYPES else None
    if tensor_type is None:
        raise cursor.refuse(f"tensor {name!r} has type {raw_type}, not one the gguf package decodes")
    offset = cursor.number("Q", f"the offset of tensor {name!r}")
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if not all(dims) or dims[0] % block:
        raise cursor.refuse(
            f"tensor {name!r} has dimensions {dims}: none may be 0, and the first must be a multiple of "
            f"{tensor_type.name}'s blocks of {block}"
        )
    numbers = 1
    for dim in dims:  # Python's integers do not wrap; numpy's uint64 product would
        numbers *= dim
    return name, offset, numbers // block * block_bytes


def _check_tensor_data(
    cursor: _Cursor, tensors: list[tuple[str, int, int]], data_start: int, alignment: int
) -> None:
    """Each tensor's bytes: aligned, inside the file, apart from the others; each name once."""
    names: set[str] = set()
    for name, _, _ in tensors:
        if name in names:
            raise cursor.refuse(f"the tensor name {name!r} appears twice")
        names.add(name)
    end_of_previous, previous = 0, None
    for name, offset, size in sorted(tensors, key=lambda tensor: tensor[1]):
        if offset % alignment:
            raise cursor.refuse(f"the offset {offset:,} of tensor {name!r} is not a multiple of {alignment}")
        if data_start + offset + size > len(cursor.data):
            raise cursor.refuse(
                f"the {size:,} bytes of tensor {name!r} at offset {offset:,} run past the end of the file "
                f"({len(cursor.data) - data_start:,} bytes of data)"
            )
        if offset < end_of_previous:
            raise cursor.refuse(f"tensors {previous!r} and {name!r} overlap")
        end_of_previous, previous = offset + size, name


def _refused(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path} is not a GGUF file minillm reads: {problem}; download or convert it again.")
