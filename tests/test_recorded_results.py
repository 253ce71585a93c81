"""The figures the pages quote against the committed runs they come from (`benchmarks/recorded.py`):
a page that says a number its result does not, or a figures table edited by hand, fails here."""

from pathlib import Path

from minillm.benchmarks.recorded import (
    RESULTS_DIR,
    figures,
    figures_page,
    load_quotes,
    load_results,
    stale_quotes,
)

REPO = Path(__file__).resolve().parent.parent


def read_page(path: str) -> str:
    return (REPO / path).read_text()


def test_every_committed_result_says_when_where_and_how():
    results = load_results()
    assert results, "no committed result in docs/results/"
    for name, result in results.items():
        assert result["name"] == name and result["command"].startswith(f"minillm bench {name}")
        assert result["date"][:4] == "2026" and result["revision"]
        assert result["machine"]["cpu_model"] and result["machine"]["cpu_extensions"]


def test_the_figures_table_is_generated_from_the_committed_results():
    assert (RESULTS_DIR / "figures.md").read_text() == figures_page(load_results()), (
        "docs/results/figures.md differs from its results: regenerate it with `minillm bench NAME --record`, "
        "never by hand"
    )


def test_every_quoted_figure_is_its_committed_result():
    quotes = load_quotes()
    assert quotes
    assert stale_quotes(load_results(), quotes, read_page) == []


def test_a_planted_wrong_figure_is_found():
    """The check can fail: the first quote's figure, one off in its last digit on a copy of its
    page, is named."""
    results, (quote, *_) = load_results(), load_quotes()
    right = quote["shown"].format(figures(results[quote["result"]])[quote["figure"]][1])
    last = max(i for i, ch in enumerate(right) if ch.isdigit())
    wrong = right[:last] + str((int(right[last]) + 1) % 10) + right[last + 1 :]
    page = " ".join(read_page(quote["page"]).split())
    assert right in page
    planted = {quote["page"]: page.replace(right, wrong)}
    (line,) = stale_quotes(results, [quote], planted.__getitem__)
    assert repr(right) in line


def test_a_quote_of_a_figure_no_result_has_is_named():
    quote = {"page": "README.md", "result": "scheduling", "figure": "no such figure", "shown": "{}"}
    (line,) = stale_quotes(load_results(), [quote], read_page)
    assert "no such figure" in line


def test_record_refuses_before_the_run_what_it_could_not_keep(capsys, monkeypatch):
    """A quick run is not the docs' figure, and an install without docs/results/ has nowhere to keep
    it: both are one line, before minutes of measuring."""
    import minillm.benchmarks.recorded as recorded
    from minillm.cli.commands import main

    assert main(["bench", "staircase", "--quick", "--record"]) == 2
    assert "drop --quick" in capsys.readouterr().err
    monkeypatch.setattr(recorded, "RESULTS_DIR", REPO / "no-such-folder")
    assert main(["bench", "tiers", "--record", "--model", "no-such-model"]) == 2
    assert "git checkout" in capsys.readouterr().err
