"""`--hf OWNER/REPO`: a Llama 3.x, Qwen2/2.5, Qwen3 or SmolLM2 checkpoint on the Hugging Face hub.

We GET the repository's files over plain HTTP ({endpoint}/{repo}/resolve/main/{file}, where
HF_ENDPOINT can move the endpoint): config.json and, when there, generation_config.json (its
eos_token_id may add end-of-sequence tokens), checked by `ModelConfig` before anything large comes
down; tokenizer.json and, when there, tokenizer_config.json and chat_template.jinja, checked by
loading them as the engine does, before the weights; then model.safetensors, or the shards its
index names. The weights are written back as one safetensors file; the configs and the tokenizer's
files as they came, the format the engine reads (`minillm/tokenizer_json.py`).

A repository is known by its whole id, owner and name: `weights/OWNER--REPO/` is its checkpoint
and `weights/.downloads/OWNER--REPO/` its downloads, so `alice/tiny` and `bob/tiny` never share a
folder, nor a cached file. A cached file is used again only while it hashes to the sha256
recorded when it came (`download.py`); anything else is downloaded again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from minillm.config import GENERATION_FILE, ConfigError, ModelConfig
from minillm.fetch import FetchError
from minillm.fetch.download import cached_http_get
from minillm.tokenizer import CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_FILE, Tokenizer

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
    for name in ("config.json", GENERATION_FILE):
        path = hub_file(repo, name, cache_dir, required=name == "config.json")
        if path is not None:
            _json_object(repo, path)  # a broken file named by its repository, not by our copy
            shutil.copy(path, out_dir / name)
    try:
        ModelConfig.from_dir(out_dir)  # checked before anything large comes down
    except ConfigError as err:
        raise FetchError(str(err)) from err
    copy_tokenizer(repo, out_dir, cache_dir)
    index = hub_file(repo, "model.safetensors.index.json", cache_dir, required=False)
    shards = _shards(repo, _json_object(repo, index)) if index else ["model.safetensors"]
    tensors = {}
    for shard in shards:
        path = hub_file(repo, shard, cache_dir)
        try:
            tensors.update(load_file(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise FetchError(f"{repo}'s {shard} is not a safetensors file ({err}).") from None
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors")


def _json_object(repo: str, path: Path) -> dict:
    """A JSON file of the repository (config.json, the shards' index), which must be an object."""
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON; nesting too deep to parse
        raise FetchError(f"{repo}'s {path.name} is not valid JSON ({err}).") from None
    if not isinstance(value, dict):
        raise FetchError(f"{repo}'s {path.name} holds a JSON {type(value).__name__}, not an object.")
    return value


def _shards(repo: str, index: dict) -> list[str]:
    """The shard files an index's weight_map names (tensor name -> file)."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise FetchError(f"{repo}'s model.safetensors.index.json has no weight_map of tensor names to files.")
    return sorted(set(weight_map.values()))


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


def copy_tokenizer(repo: str, out_dir: Path, cache_dir: Path) -> None:
    """The repository's tokenizer files, as they came, once they load as the engine loads them."""
    for name in (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE):
        path = hub_file(repo, name, cache_dir, required=name == TOKENIZER_FILE)
        if path is not None:
            shutil.copy(path, out_dir / name)
    try:
        Tokenizer(out_dir)
    except ConfigError as err:
        raise FetchError(f"{repo}'s tokenizer does not load: {err}") from err
