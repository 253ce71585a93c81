"""Text <-> token ids: a Hugging Face tokenizer.json, run by tiktoken; a conversation through the
checkpoint's chat template.

A checkpoint folder holds its tokenizer as Hugging Face saves it: `tokenizer.json` (the vocabulary,
merges, pre-tokenizer regex and added tokens), `tokenizer_config.json` (bos and eos tokens, the
chat template) and, as transformers 5 writes it, `chat_template.jinja`. A user's own Hugging Face
folder works as it is, and so does a llama.cpp GGUF file, whose tokenizer metadata
`gguf_file.py` reads as those files' contents. `minillm/tokenizer_json.py` reads tokenizer.json and
says what each part means; here its ranks and regex become a tiktoken encoder, which cuts and merges in Rust.
`encode_chat` lays a conversation out with the chat template (`minillm/chat_template.py` runs it).

What tiktoken does not do is done around it:
- added tokens (`<|im_end|>`, Qwen3's `<think>`) are cut out of the text first, longest first, as
  `tokenizers` does; the stretches between them are normalized (NFC, for Qwen) and encoded;
- a byte with no token (21 in SmolLM2, mostly control characters) has no rank, but tiktoken needs
  every byte to have one: it gets a rank past the vocabulary, and `encode` drops it afterwards,
  exactly what the upstream tokenizer does with a character it cannot encode;
- a model may have more ids than its tokenizer (Qwen pads 151665 tokens to 151936 rows): an id
  with no token decodes to nothing, as `tokenizers` skips it.
"""

from __future__ import annotations

import codecs
import json
import re
import reprlib
import unicodedata
from pathlib import Path

import tiktoken

from minillm.chat_template import ChatTemplate
from minillm.config import FETCH_HINT, ConfigError, is_gguf
from minillm.tokenizer_json import LOADS, AddedToken, TokenizerSpec, read_tokenizer_json, tokenizer_spec

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
REGEX_PROBE = "Hello, world! It's 12:30.\n\tcafé 😀  x"  # text every pre-tokenizer regex must cover


