"""The flags several `minillm` commands share: which model, how to sample, the engine's switches.

Every engine flag is made from its entry in `config.SWITCHES` (name, choices, default, help), in
groups a command adds beside its own flags: model, engine, KV quantization, eviction, tiers,
speculative decoding.
`engine_switches` reads them back as EngineConfig fields, and `engine_argv` writes them out again
as flags for a child `minillm serve`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

from minillm.chat_template import template_variables
from minillm.config import DEFAULT_MODEL_DIR, SWITCHES, ConfigError
from minillm.switches import Switch

# the attention backends a CPU benchmark can be asked for
CPU_BACKENDS = tuple(b for b in SWITCHES["attention_backend"].choices if b != "cuda")


def whole_number(minimum: int, name: str, maximum: int | None = None):
    """An argparse type: a whole number >= `minimum` (and <= `maximum`, if given); anything else is
    argparse's one-line error."""
    span = f"{minimum} or more" if maximum is None else f"{minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number; give {span}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{value} is not {name}; give {span}")
        return value

    parse.__name__ = name.replace(" ", "_")
    return parse


positive_int = whole_number(1, "a positive count")  # every count flag: tokens, requests, segments...
non_negative_int = whole_number(0, "a size >= 0")  # a size that may be 0 (off)


def positive_float(text: str) -> float:
    """The type of every rate or fraction flag that must be a finite number above 0."""
    return _finite_float(text, "above 0", lambda value: value > 0)


def non_negative_float(text: str) -> float:
    """The type of a flag in seconds where 0 means "none" (--shutdown-timeout 0: no grace)."""
    return _finite_float(text, "of 0 or more", lambda value: value >= 0)


def _finite_float(text: str, wanted: str, allowed: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one {wanted}") from None
    if not (math.isfinite(value) and allowed(value)):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number {wanted}; give one {wanted}")
    return value


# the type of a whole-number switch, by its minimum
COUNT_TYPES = {0: non_negative_int, 1: positive_int, 2: whole_number(2, "a context of 2 tokens or more")}


def seed_list(text: str) -> tuple[int, ...]:
    """--seeds 1,2,3: whole numbers, comma-separated."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"whole numbers separated by commas (1,2,3), not {text!r}") from None


def _argparse_type(parse):
    """A switch's parser as an argparse type: its ValueError becomes argparse's one-line error."""

    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse_flag.__name__ = parse.__name__
    return parse_flag


# where the commands that serve conversations (serve, bench serve-http, chat) start otherwise than
# EngineConfig's library default: the prefix cache on, as in vLLM's V1 server and llama.cpp's (which
# keeps each slot's prompt), so a conversation resent with every turn is prefilled from its new turn
SERVING_DEFAULTS = {"prefix_caching": True}


def add_switch(parser, name: str, **overrides) -> None:
    """The flag of EngineConfig switch `name`, as `SWITCHES` declares it; a command may narrow its
    choices or give it its own help, default or nargs. An on/off flag's help ends with its default
    in this command, on or off."""
    switch = SWITCHES[name]
    spec = {"default": switch.default, "help": switch.help}
    if switch.on_off:  # --flag and --no-flag
        spec["action"] = argparse.BooleanOptionalAction
    elif switch.choices:
        spec["choices"] = switch.choices
    elif switch.minimum is not None:
        spec["type"] = COUNT_TYPES[switch.minimum]
    elif switch.parse is not None:
        spec["type"] = _argparse_type(switch.parse)
    spec.update(overrides)
    if switch.on_off:
        spec["help"] += f" (default: {'on' if spec['default'] else 'off'})"
    parser.add_argument(switch.option, **spec)


def _add_group(parser, group: str, defaults: dict | None = None) -> None:
    """Every switch of `group`; `defaults` gives some of them the command's own default."""
    defaults = defaults or {}
    for switch in SWITCHES.values():
        if switch.group == group:
            own = {"default": defaults[switch.name]} if switch.name in defaults else {}
            add_switch(parser, switch.name, **own)


def add_model_args(
    parser: argparse.ArgumentParser, dtype: str | None = None, weights: str | None = None
) -> None:
    """The model flags; `dtype` overrides the default precision (the commands that serve a user
    give "auto", the fastest on this machine, as do `bench scheduling` and `bench staircase`; the
    other benchmarks keep float32, the HF comparisons' dtype).
    --weights and --fused-decode are declared only where `weights` gives the first's default: the
    commands that load the model through the engine and so honour them."""
    for switch in SWITCHES.values():
        if switch.group != "model" or (switch.name in ("weights", "fused_decode") and weights is None):
            continue
        override = {"dtype": {"default": dtype} if dtype else {}, "weights": {"default": weights}}
        add_switch(parser, switch.name, **override.get(switch.name, {}))


def add_shape_arg(parser: argparse.ArgumentParser) -> None:
    """--shape NAME, for the commands that measure speed and memory: run on NAME's real config with
    random weights (`minillm/fetch/shapes.py`), written once beside the default checkpoint."""
    from minillm.fetch.shapes import SHAPES

    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="instead of --model, the real config of this model with RANDOM weights (speed and memory "
        "only; its text is noise), written once to weights/NAME-random-weights/",
    )


