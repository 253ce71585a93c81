"""Every file from outside is hostile: each reader, fed a thousand mutations of a small valid file.

The seeds are tiny valid files of each kind minillm reads: config.json, tokenizer.json (two
layouts), model.safetensors, the packed Q4_1/Q8_0 blocks beside it, and a GGUF. Hypothesis mutates
each (bit flips, bytes overwritten with boundary values such as 2**63 - 1 or a NaN, truncations,
insertions, a region copied elsewhere; in JSON, a file's or a safetensors header's, values swapped
for extreme ones too, which byte mutations rarely get past the JSON syntax to reach) and the reader
must answer each mutant with its one-line ConfigError or accept it: no other exception, no case
running past `DEADLINE_S`, no more Python/numpy memory than the file plus `MEMORY_CAP`. The GGUF's
reader is `check_gguf` and then `gguf.GGUFReader`, every field and tensor read and every tensor
dequantized: whatever escapes after `check_gguf` passed a file is a hole in `check_gguf`. A
second GGUF seed is a whole tiny Qwen3 in block formats, opened as `--model FILE.gguf` opens it
(`Tokenizer` and `load_model`, through `open_gguf`, which runs `check_gguf` first).
`derandomize=True` makes the cases the same on every run.
"""

import copy
import json
import re
import shutil
import signal
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from helpers import (
    ANY_JSON,
    GGUF_CACHE,
    TINY_CONFIG,
    random_llama_tensors,
    tiny_gpt2_tokenizer_json,
    write_checkpoint,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from minillm.config import ConfigError, ModelConfig
from minillm.gguf_check import check_gguf
from minillm.quantized_weights import BLOCK_BYTES, PACKED_FILE, read_packed
from minillm.safetensors_check import check_safetensors
from minillm.tokenizer import Tokenizer
from minillm.tokenizer_json import GPT2_PATTERN
from minillm.weights import load_model, read_checkpoint

Q8_0 = gguf.GGMLQuantizationType.Q8_0
FORMATS = ("q4_1", "q8_0")
DEADLINE_S = 2.0
MEMORY_CAP = 64 << 20
FUZZ = settings(
    max_examples=1000,
    deadline=None,  # the alarm below is the deadline; Hypothesis' own would count shrinking too
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
# a Llama small enough that most of its safetensors file is header: 1 layer of width 8
SMALL_CONFIG = TINY_CONFIG | {
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
}
BOUNDARY_VALUES = [
    b"\xff" * 8,
    (2**63 - 1).to_bytes(8, "little"),
    (2**63).to_bytes(8, "little"),
    (2**32).to_bytes(8, "little"),
    (2**31 - 1).to_bytes(4, "little"),
    b"\x00" * 8,
    b"\x00\x00\xc0\x7f",  # float32 NaN
    b"\x00\x00\x80\x7f",  # float32 inf
    b"\x00\x7e",  # float16 NaN
    b"\x00\x7c",  # float16 inf
    # and for JSON
    b"-1",
    b"0",
    b"1e999",
    b"NaN",
    b"9223372036854775807",
    b"18446744073709551616",
    b"null",
    b"[]",
    b"{}",
    b'"',
    b"[[[[",
]
POSITION = st.integers(0, 4096) | st.integers(0, 2**32)  # the headers are near the start
MUTATION = st.one_of(
    st.tuples(st.just("flip"), POSITION, st.integers(0, 7)),
    st.tuples(st.just("overwrite"), POSITION, st.sampled_from(BOUNDARY_VALUES)),
    st.tuples(st.just("truncate"), POSITION),
    st.tuples(st.just("insert"), POSITION, st.sampled_from(BOUNDARY_VALUES) | st.binary(max_size=8)),
    st.tuples(st.just("duplicate"), POSITION, st.integers(1, 256), POSITION),
)
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=4)
# a JSON file's values swapped for others (where byte mutations mostly break its syntax): a path
# of child indices from the top, and what goes there
JSON_VALUE = ANY_JSON | st.sampled_from(
    [2**63 - 1, 2**64, 10**400, -(2**63), 1e308, "x" * 10_000, [[[[[]]]]]]
)
JSON_EDITS = st.lists(st.tuples(st.lists(st.integers(0, 2**16), max_size=5), JSON_VALUE), max_size=3)


def mutate(seed: bytes, mutations: list[tuple]) -> bytes:
    data = bytearray(seed)
    for kind, position, *args in mutations:
        at = position % (len(data) + 1)
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << args[0]
        elif kind == "overwrite":
            data[at : at + len(args[0])] = args[0]
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = args[0]
        elif kind == "duplicate":
            region = data[at : at + args[0]]
            to = args[1] % (len(data) + 1)
            data[to:to] = region
    return bytes(data)


def edit_json(raw: object, edits: list[tuple[list[int], object]]) -> bytes:
    """`raw` as JSON with each edit's value put at the end of its path (an index picks a key or an
    item, modulo their count; the path stops early at a leaf)."""
    raw = copy.deepcopy(raw)
    for path, shared_value in edits:
        value = copy.deepcopy(shared_value)  # (Hypothesis may hand the same list to two edits)
        parent, key = None, None
        node = raw
        for index in path:
            keys = (
                list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else []
            )
            if not keys:
                break
            parent, key = node, keys[index % len(keys)]
            node = node[key]
        if parent is None:
            raw = value
        else:
            parent[key] = value
    return json.dumps(raw).encode()


def edit_header(seed: bytes, edits: list[tuple[list[int], object]]) -> bytes:
    """A safetensors file with `edit_json`'s edits made to its JSON header (its length updated)."""
    length = int.from_bytes(seed[:8], "little")
    header = edit_json(json.loads(seed[8 : 8 + length]), edits)
    return struct.pack("<Q", len(header)) + header + seed[8 + length :]


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so no `except Exception` in a reader swallows it."""


def _alarm(signum, frame):
    raise Hang(f"the case ran past {DEADLINE_S} s")


def survives(read, path: Path, data: bytes) -> None:
    """Write `data` to `path` and read it: ConfigError or nothing, in time and memory."""
    path.unlink(missing_ok=True)  # (a GGUFReader's map of the last case keeps its own copy)
    path.write_bytes(data)
    previous = signal.signal(signal.SIGALRM, _alarm)
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        read(path)
    except ConfigError as err:
        assert "\n" not in str(err), err
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, previous)
    assert peak <= len(data) + MEMORY_CAP, f"{peak:,} bytes allocated reading {len(data):,}"


# ---------------------------------------------------------------------------------------- seeds


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    folder = write_checkpoint(
        tmp_path_factory.mktemp("fuzz"), SMALL_CONFIG, random_llama_tensors(SMALL_CONFIG)
    )
    load_model(folder)  # the first load imports what torch imports lazily: seconds, outside the deadline
    return folder


def split_tokenizer_json() -> dict:
    """The tiny tokenizer laid out as Llama 3's: a Split regex before a ByteLevel without its own,
    and a TemplateProcessing that puts <|end|> before each prompt."""
    raw = tiny_gpt2_tokenizer_json()
    split = {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated", "invert": False}
    byte_level = raw["pre_tokenizer"] | {"use_regex": False}
    raw["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    end, prompt = {"SpecialToken": {"id": "<|end|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    raw["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [end, prompt],
        "pair": [end, prompt, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|end|>": {"id": "<|end|>", "ids": [259], "tokens": ["<|end|>"]}},
    }
    return raw


def packed_file(path: Path) -> Path:
    """A packed-blocks file as weights_fetch.py writes one: a Q4_1 and a Q8_0 matrix, 2 x 64."""
    rows = np.linspace(-2, 2, 128, dtype=np.float32).reshape(2, 64)
    blocks = {f: torch.from_numpy(gguf.quantize(rows, gguf.GGMLQuantizationType[f.upper()])) for f in FORMATS}
    save_file(
        {f"{f}.weight": b for f, b in blocks.items()}, path, metadata={f"{f}.weight": f for f in FORMATS}
    )
    return path


def tiny_gguf(path: Path) -> Path:
    """A GGUF of a few metadata kinds (strings, numbers, arrays of numbers, strings and arrays)
    and two small tensors, F32 and Q8_0, written by the gguf package."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("general.alignment", 32)
    writer.add_string("general.name", "tiny")
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_tensor("norm.weight", np.linspace(-1, 1, 8, dtype=np.float32))
    blocks = gguf.quantize(np.linspace(-2, 2, 64, dtype=np.float32).reshape(2, 32), Q8_0)
    writer.add_tensor("embed.weight", blocks, raw_shape=blocks.shape, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------- readers


def read_gguf(path: Path) -> None:
    """check_gguf, then everything GGUFReader offers: no error may come after check_gguf."""
    check_gguf(path)
    reader = gguf.GGUFReader(path)
    for field in reader.fields.values():
        field.contents()
    for tensor in reader.tensors:
        gguf.dequantize(tensor.data, tensor.tensor_type)


def read_tokenizer(path: Path) -> None:
    Tokenizer(path.parent)


def read_config(path: Path) -> None:
    ModelConfig.from_dir(path.parent)


def read_weights(path: Path) -> None:
    load_model(path.parent)


def read_blocks(path: Path) -> None:
    """read_packed, and each matrix its blocks hold, which must be finite once read_packed passed."""
    for name, weight in read_packed(path.parent).items():
        if weight.blocks.shape[1] % BLOCK_BYTES[weight.format] == 0:  # (else load_model refuses its shape)
            assert torch.isfinite(weight.dequantize()).all(), name


def test_the_seeds_are_valid(small_dir, tmp_path):
    """Each seed reads without error, so the mutants start from a file each reader takes."""
    read_config(small_dir / "config.json")
    read_weights(small_dir / "model.safetensors")
    for raw in (tiny_gpt2_tokenizer_json(), split_tokenizer_json()):  # as the tokenizers library reads them
        (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
        upstream = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        assert Tokenizer(tmp_path).encode_prompt("the theme") == upstream.encode("the theme").ids
    read_blocks(packed_file(tmp_path / PACKED_FILE))
    read_gguf(tiny_gguf(tmp_path / "tiny.gguf"))


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory) -> bytes:
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "seed.gguf").read_bytes()


@pytest.fixture(scope="module")
def mutant_dir(small_dir, tmp_path_factory) -> Path:
    """A checkpoint folder whose one file under test each case replaces."""
    folder = tmp_path_factory.mktemp("mutant")
    shutil.copytree(small_dir, folder, dirs_exist_ok=True)
    return folder


@FUZZ
@given(edits=JSON_EDITS, mutations=st.lists(MUTATION, max_size=4))
def test_a_mutated_config_json_is_refused_in_one_line_or_read(edits, mutations, mutant_dir):
    seed = edit_json(SMALL_CONFIG, edits)
    survives(read_config, mutant_dir / "config.json", mutate(seed, mutations))


@FUZZ
@given(
    layout=st.sampled_from([tiny_gpt2_tokenizer_json, split_tokenizer_json]),
    edits=JSON_EDITS,
    mutations=st.lists(MUTATION, max_size=4),
)
def test_a_mutated_tokenizer_json_is_refused_in_one_line_or_read(layout, edits, mutations, tmp_path_factory):
    seed = edit_json(layout(), edits)
    survives(read_tokenizer, tmp_path_factory.getbasetemp() / "tokenizer.json", mutate(seed, mutations))


@FUZZ
@given(edits=JSON_EDITS, mutations=st.lists(MUTATION, max_size=4))
def test_a_mutated_safetensors_checkpoint_is_refused_in_one_line_or_loaded(
    edits, mutations, small_dir, mutant_dir
):
    (mutant_dir / "config.json").write_bytes((small_dir / "config.json").read_bytes())
    seed = edit_header((small_dir / "model.safetensors").read_bytes(), edits)
    survives(read_weights, mutant_dir / "model.safetensors", mutate(seed, mutations))


@pytest.fixture(scope="module")
def packed_seed(tmp_path_factory) -> bytes:
    return packed_file(tmp_path_factory.mktemp("packed") / PACKED_FILE).read_bytes()


@FUZZ
@given(edits=JSON_EDITS, mutations=st.lists(MUTATION, max_size=4))
def test_a_mutated_packed_blocks_file_is_refused_in_one_line_or_read(
    edits, mutations, packed_seed, tmp_path_factory
):
    seed = edit_header(packed_seed, edits)
    survives(read_blocks, tmp_path_factory.getbasetemp() / PACKED_FILE, mutate(seed, mutations))


@FUZZ
@given(mutations=MUTATIONS)
def test_a_mutated_gguf_is_refused_in_one_line_or_read(mutations, gguf_seed, tmp_path_factory):
    survives(read_gguf, tmp_path_factory.getbasetemp() / "mutant.gguf", mutate(gguf_seed, mutations))


@pytest.fixture(scope="module")
def model_gguf_seed(tmp_path_factory) -> bytes:
    """A whole model as llama.cpp writes it: a tiny Qwen3 with Q8_0, Q4_0 and Q4_1 matrices."""
    from test_gguf_model import QUANTIZED, hf_model, write_gguf

    path = tmp_path_factory.mktemp("model-gguf") / "seed.gguf"
    write_gguf(path, "qwen3", hf_model("qwen3"), QUANTIZED)
    open_gguf_model(path)  # once outside the alarm: the first load also loads the C++ kernels
    return path.read_bytes()


def open_gguf_model(path: Path) -> None:
    """What `--model FILE.gguf` does with the file: its config, tokenizer, weights and blocks."""
    Tokenizer(path)
    load_model(path, weights="auto")


@FUZZ
@given(mutations=MUTATIONS)
def test_a_mutated_gguf_model_is_refused_in_one_line_or_opened(mutations, model_gguf_seed, tmp_path_factory):
    """The loader itself, on a model file. Each case has its own path:
    `open_gguf` keeps the last file parsed while its path, size and mtime are unchanged."""
    folder = tmp_path_factory.mktemp("mutant-model")
    survives(open_gguf_model, folder / "model.gguf", mutate(model_gguf_seed, mutations))


# ------------------------------------------------------------------ each refusal, made by hand


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _entry(key: bytes, value_type: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", value_type) + value


def _tensor(name: bytes, dims: list[int], tensor_type: int = 0, offset: int = 0) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, tensor_type, offset)


def handmade_gguf(entries=(), tensors=(), data=b"", counts=None, version=3) -> bytes:
    """A GGUF laid out by hand: the header, padding to 32 bytes, `data`."""
    counts = counts or (len(tensors), len(entries))
    header = b"GGUF" + struct.pack("<IQQ", version, *counts) + b"".join(entries) + b"".join(tensors)
    return header + bytes(-len(header) % 32) + data


UINT32, STRING, ARRAY = 4, 8, 9
HOSTILE_GGUFS = {
    "a version 1 file": (handmade_gguf(version=1), "its version is 1"),
    "a count of 2**63 entries": (handmade_gguf(counts=(0, 2**63)), "counts 9,223,372,036,854,775,808 items"),
    "a string of 2**63 bytes": (
        handmade_gguf([_entry(b"general.name", STRING, struct.pack("<Q", 2**63))]),
        "the string of 'general.name' is 9,223,372,036,854,775,808 bytes long",
    ),
    "an array of 2**63 - 1 items": (
        handmade_gguf([_entry(b"a", ARRAY, struct.pack("<IQ", 0, 2**63 - 1))]),
        "the array of 'a' counts 9,223,372,036,854,775,807 items",
    ),
    "arrays three deep": (
        handmade_gguf([_entry(b"a", ARRAY, struct.pack("<IQIQIQ", ARRAY, 1, ARRAY, 1, 0, 0))]),
        "nests arrays more than 2 deep",
    ),
    "a file cut inside a value": (
        handmade_gguf([_entry(b"a", UINT32, bytes(4))])[:38],
        "needs 4 bytes but 1 are left",
    ),
    "a key twice": (
        handmade_gguf([_entry(b"a", UINT32, bytes(4))] * 2),
        "the metadata key 'a' appears twice",
    ),
    "an alignment of 3": (
        handmade_gguf([_entry(b"general.alignment", UINT32, struct.pack("<I", 3))]),
        "general.alignment is 3, not a uint32 power of two",
    ),
    "five dimensions": (handmade_gguf(tensors=[_tensor(b"w", [1] * 5)]), "tensor 'w' has 5 dimensions"),
    "an unknown type": (handmade_gguf(tensors=[_tensor(b"w", [8], 99)]), "has type 99, not one the gguf"),
    "a tensor past the end": (
        handmade_gguf(tensors=[_tensor(b"w", [8])], data=bytes(16)),
        "the 32 bytes of tensor 'w' at offset 0 run past the end of the file (16 bytes of data)",
    ),
    "dims whose product passes 2**64": (
        handmade_gguf(tensors=[_tensor(b"w", [2**32] * 4)], data=bytes(32)),
        "the 1,361,129,467,683,753,853,853,498,429,727,072,845,824 bytes of tensor 'w'",  # 2**130
    ),
    "a misaligned offset": (
        handmade_gguf(tensors=[_tensor(b"w", [1], offset=4)], data=bytes(32)),
        "the offset 4 of tensor 'w' is not a multiple of 32",
    ),
    "a tensor name twice": (
        handmade_gguf(tensors=[_tensor(b"w", [8]), _tensor(b"w", [8], offset=32)], data=bytes(64)),
        "the tensor name 'w' appears twice",
    ),
    "overlapping tensors": (
        handmade_gguf(tensors=[_tensor(b"v", [16]), _tensor(b"w", [8], offset=32)], data=bytes(64)),
        "tensors 'v' and 'w' overlap",
    ),
}


@pytest.mark.parametrize("data, problem", HOSTILE_GGUFS.values(), ids=HOSTILE_GGUFS)
def test_each_hostile_gguf_is_refused_in_one_line(data, problem, tmp_path):
    (tmp_path / "x.gguf").write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        check_gguf(tmp_path / "x.gguf")


def test_a_gguf_that_cannot_be_read_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"missing.gguf is not a GGUF .*: it cannot be read \(No such file"):
        check_gguf(tmp_path / "missing.gguf")
    (tmp_path / "empty.gguf").touch()
    with pytest.raises(ConfigError, match="empty.gguf is not a GGUF .*: it is too short for a header"):
        check_gguf(tmp_path / "empty.gguf")


