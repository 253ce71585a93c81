"""Small helpers the lessons share: their command line, where the model is, how tables print,
where plots and numbers go."""

import argparse
import json
import sys
from pathlib import Path

from minillm.report import console, print_table

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
OUT_DIR = Path(__file__).resolve().parent / "out"


def lesson_args(lesson_doc: str, options=None, quick: dict | None = None) -> argparse.Namespace:
    """The command line every lesson shares: --out DIR (plot and numbers) and --quick (a small
    setting that finishes in seconds; the tests run it). `options(parser)` adds a lesson's own
    options; `quick` holds their small values, which --quick uses unless the option is given."""
    parser = argparse.ArgumentParser(description=lesson_doc.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=OUT_DIR,
        metavar="DIR",
        help="folder for the plot and the JSON of headline numbers (default: lessons/out)",
    )
    parser.add_argument("--quick", action="store_true", help="a small setting that finishes in seconds")
    if options:
        options(parser)
    args = parser.parse_args()
    if args.quick and quick:  # parse again with the small values as defaults: explicit options still win
        parser.set_defaults(**quick)
        args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file; give a folder for the plot and its numbers")
    for name, value in vars(args).items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    return args


def require_model() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        console.print(f"[red]error:[/red] no weights in {MODEL_DIR} — run: python weights_fetch.py")
        sys.exit(2)
    return MODEL_DIR


def shape_option(parser) -> None:
    """--shape NAME (lessons 01 and 03): the real config of a 0.6-1.5B model with random weights."""
    from minillm.cli.flags import add_shape_arg

    add_shape_arg(parser)


def lesson_model(args) -> tuple[Path, str]:
    """The checkpoint a lesson measures and its name in the tables: SmolLM2, or --shape's folder
    (whose tables also say "random weights" under them)."""
    from minillm.cli.flags import use_shape
    from minillm.config import ConfigError

    if getattr(args, "shape", None):
        try:
            use_shape(args)
        except ConfigError as err:
            console.print(f"[red]error:[/red] {err}")
            sys.exit(2)
        return args.model, f"{args.shape} (random weights)"
    return require_model(), "SmolLM2-135M"


def perplexity_setup(lesson_doc: str, segments: int, segment_len: int, quick: dict):
    """For the lessons that score text through the cache: their --segments / --segment-len
    arguments (defaults given here, small values under --quick), the model, its tokenizer and the
    evaluation text's tokens."""
    from minillm.evaluation import read_text
    from minillm.tokenizer import Tokenizer
    from minillm.weights import load_model

    def options(parser):
        parser.add_argument(
            "--segments",
            type=int,
            default=segments,
            help=f"text segments scored side by side (default: {segments})",
        )
        parser.add_argument(
            "--segment-len",
            type=int,
            default=segment_len,
            help=f"tokens per segment (default: {segment_len})",
        )

    args = lesson_args(lesson_doc, options, quick)
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    return args, model_dir, model, tokenizer, tokenizer.encode(read_text())


def table(title: str, columns: list[str], rows: list[list]) -> None:
    """A table as the benchmarks print theirs (minillm.report)."""
    print_table(console, title, columns, rows)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def save_plot(fig, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir.resolve() / name
    fig.savefig(path, dpi=120, bbox_inches="tight")
    console.print(f"plot saved to {_shown(path)}")
    return path


def save_numbers(out_dir: Path, name: str, numbers: dict) -> Path:
    """The few numbers a lesson's closing sentence rests on, measured in this run, as flat JSON
    (the tests read the direction of each claim from it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir.resolve() / name
    path.write_text(json.dumps(numbers, indent=2) + "\n")
    console.print(f"numbers saved to {_shown(path)}")
    return path
