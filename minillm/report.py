"""How a measurement is shown: one line of strict JSON for a program, tables for a person.

Every command that measures takes --json and prints one JSON object, so numbers can be compared
across commits; without it the same report prints as tables of right-aligned columns. The CLI,
the benchmarks and the lessons all print through these functions, so a table looks the same
wherever it was measured.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)  # what a command says about itself, beside its output
_every_table_caption: list[str] = []  # what every table of this process says under it (`caption_tables`)


def caption_tables(caption: str) -> None:
    """Say `caption` under every table this process prints from now on: a run on random weights
    (`--shape`) says so wherever its numbers appear."""
    _every_table_caption[:] = [caption]


def print_json(report: dict) -> None:
    """Every --json output: one line of strict JSON. A rate that cannot be measured is null, never
    NaN or Infinity, which Python's json writes by default and JSON parsers reject."""
    try:
        line = json.dumps(report, allow_nan=False)
    except ValueError as err:  # a bug in the command, not a user's error (main turns ValueError into one)
        raise RuntimeError(
            f"--json output is not strict JSON ({err}); a rate with nothing to measure must be None"
        ) from err
    print(line)


def print_table(console: Console, title: str, columns: list[str], rows: list[list]) -> None:
    """A titled table, every column right-aligned so numbers line up by their last digit."""
    table = Table(title=title, caption=" ".join(_every_table_caption) or None)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*[str(cell) for cell in row])
    console.print(table)


def show(report: dict, printer, as_json: bool) -> None:
    """One JSON object with --json (to compare across commits), else `printer`'s tables."""
    print_json(report) if as_json else printer(report, console)
