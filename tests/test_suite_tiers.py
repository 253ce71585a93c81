"""The suite's own tiers: what `-m slow` collects is what the source marks slow.

A test is slow because of what it uses (the real weights, a lesson, a soak: `conftest.py` marks
those) or because it says so where it is defined: `@pytest.mark.slow` on the function, or
`pytest.param(..., marks=...)` on a case. Read from the source with `ast`, those names must all
be in the slow tier's collection, and none in the fast tier's: a renamed test keeps its mark, and a
mark that no longer reaches pytest (a typo, a decorator lost in a merge) fails here.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def _is_slow_mark(node: ast.expr, aliases: set[str]) -> bool:
    """`pytest.mark.slow`, or a module-level name bound to it."""
    return ast.unparse(node) == "pytest.mark.slow" or (isinstance(node, ast.Name) and node.id in aliases)


def _slow_aliases(tree: ast.Module) -> set[str]:
    return {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "pytest.mark.slow"
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def marked_slow_in_source() -> tuple[set[str], set[str]]:
    """(functions marked slow, as "module::name"; modules with a case marked slow)."""
    functions, with_slow_cases = set(), set()
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        aliases = _slow_aliases(tree)
        for node in ast.walk(tree):
            decorators = node.decorator_list if isinstance(node, ast.FunctionDef) else []
            if any(_is_slow_mark(decorator, aliases) for decorator in decorators):
                functions.add(f"{path.name}::{node.name}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param":
                if any(k.arg == "marks" and _is_slow_mark(k.value, aliases) for k in node.keywords):
                    with_slow_cases.add(path.name)
    return functions, with_slow_cases


def collected(marker_expression: str) -> set[str]:
    """The node ids pytest collects under `-m marker_expression`, without running anything."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"]
        + ["-m", marker_expression],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line.removeprefix("tests/") for line in done.stdout.splitlines() if "::" in line}


@pytest.mark.slow  # two collections of the whole suite (~15 s); it checks its own mark too
def test_what_the_source_marks_slow_is_in_the_slow_tier_and_not_in_the_fast_one():
    functions, with_slow_cases = marked_slow_in_source()
    assert functions and with_slow_cases  # the parsing found the marks this suite has
    slow, fast = collected("slow"), collected("not slow")
    assert slow and fast and not slow & fast
    slow_functions = {node_id.partition("[")[0] for node_id in slow}
    fast_functions = {node_id.partition("[")[0] for node_id in fast}
    assert functions <= slow_functions, functions - slow_functions
    assert not functions & fast_functions, functions & fast_functions
    for module in with_slow_cases:  # each such module has cases in both tiers: some stay fast
        assert any(node_id.startswith(module) and "[" in node_id for node_id in slow), module
