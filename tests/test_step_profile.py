"""`bench decode --profile` and `--contexts`: the parts of a step add up to it, each is a real
share of it, the calls counted are the model's layers, and the bytes are those counted here from
the checkpoint's own files (its config and its blocks), not from the benchmark.

They run on the tiny random Llama with the real tokenizer (real text in), every matrix snapped to
Q8_0 and its blocks written beside it, so that weights="auto" reads them and each layer runs
fused, as the real model does, in seconds.
"""

import json

import pytest
from helpers import run_json, snap_to_blocks, tiny_with_real_tokenizer
from safetensors.torch import load_file, save_file

import minillm.matmul
import minillm.model
from minillm.attention.paged import PagedAttention
from minillm.model import Transformer
from minillm.quantized_weights import PACKED_FILE

ORIGINALS = (minillm.matmul.dense_kernel, PagedAttention.attend, Transformer.forward, Transformer.logits)


@pytest.fixture(scope="module")
def blocks_dir(real_dir, tmp_path_factory):
    """The tiny model (tied head, a 1024-token context) with Q8_0 blocks for every matrix."""
    folder = tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("tiny-blocks"),
        real_dir,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    snapped, packed, formats = snap_to_blocks(load_file(folder / "model.safetensors"), "q8_0")
    save_file(snapped, folder / "model.safetensors")
    save_file(packed, folder / PACKED_FILE, metadata=formats)
    return folder


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def fp32_kv_bytes_per_token(config: dict) -> int:
    """K and V, every layer, every KV head, head_dim numbers of 4 bytes."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4


def cpp_calls(parts: dict) -> dict:
    """The parts that are C++ calls: all but the attention, the logits and the two "other"s."""
    return {
        name: part
        for name, part in parts.items()
        if name not in ("attention", "logits", "model other", "engine other")
    }


def assert_parts_make_the_step(profile: dict, layers: int) -> None:
    """Every part a non-negative share; together about the step (medians do not add exactly);
    each C++ call, and the attention, once a layer; the logits once."""
    parts = profile["parts"]
    assert all(part["ms"] >= 0 for part in parts.values())
    assert 0.6 * profile["step_ms"] <= sum(part["ms"] for part in parts.values()) <= 1.4 * profile["step_ms"]
    kernel_calls = cpp_calls(parts)
    assert kernel_calls and all(part["calls_per_step"] == layers for part in kernel_calls.values())
    assert profile["cpp_calls_per_step"] == len(kernel_calls) * layers
    assert parts["attention"]["calls_per_step"] == layers and parts["logits"]["calls_per_step"] == 1


def test_profile_parts_add_up_to_the_step_and_read_the_checkpoints_bytes(capsys, blocks_dir):
    report = run_json(
        capsys, "bench", "decode", "--profile", "--json", "--tokens", 8, "--prompt-len", 12,
        "--repeats", 2, "--model", blocks_dir,
    )  # fmt: skip
    assert (
        minillm.model.dense_kernel,
        PagedAttention.attend,
        Transformer.forward,
        Transformer.logits,
    ) == ORIGINALS
    config, profile = config_of(blocks_dir), report["profile"]
    assert_parts_make_the_step(profile, config["num_hidden_layers"])
    assert profile["unwrapped_step_ms"] > 0 and profile["weights"] == "q8_0 fused"
    blocks = {name: tensor.nbytes for name, tensor in load_file(blocks_dir / PACKED_FILE).items()}
    layer_blocks = sum(nbytes for name, nbytes in blocks.items() if name.startswith("model.layers."))
    norms = config["num_hidden_layers"] * 2 * config["hidden_size"] * 4  # two fp32 norms a layer
    parts = profile["parts"]
    cpp_bytes = sum(part["bytes_per_step"] for part in cpp_calls(parts).values())
    activations = cpp_bytes - layer_blocks - norms  # one token's activations and RoPE rows a call
    assert 0 < activations < profile["cpp_calls_per_step"] * 4096
    assert parts["logits"]["bytes_per_step"] == blocks["model.embed_tokens.weight"]  # the tied head
    kv_per_token = fp32_kv_bytes_per_token(config)
    assert profile["kv_bytes_per_token"] == kv_per_token
    assert parts["attention"]["bytes_per_step"] == pytest.approx(
        kv_per_token * (profile["prompt_len"] + 8 / 2)
    )
    for part in parts.values():
        if part["GBs"] is not None:
            assert part["GBs"] == pytest.approx(part["bytes_per_step"] / part["ms"] / 1e6)
            assert part["read_roof_fraction"] == pytest.approx(part["GBs"] / report["read_bandwidth_GBs"])


def test_contexts_rows_for_each_kv_format_cut_the_prompt_to_fit_the_context(capsys, blocks_dir):
    report = run_json(
        capsys, "bench", "decode", "--contexts", 16, 1024, "--json", "--tokens", 4, "--repeats", 1,
        "--model", blocks_dir,
    )  # fmt: skip
    config = config_of(blocks_dir)
    rows = report["contexts"]
    assert [(row["kv"], row["context"]) for row in rows] == [
        ("float32", 16), ("float32", 1024), ("int8", 16), ("int8", 1024)
    ]  # fmt: skip
    for row in rows:
        assert_parts_make_the_step(row, config["num_hidden_layers"])
        assert row["kv_bytes_per_step"] == pytest.approx(
            row["kv_bytes_per_token"] * (row["prompt_len"] + 4 / 2)
        )
        assert 0 < row["attention_share"] < 1 and row["ms_per_token"] == pytest.approx(1e3 / row["tok_s"])
        # the longest prompt that leaves room for its new tokens (and the first, from the prefill)
        expected_prompt = 16 if row["context"] == 16 else config["max_position_embeddings"] - 4 - 1
        assert (row["prompt_len"], row["capped"]) == (expected_prompt, row["context"] == 1024)
    fp32, int8 = rows[0]["kv_bytes_per_token"], rows[2]["kv_bytes_per_token"]
    assert (
        fp32 == fp32_kv_bytes_per_token(config) and fp32 / 4 < int8 < fp32 / 2
    )  # a byte a number, and scales
