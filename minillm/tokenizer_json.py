"""A Hugging Face `tokenizer.json`, read as what tiktoken needs: merge ranks, a regex, added tokens.

A byte-level BPE tokenizer does three things to text. It cuts the text into pieces with a regex
("pre-tokenization": words, runs of digits, punctuation, whitespace), it writes each piece as
bytes, and it glues each piece's adjacent bytes into tokens by the merge rules, the best-ranked
pair first. tokenizer.json spells that pipeline out as parts, and this module reads each one:

    normalizer      null, or NFC (Qwen: "e" + U+0301 becomes "é" before anything else)
    pre_tokenizer   the regex, as one of three layouts (`_pattern`)
    model           BPE: `vocab` (token -> id) and `merges` (pairs, best first)
    added_tokens    strings matched whole before the regex runs, each one token
    post_processor  tokens put around a prompt (Llama 3's <|begin_of_text|>)
    decoder         ByteLevel: ids back to bytes

tiktoken wants one number per token, the *rank*: it merges the adjacent pair whose joined bytes
have the lowest rank. Taking the token id as its rank works when ids grow in merge order (the
token a later merge makes has a larger id), which is how every byte-level family we read was laid
out; we check it rather than trust it. The vocabulary spells bytes in GPT-2's printable stand-ins
(space is "Ġ", newline "Ċ": `bytes_to_unicode`); the ranks are the real bytes.

Added tokens come in two kinds. `special: true` ones are control tokens (`<|im_end|>`): plain
text never produces them, so a user cannot forge the end of a turn by typing it. `special: false`
ones (Qwen3's `<think>`) are words the model should see whole, and text does produce them.

SentencePiece tokenizers saved as tokenizer.json (Llama 2, Mistral v0.1: spaces written as "▁",
a byte with no token written as <0xNN>) are a different algorithm and are refused, as is any part
not listed above: one line that says what was found and what loads.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from pathlib import Path

from minillm.config import ConfigError

# The GPT-2 pre-tokenizer regex: what HF's ByteLevel pre-tokenizer runs when use_regex is true.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 first isolates every digit (a Digits step), then runs the GPT-2 regex on the stretches
# between digits. One regex does both: a digit is a piece of its own, and a run of spaces ends
# before a digit as it would at the end of a stretch (`x =  5` -> 'x', ' =', '  ', '5'; plain
# GPT-2 gives ' ', ' 5').
DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LOADS = "minillm reads byte-level BPE tokenizers (Llama 3, Qwen2/2.5/3, SmolLM2)"
MAX_FILE_BYTES = 128 << 20  # the largest tokenizer.json read (Llama 3's is 9 MB, Gemma 3's 33 MB)
MAX_IDS = 1 << 20  # token ids are below this (the largest vocabularies hold ~262k tokens)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character; vocab files spell tokens with it."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@dataclass(frozen=True)
class AddedToken:
    content: str  # the text it stands for, matched whole
    id: int
    special: bool  # a control token: never produced from plain text


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer.json, checked, in the form tiktoken and `minillm.tokenizer.Tokenizer` take."""

    ranks: dict[bytes, int]  # each vocabulary token's bytes -> its id (added tokens are apart)
    pattern: str  # the pre-tokenizer's regex
    added_tokens: list[AddedToken]
    nfc: bool  # text is put in Unicode NFC before it is cut (the NFC normalizer)
    prompt_prefix: list[int]  # the post-processor's tokens before a prompt (Llama 3's BOS)
    prompt_suffix: list[int]  # and after it
    vocab_size: int  # the highest id + 1


