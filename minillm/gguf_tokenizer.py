"""A GGUF file's tokenizer, as Hugging Face's `tokenizer.json` and `tokenizer_config.json` would hold it.

llama.cpp's converter keeps a byte-level BPE tokenizer in the GGUF metadata as lists and names:

    tokenizer.ggml.model        "gpt2" for byte-level BPE ("llama" is SentencePiece)
    tokenizer.ggml.pre          which pre-tokenizer the family uses, by name ("llama-bpe", "qwen2", "smollm")
    tokenizer.ggml.tokens       every id's token: vocabulary tokens in GPT-2's byte spelling, added
                                tokens as their text
    tokenizer.ggml.token_type   each id's kind: 1 normal, 3 control, 4 user-defined, 5 unused
    tokenizer.ggml.merges       "a b", best first
    tokenizer.ggml.bos_token_id, eos_token_id, add_bos_token, and tokenizer.chat_template

`tokenizer_json_from_gguf` turns them back into what the files of a Hugging Face checkpoint hold,
as dicts, so the engine reads one format (`minillm/tokenizer_json.py`): a GGUF opened in place
(`gguf_file.py`) hands them to `Tokenizer` as they are, and weights_fetch.py writes them out.
The pre-tokenizer's name becomes the steps Hugging Face's tokenizer.json of that family holds;
a control token becomes a special added token, a user-defined one an added token that text
produces. The fields are outside input: each
is checked for its type and size, and anything unknown is refused in one line.
"""

from __future__ import annotations

import copy
import reprlib
from collections.abc import Mapping

from minillm.config import ConfigError
from minillm.tokenizer_json import MAX_IDS

# Llama 3's pre-tokenizer regex, as its tokenizer.json has it; Qwen2's cuts digits one at a time.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_bytes(pattern: str) -> dict:
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(use_regex=False)]}


def _digits_then_bytes() -> dict:
    digits = {"type": "Digits", "individual_digits": True}
    return {"type": "Sequence", "pretokenizers": [digits, _byte_level(use_regex=True)]}


# tokenizer.ggml.pre -> (normalizer, pre_tokenizer) of the family's tokenizer.json
PRE_TOKENIZERS = {
    "smollm": (None, _digits_then_bytes()),
    "llama-bpe": (None, _split_then_bytes(LLAMA3_PATTERN)),
    "qwen2": ({"type": "NFC"}, _split_then_bytes(QWEN2_PATTERN)),
}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama.cpp's token types
# an added token's options that minillm does not implement, all off
NOT_STRIPPED = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}


def tokenizer_json_from_gguf(fields: Mapping[str, object]) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) as dicts, from a GGUF's metadata (key -> value)."""
    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre")
    if model != "gpt2":
        raise ConfigError(
            f"The GGUF's tokenizer is {reprlib.repr(model)}, not byte-level BPE ('gpt2'); minillm reads "
            "Llama 3, Qwen2/2.5/3 and SmolLM2 tokenizers, not SentencePiece ones (Llama 2, Mistral v0.1)."
        )
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(
            f"The GGUF's pre-tokenizer {reprlib.repr(pre)} is not one minillm knows "
            f"({', '.join(PRE_TOKENIZERS)})."
        )
    tokens = _strings(fields, "tokenizer.ggml.tokens")
    token_types = fields.get("tokenizer.ggml.token_type")
    if not isinstance(token_types, list) or len(token_types) != len(tokens):
        raise ConfigError("The GGUF's tokenizer.ggml.token_type is not one type per token.")
    vocab, added = _vocab_and_added(tokens, token_types)
    merges = [_merge(merge) for merge in _strings(fields, "tokenizer.ggml.merges")]
    normalizer, pre_tokenizer = copy.deepcopy(PRE_TOKENIZERS[pre])  # the caller's to change
    # llama.cpp adds a BOS for the Llama 3 pre-tokenizer unless the file says otherwise
    add_bos = _flag(fields, "tokenizer.ggml.add_bos_token", default=pre == "llama-bpe")
    add_eos = _flag(fields, "tokenizer.ggml.add_eos_token", default=False)
    bos, eos = (_added_text(fields, f"tokenizer.ggml.{name}_token_id", added) for name in ("bos", "eos"))
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _post_processor(bos if add_bos else None, eos if add_eos else None, added),
        "decoder": _byte_level(use_regex=True),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre == "llama-bpe",  # as llama.cpp does for it
            "vocab": vocab,
            "merges": merges,
        },
    }
    return tokenizer_json, _tokenizer_config(bos, eos, fields.get("tokenizer.chat_template"))


