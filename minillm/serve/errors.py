"""Errors in OpenAI's shape, and JSON no client can use to make the server fail.

A request the server refuses raises `APIError` with the HTTP status and the message the client
reads; `error_body` is OpenAI's error object, which the official client turns into its exception.

Whatever JSON a client sends gets a 4xx, never a 500: `parse_json` refuses, before any check reads
the body, nesting deeper than MAX_DEPTH, integers of 2**64 or more (a 401-digit temperature would
overflow float(); one of 5,000 is not even read) and lone surrogates ("\\ud800"
is valid JSON but no UTF-8 can carry it back in an answer). A message names the field and quotes
its value cut short (`shown`), so a 20 MB prompt is not sent back. The sizes a request may ask for
(prompts, tokens, stop strings) are `ServeLimits`' (`limits.py`).
"""

from __future__ import annotations

import json
import re
import reprlib

MAX_DEPTH = 32  # a chat is 5 levels deep (body, messages, message, content parts, part)
INTEGER_BOUND = 2**64  # no field takes more (a seed is below 2**64); a bigger one is refused unread
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """A request the server refuses: HTTP `status`, and the body of OpenAI's error shape."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        408: "RequestTimeoutError",
        413: "RequestTooLargeError",
        415: "UnsupportedMediaTypeError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: what the openai client reads into its exception."""
    return {
        "error": {
            "message": message,
            "type": APIError.TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def shown(value) -> str:
    """`value` as an error message quotes it: its repr, cut short (a few items, a few dozen characters)."""
    return SHORT_REPR.repr(value)


SHORT_REPR = reprlib.Repr()  # Python 3.10's Repr takes no keyword arguments
SHORT_REPR.maxlevel, SHORT_REPR.maxstring, SHORT_REPR.maxother, SHORT_REPR.maxlong = 2, 40, 40, 24
SHORT_REPR.maxlist = SHORT_REPR.maxdict = SHORT_REPR.maxtuple = SHORT_REPR.maxset = 4


class LongNumber(int):
    """An integer literal of more digits than 2**64 has, kept unread: reading one of 5,000 digits
    takes quadratic time, and Python refuses past 4,300. `check_values` refuses it by its field."""


def read_integer(literal: str) -> int:
    return int(literal) if len(literal) <= 21 else LongNumber(INTEGER_BOUND)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object whose every value the checks can read (`check_values`)."""
    try:
        body = json.loads(raw, parse_int=read_integer)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"The request body is not valid JSON ({err}).") from None
    except RecursionError:
        raise APIError(400, f"The request body nests deeper than {MAX_DEPTH} levels; flatten it.") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, not a JSON {type(body).__name__}.")
    check_values(body)
    return body


def check_values(body: dict) -> None:
    """Nesting, integers and strings anywhere in the body, checked without recursion (a deep body
    would overflow the stack of a recursive walk); the error names the top-level field."""
    stack = [(name, 1, name) for name in body] + [(value, 2, name) for name, value in body.items()]
    while stack:
        value, depth, name = stack.pop()
        if depth > MAX_DEPTH:
            raise value_error(name, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack += [(item, depth + 1, name) for item in (*value.keys(), *value.values())]
        elif isinstance(value, list):
            stack += [(item, depth + 1, name) for item in value]
        elif isinstance(value, str) and LONE_SURROGATE.search(value):
            raise value_error(name, "holds a lone surrogate (\\ud800-\\udfff, unpaired): not Unicode text")
        elif isinstance(value, int) and not -INTEGER_BOUND < value < INTEGER_BOUND:
            raise value_error(name, "holds a number of 2**64 or more; no field takes one")


def value_error(name: str, problem: str) -> APIError:
    """A 400 for field `name`, its name made printable (it may hold the lone surrogate itself)."""
    printable = LONE_SURROGATE.sub("\ufffd", name)
    return APIError(400, f"{shown(printable)} {problem}.", printable if len(printable) <= 64 else None)
