"""Every module is on the maps a reader starts from: its package's docstring and docs/layout.md.

A package's `__init__.py` docstring is its table of contents, and `docs/layout.md` is the whole
project's; a module missing from either is one a reader never finds. Names are matched as file
names (`engine.py`, `scheduling/`), the way both maps write them.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = sorted(path.parent for path in (ROOT / "minillm").rglob("__init__.py"))


def members(package: Path) -> list[str]:
    """The package's modules (`name.py`) and subpackages (`name/`), as the maps write them."""
    modules = [p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    subpackages = [f"{p.parent.name}/" for p in package.glob("*/__init__.py")]
    return sorted(modules + subpackages)


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


@pytest.mark.parametrize("package", PACKAGES, ids=[str(p.relative_to(ROOT)) for p in PACKAGES])
def test_every_module_is_named_in_its_package_docstring(package):
    text = docstring(package)
    missing = [name for name in members(package) if name not in text and name.removesuffix("/") not in text]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}"


def test_every_module_is_named_in_the_layout_page():
    layout = (ROOT / "docs" / "layout.md").read_text()
    missing = [
        f"{package.relative_to(ROOT)}/{name}"
        for package in PACKAGES
        for name in members(package)
        if name not in layout and f"{name.removesuffix('.py')}" not in layout
    ]
    assert not missing, f"docs/layout.md does not name {missing}"
