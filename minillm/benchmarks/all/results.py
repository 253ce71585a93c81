"""The results of `bench all` as a markdown table, bar charts and the printed headline table."""

from __future__ import annotations

from pathlib import Path

from minillm.config import ConfigError
from minillm.report import console, print_table


def cell(value) -> str:
    """A headline value as the table shows it: the rounded number itself, so it reads back equal."""
    return "n/a" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"`{results['command']}` on {results['date'][:10]}: {m['cpu_model']}, {m['cpus']} CPUs, "
        f"torch {m['torch']}, {m['torch_threads']} torch thread(s); {results['seconds']:.0f} s in all.",
        "",
        "| benchmark | measurement | value | unit |",
        "|---|---|---:|---|",
    ]
    for name, result in results["benchmarks"].items():
        if result["status"] == "failed":
            lines.append(f"| {name} | FAILED: {result['error'].replace('|', '/')} | | |")
            continue
        lines += [
            f"| {name} | {h['measurement']} | {cell(h['value'])} | {h['unit']} |" for h in result["headlines"]
        ]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot drawing to files, or one line saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "bench all draws its plots with matplotlib, which is not installed — run: "
            "pip install -e '.[lessons]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(plt, path: Path, name: str, title: str, axis: str, bars: dict[str, float]) -> str:
    """One horizontal bar per entry, its value written at its end."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * len(bars)))
    ax.barh(list(bars), list(bars.values()), color="tab:blue")
    ax.invert_yaxis()  # the first entry on top, as in the table
    for y, value in enumerate(bars.values()):
        ax.text(value, y, f" {value:,.0f}" if abs(value) >= 100 else f" {value:.3g}", va="center", fontsize=8)
    ax.set_xlabel(axis)
    ax.set_title(f"{name}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def print_results(results: dict, out_dir: Path) -> None:
    """The headline table and where the files are (each benchmark's own report printed as it finished)."""
    rows = [
        [name, h["measurement"], cell(h["value"]), h["unit"]]
        for name, result in results["benchmarks"].items()
        if result["status"] == "ok"
        for h in result["headlines"]
    ]
    rows += [
        [name, f"FAILED: {result['error']}", "", ""]
        for name, result in results["benchmarks"].items()
        if result["status"] == "failed"
    ]
    print_table(
        console, f"bench all, {results['seconds']:.0f} s", ["benchmark", "measurement", "value", "unit"], rows
    )
    console.print(
        f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'} and "
        f"{sum(r['status'] == 'ok' for r in results['benchmarks'].values())} plots in {out_dir}/"
    )
