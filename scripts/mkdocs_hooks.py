"""mkdocs hooks: the site's diagrams need Mermaid's script beside the pages (`fetch_mermaid.py`)."""

from pathlib import Path

from mkdocs.exceptions import PluginError

MERMAID = Path(__file__).resolve().parent.parent / "docs" / "javascripts" / "mermaid.min.js"


def on_config(config):
    if not MERMAID.exists():
        raise PluginError(
            "docs/javascripts/mermaid.min.js is missing: run `python scripts/fetch_mermaid.py` once "
            "(the diagrams are drawn offline from it)."
        )
    return config
