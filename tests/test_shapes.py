"""`--shape NAME`: a 1B-class model's real config with random weights, for speed and memory only.

The tensors `minillm/fetch/shapes.py` writes must be the ones transformers builds for the same
config (names and shapes, checked on the meta device: nothing allocated), and the folder it writes
must load, carry the default tokenizer and say "random weights" in its name and tables.
"""

import pytest
import torch
from helpers import TINY_CONFIG

from minillm.config import ConfigError, ModelConfig
from minillm.fetch import shapes
from minillm.fetch.shapes import SHAPES, random_tensors, shape_checkpoint


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shape_has_the_tensors_transformers_builds(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = SHAPES[name]
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    if raw["tie_word_embeddings"]:
        expected.pop("lm_head.weight")  # tied: the checkpoint stores the embedding once
    with torch.device("meta"):
        ours = {k: tuple(v.shape) for k, v in random_tensors(raw).items()}
    assert ours == expected


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shape_is_a_config_minillm_runs(name):
    config = ModelConfig.from_dict(SHAPES[name])
    assert config.num_layers == SHAPES[name]["num_hidden_layers"]
    assert config.kv_bytes_per_token(torch.bfloat16) > 10_000  # 1B class: tens of KiB a token


def test_a_shape_folder_loads_with_the_default_tokenizer(tmp_path, real_dir, monkeypatch):
    from minillm.tokenizer import Tokenizer
    from minillm.weights import load_model

    monkeypatch.setitem(SHAPES, "tiny", TINY_CONFIG)
    folder = shape_checkpoint("tiny", tmp_path, real_dir)
    assert folder.name.endswith(shapes.RANDOM_SUFFIX)
    model = load_model(folder)
    assert model.config.num_layers == TINY_CONFIG["num_hidden_layers"]
    assert Tokenizer(folder).encode("hello") == Tokenizer(real_dir).encode("hello")
    assert shape_checkpoint("tiny", tmp_path, real_dir) == folder  # written once, then reused


def test_record_refuses_a_shape(monkeypatch):
    from minillm.cli.commands import build_parser
    from minillm.cli.flags import use_shape

    monkeypatch.setattr(shapes, "shape_checkpoint", lambda *_: pytest.fail("wrote a checkpoint"))
    args = build_parser().parse_args(["bench", "scheduling", "--shape", "qwen3-0.6b", "--record"])
    with pytest.raises(ConfigError, match="drop --shape"):
        use_shape(args)


def test_shape_and_another_model_are_refused_in_either_order(monkeypatch):
    from minillm.cli.commands import build_parser
    from minillm.cli.flags import use_shape

    monkeypatch.setattr(shapes, "shape_checkpoint", lambda *_: pytest.fail("wrote a checkpoint"))
    shape, model = ["--shape", "qwen3-0.6b"], ["--model", "elsewhere"]
    for order in (shape + model, model + shape):
        args = build_parser().parse_args(["bench", "decode", *order])
        with pytest.raises(ConfigError, match="--shape qwen3-0.6b and --model elsewhere both name the model"):
            use_shape(args)


@pytest.mark.parametrize("command", [["bench", "decode"], ["bench", "staircase"], ["bench", "memory"]])
def test_the_shape_flag_is_the_model_the_command_runs(command, tmp_path, monkeypatch):
    from minillm.cli.commands import build_parser
    from minillm.cli.flags import use_shape
    from minillm.report import caption_tables

    written = tmp_path / "qwen3-0.6b-random-weights"
    monkeypatch.setattr(shapes, "shape_checkpoint", lambda name, root, tokenizer_from: written)
    args = build_parser().parse_args([*command, "--shape", "qwen3-0.6b"])
    use_shape(args)
    caption_tables("")  # the flag captions this process's tables; the next test's start clean
    assert args.model == written and args.shape == "qwen3-0.6b"
