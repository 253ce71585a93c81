"""Every file from outside is hostile: each reader, fed a thousand mutations of a small valid file.

The seeds are tiny valid files of each kind minillm reads: config.json, tokenizer.json,
model.safetensors and a GGUF. Hypothesis mutates each (bit flips, bytes overwritten with boundary
values such as 2**63 - 1 or a NaN, truncations, insertions, a region copied elsewhere) and the
reader must answer each mutant with its one-line ConfigError or accept it: no other exception, no
case running past `DEADLINE_S`, no more Python/numpy memory than the file plus `MEMORY_CAP`. The
GGUF's reader is `check_gguf` and then `gguf.GGUFReader`, every field and tensor read and every
tensor dequantized: whatever escapes after `check_gguf` passed a file is a hole in `check_gguf`.
`derandomize=True` makes the cases the same on every run.
"""

import copy
import json
import shutil
import signal
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import ANY_JSON, TINY_CONFIG, random_llama_tensors, tiny_gpt2_tokenizer_json, write_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from minillm.config import ConfigError, ModelConfig
from minillm.gguf_check import check_gguf
from minillm.quantized_weights import BLOCK_BYTES, PACKED_FILE, read_packed
from minillm.tokenizer import Tokenizer
from minillm.tokenizer_json import GPT2_PATTERN
from minillm.weights import load_model

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
    return write_checkpoint(tmp_path_factory.mktemp("fuzz"), SMALL_CONFIG, random_llama_tensors(SMALL_CONFIG))


def split_tokenizer_json() -> dict:
    """The tiny tokenizer laid out as Llama 3's: a Split regex before a ByteLevel without its own,
    and a TemplateProcessing that puts <|end|> before each prompt."""
    raw = tiny_gpt2_tokenizer_json()
    split = {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated", "invert": False}
    byte_level = raw["pre_tokenizer"] | {"use_regex": False}
    raw["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    raw["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|end|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
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
    for raw in (tiny_gpt2_tokenizer_json(), split_tokenizer_json()):
        (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
        assert Tokenizer(tmp_path).encode_prompt("the end") == Tokenizer(tmp_path).encode_prompt("the end")
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
@given(mutations=MUTATIONS)
def test_a_mutated_safetensors_checkpoint_is_refused_in_one_line_or_loaded(mutations, small_dir, mutant_dir):
    (mutant_dir / "config.json").write_bytes((small_dir / "config.json").read_bytes())
    seed = (small_dir / "model.safetensors").read_bytes()
    survives(read_weights, mutant_dir / "model.safetensors", mutate(seed, mutations))


@FUZZ
@given(mutations=MUTATIONS)
def test_a_mutated_packed_blocks_file_is_refused_in_one_line_or_read(mutations, tmp_path_factory):
    folder = tmp_path_factory.getbasetemp()
    seed = packed_file(folder / "seed.safetensors").read_bytes()
    survives(read_blocks, folder / PACKED_FILE, mutate(seed, mutations))


@FUZZ
@given(mutations=MUTATIONS)
def test_a_mutated_gguf_is_refused_in_one_line_or_read(mutations, gguf_seed, tmp_path_factory):
    survives(read_gguf, tmp_path_factory.getbasetemp() / "mutant.gguf", mutate(gguf_seed, mutations))
