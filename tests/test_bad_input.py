"""Every bad input a user can cause ends in one clear line that says what to do."""

import json
import re
import shutil

import pytest
from helpers import TINY_CONFIG, random_llama_tensors, write_checkpoint

from minillm.cli import main
from minillm.config import DTYPES, ConfigError, EngineConfig, ModelConfig, resolve_dtype
from minillm.decoding import PromptError, generate
from minillm.runtime import Runtime
from minillm.sampling import SamplingParams
from minillm.weights import load_model


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "model")


def test_missing_weights_name_the_fetch_command(tmp_path):
    with pytest.raises(ConfigError, match="python weights_fetch.py"):
        load_model(tmp_path / "nowhere")


def test_missing_safetensors_file_names_the_fetch_command(tiny_copy):
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="model.safetensors is missing.*weights_fetch.py"):
        load_model(tiny_copy)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_safetensors_is_reported_as_corrupt(tiny_copy, damage):
    path = tiny_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        load_model(tiny_copy)


def test_unsupported_architecture_is_named(tmp_path):
    write_checkpoint(
        tmp_path, {**TINY_CONFIG, "architectures": ["GPT2LMHeadModel"]}, random_llama_tensors(TINY_CONFIG)
    )
    with pytest.raises(ConfigError, match="Unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


def test_invalid_config_json_is_reported(tiny_copy):
    (tiny_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(tiny_copy)


def test_binary_config_json_names_the_file(tiny_copy):
    path = tiny_copy / "config.json"
    path.write_bytes(b"\xff\xfe\x00\x01 not text")
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        load_model(tiny_copy)
    assert str(path) in str(err.value)


def test_config_json_that_is_a_list_is_refused(tiny_copy):
    (tiny_copy / "config.json").write_text(json.dumps([TINY_CONFIG]))
    with pytest.raises(ConfigError, match="holds a JSON list, not an object"):
        load_model(tiny_copy)


@pytest.mark.parametrize(
    "field, value",
    [("num_key_value_heads", 0), ("vocab_size", "49152"), ("num_hidden_layers", True), ("head_dim", -16)],
)
def test_size_field_that_is_not_a_positive_integer_is_named(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value!r} in config.json must be a positive integer"):
        ModelConfig.from_dict({**TINY_CONFIG, field: value})


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"head_dim": 15}, "head_dim=15 .* must be an even number >= 2"),
        ({"head_dim": None, "hidden_size": 2}, "head_dim=0 .* must be an even number >= 2"),
        ({"max_position_embeddings": 10**12}, "RoPE tables past the 268,435,456 numbers"),
    ],
    ids=["odd head_dim", "head_dim 0", "a trillion positions"],
)
def test_a_rope_that_cannot_turn_or_be_held_is_refused_before_its_tables(fields, words):
    """An odd head_dim failed at the first token, deep in RoPE; a zero one (no head_dim, fewer
    dimensions than heads) divided by zero; a trillion positions asked torch for 4 TB of tables."""
    config = {name: value for name, value in {**TINY_CONFIG, **fields}.items() if value is not None}
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize("layers", [4, 10**9])
def test_layers_the_checkpoint_lacks_are_refused_before_the_model_is_built(layers, tmp_path):
    """A num_hidden_layers of 10**9 once built names and modules for each layer, without end."""
    config = {**TINY_CONFIG, "num_hidden_layers": layers}
    write_checkpoint(tmp_path, config, random_llama_tensors(TINY_CONFIG))
    with pytest.raises(ConfigError, match=f"num_hidden_layers={layers} but the checkpoint holds 3 layers"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    tensors = random_llama_tensors(TINY_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(tmp_path, TINY_CONFIG, tensors)
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_shape_disagreeing_with_config_is_named(tmp_path):
    write_checkpoint(tmp_path, {**TINY_CONFIG, "intermediate_size": 128}, random_llama_tensors(TINY_CONFIG))
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_nan_weights_are_refused(tmp_path):
    tensors = random_llama_tensors(TINY_CONFIG)
    tensors["model.norm.weight"][3] = float("nan")
    write_checkpoint(tmp_path, TINY_CONFIG, tensors)
    with pytest.raises(ConfigError, match="NaN"):
        load_model(tmp_path)


def test_prompt_longer_than_the_context_is_refused(tiny_model):
    context = tiny_model.config.max_position_embeddings
    with pytest.raises(PromptError, match=f"{context + 5} tokens but the context holds {context}"):
        generate(tiny_model, [1] * (context + 5), SamplingParams())


def test_empty_prompt_is_refused(tiny_model):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_model, [], SamplingParams())


def test_context_beyond_the_model_is_refused_before_decoding(tiny_model):
    with pytest.raises(ConfigError, match="max_seq_len=257 is longer than the model's context \\(256 tokens"):
        generate(tiny_model, [1, 2, 3], SamplingParams(max_tokens=1), context_len=257)


def test_max_seq_len_beyond_the_model_is_refused_at_load(real_dir):
    with pytest.raises(
        ConfigError, match="max_seq_len=8193 is longer than the model's context \\(8192 tokens"
    ):
        Runtime(EngineConfig(model_dir=real_dir, max_seq_len=8193))


@pytest.mark.parametrize("switch, value", [("flash_prefill", "yes"), ("prefix_caching", 1)])
def test_an_on_off_switch_takes_only_a_bool(switch, value):
    with pytest.raises(ConfigError, match=f"{switch} is on or off: True or False, not {value!r}"):
        EngineConfig(**{switch: value})


# ----------------------------------------------------------------------------- through the CLI


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_missing_weights_is_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, "generate", "hello", "--model", str(tmp_path / "nowhere"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "python weights_fetch.py" in err


@pytest.mark.parametrize("bench", ["decode", "serve", "prefix", "all"])
def test_cli_bench_without_its_text_is_one_line(capsys, monkeypatch, tmp_path, real_dir, bench):
    monkeypatch.chdir(tmp_path)  # no weights/texts/alice29.txt here
    code, out, err = run_cli(capsys, "bench", bench, "--model", str(real_dir.resolve()))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "alice29.txt" in err and "python weights_fetch.py" in err


def test_cli_bad_sampling_is_one_line(capsys, real_dir):
    code, _, err = run_cli(capsys, "generate", "hello", "--top-p", "2", "--model", str(real_dir))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "top_p" in err


def test_cli_unknown_device_is_one_line(capsys, real_dir):
    code, out, err = run_cli(capsys, "generate", "hello", "--device", "tpu", "--model", str(real_dir))
    assert code == 2 and out == ""
    assert err == "error: device must be 'cpu', 'cuda' or 'cuda:N', not 'tpu'.\n"


def test_cli_binary_text_to_score_names_the_file(capsys, tmp_path, real_dir):
    text = tmp_path / "model.safetensors.txt"
    text.write_bytes(b"plain start \xff\xfe binary after")
    code, out, err = run_cli(capsys, "eval", "ppl", "--text", str(text), "--model", str(real_dir))
    assert code == 2 and out == ""
    assert (
        err == f"error: {text} is not UTF-8 text (invalid start byte at byte 12); give a UTF-8 text file.\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "ppl", "--segments"],
        ["eval", "ppl", "--segment-len"],
        ["bench", "decode", "--tokens"],
        ["bench", "serve", "--requests"],
    ],
)
def test_cli_zero_count_is_refused_by_argparse(capsys, tmp_path, argv):
    # before any weights load
    code, out, err = run_cli(capsys, *argv, "0", "--model", str(tmp_path / "nowhere"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: minillm ") and err.strip().endswith(
        f"argument {argv[2]}: 0 is not a positive count; give 1 or more"
    )


def test_cli_prompt_too_long_is_one_line(capsys, real_dir):
    code, _, err = run_cli(capsys, "generate", "word " * 9000, "--model", str(real_dir))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "shorten the prompt" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--chat", "--chat-template-kwargs", "{enable_thinking: false}"],
            "argument --chat-template-kwargs: not JSON",
        ),
        (
            ["--chat", "--chat-template-kwargs", "[false]"],
            'must be a JSON object such as {"enable_thinking": false}',
        ),
        (
            ["--chat", "--chat-template-kwargs", '{"messages": []}'],
            "sets messages, which the chat sets itself",
        ),
        (
            ["--chat-template-kwargs", '{"enable_thinking": false}'],
            "the chat template's variables: add --chat.",
        ),
        (  # copied for the template, it once recursed past Python's limit: a RecursionError traceback
            ["--chat", "--chat-template-kwargs", '{"a": ' * 900 + "1" + "}" * 900],
            "nests lists or objects more than 32 deep",
        ),
    ],
)
def test_cli_chat_template_kwargs_that_cannot_work_are_one_line(capsys, tmp_path, argv, says):
    # before any weights load
    code, out, err = run_cli(capsys, "generate", "hi", *argv, "--model", str(tmp_path / "nowhere"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err


def test_cli_generate_json_prints_ids_text_and_timings(capsys, real_dir, real_tokenizer):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "The capital of France is",
        "--max-tokens",
        "5",
        "--json",
        "--model",
        str(real_dir),
    )
    report = json.loads(out)
    assert code == 0
    assert report["prompt_ids"] == real_tokenizer.encode("The capital of France is")
    assert len(report["generated_ids"]) == 5 and report["text"] == real_tokenizer.decode(
        report["generated_ids"]
    )
    assert report["timings"]["prefill_s"] > 0
    # cached decoder, in the precision generate runs in by default: this machine's fastest
    itemsize = DTYPES[resolve_dtype("auto")].itemsize
    assert report["kv_bytes_allocated"] == (len(report["prompt_ids"]) + 5) * 2 * 30 * 3 * 64 * itemsize


def test_cli_info_reports_kv_bytes_from_formula_and_tensors(capsys, real_dir):
    code, out, _ = run_cli(capsys, "info", "--json", "--model", str(real_dir))
    info = json.loads(out)
    assert code == 0
    assert info["kv_bytes_per_token_formula"] == 2 * 30 * 3 * 64 * 4 == info["kv_bytes_per_token_allocated"]


def test_cli_chat_streams_replies_and_handles_commands(monkeypatch, capsys, real_dir):
    lines = iter(["/stats", "Say hello.", "/stats", "And goodbye?", "/stats", "/reset", "/exit"])
    monkeypatch.setattr("minillm.report.console.input", lambda prompt="": next(lines))
    code, out, _ = run_cli(capsys, "chat", "--max-tokens", "8", "--model", str(real_dir))
    out = " ".join(out.split())  # the terminal wraps long lines
    assert code == 0
    assert "no reply yet" in out and "tok/s" in out and "KV cache" in out and "conversation cleared" in out
    reused = [int(n) for n in re.findall(r"\((\d+) reused from the prefix cache\)", out)]
    assert reused[0] == 0 and reused[1] >= 32  # the second turn finds the first one's blocks cached