class Tokenizer:
    def __init__(self, model_path: str | Path):
        """The tokenizer of a checkpoint folder (its files) or of a GGUF file (its metadata, read as
        the same two dicts in `gguf_file.py`); both are built by `_build`."""
        model_path = Path(model_path)
        if is_gguf(model_path):
            from minillm.gguf_file import gguf_tokenizer_files, open_gguf

            tokenizer_json, config = gguf_tokenizer_files(open_gguf(model_path))
            try:
                spec = tokenizer_spec(tokenizer_json)
            except ConfigError as err:
                raise ConfigError(f"{model_path}: {err}") from None
            self._build(spec, config, model_path, model_path)
            return
        if not (model_path / TOKENIZER_FILE).is_file():
            raise ConfigError(f"No {TOKENIZER_FILE} in {model_path} — {FETCH_HINT}")
        config = _read_config(model_path)
        if (model_path / TEMPLATE_FILE).is_file():  # transformers 5 saves the template so; it wins
            config["chat_template"] = _read_template(model_path / TEMPLATE_FILE)
        self._build(
            read_tokenizer_json(model_path / TOKENIZER_FILE), config, model_path, model_path / CONFIG_FILE
        )

    def _build(self, spec: TokenizerSpec, config: dict, model_path: Path, config_where: Path) -> None:
        """The tokenizer from tokenizer.json's spec and tokenizer_config.json's dict; `config_where`
        names where the latter came from, for errors."""
        self.ranks: dict[bytes, int] = spec.ranks  # the vocabulary's tokens (bytes -> id)
        self.pattern: str = spec.pattern  # the pre-tokenizer's regex
        self.vocab_size: int = spec.vocab_size  # ids the tokenizer knows (the model may have more)
        self.prompt_prefix, self.prompt_suffix = spec.prompt_prefix, spec.prompt_suffix
        self.special_tokens: dict[str, int] = {t.content: t.id for t in spec.added_tokens if t.special}
        self._nfc = spec.nfc
        self._added: dict[str, AddedToken] = {token.content: token for token in spec.added_tokens}
        # one alternation, longest first: at each place the longest added token wins, as in tokenizers
        by_length = sorted(self._added, key=len, reverse=True)
        self._added_regex = re.compile("(" + "|".join(map(re.escape, by_length)) + ")") if by_length else None
        self._bytes_of = {i: b for b, i in spec.ranks.items()} | {
            token.id: token.content.encode() for token in spec.added_tokens
        }
        self.encoding = _encoder(model_path, spec.ranks, spec.pattern, spec.vocab_size)
        self.bos_token: str | None = _token_name(config, "bos_token", config_where)
        self.eos_token: str | None = _token_name(config, "eos_token", config_where)
        self.eos_token_id: int | None = self._token_id(self.eos_token, config_where)
        self.chat_template: str | None = _chat_template(
            config, config_where
        )  # Jinja source (chat_template.py)
        self.template = self._compiled_template()

    def _compiled_template(self) -> ChatTemplate | None:
        """The chat template, compiled at load: a broken one is reported now, not mid-chat."""
        if not self.chat_template:
            return None
        token_names = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return ChatTemplate(self.chat_template, self.special_tokens, token_names)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids. Special-token strings in the text are encoded as text, never as
        control tokens: a user cannot forge `<|im_end|>` by typing it. Added tokens that are not
        special (Qwen3's `<think>`) are matched, as Hugging Face's tokenizers match them."""
        return self._encode(text, control_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A plain-text prompt as the model's input: `encode`, inside the tokens the post-processor
        adds (Llama 3's <|begin_of_text|>; nothing for Qwen or SmolLM2)."""
        return [*self.prompt_prefix, *self.encode(text), *self.prompt_suffix]

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Text to ids where each special-token string is that token (`<|im_end|>` -> 2), as Hugging
        Face's tokenizers read text: for a client that renders the chat template itself."""
        return self._encode(text, control_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._bytes_of.get(i, b"") for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (part of a character, for some): what the API's logprobs report."""
        return self._bytes_of.get(token_id, b"")

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

    def _encode(self, text: str, control_tokens: bool) -> list[int]:
        """The added tokens cut out first; a special one found where control tokens are not
        allowed stays text, and joins the text around it (tokenizers' encode_special_tokens)."""
        pieces = self._added_regex.split(text) if self._added_regex else [text]  # text, token, text, ...
        ids: list[int] = []
        plain: list[str] = []  # text since the last token
        for index, piece in enumerate(pieces):
            token = self._added[piece] if index % 2 else None
            if token is None or (token.special and not control_tokens):
                plain.append(piece)
            else:
                ids += [*self._encode_plain("".join(plain)), token.id]
                plain = []
        return ids + self._encode_plain("".join(plain))

    def _encode_plain(self, text: str) -> list[int]:
        if self._nfc:
            text = unicodedata.normalize("NFC", text)
        return [i for i in _encode_ordinary(self.encoding, text) if i < self.vocab_size]

    def _token_id(self, name: str | None, config_where: Path) -> int | None:
        """The id of the token `name` (an added token, or one of the vocabulary), None for None."""
        if name is None:
            return None
        token_id = self._added[name].id if name in self._added else self.ranks.get(name.encode())
        if token_id is None:
            raise ConfigError(f"{config_where} names {name!r}, which is not one token of {TOKENIZER_FILE}.")
        return token_id


class StreamDecoder:
    """Turns a stream of ids into a stream of text. One character may span several tokens (an
    emoji is 4 bytes, often 2 tokens), so bytes wait here until they form whole characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self.utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


def end_of_sequence(config_eos_token_ids: tuple[int, ...], tokenizer: Tokenizer | None) -> frozenset[int]:
    """The tokens where generation stops, any of them: the checkpoint's own (config.json's
    eos_token_id, one id or a list, with generation_config.json's), which win (the model was trained
    to end there); else the tokenizer's eos (tokenizer_config.json); else none."""
    if config_eos_token_ids or tokenizer is None or tokenizer.eos_token_id is None:
        return frozenset(config_eos_token_ids)
    return frozenset({tokenizer.eos_token_id})


def _encoder(model_path: Path, ranks: dict[bytes, int], pattern: str, vocab_size: int) -> tiktoken.Encoding:
    """tiktoken over the vocabulary's ranks; a byte with no token gets a rank past the vocabulary
    (tiktoken needs one for every byte), and `encode` drops what it gives."""
    every_byte = dict(ranks)
    for byte in range(256):
        every_byte.setdefault(bytes([byte]), vocab_size + byte)
    try:
        encoding = tiktoken.Encoding(
            name=model_path.name, pat_str=pattern, mergeable_ranks=every_byte, special_tokens={}
        )
    except ValueError as err:  # the regex did not compile
        raise ConfigError(
            f"{_tokenizer_where(model_path)}: its pre-tokenizer regex is not one tiktoken reads "
            f"({err}); {LOADS}."
        ) from None
    try:  # tiktoken drops the text no piece covers, and gives up on a regex that matches ""
        covered = encoding.decode(_encode_ordinary(encoding, REGEX_PROBE)) == REGEX_PROBE
    except ValueError:
        covered = False
    if not covered:
        raise ConfigError(
            f"{_tokenizer_where(model_path)}: its pre-tokenizer regex does not cut plain text into "
            f"pieces that cover it; {LOADS}."
        )
    return encoding


def _tokenizer_where(model_path: Path) -> Path:
    """Where the tokenizer was read: tokenizer.json of a folder, or the GGUF file itself."""
    return model_path if is_gguf(model_path) else model_path / TOKENIZER_FILE


def _encode_ordinary(encoding: tiktoken.Encoding, text: str) -> list[int]:
    """tiktoken's encode. Its regex engine gives up on some texts (a run of about a million
    spaces, with every family's regex) and says so with a Rust panic, which Python raises as a
    BaseException that passes every `except Exception`: here it is one ValueError line instead,
    so the text fails alone (a 400 from the server, an error line from the CLI)."""
    try:
        return encoding.encode_ordinary(text)
    except BaseException as err:
        if type(err).__name__ != "PanicException":  # pyo3's; its module cannot be imported
            raise
        raise ValueError(
            f"The tokenizer's regex gave up on this text of {len(text):,} characters; shorten its "
            "long runs of spaces."
        ) from None


def _read_config(model_dir: Path) -> dict:
    """tokenizer_config.json as a dict ({} when the folder has none)."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); fetch the checkpoint again.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object; fetch the checkpoint again.")
    return config


def _token_name(config: dict, key: str, where: Path) -> str | None:
    """`bos_token` or `eos_token`: a string, or {"content": string} as transformers writes it."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content", value)  # without "content" it is refused below, not dropped
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{where}: {key} is {reprlib.repr(value)}, not a token's text.")
    return value


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err}).") from None


def _chat_template(config: dict, where: Path) -> str | None:
    """The chat template: tokenizer_config.json's (or chat_template.jinja's, put there), a string
    or a list of named ones of which "default" is used."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {
            t["name"]: t.get("template")
            for t in template
            if isinstance(t, dict) and type(t.get("name")) is str
        }
        if "default" not in named:  # transformers refuses to guess which one too
            raise ConfigError(
                f"{where}: its chat_template is a list of named templates, none named "
                '"default"; put the one to use in chat_template.jinja beside it.'
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{where}: its chat_template is not a template's text.")
    return template
