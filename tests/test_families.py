"""Llama 3.x, Qwen2/2.5 and Qwen3 in minillm's one transformer, held to HF transformers.

Each family's tiny random model is built by transformers itself (its config class and modules,
`save_pretrained`), with biases and norm weights that are not zeros and ones, and every matrix on
the Q8_0 grid, so `--weights int8` reads the same values through GGUF blocks. minillm loads the
folder and must give transformers' logits (1e-4, fp32) and `generate`'s greedy tokens through
every path: naive, cached, the engine under each lossless switch, with the fused decode layer over
blocks too; the lossy switches stay within the bounds their own tests state (`references.py`);
`to_hf_dict` writes a config.json transformers reads back as the same model; and what minillm
does not implement is refused in one line.
"""

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    assert_drained,
    assert_fused_layers_equal_unfused,
    random_prompts,
    snap_to_blocks,
)
from references import (
    assert_equals_eviction_reference,
    assert_near_the_quantized_reference,
    run_recorded,
)

from minillm.config import ConfigError, ModelConfig
from minillm.decoding import generate
from minillm.decoding.cached import CachedDecoder
from minillm.decoding.naive import sequence_logits
from minillm.engine import LLM, SamplingParams
from minillm.memory.quantization import FORMATS
from minillm.model import rope_tables
from minillm.weights import load_model

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,  # no end of sequence: every path decodes its max_tokens
    eos_token_id=None,
)
# pretrained on 32 positions: with head_dim 16 one pair of each head turns too fast to change
# (wavelength < 32 / 4), one is blended, the slower six are slowed 8 times
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {  # name -> (transformers' config class, its switches)
    "llama3-tied": ("LlamaConfig", dict(rope_scaling=LLAMA3, tie_word_embeddings=True)),
    "llama3-bias": ("LlamaConfig", dict(rope_scaling=LLAMA3, attention_bias=True)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),  # not 64 / 4 heads
}
SHARED = random_prompts(1, seed=1, shortest=13, longest=13, vocab=VOCAB)[0]  # 3 blocks of 4 and one
PROMPTS = [SHARED + tail for tail in random_prompts(3, seed=2, shortest=1, longest=7, vocab=VOCAB)]
PROMPTS += random_prompts(3, seed=3, shortest=2, longest=40, vocab=VOCAB)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# The lossy switches' references replay every chunk of every sequence without a cache, and their
# bound is per token while float noise that tips one rounding in a sequence's KV moves all its
# later tokens: shorter sequences than PROMPTS (each longer than H2O's budget below)
LOSSY_PROMPTS = random_prompts(8, seed=4, shortest=4, longest=12, vocab=VOCAB)
LOSSY_PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def hf_config(name: str):
    import transformers

    config_class, switches = FAMILIES[name]
    architecture = config_class.replace("Config", "ForCausalLM")
    return getattr(transformers, config_class)(architectures=[architecture], **COMMON, **switches)


def randomize(hf, seed: int) -> None:
    """Weights of O(1) activations (transformers' init has zero biases and unit norms, which would
    hide a bias or norm read wrongly), every matrix snapped to the Q8_0 grid."""
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for name, param in hf.named_parameters():  # (a tied head is the embedding, named once)
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            values[name] = 1 + 0.1 * noise
        elif param.dim() == 1:  # a bias
            values[name] = 0.5 * noise
        else:
            values[name] = noise * param.shape[-1] ** -0.5
    snapped, _, _ = snap_to_blocks(values, "q8_0")
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(snapped[name])


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]  # (T, vocab)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """One family's folder (written by transformers), transformers' model, minillm's model, the
    same read through GGUF blocks with fused decode layers, and transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(request.param), attn_implementation="eager")
    randomize(hf, seed=len(request.param))
    hf.eval().save_pretrained(folder)

    def greedy(prompt):
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=PARAMS.max_tokens)
        return out[0, len(prompt) :].tolist()

    fused = load_model(folder, weights="int8")
    assert all(layer.fused for layer in fused.layers)
    return SimpleNamespace(
        name=request.param,
        dir=folder,
        hf=hf,
        model=load_model(folder),
        fused=fused,
        greedy={tuple(prompt): greedy(prompt) for prompt in PROMPTS},
    )


