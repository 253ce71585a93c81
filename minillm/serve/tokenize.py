"""vLLM's tokenizer routes: the server's tokenizer, lent to a client that builds its own prompts.

    POST /tokenize         {"prompt": str, "add_special_tokens": bool}, or {"messages": [...],
                           "add_generation_prompt": bool, "chat_template_kwargs": {...}} (the
                           chat template) -> {"count", "max_model_len", "tokens"}
    POST /detokenize       {"tokens": [ids]} -> {"prompt": str}
    GET  /tokenizer_info   bos, eos and pad tokens, model_max_length, the chat template

An evaluation harness tokenizes through them (lm-eval's `RemoteTokenizer`, chosen on its own when
/tokenizer_info answers), then sends token ids to /v1/completions: it cuts a context from its
continuation by token count, so its tokens must be the server's.

Special tokens. /tokenize reads `<|im_end|>` in a prompt as the token <|im_end|> (id 2), as vLLM
does (Hugging Face's tokenizers split special-token strings out of any text): lm-eval finds the
EOS id as `tokenize(tokenizer_info["eos_token"])[0]` (the BOS id likewise, the prefix of a text
scored from its start), and a client that renders the chat template itself gets its control
tokens. A prompt string sent to /v1/completions is plain text instead, so a user's text cannot
forge <|im_end|>; a client that means control tokens sends ids, as lm-eval does with
`tokenized_requests=True`. For a string that holds a special token's name the two routes count
differently; for any other text they agree. `add_special_tokens` (true unless a body says false,
as in vLLM) puts the tokens the tokenizer's post-processor adds around the prompt, as a completion
prompt string gets them: Llama 3's <|begin_of_text|>; SmolLM2 and Qwen add none.

Bodies are checked as the completion routes' are (`protocol.py`): a wrong type, an id outside the
vocabulary, more tokens than `max_request_tokens` is a 400 that names the field, never a 500.
"""

from __future__ import annotations

from minillm.serve.endpoints import message_text
from minillm.serve.errors import APIError, shown
from minillm.serve.fields import parse_chat_template_kwargs, typed
from minillm.serve.limits import ServeLimits
from minillm.serve.protocol import check_fields
from minillm.tokenizer import Tokenizer

TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens")
CHAT_TOKENIZE_FIELDS = (
    "model",
    "messages",
    "add_generation_prompt",
    "add_special_tokens",
    "chat_template_kwargs",
)
DETOKENIZE_FIELDS = ("model", "tokens")


def tokenize(
    body: dict, tokenizer: Tokenizer | None, model: str, context_len: int, limits: ServeLimits
) -> dict:
    """POST /tokenize: a prompt, or a chat's messages through the chat template, as token ids."""
    tokenizer = _checked(body, tokenizer, model)
    if "messages" in body:
        check_fields(body, CHAT_TOKENIZE_FIELDS)
        ids = _chat_ids(body, tokenizer)
    else:
        check_fields(body, TOKENIZE_FIELDS)
        add_special_tokens = typed(body, "add_special_tokens", bool, True, "true or false")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            message = (
                "'prompt' is required."
                if prompt is None
                else f"'prompt' must be a string, not {shown(prompt)}."
            )
            raise APIError(400, message, "prompt")
        try:
            ids = tokenizer.encode_with_special_tokens(prompt)
        except ValueError as err:  # text the tokenizer's regex gives up on
            raise APIError(400, str(err), "prompt") from None
        if add_special_tokens:
            ids = [*tokenizer.prompt_prefix, *ids, *tokenizer.prompt_suffix]
    if len(ids) > limits.max_request_tokens:
        raise APIError(
            400,
            f"This prompt is {len(ids)} tokens; this server tokenizes at most {limits.max_request_tokens} "
            "per request (--max-request-tokens): send it in parts.",
            "messages" if "messages" in body else "prompt",
        )
    return {"count": len(ids), "max_model_len": context_len, "tokens": ids}


def _chat_ids(body: dict, tokenizer: Tokenizer) -> list[int]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise APIError(
            400, '\'messages\' must be a non-empty list of {"role", "content"} objects.', "messages"
        )
    conversation = [message_text(m, i) for i, m in enumerate(messages)]
    typed(body, "add_special_tokens", bool, False, "true or false")
    add_generation_prompt = typed(body, "add_generation_prompt", bool, True, "true or false")
    template_vars = parse_chat_template_kwargs(body)
    try:
        return tokenizer.encode_chat(conversation, add_generation_prompt, **template_vars)
    except ValueError as err:  # ConfigError too: no chat template, or it fails on this conversation
        raise APIError(400, str(err), "messages") from None


def detokenize(body: dict, tokenizer: Tokenizer | None, model: str, limits: ServeLimits) -> dict:
    """POST /detokenize: token ids as text (a character cut between tokens comes out as U+FFFD)."""
    tokenizer = _checked(body, tokenizer, model)
    check_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise APIError(400, f"'tokens' must be a list of token ids, not {shown(tokens)}.", "tokens")
    if len(tokens) > limits.max_request_tokens:
        raise APIError(
            400,
            f"'tokens' holds {len(tokens)} ids; this server detokenizes at most {limits.max_request_tokens} "
            "per request (--max-request-tokens).",
            "tokens",
        )
    for position, token_id in enumerate(tokens):
        if not 0 <= token_id < tokenizer.vocab_size:
            raise APIError(
                400,
                f"Token {position} is {token_id}; token ids are integers in [0, {tokenizer.vocab_size}) "
                "for this model's vocabulary.",
                "tokens",
            )
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer: Tokenizer | None, context_len: int) -> dict:
    """GET /tokenizer_info: what vLLM sends (the HF tokenizer's settings) that a client reads:
    bos and eos as tokenizer_config.json names them; minillm reads no pad token."""
    if tokenizer is None:
        raise APIError(404, "This model has no tokenizer; send prompts as token ids.")
    info = {
        "tokenizer_class": "minillm.tokenizer.Tokenizer",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "model_max_length": context_len,
        "add_bos_token": bool(tokenizer.prompt_prefix),
        "add_eos_token": bool(tokenizer.prompt_suffix),
    }
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _checked(body: dict, tokenizer: Tokenizer | None, model: str) -> Tokenizer:
    """The tokenizer, if there is one and the body names this server's model (or none)."""
    if body.get("model", model) != model:
        raise APIError(
            404, f"The model {shown(body['model'])} does not exist; this server serves `{model}`.", "model"
        )
    if tokenizer is None:
        raise APIError(400, "This model has no tokenizer; send prompts as token ids.")
    return tokenizer