def handmade_safetensors(header: bytes | dict, data: bytes = b"", length: int | None = None) -> bytes:
    header = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(header) if length is None else length) + header + data


F32_PAIR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HOSTILE_SAFETENSORS = {
    "a header of 2**63 bytes": (handmade_safetensors(b"{}", length=2**63), "its header of 9,223,372,036"),
    "a header that is not JSON": (handmade_safetensors(b"{not json"), "its header is not JSON"),
    "a name twice": (handmade_safetensors(b'{"a": {}, "a": {}}'), "its header names 'a' twice"),
    "an unknown dtype": (
        handmade_safetensors({"a": F32_PAIR | {"dtype": "F128"}}, bytes(8)),
        "tensor 'a' lacks a known dtype",
    ),
    "a dtype that is a list": (
        handmade_safetensors({"a": F32_PAIR | {"dtype": ["F32"]}}, bytes(8)),
        "tensor 'a' lacks a known dtype",
    ),
    "a tensor past the end": (
        handmade_safetensors({"a": F32_PAIR}, bytes(4)),
        "tensor 'a' (F32 [2]) has bytes [0, 8), which its shape does not fill or its 4 bytes",
    ),
    "a shape of 2**63": (
        handmade_safetensors({"a": F32_PAIR | {"shape": [2**63]}}, bytes(8)),
        "tensor 'a' (F32 [9223372036854775808]) has bytes [0, 8)",
    ),
    "overlapping tensors": (
        handmade_safetensors({"a": F32_PAIR, "b": F32_PAIR | {"data_offsets": [4, 12]}}, bytes(12)),
        "tensors 'a' and 'b' overlap",
    ),
    "metadata that is not strings": (
        handmade_safetensors({"__metadata__": {"format": 1}}),
        "its __metadata__ is not an object of strings",
    ),
}


