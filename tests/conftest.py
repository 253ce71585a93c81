"""Shared fixtures: a tiny random Llama (fast, made here) and the real SmolLM2 checkpoint.

The real checkpoint is fetched by the README's first command (`python weights_fetch.py`); the
tests need it and say so instead of skipping, because exactness on real weights is the point.
The same command writes the real texts the tests read into TEXTS_DIR.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REAL_MODEL_DIR = Path(
    os.environ.get("MINILLM_MODEL_DIR", Path(__file__).parent.parent / "weights" / "SmolLM2-135M-Instruct")
)
GGUF_CACHE = REAL_MODEL_DIR.parent / ".downloads" / REAL_MODEL_DIR.name
TEXTS_DIR = REAL_MODEL_DIR.parent / "texts"  # alice29.txt, lcet10.txt (see minillm/fetch/texts.py)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}


def random_llama_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]

    def rand(*shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=gen) * scale

    tensors = {
        "model.embed_tokens.weight": rand(config["vocab_size"], d, scale=1.0),
        "model.norm.weight": 1 + rand(d, scale=0.1),
    }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + rand(d, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + rand(d, scale=0.1),
            p + "self_attn.q_proj.weight": rand(nh * hd, d),
            p + "self_attn.k_proj.weight": rand(nkv * hd, d),
            p + "self_attn.v_proj.weight": rand(nkv * hd, d),
            p + "self_attn.o_proj.weight": rand(d, nh * hd),
            p + "mlp.gate_proj.weight": rand(inter, d),
            p + "mlp.up_proj.weight": rand(inter, d),
            p + "mlp.down_proj.weight": rand(d, inter),
        }
    return tensors


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


def tiny_with_real_tokenizer(folder: Path, real_dir: Path, **config_overrides) -> Path:
    """The tiny random Llama with the real model's tokenizer (vocabulary and chat template) in
    `folder`: real text in, random-weight speed."""
    vocab_size = json.loads((real_dir / "config.json").read_text())["vocab_size"]
    config = {**TINY_CONFIG, "vocab_size": vocab_size, **config_overrides}
    write_checkpoint(folder, config, random_llama_tensors(config))
    for name in ("tokenizer.tiktoken", "tokenizer_config.json"):
        shutil.copy(real_dir / name, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_CONFIG, random_llama_tensors(TINY_CONFIG))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from minillm.weights import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not (REAL_MODEL_DIR / "manifest.json").is_file():
        pytest.fail(
            f"The real checkpoint is missing in {REAL_MODEL_DIR}: run `python weights_fetch.py` first "
            "(the README's first command does)."
        )
    return REAL_MODEL_DIR


@pytest.fixture(scope="session")
def real_model(real_dir):
    from minillm.weights import load_model

    return load_model(real_dir)


@pytest.fixture(scope="session")
def real_tokenizer(real_dir):
    from minillm.tokenizer import Tokenizer

    return Tokenizer(real_dir)


@pytest.fixture(scope="session")
def hf_model(real_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_text_ids(real_tokenizer) -> list[int]:
    """Tokens of real prose from outside the project: "Alice's Adventures in Wonderland"."""
    from minillm.evaluation import read_text

    return real_tokenizer.encode(read_text(TEXTS_DIR / "alice29.txt"))


@pytest.fixture(scope="module")
def always_guess():
    """Speculation guesses as far as it may, whatever the machine's measured price of a row:
    exactness tests then exercise guesses and rollbacks on every step, independent of timing."""
    from minillm.engine.speculative import PassCost

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PassCost, "guesses_worth", lambda self, acceptance, batch, most: most)
        yield
