"""A GGUF file opened in place (`minillm/gguf_file.py`), held to transformers' own GGUF loading.

Each family's tiny random model is built by transformers (Llama 3 with its rope_scaling, Qwen2
with its q/k/v biases, Qwen3 with its q/k norms and its own head_dim) and written as llama.cpp's
converter writes it, with the `gguf` package's GGUFWriter: the package's own tensor names, llama's
q/k rows permuted by llama.cpp's `permute`, Llama 3's rope scaling as the `rope_freqs` tensor
llama.cpp computes, the tokenizer as `tokenizer.ggml.*`; once all F32, once with the matrices in
Q8_0, Q4_0 and Q4_1 (`gguf.quants.quantize`). Then:
- minillm's dequantized weights equal transformers' reading of the file (`load_gguf_checkpoint`);
- its greedy ids equal transformers' `generate` (fp32), on transformers' model of the same file;
- its tokenizer's ids equal transformers' tokenizer of the same file;
- the blocks `quant_dense` reads are views of the file, and a product without them is named;
- every type the `gguf` package dequantizes opens and equals `gguf.dequantize`;
- SmolLM2's real Q4_1 file gives the fetched folder's greedy ids (slow).
"""

import math
import re

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize
from helpers import tiny_gpt2_tokenizer_json

from minillm.config import ConfigError, ModelConfig
from minillm.engine import LLM, SamplingParams
from minillm.gguf_file import PACKED_TYPES, gguf_tensors, open_gguf
from minillm.quantized_weights import BLOCK_TYPES
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