def _vocab_and_added(tokens: list[str], token_types: list) -> tuple[dict[str, int], list[dict]]:
    """The vocabulary (normal tokens) and the added tokens (control: special; user-defined: not).

    tokenizers numbers an added token itself: the vocabulary's id for its text, else the next id
    after the vocabulary. So an added token among the vocabulary's ids (SmolLM2's specials are
    0-16) goes into the vocabulary too, as Hugging Face's own files have it; those after it
    (Llama 3's from 128000) are numbered in order. Unused ids have no token: llama.cpp fills a
    vocabulary padded past its tokens with "[PAD<id>]", typed unused (older converters typed them
    user-defined, as the Qwen2 vocabulary file has them)."""
    vocab, added = {}, []
    for token_id, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind == UNUSED or (kind == USER_DEFINED and token == f"[PAD{token_id}]"):
            continue
        if kind not in (NORMAL, CONTROL, USER_DEFINED):
            raise ConfigError(
                f"The GGUF's token {token_id} has type {reprlib.repr(kind)}; byte-level BPE uses types "
                "1 (normal), 3 (control), 4 (user-defined) and 5 (unused)."
            )
        if kind != NORMAL:
            added.append({"id": token_id, "content": token, **NOT_STRIPPED, "special": kind == CONTROL})
        elif vocab.setdefault(token, token_id) != token_id:
            raise ConfigError(f"The GGUF's vocabulary holds the token {reprlib.repr(token)} twice.")
    vocab_end = max(vocab.values(), default=-1) + 1
    for token in added:
        if token["id"] < vocab_end and vocab.setdefault(token["content"], token["id"]) != token["id"]:
            raise ConfigError(f"The GGUF holds the token {reprlib.repr(token['content'])} twice.")
    return vocab, added


def _post_processor(bos: str | None, eos: str | None, added: list[dict]) -> dict:
    """ByteLevel (it adds no token), or Llama 3's TemplateProcessing: BOS, the text, EOS as asked."""
    if bos is None and eos is None:
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    ids = {token["content"]: token["id"] for token in added}

    def special(name: str, type_id: int) -> dict:
        return {"SpecialToken": {"id": name, "type_id": type_id}}

    def template(sequence: str, type_id: int) -> list[dict]:
        middle = {"Sequence": {"id": sequence, "type_id": type_id}}
        return [*([special(bos, type_id)] if bos else []), middle, *([special(eos, type_id)] if eos else [])]

    return {
        "type": "TemplateProcessing",
        "single": template("A", 0),
        "pair": template("A", 0) + template("B", 1),
        "special_tokens": {
            name: {"id": name, "ids": [ids[name]], "tokens": [name]} for name in {bos, eos} - {None}
        },
    }


def _tokenizer_config(bos: str | None, eos: str | None, chat_template: object) -> dict:
    if chat_template is not None and not isinstance(chat_template, str):
        raise ConfigError("The GGUF's tokenizer.chat_template is not a string.")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "clean_up_tokenization_spaces": False,
    }
    return config | ({"chat_template": chat_template} if chat_template is not None else {})


def _strings(fields: Mapping[str, object], key: str) -> list[str]:
    values = fields.get(key)
    if not isinstance(values, list) or not 0 < len(values) <= MAX_IDS:
        raise ConfigError(f"The GGUF's {key} is not a list of 1 to {MAX_IDS} entries.")
    if not all(isinstance(value, str) and value for value in values):
        raise ConfigError(f"The GGUF's {key} holds an entry that is not a non-empty string.")
    return values


def _merge(merge: str) -> list[str]:
    pair = merge.split(" ")
    if len(pair) != 2:
        raise ConfigError(f"The GGUF's merge {reprlib.repr(merge)} is not two tokens joined by a space.")
    return pair


def _flag(fields: Mapping[str, object], key: str, default: bool) -> bool:
    value = fields.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"The GGUF's {key} is {reprlib.repr(value)}, not true or false.")
    return value


def _added_text(fields: Mapping[str, object], key: str, added: list[dict]) -> str | None:
    """The text of the added token whose id `key` names (None where the GGUF names none)."""
    token_id = fields.get(key)
    if token_id is None:
        return None
    text = next((token["content"] for token in added if token["id"] == token_id), None)
    if isinstance(token_id, bool) or text is None:
        raise ConfigError(
            f"The GGUF's {key} {reprlib.repr(token_id)} is not a control or user-defined token."
        )
    return text
