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

import json
import signal
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers import TINY_CONFIG, random_llama_tensors, tiny_gpt2_tokenizer_json, write_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.config import ConfigError, ModelConfig
from minillm.gguf_check import check_gguf
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

Q8_0 = gguf.GGMLQuantizationType.Q8_0
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


def test_the_seeds_are_valid(small_dir, tmp_path):
    """Each seed reads without error, so the mutants start from a file each reader takes."""
    ModelConfig.from_dir(small_dir)
    load_model(small_dir)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tiny_gpt2_tokenizer_json()))
    Tokenizer(tmp_path)
    read_gguf(tiny_gguf(tmp_path / "tiny.gguf"))


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory) -> bytes:
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "seed.gguf").read_bytes()


@FUZZ
@given(mutations=MUTATIONS)
def test_a_mutated_gguf_is_refused_in_one_line_or_read(mutations, gguf_seed, tmp_path_factory):
    survives(read_gguf, tmp_path_factory.getbasetemp() / "mutant.gguf", mutate(gguf_seed, mutations))