# Llama 3.x's rope scaling as its config.json has it; with head_dim 16 and theta 500000 two pairs
# turn too fast to change, one is blended and the slower ones are slowed 8 times
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
FAMILIES = {  # name -> (GGUF architecture, transformers' config class, its switches, tokenizer.ggml.pre)
    "llama3": (
        "llama",
        "LlamaConfig",
        dict(rope_scaling=LLAMA3, rope_theta=500000.0, max_position_embeddings=16384),
        "llama-bpe",
    ),
    "qwen2": ("qwen2", "Qwen2Config", dict(rope_theta=1e6), "qwen2"),
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), "qwen2"),
}
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=None,  # the tiny vocabulary has none
)
# the quantized file's matrices, by llama.cpp's name: the block types quant_dense reads, and Q4_0
QUANTIZED = {"attn_q": "Q8_0", "attn_k": "Q4_1", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1"}
QUANTIZED |= {"ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q4_1"}
PROMPTS = [[5, 77, 200, 31, 9], [258, 1, 2, 3, 4, 5, 6, 7, 8, 120, 44]]
TEXTS = ["the theme, then the 12 themes", "  the\n\tthe <|end|> them", "héllo the 2024"]


def tiny_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges of the smallest byte-level BPE (helpers), with an end token."""
    tiny = tiny_gpt2_tokenizer_json()
    tokens = sorted(tiny["model"]["vocab"], key=tiny["model"]["vocab"].get) + ["<|end|>"]
    return tokens, [1] * (len(tokens) - 1) + [3], tiny["model"]["merges"]


def hf_model(family: str):
    import transformers

    _, config_class, switches, _ = FAMILIES[family]
    vocab = len(tiny_tokenizer()[0])
    config = getattr(transformers, config_class)(
        **(COMMON | switches), vocab_size=vocab, eos_token_id=vocab - 1
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases that are not ones and zeros, so a misread one shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` (q: the query heads, k: the KV heads)."""
    shape = weights.shape
    return weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf: Llama 3's rope scaling as one factor a frequency."""
    scaling, dim = config.rope_parameters, config.head_dim
    freqs = 1.0 / (scaling["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, family: str, model, types: dict[str, str]) -> None:
    """The model as llama.cpp's converter writes it; `types`: llama.cpp name -> block type."""
    arch, _, _, pre = FAMILIES[family]
    config = model.config
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if arch == "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    tokens, token_types, merges = tiny_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    writer.add_add_bos_token(False)
    names = get_tensor_name_map(MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        values = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            values = llama_cpp_permute(values, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in name:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        kind = types.get(name.split(".")[-2]) if values.ndim == 2 else None
        if kind is None:
            writer.add_tensor(name, values)
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in ("f32", "quantized")])
def written(request, tmp_path_factory):
    """(family, the GGUF file, the HF folder of the model it was written from)."""
    family, types = request.param
    folder = tmp_path_factory.mktemp(f"{family}-{types}")
    model = hf_model(family)
    model.save_pretrained(folder)
    path = folder / "model.gguf"
    write_gguf(path, family, model, QUANTIZED if types == "quantized" else {})
    return family, path, folder


def theirs_tensors(path, folder) -> dict[str, torch.Tensor]:
    """transformers' own reading of the file: dequantized, llama's q/k rows put back."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        shapes_only = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shapes_only)["tensors"]


def theirs_model(family: str, path, folder):
    """transformers' model of the file, fp32. Its GGUF loader drops Llama 3's rope_freqs (the
    rope scaling) and Qwen3's key_length (its head_dim), so their model is the folder's config
    with transformers' reading of the file's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family == "qwen2":
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.load_state_dict(theirs_tensors(path, folder), strict=False)  # (a tied lm_head is none)
    model.tie_weights()
    return model.eval()


def test_the_config_is_the_models(written):
    family, path, folder = written
    ours, folders = ModelConfig.from_dir(path), ModelConfig.from_dir(folder)
    assert ours == folders
    assert (ours.qkv_bias, ours.qk_norm, ours.rope_scaling is not None) == (
        family == "qwen2",
        family == "qwen3",
        family == "llama3",
    )


def test_the_dequantized_weights_equal_transformers_reading(written):
    _, path, folder = written
    ours, theirs = gguf_tensors(open_gguf(path)), theirs_tensors(path, folder)
    assert set(ours) == set(theirs) - {"lm_head.weight"} or set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name].float()), name


def test_greedy_ids_equal_transformers_generate(written):
    family, path, folder = written
    theirs = theirs_model(family, path, folder)
    llm = LLM(path, weights="auto")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        expected = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert output.token_ids == expected, prompt


def test_the_tokenizer_equals_transformers_tokenizer_of_the_file(written):
    from transformers import AutoTokenizer

    _, path, folder = written
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode_with_special_tokens(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_token_id == theirs.eos_token_id


def test_the_blocks_are_read_in_place_and_the_rest_named(written, capsys):
    family, path, _ = written
    model = load_model(path, weights="auto")
    said = capsys.readouterr().err
    products = model.products()
    if "quantized" not in str(path.parent.name):
        assert all(m.quantized is None for m in products.values())
        assert f"reads the dense weights: it stores no matrix in {BLOCK_TYPES}" in said
        with pytest.raises(ConfigError, match=re.escape(f"reads the GGUF's own blocks ({BLOCK_TYPES}), and")):
            load_model(path, weights="q4_1")
        return
    for name, matmul in products.items():
        if "wqkv" in name:  # Q8_0 | Q4_1 | Q4_0: no one block format
            assert matmul.quantized is None, name
        elif family != "llama3" or "wqkv" not in name:  # (llama's q/k rows are put back: a copy)
            # a view of the mapped file, never a copy: the blocks' storage is the whole file
            assert matmul.quantized.blocks.untyped_storage().nbytes() == path.stat().st_size, name
    assert re.search(
        r"weights: 2 of \d+ products read the dense weights.*layers\.\*\.attn\.wqkv\.weight", said
    )


def test_a_qwen_file_is_read_as_it_is_written(tmp_path):
    """llama.cpp writes Qwen's q/k rows unpermuted: they must come back in the model's own order."""
    model = hf_model("qwen2")
    write_gguf(tmp_path / "qwen2.gguf", "qwen2", model, {})
    ours = gguf_tensors(open_gguf(tmp_path / "qwen2.gguf"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(ours[name], tensor), name


def test_another_architecture_is_refused_in_one_line(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(path, "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ConfigError, match="holds a 'phi3' model; minillm opens GGUF files of the architectures"
    ):
        ModelConfig.from_dir(path)
    with pytest.raises(ConfigError, match="No GGUF file at"):
        Tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
        ModelConfig.from_dir(tmp_path / "broken.gguf")


def every_dequantized_type() -> list[GGMLQuantizationType]:
    """The types the gguf package dequantizes (F32, F16, BF16 and its block types)."""
    from gguf.quants import _type_traits

    return [GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits]


def any_blocks(qtype: GGMLQuantizationType, rows: int, columns: int, rng) -> np.ndarray:
    """`rows` rows of valid blocks: quantized where the gguf package quantizes the type, else random
    bytes none of whose byte pairs is an fp16 infinity or NaN (so the scales are finite)."""
    from gguf import GGML_QUANT_SIZES

    values = rng.standard_normal((rows, columns)).astype(np.float32)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return values.astype(np.float16 if qtype == GGMLQuantizationType.F16 else np.float32)
    try:
        return quantize(values, qtype)
    except NotImplementedError:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        finite = np.array([b for b in range(256) if b & 0x7C != 0x7C], dtype=np.uint8)
        data = rng.choice(finite, size=(rows, columns // block_size * type_size))
        # IQ1_M spreads its fp16 scale over four nibbles: a row that still makes one infinite is zeros
        with np.errstate(invalid="ignore", over="ignore"):
            data[~np.isfinite(dequantize(data, qtype)).all(axis=1)] = 0
        return data


def test_every_type_the_gguf_package_dequantizes_opens(tmp_path, capsys):
    """One llama file with its matrices in every type, round robin (rows 256 weights wide: a
    K-quant block): minillm reads each as gguf.dequantize does, and loads the model."""
    rng, path, layers = np.random.default_rng(0), tmp_path / "every-type.gguf", 4
    qtypes = every_dequantized_type()
    writer = GGUFWriter(path, "llama")
    for key, value in dict(block_count=layers, context_length=64, embedding_length=256).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens, token_types, merges = tiny_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    shapes = {"token_embd": len(tokens), "output": len(tokens)}
    shapes |= {f"blk.{i}.{p}": rows for i in range(layers) for p, rows in _LAYER_ROWS.items()}
    # two products in one block type quant_dense reads; the others round robin over every type
    chosen = {"blk.3.attn_output": GGMLQuantizationType.Q8_0, "blk.3.ffn_down": GGMLQuantizationType.Q4_1}
    written = {}
    for index, (name, rows) in enumerate(shapes.items()):
        qtype = chosen.get(name, qtypes[index % len(qtypes)])
        data = any_blocks(qtype, rows, 256, rng)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=None if data.dtype != np.uint8 else qtype)
        written[f"{name}.weight"] = qtype
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(256, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert set(written.values()) == set(qtypes)

    reader = GGUFReader(path)
    ours = gguf_tensors(open_gguf(path))
    for tensor in reader.tensors:
        expected = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if ".attn_q." in tensor.name:
            expected = _unpermute(expected, 4)
        if ".attn_k." in tensor.name:
            expected = _unpermute(expected, 2)
        hf = _HF_NAMES[tensor.name.split(".")[-2]]
        hf = hf.format(tensor.name.split(".")[1]) if tensor.name.startswith("blk.") else hf
        assert np.array_equal(ours[hf].numpy(), expected, equal_nan=True), tensor.name
    model = load_model(path, weights="auto")
    with_blocks = {name for name, m in model.products().items() if m.quantized is not None}
    assert {"layers.3.attn.wo.weight", "layers.3.mlp.w_down.weight"} <= with_blocks
    assert all(
        all(written[f"{source}.weight"].name in PACKED_TYPES for source in _sources(name))
        for name in with_blocks
    )
    assert (
        f"weights: {17 - len(with_blocks)} of 17 products read the dense weights" in capsys.readouterr().err
    )


_LAYER_ROWS = {"attn_q": 256, "attn_k": 128, "attn_v": 128, "attn_output": 256, "ffn_gate": 256}
_LAYER_ROWS |= {"ffn_up": 256, "ffn_down": 256}
_HF_NAMES = {
    "token_embd": "model.embed_tokens.weight",
    "output": "lm_head.weight",
    "output_norm": "model.norm.weight",
    "attn_norm": "model.layers.{}.input_layernorm.weight",
    "ffn_norm": "model.layers.{}.post_attention_layernorm.weight",
    **{p: f"model.layers.{{}}.self_attn.{p[5]}_proj.weight" for p in ("attn_q", "attn_k", "attn_v")},
    "attn_output": "model.layers.{}.self_attn.o_proj.weight",
    **{f"ffn_{p}": f"model.layers.{{}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def _sources(product: str) -> list[str]:
    """llama.cpp's names of the matrices one of minillm's products is stacked from."""
    if product == "lm_head.weight":
        return ["output"]
    layer, part = product.split(".")[1], product.split(".", 2)[2]
    parts = {"attn.wqkv.weight": ["attn_q", "attn_k", "attn_v"], "attn.wo.weight": ["attn_output"]}
    parts |= {"mlp.w_gate_up.weight": ["ffn_gate", "ffn_up"], "mlp.w_down.weight": ["ffn_down"]}
    return [f"blk.{layer}.{p}" for p in parts[part]]


def _unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama_cpp_permute, as transformers' GGUF loader writes it."""
    shape = weights.shape
    return weights.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(2, 1).reshape(shape)


@pytest.mark.slow  # SmolLM2 loaded from the file, from the folder and by transformers (~45 s)
def test_smollm2s_gguf_gives_the_fetched_folders_greedy_ids(real_dir):
    from transformers import AutoModelForCausalLM

    gguf = next((real_dir.parent / ".downloads" / real_dir.name).glob("*.gguf"))
    prompt = Tokenizer(gguf).encode("The capital of France is")
    assert prompt == Tokenizer(real_dir).encode("The capital of France is")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ours, folders = (
        LLM(model, weights="auto").generate([prompt], params)[0].token_ids for model in (gguf, real_dir)
    )
    theirs = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)[
        0, len(prompt) :
    ]
    assert ours == folders == theirs.tolist()
    chat = [{"role": "user", "content": "Hi"}]
    assert Tokenizer(gguf).encode_chat(chat) == Tokenizer(real_dir).encode_chat(chat)


def test_a_vocabulary_only_file_is_refused_in_one_line(tmp_path):
    """llama.cpp's ggml-vocab-*.gguf files hold a tokenizer and no tensors: said so, not as a
    missing vocab_size."""
    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(path, "qwen2")
    tokens, token_types, merges = tiny_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="holds no model \\(no token_embd.weight tensor\\)") as refused:
        ModelConfig.from_dir(path)
    assert "\n" not in str(refused.value)
