"""`--hf OWNER/REPO`: any Llama-family safetensors checkpoint on the Hugging Face hub.

We GET the repository's files over plain HTTP ({endpoint}/{repo}/resolve/main/{file}, where
HF_ENDPOINT can move the endpoint): config.json, checked by `ModelConfig` before anything large
comes down; model.safetensors, or the shards its index names; tokenizer.json and, when there,
tokenizer_config.json for the chat template. The weights are written back as one safetensors file
and the config as it came; the tokenizer goes through `bpe.py` like the GGUF's.

A repository is known by its whole id, owner and name: `weights/OWNER--REPO/` is its checkpoint
and `weights/.downloads/OWNER--REPO/` its downloads, so `alice/tiny` and `bob/tiny` never share a
folder, nor a cached file. A cached file is used again only while it hashes to the sha256
recorded when it came (`download.py`); anything else is downloaded again.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from safetensors.torch import load_file, save_file

from minillm.config import ConfigError, ModelConfig
from minillm.fetch import FetchError
from minillm.fetch.bpe import DIGITS_PATTERN, GPT2_PATTERN, tiktoken_ranks, write_tokenizer
from minillm.fetch.download import cached_http_get

# A repository's owner, its name, and the files it names: one path component each, never "." or
# "..", so that what the repository says cannot lead a write out of its folder.
PLAIN_NAME = re.compile(r"\w[\w.-]*")


def repo_folder(repo: str) -> str:
    """The folder `OWNER/REPO` is written to, and its downloads cached in: OWNER--REPO. The hub
    allows no '--' inside an owner or a name, so no two repositories share a folder, and none is
    the default checkpoint's, `texts` or `.downloads`."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(PLAIN_NAME.fullmatch(part) and "--" not in part for part in parts):
        raise FetchError(f"--hf takes OWNER/REPO (letters, digits, '-', '_', '.', never '--'), not {repo!r}.")
    return "--".join(parts)


def fetch_hf(repo: str, out_dir: Path, cache_dir: Path) -> None:
    config_path = hub_file(repo, "config.json", cache_dir)
    raw_config = json.loads(config_path.read_text())
    try:
        config = ModelConfig.from_dict(raw_config)
    except ConfigError as err:
        raise FetchError(str(err)) from err
    index = hub_file(repo, "model.safetensors.index.json", cache_dir, required=False)
    shards = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index else ["model.safetensors"]
    )
    tensors = {}
    for shard in shards:
        tensors.update(load_file(hub_file(repo, shard, cache_dir)))
    hf_tokenizer(
        hub_file(repo, "tokenizer.json", cache_dir),
        hub_file(repo, "tokenizer_config.json", cache_dir, required=False),
        out_dir,
        config.eos_token_id,
    )
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")


def hub_file(repo: str, filename: str, cache_dir: Path, required: bool = True) -> Path | None:
    """`filename` of `repo` in `cache_dir`, downloaded unless an intact copy is there; None when
    an optional file cannot be had."""
    if not PLAIN_NAME.fullmatch(filename):
        raise FetchError(f"{repo} names the file {filename!r}, which is not a plain file name; refusing it.")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        return cached_http_get(f"{endpoint}/{repo}/resolve/main/{filename}", cache_dir / filename)
    except FetchError:
        if required:
            raise
        return None


def hf_pattern(pre_tokenizer: dict | None) -> str:
    """The regex of a byte-level pre-tokenizer: an explicit Split regex (Llama 3 style), or
    GPT-2's, with digits isolated first if a Digits step says so (SmolLM2, StarCoder)."""
    steps = (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer or {}])
    kinds = [s.get("type") for s in steps]
    if "ByteLevel" not in kinds:
        raise FetchError(
            "Only byte-level BPE tokenizers are supported (this one has no ByteLevel pre-tokenizer)."
        )
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            return step["pattern"]["Regex"]
    if any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps):
        return DIGITS_PATTERN
    return GPT2_PATTERN


def hf_tokenizer(
    tokenizer_json: Path, tokenizer_config: Path | None, out_dir: Path, eos_token_id: int
) -> None:
    spec = json.loads(tokenizer_json.read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise FetchError(
            f"Tokenizer model {model.get('type')!r} is not BPE; minillm's tiktoken path needs byte-level BPE."
        )
    vocab = model["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = [None] * (max([*vocab.values(), *special.values()]) + 1)
    for tok, i in [*vocab.items(), *special.items()]:
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ranks = tiktoken_ranks(tokens, set(special.values()), merges)
    extra = json.loads(tokenizer_config.read_text()) if tokenizer_config else {}
    write_tokenizer(
        out_dir,
        ranks,
        special,
        hf_pattern(spec.get("pre_tokenizer")),
        tokens[eos_token_id],
        extra.get("chat_template"),
    )
