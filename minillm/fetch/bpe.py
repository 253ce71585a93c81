"""A checkpoint's byte-level BPE tokenizer, rewritten as the two files `minillm/tokenizer.py` reads.

tiktoken needs merge *ranks*: the bytes of every token, with the token id as its rank, written to
`tokenizer.tiktoken` (base64 bytes and rank, one per line). Next to it, `tokenizer_config.json`
holds the pre-tokenizer regex, the special tokens and the chat template. Both the GGUF and the
hub's tokenizer.json spell tokens in GPT-2's printable stand-ins for bytes; `bytes_to_unicode`
undoes that.

The regex is the part that is easy to get wrong: SmolLM2 isolates every digit *before* the GPT-2
regex runs, so its pattern is `DIGITS_PATTERN` below, not `GPT2_PATTERN`.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from minillm.fetch import FetchError

# The GPT-2 pre-tokenizer regex (also what HF's ByteLevel pre-tokenizer uses).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 first isolates every digit, then runs the GPT-2 regex on the stretches between digits.
# One regex does both: a digit is a piece of its own, and a run of spaces ends before a digit as it
# would at the end of a stretch (`x =  5` -> 'x', ' =', '  ', '5'; plain GPT-2 gives ' ', ' 5').
DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""


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


def tiktoken_ranks(tokens: list[str], special_ids: set[int], merges: list[str]) -> dict[bytes, int]:
    """Token bytes -> rank, where the rank is the token id.

    tiktoken merges the adjacent pair whose joined bytes have the lowest rank and returns ranks as
    ids, so ids must grow in merge order. Checkpoints made by HF's BPE trainer are laid out that
    way; we check it rather than trust it.
    """
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ids = {tok: i for i, tok in enumerate(tokens)}
    merged_ids = [ids.get(left + right, -1) for left, right in (m.split(" ", 1) for m in merges)]
    if any(b <= a for a, b in zip(merged_ids, merged_ids[1:])) or -1 in merged_ids:
        raise FetchError(
            "This tokenizer's token ids do not follow its merge order; tiktoken cannot represent it."
        )
    ranks = {}
    for i, tok in enumerate(tokens):
        if i not in special_ids:
            ranks[bytes(char_to_byte[c] for c in tok)] = i
    return ranks


def chat_fields(chat_template: str | None) -> dict:
    """Recognize a ChatML template and pull out its default system prompt, if it has one."""
    if not chat_template or "<|im_start|>" not in chat_template:
        return {"chat_format": None, "default_system_prompt": None, "chat_template": chat_template}
    default = re.search(r"<\|im_start\|>system\n([^{}]*?)<\|im_end\|>", chat_template)
    return {
        "chat_format": "chatml",
        "default_system_prompt": default.group(1) if default else None,
        "chat_template": chat_template,
    }


def write_tokenizer(
    out_dir: Path,
    ranks: dict[bytes, int],
    special_tokens: dict[str, int],
    pattern: str,
    eos_token: str,
    chat_template: str | None,
) -> None:
    lines = [
        f"{base64.b64encode(tok).decode()} {rank}"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    (out_dir / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n")
    spec = {
        "vocab_size": len(ranks) + len(special_tokens),
        "pattern": pattern,
        "special_tokens": special_tokens,
        "eos_token": eos_token,
        **chat_fields(chat_template),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(spec, indent=2, ensure_ascii=False))
