"""Text <-> token ids with tiktoken; a conversation through the checkpoint's chat template.

A byte-level BPE tokenizer is two things: a regex that cuts text into pieces ("pre-tokenization"),
and merge ranks that glue each piece's bytes into tokens, lowest rank first. tiktoken does both
in Rust, given the ranks and the regex; `weights_fetch.py` writes them from the checkpoint
(`minillm/fetch/bpe.py`): `tokenizer.tiktoken` (base64 token bytes and rank, one per line) and
`tokenizer_config.json` (regex, special tokens, chat template; `minillm/chat_template.py` runs
the template).

Two traps of SmolLM2's tokenizer live in that data, not in this code:
- its pre-tokenizer isolates every digit *before* the GPT-2 regex runs, so its regex is the GPT-2
  one rewritten to treat a digit as a piece boundary (`DIGITS_PATTERN` in `minillm/fetch/bpe.py`);
- 21 single bytes (mostly control characters) have no token. tiktoken needs every byte to have a
  rank, so they get ranks past the vocabulary, and `encode` drops them afterwards — exactly what
  the upstream tokenizer does with a character it cannot encode.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from minillm.chat_template import ChatTemplate
from minillm.config import FETCH_HINT, ConfigError

RANKS_FILE = "tokenizer.tiktoken"
CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        if not (model_dir / RANKS_FILE).is_file() or not (model_dir / CONFIG_FILE).is_file():
            raise ConfigError(
                f"Tokenizer files missing in {model_dir} ({RANKS_FILE}, {CONFIG_FILE}) — {FETCH_HINT}"
            )
        spec = json.loads((model_dir / CONFIG_FILE).read_text())
        ranks = load_tiktoken_bpe(str(model_dir / RANKS_FILE))
        self.ranks: dict[bytes, int] = dict(ranks)  # the vocabulary's tokens (bytes -> id), as written
        self.pattern: str = spec["pattern"]  # the pre-tokenizer's regex
        self.vocab_size: int = spec["vocab_size"]
        self.special_tokens: dict[str, int] = spec["special_tokens"]
        self.eos_token_id: int = self.special_tokens[spec["eos_token"]]
        self.chat_template: str | None = spec.get("chat_template")  # Jinja source (chat_template.py)
        for byte in range(256):  # bytes without a token: ranks past the vocabulary, dropped by encode
            ranks.setdefault(bytes([byte]), self.vocab_size + byte)
        self.encoding = tiktoken.Encoding(
            name=model_dir.name,
            pat_str=self.pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.template = self._compiled_template()

    def _compiled_template(self) -> ChatTemplate | None:
        """The chat template, compiled at load: a broken one is reported now, not mid-chat."""
        if not self.chat_template:
            return None
        token_names = {name: getattr(self, name, None) for name in ("bos_token", "eos_token")}
        return ChatTemplate(self.chat_template, self.special_tokens, token_names)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids. Special-token strings in the text are encoded as text, never as
        control tokens: a user cannot forge `<|im_end|>` by typing it."""
        ids = self.encoding.encode_ordinary(text)
        return [i for i in ids if i < self.vocab_size]

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Text to ids where each special-token string is that token (`<|im_end|>` -> 2), as Hugging
        Face's tokenizers read text: for a client that renders the chat template itself."""
        ids = self.encoding.encode(text, allowed_special="all")
        return [i for i in ids if i < self.vocab_size]

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (part of a character, for some): what the API's logprobs report."""
        return self.encoding.decode_single_token_bytes(token_id)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def encode_chat(
        self, messages: list[dict], /, add_generation_prompt: bool = True, **template_vars
    ) -> list[int]:
        """The conversation laid out by the checkpoint's own chat template, as ids: the special
        tokens the template writes are tokens, the same strings in a message are text.
        `template_vars` reach the template as variables (Qwen3's `enable_thinking=False`)."""
        if self.template is None:
            raise ConfigError("This checkpoint has no chat template; use `minillm generate` without --chat.")
        return self.template.encode(messages, self.encode, add_generation_prompt, **template_vars)


class StreamDecoder:
    """Turns a stream of ids into a stream of text. One character may span several tokens (an
    emoji is 4 bytes, often 2 tokens), so bytes wait here until they form whole characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self.utf8.decode(self.tokenizer.encoding.decode_single_token_bytes(token_id))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