@pytest.mark.parametrize("data, problem", HOSTILE_SAFETENSORS.values(), ids=HOSTILE_SAFETENSORS)
def test_each_hostile_safetensors_file_is_refused_in_one_line(data, problem, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(ConfigError, match="is truncated or corrupt: " + re.escape(problem)):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("fmt, scale", [("q4_1", b"\x00\x7e"), ("q8_0", b"\x00\x7c")])
def test_packed_blocks_with_a_nan_or_inf_scale_are_refused(fmt, scale, tmp_path):
    """Each block's fp16 scale d opens it: NaN (or inf) there makes its 32 weights NaN."""
    packed = load_file(packed_file(tmp_path / PACKED_FILE))
    packed[f"{fmt}.weight"][1, BLOCK_BYTES[fmt] : BLOCK_BYTES[fmt] + 2] = torch.frombuffer(
        scale, dtype=torch.uint8
    )
    save_file(packed, tmp_path / PACKED_FILE, metadata={f"{f}.weight": f for f in FORMATS})
    with pytest.raises(ConfigError, match=f"{fmt}.weight has NaN or inf scales"):
        read_packed(tmp_path)


HOSTILE_CONFIGS = {
    "a config of 2 MB": (b"{" + b" " * (2 << 20) + b"}", "is 2,097,154 bytes, more than a config holds"),
    "an integer of 5,000 digits": (b'{"vocab_size": ' + b"9" * 5000 + b"}", "is not valid JSON (Exceeds"),
    "10**12 sliding layers": (
        json.dumps(
            SMALL_CONFIG
            | {
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 0,
                "num_hidden_layers": 10**12,
            }
        ).encode(),
        "sliding-window attention in layers [0, 1, 2, 3, 4, 5, ...]",
    ),
}


@pytest.mark.parametrize("data, problem", HOSTILE_CONFIGS.values(), ids=HOSTILE_CONFIGS)
def test_each_hostile_config_json_is_refused_in_one_line(data, problem, tmp_path):
    """(The sliding layers of a 10**12-layer config were a list of 10**12 numbers.)"""
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        ModelConfig.from_dir(tmp_path)


def test_a_template_piece_whose_special_token_is_not_an_object_is_refused(tmp_path):
    """(It was an AttributeError: the piece's SpecialToken was read as an object.)"""
    raw = split_tokenizer_json()
    raw["post_processor"]["single"][0] = {"SpecialToken": "<|end|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="its TemplateProcessing piece .* is not a known token nor A"):
        Tokenizer(tmp_path)


def test_the_fetched_files_pass_their_checks(real_dir):
    """The checks refuse damage, not the files minillm fetches: SmolLM2's GGUF (the tensor list
    GGUFReader reads from it), its safetensors checkpoint and its packed blocks."""
    path = next(GGUF_CACHE.glob("*.gguf"), None)
    if path is None:
        pytest.fail(f"No GGUF file in {GGUF_CACHE}: run `python weights_fetch.py` first.")
    check_gguf(path)
    assert len(gguf.GGUFReader(path).tensors) == 30 * 9 + 2  # 30 layers of 9, the embedding, the norm
    check_safetensors(real_dir / "model.safetensors")
    check_safetensors(real_dir / PACKED_FILE)
