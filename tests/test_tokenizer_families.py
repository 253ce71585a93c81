"""minillm reads each byte-level BPE family's tokenizer.json as Hugging Face's `tokenizers` does.

The families' real tokenizers come from llama.cpp's vocabulary files (`tests/upstream.py`): Llama 3's,
and the one Qwen2, Qwen2.5 and Qwen3 share, each with 46 test strings and the ids Hugging Face gave
them. `tokenizer_json_from_gguf` writes each as a tokenizer.json, and then:
(a) `tokenizers` reading that file gives the recorded ids: the file is the family's tokenizer;
(b) minillm gives the ids `tokenizers` gives, on every test string, the texts and hostile strings,
    for each way of encoding (specials as text, with the post-processor's BOS, specials matched),
    and decodes them as it does;
(c) the families: Llama 3 (BOS 128000), Qwen2.5 and Qwen3 (the Qwen2 vocabulary with each one's
    own added tokens, some of them not special), SmolLM2 (the fetched checkpoint);
(d) what minillm does not read (SentencePiece, other pre-tokenizers or normalizers, hostile files)
    is refused in one line.
Reading a family's GGUF takes the `gguf` package ~9 s, so those families are in the slow tier.
"""

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TEXTS_DIR, sentencepiece_tokenizer_json, tiny_gpt2_tokenizer_json
from upstream import upstream_file, vocab_cases

from minillm import tokenizer_json
from minillm.config import ConfigError
from minillm.gguf_tokenizer import tokenizer_json_from_gguf
from minillm.tokenizer import Tokenizer
from minillm.tokenizer_json import LOADS

LLAMA3, QWEN2 = "ggml-vocab-llama-bpe.gguf", "ggml-vocab-qwen2.gguf"
# Qwen2.5's added tokens from 151643, as its tokenizer.json lists them: special ones, then not
QWEN25_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
QWEN25_PLAIN = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
QWEN3_PLAIN = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # Qwen3's, from 151665
QWEN_MODEL_ROWS = 151936  # Qwen's config.json vocab_size: its embedding is padded past the tokens
HOSTILE = [
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "café Ångström naïve",
    "cafe\u0301 A\u030angstro\u0308m nai\u0308ve",  # the same, decomposed (NFD)
    "e\u0327\u0301 d\u0307\u0323: combining marks out of canonical order",
    " " * 37 + "x" + " " * 5,
    "\t\ttabs\r\nand\r\n\r\n  CR LF\n\n\n  ",
    "1234567890 12 123 1234 12345 ١٢٣٤ ①② x =  5",
    "don't WE'LL they'RE I'M",
    "<|im_end|> <|im_start|>user\nhi<|endoftext|>",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nhi<|eot_id|>",
    "<think>reasoning</think> <tool_call>{}</tool_call> <|fim_prefix|>def",
    "<|im_end|>\u0338 and <think>\u0301",  # a combining mark right after a token's text
    "<|im_end <think <|im_end| <<think>>",
    "a" * 300,
    "",
]


@dataclass
class Family:
    name: str
    ours: Tokenizer
    theirs: object  # tokenizers.Tokenizer over the same tokenizer.json