def use_shape(args) -> None:
    """--shape NAME, once the whole command line is read (so --help and the other flags' checks
    come first): the model folder becomes NAME's random-weight checkpoint, written the first
    time, and every table the run prints says so."""
    from minillm.fetch.shapes import shape_checkpoint
    from minillm.report import caption_tables

    name, dest = getattr(args, "shape", None), SWITCHES["model_dir"].dest
    if name is None:
        return
    given = getattr(args, dest, None)
    if given is not None and Path(given) != DEFAULT_MODEL_DIR:
        raise ConfigError(f"--shape {name} and --model {given} both name the model: give one of them.")
    if getattr(args, "record", False):
        raise ConfigError("--record keeps SmolLM2's run the docs quote: drop --shape (random weights).")
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ConfigError(
            f"--shape borrows the tokenizer of {DEFAULT_MODEL_DIR}: run python weights_fetch.py first."
        )
    setattr(args, dest, shape_checkpoint(name, DEFAULT_MODEL_DIR.parent, DEFAULT_MODEL_DIR))
    caption_tables(f"{name}: its real config with random weights (speed and memory only)")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=max_tokens,
        help=f"new tokens at most (default: {max_tokens})",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens; 0 is off (default: 0)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 is off (default: 1)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_from(args):
    from minillm.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        logprobs=getattr(args, "logprobs", None),  # generate's own flag
    )


def _template_variables(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"not JSON ({err.msg}, at character {err.pos}): {text[:60]!r}"
        ) from None
    try:
        return template_variables(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template-kwargs",
        type=_template_variables,
        default={},
        metavar="JSON",
        help="variables for the checkpoint's chat template, as a JSON object: e.g. "
        "'{\"enable_thinking\": false}' has Qwen3 answer without thinking first; a template reads "
        "the ones it knows and ignores the rest",
    )


def add_kv_quantization_args(parser: argparse.ArgumentParser) -> None:
    _add_group(parser, "kv_quantization")


def add_eviction_args(parser: argparse.ArgumentParser) -> None:
    _add_group(parser, "eviction")


def add_tier_args(parser: argparse.ArgumentParser) -> None:
    _add_group(parser, "tiers")


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    _add_group(parser, "speculative")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The serving engine's own switches, for the commands that run one engine for many requests
    (serve, bench serve-http), at SERVING_DEFAULTS where those differ from EngineConfig's."""
    _add_group(parser.add_argument_group("engine (EngineConfig switches)"), "engine", SERVING_DEFAULTS)


def add_trace_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        dest="trace_file",
        metavar="FILE",
        default=None,
        help="write every KV event of the run's engines (a block allocated, filled, cached, hit, "
        "copied, swapped, spilled, evicted, freed) to FILE as JSON lines; read it with "
        "`minillm trace show FILE`",
    )


def _declared(args) -> list[Switch]:
    """The switches whose flags the command of `args` declared (in a group, or one by one with
    `add_switch`, as chat declares eviction_trigger)."""
    return [switch for switch in SWITCHES.values() if hasattr(args, switch.dest)]


def engine_switches(args) -> dict:
    """The EngineConfig fields that the flags in `args` set (every switch the command declared)."""
    return {switch.name: switch.field_value(getattr(args, switch.dest)) for switch in _declared(args)}


def engine_argv(args) -> list[str]:
    """engine_switches(args) as flags again, for a child `minillm serve` run with the same engine."""
    argv = []
    for switch in _declared(args):
        value = getattr(args, switch.dest)
        if switch.on_off:
            argv.append(switch.option if value else "--no-" + switch.option[2:])
        elif value is not None:
            argv += [switch.option, str(value)]
    return argv


def add_record_arg(bench) -> None:
    bench.add_argument(
        "--record",
        action="store_true",
        help="keep this run as the committed result the docs quote (docs/results/NAME.json) and "
        "regenerate docs/results/figures.md; run it at the default sizes, on an idle machine",
    )


def shown_and_recorded(args, name: str, measure: Callable[[], dict], printer) -> None:
    """`measure()`'s report shown (tables, or JSON with --json); with --record also kept in
    docs/results/, refused before the run if it could not be kept as the docs' figure."""
    from minillm.benchmarks.recorded import RESULTS_DIR, record
    from minillm.report import show

    if args.record and getattr(args, "quick", False):
        raise ConfigError("--record keeps the run the docs quote, at the default sizes: drop --quick.")
    if args.record and not RESULTS_DIR.is_dir():
        raise ConfigError(f"--record writes into {RESULTS_DIR} (not there): run it in a git checkout.")
    report = measure()
    show(report, printer, args.json)
    if args.record:
        path = record(name, report, " ".join(["minillm", *sys.argv[1:]]), threads=args.threads)
        print(f"Recorded {path}; run the tests: a page that quotes a figure which moved must change too.")