def read_tokenizer_json(path: Path) -> TokenizerSpec:
    """The file at `path`, checked part by part; anything else is one ConfigError line."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is {size} bytes, more than a tokenizer.json holds ({MAX_FILE_BYTES}).")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON; nesting too deep to parse
        raise ConfigError(f"{path} is not valid JSON ({err}); fetch the checkpoint again.") from None
    try:
        return tokenizer_spec(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def tokenizer_spec(raw: object) -> TokenizerSpec:
    """A parsed tokenizer.json as a TokenizerSpec. The small parts are checked first, so a file
    that is refused is refused before its vocabulary is built."""
    raw = _object(raw, "the file")
    model = _object(raw.get("model"), "'model'")
    _refuse_sentencepiece(raw, model)
    nfc = _normalizer(raw.get("normalizer"))
    pattern = _pattern(raw.get("pre_tokenizer"))
    _check_bpe_options(model)
    if _types(raw.get("decoder"), "decoders", "decoder") != ["ByteLevel"]:
        raise _refused("its decoder is not ByteLevel")
    vocab = _vocab(model.get("vocab"))
    _check_merges(model.get("merges"), vocab)
    added = _added_tokens(raw.get("added_tokens", []), nfc)
    _check_added_ids(added, vocab)
    ranks = _ranks(vocab, added)
    if model.get("unk_token") is not None and any(bytes([b]) not in ranks for b in range(256)):
        # tokenizers writes the unknown token for a byte with no token; minillm drops the byte
        raise _refused(f"its unk_token {reprlib.repr(model['unk_token'])} stands for bytes with no token")
    vocab_size = max([*vocab.values(), *(token.id for token in added)]) + 1
    prefix, suffix = _template(raw.get("post_processor"), vocab_size)
    return TokenizerSpec(ranks, pattern, added, nfc, prefix, suffix, vocab_size)


# ----------------------------------------------------------------------------- the parts


def _refuse_sentencepiece(raw: dict, model: dict) -> None:
    """Llama 2 and Mistral v0.1 keep SentencePiece's algorithm inside tokenizer.json: a Unigram
    model, or BPE whose missing bytes fall back to <0xNN> tokens, behind a Metaspace step that
    writes spaces as "▁"."""
    steps = [
        *_types(raw.get("normalizer"), "normalizers", "normalizer"),
        *_types(raw.get("pre_tokenizer"), "pretokenizers", "pre_tokenizer"),
        *_types(raw.get("decoder"), "decoders", "decoder"),
    ]
    if model.get("type") == "Unigram" or model.get("byte_fallback") is True or "Metaspace" in steps:
        raise _refused("it is a SentencePiece tokenizer (as Llama 2's and Mistral v0.1's are)")


def _normalizer(normalizer: object) -> bool:
    """True for NFC, False for none: the two normalizers the families use."""
    types = _types(normalizer, "normalizers", "normalizer")
    if types not in ([], ["NFC"]):
        raise _refused(f"its normalizer {types} is not supported (null and NFC are)")
    return types == ["NFC"]


def _pattern(pre_tokenizer: object) -> str:
    """The regex that cuts text into pieces, from one of three layouts: ByteLevel alone (its own
    regex, GPT-2's), Digits then ByteLevel (SmolLM2), or a Split regex then a ByteLevel that only
    maps bytes (Llama 3, Qwen)."""
    steps = _steps(pre_tokenizer, "pretokenizers", "pre_tokenizer")
    types = [step["type"] for step in steps]
    byte_level = steps[-1] if types and types[-1] == "ByteLevel" else {}
    if byte_level.get("add_prefix_space") is True:
        raise _refused("its ByteLevel step adds a prefix space, which minillm does not implement")
    own_regex = byte_level.get("use_regex", True) is True
    if types == ["ByteLevel"] and own_regex:
        return GPT2_PATTERN
    if types == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") is True and own_regex:
        return DIGITS_PATTERN
    if types == ["Split", "ByteLevel"] and not own_regex:
        split = steps[0]
        regex = split.get("pattern", {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
        if isinstance(regex, str) and split.get("behavior") == "Isolated" and split.get("invert") is False:
            return regex
    raise _refused(
        f"its pre_tokenizer {types} is not one minillm reads: ByteLevel (GPT-2), Digits + ByteLevel "
        "(SmolLM2), or Split (a regex, Isolated) + ByteLevel without its regex (Llama 3, Qwen)"
    )


def _check_bpe_options(model: dict) -> None:
    """The BPE options that change what encode gives, set to what tiktoken does.

    `ignore_merges` may be either. True (Llama 3) means a piece that is a token whole is that
    token, which is what tiktoken does first for every piece. False means the piece is merged
    step by step even then; that gives another answer only where the merges cannot rebuild a token
    of the vocabulary, which the families' tests show does not happen in theirs."""
    if model.get("type") != "BPE":
        raise _refused(f"its model is {reprlib.repr(model.get('type'))}, not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise _refused("its BPE has dropout (random merges), which minillm does not implement")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) not in (None, ""):
            raise _refused(f"its BPE has a {key}, which byte-level BPE does not use")
    if not isinstance(model.get("ignore_merges", False), bool):
        raise _refused("its BPE ignore_merges is not true or false")


def _vocab(vocab: object) -> dict[str, int]:
    """token (in GPT-2's byte spelling) -> id, each id once."""
    if not isinstance(vocab, dict) or not vocab or len(vocab) > MAX_IDS:
        raise _refused(f"its model.vocab is not a map of 1 to {MAX_IDS} tokens to ids")
    if not all(_is_id(i) for i in vocab.values()) or "" in vocab:
        raise _refused(
            f"its model.vocab has an empty token, or an id that is not an integer in [0, {MAX_IDS})"
        )
    if len(set(vocab.values())) != len(vocab):
        raise _refused("two tokens of its model.vocab share an id")
    strangers = set("".join(vocab)) - set(bytes_to_unicode().values())
    if strangers:
        raise _refused(
            f"its vocabulary is not byte-level: it spells tokens with {reprlib.repr(min(strangers))}"
        )
    return vocab


def _check_merges(merges: object, vocab: dict[str, int]) -> None:
    """Each merge joins two tokens into a third, all in the vocabulary, and the ids of the tokens
    merges make never fall in merge order: the id is then the rank tiktoken merges by. (A token
    may be made by several merges in a row: Llama 3's 128k tokens have 280k merges.)"""
    if not isinstance(merges, list):
        raise _refused("its model.merges is not a list")
    previous = -1
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge  # "a b" or ["a", "b"]
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(part, str) for part in pair):
            raise _refused(f"its merge {reprlib.repr(merge)} is neither 'a b' nor ['a', 'b']")
        left, right = pair
        merged = vocab.get(left + right)
        if left not in vocab or right not in vocab or merged is None:
            raise _refused(f"its merge {reprlib.repr(merge)} names a token that is not in the vocabulary")
        if merged < previous:
            raise _refused(
                f"its token ids do not grow in merge order (at {reprlib.repr(merge)}), "
                "so tiktoken cannot rank them"
            )
        previous = merged


def _added_tokens(entries: object, nfc: bool) -> list[AddedToken]:
    if not isinstance(entries, list) or len(entries) > MAX_IDS:
        raise _refused("its added_tokens is not a list")
    tokens = []
    for entry in entries:
        if not (
            isinstance(entry, dict)
            and _is_id(entry.get("id"))
            and isinstance(entry.get("content"), str)
            and entry["content"]
            and isinstance(entry.get("special"), bool)
        ):
            raise _refused(
                f"its added token {reprlib.repr(entry)} lacks an id, a content or special true/false"
            )
        stripping = [key for key in ("lstrip", "rstrip", "single_word") if entry.get(key) is True]
        if stripping:
            raise _refused(
                f"its added token {entry['content']!r} sets {stripping}, which minillm does not implement"
            )
        if nfc and entry.get("normalized") is True:  # matched in normalized text: not implemented
            raise _refused(
                f"its added token {entry['content']!r} is matched after NFC, which minillm does not implement"
            )
        tokens.append(AddedToken(entry["content"], entry["id"], entry["special"]))
    if len({t.id for t in tokens}) != len(tokens) or len({t.content for t in tokens}) != len(tokens):
        raise _refused("two of its added tokens share an id or a content")
    return tokens


def _check_added_ids(added: list[AddedToken], vocab: dict[str, int]) -> None:
    """tokenizers does not take an added token's id from the file: it gives the vocabulary's id to
    a token whose text is in the vocabulary (SmolLM2's specials are ids 0-16 there), and the next
    ids after the vocabulary, in file order, to the others (Llama 3's from 128000). A file whose
    ids say otherwise would be read two ways; it is refused."""
    vocab_ids = set(vocab.values())
    next_id = len(vocab)
    for token in added:
        expected = vocab.get(token.content)
        if expected is None:
            expected, next_id = next_id, next_id + 1
            if expected in vocab_ids:  # the vocabulary skips ids, so the next one is taken
                raise _refused(
                    f"its added token {token.content!r} would get id {expected}, a vocabulary token's"
                )
        if token.id != expected:
            raise _refused(
                f"its added token {token.content!r} has id {token.id}, but tokenizers numbers it "
                f"{expected} (the vocabulary's id for its text, else the next after the vocabulary)"
            )


def _ranks(vocab: dict[str, int], added: list[AddedToken]) -> dict[bytes, int]:
    """token bytes -> id for the vocabulary's tokens, less the added tokens among them: only
    their whole text makes them."""
    added_texts = {token.content for token in added}
    to_byte = str.maketrans({char: chr(byte) for byte, char in bytes_to_unicode().items()})
    return {
        token.translate(to_byte).encode("latin-1"): token_id
        for token, token_id in vocab.items()
        if token not in added_texts
    }


def _template(post_processor: object, vocab_size: int) -> tuple[list[int], list[int]]:
    """The tokens the post-processor puts before and after a prompt: none for ByteLevel (it only
    moves offsets), a TemplateProcessing's "single" template around its sequence "A" otherwise."""
    steps = _steps(post_processor, "processors", "post_processor")
    types = [step["type"] for step in steps]
    if set(types) - {"ByteLevel", "TemplateProcessing"} or types.count("TemplateProcessing") > 1:
        raise _refused(f"its post_processor {types} is not supported (ByteLevel, TemplateProcessing are)")
    if "TemplateProcessing" not in types:
        return [], []
    template = next(step for step in steps if step["type"] == "TemplateProcessing")
    single, named = template.get("single"), template.get("special_tokens")
    if not isinstance(single, list) or not isinstance(named, dict):
        raise _refused("its TemplateProcessing lacks a 'single' template or its special_tokens")
    pieces = [_template_piece(piece, named, vocab_size) for piece in single]
    if pieces.count(None) != 1:
        raise _refused("its TemplateProcessing 'single' template does not hold the sequence A once")
    cut = pieces.index(None)
    return [i for ids in pieces[:cut] for i in ids], [i for ids in pieces[cut + 1 :] for i in ids]


def _template_piece(piece: object, named: dict, vocab_size: int) -> list[int] | None:
    """A template's piece: a special token's ids, or None for the sequence A (the prompt)."""
    if (
        isinstance(piece, dict)
        and isinstance(piece.get("Sequence"), dict)
        and piece["Sequence"].get("id") == "A"
    ):
        return None
    special = piece.get("SpecialToken") if isinstance(piece, dict) else None
    name = special.get("id") if isinstance(special, dict) else None
    entry = named.get(name) if isinstance(name, str) else None
    ids = entry.get("ids") if isinstance(entry, dict) else None
    if not isinstance(ids, list) or not all(_is_id(i) and i < vocab_size for i in ids):
        raise _refused(f"its TemplateProcessing piece {reprlib.repr(piece)} is not a known token nor A")
    return ids


# ----------------------------------------------------------------------------- small checks


def _steps(component: object, steps_key: str, where: str) -> list[dict]:
    """The steps of a normalizer / pre-tokenizer / post-processor / decoder: none for null, itself
    for a single step, the list under `steps_key` for a Sequence; each one has a type."""
    if component is None:
        return []
    component = _object(component, where)
    steps = component.get(steps_key) if component.get("type") == "Sequence" else [component]
    if not isinstance(steps, list) or not all(
        isinstance(step, dict) and isinstance(step.get("type"), str) for step in steps
    ):
        raise _refused(f"its {where} is not a step or a Sequence of steps, each with a type")
    return steps


def _types(component: object, steps_key: str, where: str) -> list[str]:
    return [step["type"] for step in _steps(component, steps_key, where)]


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise _refused(f"{where} is not a JSON object")
    return value


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_IDS


def _refused(problem: str) -> ConfigError:
    return ConfigError(f"{problem}; {LOADS}.")
