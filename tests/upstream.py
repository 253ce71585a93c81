"""The families' own files, from PyPI, for the tests to check minillm against.

llama-cpp-python's source archive vendors llama.cpp, whose `models/` folder holds, for each family:
- its tokenizer as a vocabulary-only GGUF (every token, the merges, each token's type), written by
  llama.cpp's converter from the family's Hugging Face tokenizer: `ggml-vocab-llama-bpe.gguf` is
  Llama 3's, `ggml-vocab-qwen2.gguf` the one Qwen2, Qwen2.5 and Qwen3 share;
- test strings for it and the ids Hugging Face's `tokenizers` gave them (`.gguf.inp`, `.gguf.out`,
  cases separated by `__ggml_vocab_test__`);
- the chat templates as the checkpoints ship them (`templates/*.jinja`, fetched from the hub by
  llama.cpp's `scripts/get_chat_template.py`).

`upstream_file(name)` extracts what the tests name, once, into `weights/.downloads/`; the archive
is pinned by the sha256 PyPI publishes for it. Workers of one run share the work under a file lock.
"""

import fcntl
import tarfile
from pathlib import Path

from helpers import REAL_MODEL_DIR

from minillm.fetch.download import pip_download

SDIST = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # as PyPI publishes it
MODELS_FOLDER = "vendor/llama.cpp/models"  # inside the source archive
DOWNLOADS = REAL_MODEL_DIR.parent / ".downloads" / "llama-cpp-python"
EXTRACTED = REAL_MODEL_DIR.parent / ".downloads" / "llama.cpp-models"
# what the tests read, relative to MODELS_FOLDER
FILES = (
    "ggml-vocab-llama-bpe.gguf",
    "ggml-vocab-llama-bpe.gguf.inp",
    "ggml-vocab-llama-bpe.gguf.out",
    "ggml-vocab-qwen2.gguf",
    "ggml-vocab-qwen2.gguf.inp",
    "ggml-vocab-qwen2.gguf.out",
    "ggml-vocab-llama-spm.gguf",
    "templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
    "templates/meta-llama-Llama-3.2-3B-Instruct.jinja",
    "templates/meta-llama-Llama-3.3-70B-Instruct.jinja",
    "templates/Qwen-Qwen2.5-7B-Instruct.jinja",
    "templates/Qwen-Qwen3-0.6B.jinja",
)
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"


def upstream_file(name: str) -> Path:
    """The file `name` (one of FILES) on disk, extracted from the pinned archive if not yet there."""
    if name not in FILES:
        raise KeyError(f"{name} is not one of tests/upstream.py's FILES; add it there")
    target = EXTRACTED / name
    if target.is_file():
        return target
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    with open(DOWNLOADS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be extracting: wait for it
        if not target.is_file():
            _extract_all(pip_download(SDIST, SDIST_SHA256, DOWNLOADS, "sdist"))
    return target


def vocab_cases(gguf_name: str) -> list[tuple[str, list[int]]]:
    """The (text, ids Hugging Face gave) pairs llama.cpp tests the vocabulary `gguf_name` with."""
    # every case ends with the separator, so the last piece of the split is empty
    texts = upstream_file(gguf_name + ".inp").read_text(encoding="utf-8").split(CASE_SEPARATOR)[:-1]
    lines = upstream_file(gguf_name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{gguf_name}: {len(texts)} test strings but {len(lines)} answers"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def _extract_all(archive: Path) -> None:
    """Every one of FILES from the archive into EXTRACTED, each renamed into place when whole."""
    wanted = {f"{MODELS_FOLDER}/{name}": name for name in FILES}
    with tarfile.open(archive) as tar:
        for member in tar:
            relative = member.name.split("/", 1)[-1]  # without the archive's top folder
            if member.isfile() and relative in wanted:
                target = EXTRACTED / wanted[relative]
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(target.name + ".part")
                partial.write_bytes(tar.extractfile(member).read())
                partial.rename(target)
    missing = [name for name in FILES if not (EXTRACTED / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{archive.name} lacks {missing}; delete {DOWNLOADS} and run again")
