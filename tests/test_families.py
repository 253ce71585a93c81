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
    tiny_gpt2_tokenizer_json,
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
from minillm.tokenizer import Tokenizer, end_of_sequence
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


def ends_emitted_early(greedy: dict[tuple, list[int]]) -> list[int]:
    """Two tokens the eos-free greedy outputs emit early, each ending a different prompt's output
    (the first token seen again or a chosen one before it disqualifies a position): as end-of-
    sequence tokens, the second and third of a list stop those outputs after 2-6 tokens."""
    chosen: list[int] = []
    for out in greedy.values():
        for k in range(1, 6):
            if out[k] not in out[:k] and not any(token in chosen for token in out[: k + 1]):
                chosen.append(out[k])
                break
        if len(chosen) == 2:
            return chosen
    raise AssertionError(f"no two early tokens to end on in {list(greedy.values())}")


@pytest.fixture(scope="module")
def llama3_eos(tmp_path_factory):
    """A Llama 3 folder whose config.json ends on [never emitted, A] and whose
    generation_config.json on [never emitted, A, B], as Llama 3.1 Instruct lists end_of_text,
    eom_id and eot_id; A and B are tokens the model emits early (from its eos-free greedy output).
    Transformers' own `generate` on the folder (reading generation_config.json itself, stopping at
    any of the list) is the reference."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("llama3-eos")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config("llama3-tied"), attn_implementation="eager")
    randomize(hf, seed=3)
    hf.eval().save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(tiny_gpt2_tokenizer_json()))  # ids < 128: bytes
    free = {tuple(p): hf_greedy(hf, p) for p in PROMPTS}
    second, third = ends_emitted_early(free)
    never = min(set(range(VOCAB)) - {t for out in free.values() for t in out})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": [never, second]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [never, second, third]}))
    theirs = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert theirs.generation_config.eos_token_id == [never, second, third]
    return SimpleNamespace(
        dir=folder,
        hf=theirs,
        model=load_model(folder),
        ends=(never, second, third),
        free=free,
        stopping={tuple(p): hf_greedy(theirs, p) for p in PROMPTS},
    )


def hf_greedy(hf, prompt: list[int], **options) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=PARAMS.max_tokens, **options)
    return out[0, len(prompt) :].tolist()


def test_every_eos_of_config_and_generation_config_ends_as_in_transformers(llama3_eos):
    """config.json's list, then the id generation_config.json adds; the naive and cached decoders
    stop where transformers stops, at the second id for one prompt and the third for another."""
    never, second, third = llama3_eos.ends
    ends = end_of_sequence(llama3_eos.model.config.eos_token_ids, None)
    assert llama3_eos.model.config.eos_token_ids == (never, second, third)
    last_tokens = {out[-1] for out in llama3_eos.stopping.values() if len(out) < PARAMS.max_tokens}
    assert {second, third} <= last_tokens, "the tiny model was meant to stop early at both"
    stopping = SamplingParams(max_tokens=PARAMS.max_tokens)
    for prompt in PROMPTS:
        expected = llama3_eos.stopping[tuple(prompt)]
        for decoder in ("naive", "cached"):
            gen = generate(llama3_eos.model, prompt, stopping, decoder, ends)
            assert gen.token_ids == expected
            assert gen.finish_reason == ("eos" if expected[-1] in ends else "length")
            ignored = generate(llama3_eos.model, prompt, PARAMS, decoder, ends)  # ignore_eos
            assert ignored.token_ids == llama3_eos.free[tuple(prompt)]


@pytest.mark.parametrize("switches", ["paged", "speculation"])
def test_the_engine_ends_at_any_eos_as_transformers_does(llama3_eos, switches, always_guess):
    """Any of the three ends a sequence ("stop") and is not text (the `tokenizers` library decodes
    the rest); ignore_eos ignores them all; min_tokens bans them all (transformers' min_new_tokens)."""
    from tokenizers import Tokenizer as Reference

    model, reference = llama3_eos.model, Reference.from_file(str(llama3_eos.dir / "tokenizer.json"))
    switched = ENGINE_SWITCHES[switches](model.config)
    llm = LLM(llama3_eos.dir, model=model, tokenizer=Tokenizer(llama3_eos.dir), **switched)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=PARAMS.max_tokens))
    for prompt, out in zip(PROMPTS, outs):
        expected = llama3_eos.stopping[tuple(prompt)]
        stopped = expected[-1] in llama3_eos.ends
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == ("stop" if stopped else "length")
        assert out.outputs[0].text == reference.decode(expected[:-1] if stopped else expected)
    ignored = llm.generate(PROMPTS, PARAMS)
    assert [out.token_ids for out in ignored] == [llama3_eos.free[tuple(p)] for p in PROMPTS]
    late = llm.generate(PROMPTS, SamplingParams(max_tokens=PARAMS.max_tokens, min_tokens=3))
    expected = [hf_greedy(llama3_eos.hf, p, min_new_tokens=3) for p in PROMPTS]
    assert [out.token_ids for out in late] == expected
    assert expected != [llama3_eos.stopping[tuple(p)] for p in PROMPTS], "min_tokens was meant to bite"
    assert_drained(llm)


BAD_GENERATION_CONFIGS = {  # generation_config.json's text -> what the one line says
    "not JSON": ("{", "is not valid JSON"),
    "a list": ("[1, 2]", "holds a JSON list, not an object"),
    "a quoted id": ('{"eos_token_id": "2"}', "eos_token_id='2' in generation_config.json"),
    "past the vocabulary": (f'{{"eos_token_id": [1, {VOCAB}]}}', f"must be a token id in \\[0, {VOCAB}\\)"),
    "negative": ('{"eos_token_id": -1}', "eos_token_id=-1 in generation_config.json"),
    "a bool": ('{"eos_token_id": true}', "eos_token_id=True in generation_config.json"),
    "nested": ('{"eos_token_id": [[1]]}', "eos_token_id=\\[\\[1\\]\\]"),
}


@pytest.mark.parametrize("text, message", BAD_GENERATION_CONFIGS.values(), ids=BAD_GENERATION_CONFIGS)
def test_a_bad_generation_config_is_refused_in_one_line(tmp_path, text, message):
    (tmp_path / "config.json").write_text(json.dumps(hf_config("llama3-tied").to_dict()))
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig.from_dir(tmp_path)
    assert "\n" not in str(err.value)


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
    (
        "qwen3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}},
        "rope_theta=1e-300 in config.json must be above 1",
    ),
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
    (
        "llama3-tied",
        {"eos_token_id": [1, "2"]},
        "eos_token_id=\\[1, '2'\\] in config.json must be a token id",
    ),
    (
        "qwen2",
        {"eos_token_id": VOCAB},
        f"eos_token_id={VOCAB} in config.json must be a token id in \\[0, {VOCAB}\\)",
    ),
    ("qwen3", {"eos_token_id": [2, None]}, "eos_token_id=\\[2, None\\] in config.json"),
    ("llama3-bias", {"eos_token_id": 2.0}, "eos_token_id=2.0 in config.json"),
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