def test_logits_equal_transformers_in_prefill_and_decode(family):
    for prompt in PROMPTS:
        expected = hf_logits(family.hf, prompt)
        assert (sequence_logits(family.model, prompt) - expected).abs().max() <= 1e-4
        decoder = CachedDecoder(family.model, len(prompt))
        assert (decoder.prefill(prompt[:-1]) - expected[-2]).abs().max() <= 1e-4
        assert (decoder.step(prompt[-1]) - expected[-1]).abs().max() <= 1e-4


def test_llama3_rope_scaling_changes_the_angles():
    """The tests above could not tell a scaling left out (their prompts reach position 52):
    the slowed pairs' angles differ from plain RoPE's from position 1 on."""
    config = ModelConfig.from_dict(hf_config("llama3-tied").to_dict())
    scaled, _ = rope_tables(config, 64)
    plain, _ = rope_tables(replace(config, rope_scaling=None), 64)
    assert config.rope_scaling is not None and not torch.allclose(scaled, plain, atol=1e-3)


@pytest.mark.parametrize("decoder", ["naive", "cached"])
def test_greedy_tokens_equal_transformers_generate(family, decoder):
    for prompt in PROMPTS:
        assert generate(family.model, prompt, PARAMS, decoder).token_ids == family.greedy[tuple(prompt)]


