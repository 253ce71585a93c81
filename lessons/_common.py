"""Small helpers the lessons share: where the model is, where plots go, how tables print."""

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
OUT_DIR = Path(__file__).resolve().parent / "out"
console = Console()


def require_model() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        console.print(f"[red]error:[/red] no weights in {MODEL_DIR} — run: python weights_fetch.py")
        sys.exit(2)
    return MODEL_DIR


def perplexity_setup(lesson_doc: str):
    """For the lessons that score text through the cache: their --segments / --segment-len
    arguments, the model, its tokenizer and the evaluation text's tokens."""
    from minillm.evaluation import read_text
    from minillm.tokenizer import Tokenizer
    from minillm.weights import load_model

    parser = argparse.ArgumentParser(description=lesson_doc.split("\n\n")[0])
    parser.add_argument("--segments", type=int, default=4, help="text segments scored side by side (default: 4)")
    parser.add_argument("--segment-len", type=int, default=512, help="tokens per segment (default: 512)")
    args = parser.parse_args()
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    return args, model_dir, model, tokenizer, tokenizer.encode(read_text())


def table(title: str, columns: list[str], rows: list[list]) -> None:
    t = Table(title=title)
    for column in columns:
        t.add_column(column, justify="right")
    for row in rows:
        t.add_row(*[str(cell) for cell in row])
    console.print(t)


def save_plot(fig, name: str) -> Path:
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / name
    fig.savefig(path, dpi=120, bbox_inches="tight")
    console.print(f"plot saved to {path.relative_to(ROOT)}")
    return path
