"""What the distribution promises, read from the source tree (nothing is built or imported here).

tests/dist/test_install.py builds the wheel and runs a job from an installed copy.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "troupe"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION_ONLY = ("tomllib",)
"""Standard-library modules newer than requires-python (3.10): imported only behind a guard."""


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Is `node` inside an `if sys.version_info ...:` or a try/except ImportError?"""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and "version_info" in ast.unparse(parent.test):
            return True
        if isinstance(parent, ast.Try) and node in parent.body and any(
            h.type is not None and any(n in ast.unparse(h.type) for n in ("ImportError", "ModuleNotFoundError"))
            for h in parent.handlers
        ):
            return True
        node = parent
    return False


def test_new_stdlib_modules_are_imported_behind_a_guard():
    bare = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            else:
                continue
            if any(n in VERSION_ONLY for n in names) and not _guarded(node, parents):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, f"unguarded import of {VERSION_ONLY} (Python 3.10 lacks it): {bare}"


def test_guard_detection():
    """The checker itself: a bare import is caught, both guard styles pass."""
    bare = "import tomllib\n"
    by_version = "import sys\nif sys.version_info >= (3, 11):\n    import tomllib\nelse:\n    import tomli as tomllib\n"
    by_try = "try:\n    import tomllib\nexcept ModuleNotFoundError:\n    import tomli as tomllib\n"
    in_handler = "try:\n    pass\nexcept ImportError:\n    import tomllib\n"

    def is_guarded(text: str) -> bool:
        tree = ast.parse(text)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.Import) and n.names[0].name == "tomllib")
        return _guarded(node, parents)

    assert not is_guarded(bare) and not is_guarded(in_handler)
    assert is_guarded(by_version) and is_guarded(by_try)


def test_distribution_metadata():
    project = PYPROJECT["project"]
    assert project["name"] != "troupe", "'troupe' on PyPI is an unrelated project"
    assert project["scripts"] == {"troupe": "troupe.cli:main"}
    assert (SRC / "__main__.py").is_file(), "python -m troupe"
    assert (SRC / "py.typed").is_file() and "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["troupe"]
    low = tuple(int(x) for x in project["requires-python"].removeprefix(">=").split("."))
    python = "Programming Language :: Python :: "
    listed = {c.removeprefix(python) for c in project["classifiers"] if c.startswith(python + "3.")}
    assert f"{low[0]}.{low[1]}" in listed, f"requires-python {project['requires-python']} but classifiers list {listed}"