ENGINE_SWITCHES = {
    "paged": lambda config: {"block_size": 4},
    "torch-attention": lambda config: {"block_size": 4, "attention_backend": "torch"},
    "prefix-cache": lambda config: {"block_size": 4, "prefix_caching": True},
    "chunked-prefill": lambda config: {"max_num_batched_tokens": 5},
    # 16 blocks of 4 for six sequences of up to 52 tokens: some are preempted and recomputed
    "preemption": lambda config: {
        "block_size": 4,
        "kv_cache_bytes": 64 * config.kv_bytes_per_token(torch.float32),
    },
    "speculation": lambda config: {"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2},
}


@pytest.mark.parametrize("weights", ["dense", "int8-fused"])
@pytest.mark.parametrize("switches", list(ENGINE_SWITCHES))
def test_the_engine_gives_transformers_greedy_tokens(family, switches, weights, always_guess):
    """Each lossless switch, on the dense weights and through GGUF blocks with fused decode layers;
    twice, so the second run's prompts find the first run's blocks (prefix caching)."""
    model = family.model if weights == "dense" else family.fused
    llm = LLM(family.dir, model=model, **ENGINE_SWITCHES[switches](model.config))
    expected = [family.greedy[tuple(prompt)] for prompt in PROMPTS]
    for _ in range(2):
        assert [out.token_ids for out in llm.generate(PROMPTS, PARAMS)] == expected
    snapshot = llm.engine.snapshot()
    assert switches != "prefix-cache" or snapshot.prefix_cache["hit_blocks"] > 0
    assert switches != "preemption" or llm.engine.num_preemptions > 0
    assert_drained(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_layer_equals_the_unfused_one(family, dtype):
    """Biases and q/k norms inside attention_in and layer_out round as the torch layer does."""
    assert_fused_layers_equal_unfused(load_model(family.dir, dtype, weights="int8"), positions=[0, 7, 40])


LOSSY_REPLAY = pytest.mark.slow  # the references replay every chunk without a cache: 2-6 s each


@LOSSY_REPLAY
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_stays_within_its_bounds(family, kv_dtype):
    llm = LLM(
        family.dir,
        model=family.model,
        kv_dtype=kv_dtype,
        block_size=4,
        max_num_batched_tokens=9,
        attention_backend="torch",  # the reference's order of sums (see test_quantization.py)
    )
    recorder, requests = run_recorded(llm, LOSSY_PROMPTS, LOSSY_PARAMS)
    assert_near_the_quantized_reference(family.model, recorder, requests, FORMATS[kv_dtype], "channel", 4)


@LOSSY_REPLAY
def test_h2o_eviction_equals_its_reference(family):
    budget = 7
    llm = LLM(
        family.dir,
        model=family.model,
        eviction="h2o",
        kv_budget=budget,
        block_size=4,
        max_num_batched_tokens=16,
        attention_backend="torch",
    )
    recorder, requests = run_recorded(llm, LOSSY_PROMPTS, LOSSY_PARAMS)
    assert all(seqs[0].num_evicted > 0 for seqs in requests)
    dropped = assert_equals_eviction_reference(family.model, recorder, requests, LOSSY_PARAMS, "h2o", budget)
    assert llm.engine.stats.tokens_evicted == dropped


def test_the_written_config_is_read_back_by_transformers_as_the_same_model(family, tmp_path):
    """`to_hf_dict` (Hub style: rope_scaling and rope_theta side by side) read by transformers
    gives the model transformers wrote (its own style: rope_parameters), and minillm reads it back
    as the same config."""
    from transformers import AutoModelForCausalLM

    config = ModelConfig.from_dir(family.dir)
    written = config.to_hf_dict()
    assert ModelConfig.from_dict(written) == config
    shutil.copy(family.dir / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(written))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(theirs) is type(family.hf)
    assert torch.equal(hf_logits(theirs, PROMPTS[0]), hf_logits(family.hf, PROMPTS[0]))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_head_dim_left_out_of_config_json_is_read_as_transformers_reads_it(name):
    """hidden_size / heads for Llama and Qwen2, but Qwen3Config's own default (128) for Qwen3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = hf_config(name).to_dict()
    raw.pop("head_dim", None)
    theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    assert ModelConfig.from_dict(raw).head_dim == theirs.model.layers[0].self_attn.head_dim


REFUSED = [  # (family, config.json fields changed, what the one line says)
    ("llama3-tied", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn'"),
    ("qwen2", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling of type 'linear'"),
    (
        "qwen3",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        "rope_parameters of type 'dynamic'",
    ),
    ("llama3-tied", {"rope_scaling": "llama3"}, "must be an object"),
    (
        "llama3-tied",
        {"rope_scaling": {**LLAMA3, "factor": "8"}},
        "factor='8' in config.json must be a positive",
    ),
    (
        "llama3-tied",
        {"rope_scaling": {**LLAMA3, "factor": True}},
        "factor=True in config.json must be a positive",
    ),
    (
        "llama3-tied",
        {"rope_scaling": {"rope_type": "llama3"}},
        "factor=None in config.json must be a positive",
    ),
    ("llama3-tied", {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "must exceed its low_freq_factor"),
    (
        "llama3-tied",
        {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
        "a positive integer",
    ),
    ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta=-1.0"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama3-bias", {"mlp_bias": True}, "mlp_bias=true"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (
        "llama3-bias",
        {"attention_bias": "false"},
        "attention_bias='false' in config.json must be true or false",
    ),
    ("qwen3", {"tie_word_embeddings": 1}, "tie_word_embeddings=1 in config.json must be true or false"),
    ("qwen2", {"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' in config.json must be a positive number"),
    (
        "qwen3",
        {"layer_types": ["full_attention", "sliding_attention"]},
        "sliding-window attention in layers \\[1\\]",
    ),
    (
        "llama3-tied",
        {"architectures": ["MistralForCausalLM"]},
        "Unsupported architecture 'MistralForCausalLM'",
    ),
]


@pytest.mark.parametrize("name, changes, message", REFUSED)
def test_what_minillm_does_not_implement_is_refused_in_one_line(name, changes, message):
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dict(hf_config(name).to_dict() | changes)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("max_window_layers", [0, 1, 2])
def test_a_sliding_window_is_refused_exactly_where_transformers_would_slide(max_window_layers):
    """use_sliding_window slides the layers from max_window_layers on (of 2): 0 and 1 are refused,
    2 slides none and loads."""
    from transformers import Qwen2Config

    raw = hf_config("qwen2").to_dict()
    raw |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": max_window_layers}
    raw.pop("layer_types")  # transformers derives them from the three fields above
    slides = set(Qwen2Config(**raw).layer_types) != {"full_attention"}
    if slides:
        with pytest.raises(ConfigError, match="sliding-window attention"):
            ModelConfig.from_dict(raw)
    else:
        assert ModelConfig.from_dict(raw).architecture == "Qwen2ForCausalLM"
    assert slides == (max_window_layers < 2)