def gguf_tokenizer_json(name: str) -> tuple[dict, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(upstream_file(name))
    return tokenizer_json_from_gguf({key: field.contents() for key, field in reader.fields.items()})


@pytest.fixture(scope="module")
def llama3_files():
    return gguf_tokenizer_json(LLAMA3)


@pytest.fixture(scope="module")
def qwen2_files():
    return gguf_tokenizer_json(QWEN2)


def added_tokens(contents: list[str], first_id: int, special: bool) -> list[dict]:
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    return [{"id": first_id + i, "content": c, **flags, "special": special} for i, c in enumerate(contents)]


def qwen_files(qwen2_files, plain_from_qwen3: list[str]) -> tuple[dict, dict]:
    """The Qwen2 vocabulary with Qwen2.5's added tokens (and Qwen3's after them)."""
    tokenizer, _ = qwen2_files
    added = added_tokens(QWEN25_SPECIAL, 151643, True) + added_tokens(QWEN25_PLAIN, 151657, False)
    added += added_tokens(plain_from_qwen3, 151665, False)
    return {**tokenizer, "added_tokens": added}, {"eos_token": "<|im_end|>", "bos_token": None}


def write_folder(folder: Path, files: tuple[dict, dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in zip(("tokenizer.json", "tokenizer_config.json"), files):
        (folder / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    return folder


FAMILIES = [
    pytest.param("SmolLM2", marks=pytest.mark.real_model),
    pytest.param("Llama 3", marks=pytest.mark.slow),
    pytest.param("Qwen2.5", marks=pytest.mark.slow),
    pytest.param("Qwen3", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    from tokenizers import Tokenizer as HFTokenizer

    if request.param == "SmolLM2":  # the checkpoint the fetch wrote
        folder = request.getfixturevalue("real_dir")
    else:
        files = {
            "Llama 3": lambda: request.getfixturevalue("llama3_files"),
            "Qwen2.5": lambda: qwen_files(request.getfixturevalue("qwen2_files"), []),
            "Qwen3": lambda: qwen_files(request.getfixturevalue("qwen2_files"), QWEN3_PLAIN),
        }[request.param]()
        folder = write_folder(tmp_path_factory.mktemp("family"), files)
    return Family(request.param, Tokenizer(folder), HFTokenizer.from_file(str(folder / "tokenizer.json")))


def strings_to_encode() -> list[str]:
    """The families' 46 test strings each, the texts in pieces of 1000 characters (their first
    20k), and the hostile strings."""
    cases = [text for name in (LLAMA3, QWEN2) for text, _ in vocab_cases(name)]
    texts = [path.read_text(encoding="utf-8")[:20_000] for path in sorted(TEXTS_DIR.glob("*.txt"))]
    return cases + [text[i : i + 1000] for text in texts for i in range(0, len(text), 1000)] + HOSTILE


# ----------------------------------------------------------------------------- (a) the files


@pytest.mark.slow  # reads both GGUF files (~20 s)
@pytest.mark.parametrize("gguf_name", [LLAMA3, QWEN2])
def test_the_written_tokenizer_json_is_the_familys_tokenizer(gguf_name, request):
    from tokenizers import Tokenizer as HFTokenizer

    fixture = "llama3_files" if gguf_name == LLAMA3 else "qwen2_files"
    theirs = HFTokenizer.from_str(json.dumps(request.getfixturevalue(fixture)[0]))
    cases = vocab_cases(gguf_name)
    wrong = [(text, ids) for text, ids in cases if theirs.encode(text, add_special_tokens=False).ids != ids]
    assert len(cases) == 46 and not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[:1]}"


# ----------------------------------------------------------------------------- (b) the same ids


ENCODINGS = {  # minillm's method -> how tokenizers is asked for the same
    "encode": {"encode_special_tokens": True, "add_special_tokens": False},
    "encode_prompt": {"encode_special_tokens": True, "add_special_tokens": True},
    "encode_with_special_tokens": {"encode_special_tokens": False, "add_special_tokens": False},
}


@pytest.mark.parametrize("method", list(ENCODINGS))
def test_encodes_every_string_as_tokenizers_does(family, method):
    how = ENCODINGS[method]
    family.theirs.encode_special_tokens = how["encode_special_tokens"]
    strings = strings_to_encode()
    wrong = [
        text
        for text in strings
        if getattr(family.ours, method)(text)
        != family.theirs.encode(text, add_special_tokens=how["add_special_tokens"]).ids
    ]
    assert not wrong, f"{family.name}: {len(wrong)} of {len(strings)} differ, first: {wrong[0]!r}"


def test_decodes_as_tokenizers_does_and_gives_the_text_back(family):
    """Back to the text (in NFC where the tokenizer normalizes to NFC), and to what `tokenizers`
    decodes, special tokens included."""
    nfc = family.name.startswith("Qwen")
    for text in strings_to_encode():
        ids = family.ours.encode_with_special_tokens(text)
        assert family.ours.decode(ids) == family.theirs.decode(ids, skip_special_tokens=False)
        assert family.ours.decode(family.ours.encode(text)) == (
            unicodedata.normalize("NFC", text) if nfc else text
        )


def test_stream_decoding_gives_the_same_text(family):
    text = "".join(HOSTILE)
    stream = family.ours.stream_decoder()
    ids = family.ours.encode_with_special_tokens(text)
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == family.ours.decode(ids)


# ----------------------------------------------------------------------------- (c) the families


def test_the_families_control_tokens_and_bos(family):
    """Llama 3 puts <|begin_of_text|> before a prompt, the others nothing; a special token's text
    is text to `encode`; Qwen3's <think> is not special, so `encode` makes it."""
    ours = family.ours
    assert ours.encode_prompt("hi") == [*({"Llama 3": [128000]}.get(family.name, [])), *ours.encode("hi")]
    end = {"Llama 3": "<|eot_id|>"}.get(family.name, "<|im_end|>")
    assert ours.encode_with_special_tokens(end) == [ours.special_tokens[end]]
    assert ours.special_tokens[end] not in ours.encode(end)
    if family.name == "Qwen3":
        assert ours.encode("<think>") == [151667] and "<think>" not in ours.special_tokens
        assert [t for t in range(151643, 151669) if t in ours.special_tokens.values()] == list(
            range(151643, 151657)
        )


@pytest.mark.slow  # reads the Qwen2 GGUF (~9 s)
def test_ids_past_the_tokenizer_decode_to_nothing_as_in_tokenizers(qwen2_files, tmp_path):
    """Qwen2.5 has 151665 tokens and 151936 embedding rows: a sampled id past the tokens is no
    text, not a crash."""
    from tokenizers import Tokenizer as HFTokenizer

    files = qwen_files(qwen2_files, [])
    ours = Tokenizer(write_folder(tmp_path, files))
    theirs = HFTokenizer.from_str(json.dumps(files[0]))
    past = [151665, 151700, QWEN_MODEL_ROWS - 1]
    hello = ours.encode("hello")
    assert ours.vocab_size == 151665
    assert ours.decode([*hello, *past]) == theirs.decode([*hello, *past]) == "hello"
    assert [ours.token_bytes(i) for i in past] == [b""] * 3
    stream = ours.stream_decoder()
    assert "".join(stream.feed(i) for i in [*hello, *past]) + stream.flush() == "hello"


# ----------------------------------------------------------------------------- (d) refusals


def test_the_gpt2_layout_encodes_as_tokenizers_does(tmp_path):
    """ByteLevel with its own regex, the third pre-tokenizer layout, on a tiny vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer

    tiny = tiny_gpt2_tokenizer_json()
    ours = Tokenizer(write_folder(tmp_path, (tiny, {"eos_token": "<|end|>"})))
    theirs = HFTokenizer.from_str(json.dumps(tiny))
    for text in ["the theme, then <|end|> the", *HOSTILE]:
        assert ours.encode_with_special_tokens(text) == theirs.encode(text).ids
    assert ours.eos_token_id == 259


def changed(change) -> dict:
    tiny = tiny_gpt2_tokenizer_json()
    change(tiny)
    return tiny


def without_byte_zero(tokenizer: dict) -> None:
    """No token for the byte 0, and an unknown token to stand for it, as `tokenizers` would."""
    vocab = tokenizer["model"]["vocab"]  # ids 1..258 become 0..257: the byte 0 (id 0) is gone
    tokenizer["model"]["vocab"] = {token: token_id - 1 for token, token_id in vocab.items() if token_id}
    tokenizer["added_tokens"][0]["id"] = 258  # the next id after the vocabulary, as tokenizers numbers it
    tokenizer["model"]["unk_token"] = "<|end|>"


def split_by(regex: str):
    """A change that makes the pre-tokenizer Llama 3's layout around `regex`."""
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    layout = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    return lambda tokenizer: tokenizer.update(pre_tokenizer=layout)


def template_of(name: str) -> dict:
    """A TemplateProcessing that puts the special token `name` before the text."""
    bos = {"SpecialToken": {"id": name, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {},
    }


REFUSED = {  # what the file is -> (its tokenizer.json, words the one line must hold)
    "Llama 2 (SentencePiece)": (sentencepiece_tokenizer_json(), "SentencePiece"),
    "Mistral (Metaspace)": (
        changed(lambda t: t.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁"})),
        "SentencePiece",
    ),
    "a Unigram model": (changed(lambda t: t["model"].update(type="Unigram")), "SentencePiece"),
    "a WordPiece model": (changed(lambda t: t["model"].update(type="WordPiece")), "not BPE"),
    "another pre-tokenizer": (
        changed(lambda t: t.update(pre_tokenizer={"type": "Whitespace"})),
        "pre_tokenizer",
    ),
    "a prefix space": (
        changed(lambda t: t["pre_tokenizer"].update(add_prefix_space=True)),
        "prefix space",
    ),
    "NFKC": (changed(lambda t: t.update(normalizer={"type": "NFKC"})), "normalizer"),
    "lowercasing": (changed(lambda t: t.update(normalizer={"type": "Lowercase"})), "normalizer"),
    "no ByteLevel decoder": (changed(lambda t: t.update(decoder=None)), "decoder"),
    "an lstrip token": (changed(lambda t: t["added_tokens"][0].update(lstrip=True)), "lstrip"),
    "an added token's id": (changed(lambda t: t["added_tokens"][0].update(id=300)), "numbers it"),
    "two ids alike": (changed(lambda t: t["model"]["vocab"].update(he=256)), "share an id"),
    "an absurd id": (changed(lambda t: t["model"]["vocab"].update(he=10**12)), "not an integer"),
    "a token off the byte alphabet": (
        changed(lambda t: t["model"]["vocab"].update({" x": 260})),
        "not byte-level",
    ),
    "a merge of an unknown token": (
        changed(lambda t: t["model"]["merges"].append("q zz")),
        "not in the vocabulary",
    ),
    "merges out of order": (changed(lambda t: t["model"]["merges"].reverse()), "merge order"),
    "a malformed merge": (changed(lambda t: t["model"]["merges"].append(["a", "b", "c"])), "neither"),
    "vocab as a list": (changed(lambda t: t["model"].update(vocab=["a", "b"])), "model.vocab"),
    "no model": (changed(lambda t: t.pop("model")), "'model'"),
    "a bad regex": (changed(split_by("([")), "regex"),
    "a regex that leaves text out": (changed(split_by(r"(a+)+(?=b)")), "pieces that cover it"),
    "a regex that matches empty pieces": (changed(split_by("(?:)")), "pieces that cover it"),
    "a top-level list": ([1, 2], "not a JSON object"),
    "dropout": (changed(lambda t: t["model"].update(dropout=0.1)), "dropout"),
    "a subword prefix": (
        changed(lambda t: t["model"].update(continuing_subword_prefix="##")),
        "continuing_subword_prefix",
    ),
    "a normalized token under NFC": (
        changed(
            lambda t: (t.update(normalizer={"type": "NFC"}), t["added_tokens"][0].update(normalized=True))
        ),
        "after NFC",
    ),
    "an unknown token for missing bytes": (changed(without_byte_zero), "unk_token"),
    "an added token on a vocabulary token's id": (
        changed(lambda t: (t["model"]["vocab"].pop(chr(256)), t["added_tokens"][0].update(id=258))),
        "a vocabulary token's",
    ),
    "a template of an unknown token": (
        changed(lambda t: t.update(post_processor=template_of("<|nope|>"))),
        "TemplateProcessing",
    ),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_what_minillm_does_not_read_is_refused_in_one_line(kind, tmp_path):
    content, words = REFUSED[kind]
    (tmp_path / "tokenizer.json").write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        Tokenizer(tmp_path)
    message = str(refused.value)
    assert words in message and LOADS in message and "\n" not in message and len(message) < 400, message


def test_text_the_regex_engine_gives_up_on_fails_alone_in_one_line(real_dir):
    """tiktoken's regex engine gives up on a run of a million spaces (`tokenizers` does not) with a
    Rust panic, a BaseException no `except Exception` catches: a ValueError line instead, and the
    tokenizer goes on."""
    tokenizer = Tokenizer(real_dir)
    with pytest.raises(ValueError, match="shorten its long runs of spaces") as refused:
        tokenizer.encode("x" + " " * 1_000_000 + "x")
    assert "\n" not in str(refused.value)
    text = "still " + " " * 1000 + "here"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_the_sentencepiece_file_is_a_tokenizer_tokenizers_reads():
    """The refusal above is of a real SentencePiece layout: `tokenizers` reads it, and falls back
    to <0xNN> byte tokens where it has no token (é is <0xC3><0xA9>)."""
    from tokenizers import Tokenizer as HFTokenizer

    theirs = HFTokenizer.from_str(json.dumps(sentencepiece_tokenizer_json()))
    encoding = theirs.encode("the é")
    assert encoding.tokens == ["<s>", "▁the", "▁", "<0xC3>", "<0xA9>"]
    assert theirs.decode(encoding.ids) == "the é"


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"model": {"type": "BPE", "vocab": {', "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'{"model": "\xff\xfe"}', "not valid JSON"),
    ],
    ids=["cut short", "nested too deep", "not UTF-8"],
)
def test_a_file_that_is_not_json_is_refused_in_one_line(content, words, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ConfigError, match=words) as refused:
        Tokenizer(tmp_path)
    assert "\n" not in str(refused.value)


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_json, "MAX_FILE_BYTES", 1000)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tiny_gpt2_tokenizer_json()))
    with pytest.raises(ConfigError, match="more than a tokenizer.json holds"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize(
    "config, words",
    [
        ({"eos_token": "<|nope|>"}, "not one token"),
        ({"eos_token": 7}, "not a token's text"),
        ({"chat_template": 7}, "chat_template"),
        ([], "not a JSON object"),
        ({"bos_token": {"special": True}}, "bos_token is {'special': True}, not a token's text"),
        ({"chat_template": [{"name": "tool_use", "template": "B"}]}, 'none named "default"'),
        ({"chat_template": [{"name": ["default"], "template": "B"}]}, 'none named "default"'),
    ],
)
def test_a_bad_tokenizer_config_is_refused_in_one_line(config, words, tmp_path):
    write_folder(tmp_path, (tiny_gpt2_tokenizer_json(), config))
    with pytest.raises(ConfigError, match=re.escape(words)) as refused:
        Tokenizer(tmp_path)
    assert "\n" not in str(refused.value)


# ----------------------------------------------------------------------------- GGUF fields


def test_a_sentencepiece_gguf_is_refused_in_one_line():
    """Llama 2's vocabulary file, as llama.cpp ships it (tokenizer model "llama")."""
    from gguf import GGUFReader

    reader = GGUFReader(upstream_file("ggml-vocab-llama-spm.gguf"))
    with pytest.raises(ConfigError, match="SentencePiece") as refused:
        tokenizer_json_from_gguf({key: field.contents() for key, field in reader.fields.items()})
    assert "\n" not in str(refused.value)


def tiny_gguf_fields() -> dict:
    """A GGUF's tokenizer fields for tiny_gpt2_tokenizer_json's vocabulary, with SmolLM2's layout."""
    tiny = tiny_gpt2_tokenizer_json()
    tokens = sorted(tiny["model"]["vocab"], key=tiny["model"]["vocab"].get) + ["<|end|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": tiny["model"]["merges"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


def test_gguf_fields_become_a_tokenizer_json_tokenizers_and_minillm_read_alike(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    files = tokenizer_json_from_gguf(tiny_gguf_fields())
    ours, theirs = Tokenizer(write_folder(tmp_path, files)), HFTokenizer.from_str(json.dumps(files[0]))
    for text in ["the theme, then <|end|> 12 the", *HOSTILE]:
        assert ours.encode_with_special_tokens(text) == theirs.encode(text).ids
    assert (ours.eos_token, ours.eos_token_id) == ("<|end|>", 259)


def changed_fields(key: str, value) -> dict:
    return {**tiny_gguf_fields(), key: value}


GGUF_REFUSED = {
    "an unknown pre-tokenizer": (changed_fields("tokenizer.ggml.pre", "deepseek-llm"), "pre-tokenizer"),
    "types not one per token": (changed_fields("tokenizer.ggml.token_type", [1, 1]), "one type per token"),
    "a byte token (SentencePiece's)": (changed_fields("tokenizer.ggml.token_type", [6] * 260), "has type 6"),
    "a token that is not a string": (
        changed_fields("tokenizer.ggml.tokens", [b"x"] * 260),
        "non-empty string",
    ),
    "tokens not a list": (changed_fields("tokenizer.ggml.tokens", "abc"), "not a list"),
    "a merge without a space": (changed_fields("tokenizer.ggml.merges", ["Ġt"]), "two tokens"),
    "add_bos_token a string": (changed_fields("tokenizer.ggml.add_bos_token", "yes"), "true or false"),
    "eos a normal token": (changed_fields("tokenizer.ggml.eos_token_id", 5), "control or user-defined"),
    "a token twice": (changed_fields("tokenizer.ggml.tokens", ["a"] * 259 + ["<|end|>"]), "twice"),
    "a chat template that is not text": (changed_fields("tokenizer.chat_template", 7), "chat_template"),
}


@pytest.mark.parametrize("kind", list(GGUF_REFUSED))
def test_gguf_fields_minillm_does_not_read_are_refused_in_one_line(kind):
    fields, words = GGUF_REFUSED[kind]
    with pytest.raises(ConfigError, match=re.escape(words)) as refused:
        tokenizer_json_from_gguf(fields)
    assert "\n" not in str(refused.value)
