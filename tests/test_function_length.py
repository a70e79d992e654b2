"""No function of the package or of its benchmark scripts is longer than
MAX_LINES lines (its signature, docstring and body; decorators not counted), so
that each one can be read and tested as one unit."""

from __future__ import annotations

import ast
import pathlib

MAX_LINES = 80
# The package's source folders and the benchmark scripts' folder, relative to the
# repository root (the parent of tests/).
SOURCE_FOLDERS = ("core", "cli", "tasks", "pipelines", "feeders", "training", "benchmarks")
# (path relative to the repository root, qualified name) of functions allowed
# to be longer: none.
ALLOWED: set[tuple[str, str]] = set()

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in ``tree``, nested ones and
    methods included (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _length(node: ast.AST) -> int:
    # ``lineno`` is the line of ``def``, after any decorators.
    return node.end_lineno - node.lineno + 1


def long_functions(root: pathlib.Path = ROOT, max_lines: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """(path, qualified name, lines) of every function over ``max_lines`` lines
    in the source folders under ``root``."""
    out = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for name, node in _functions(tree):
                if _length(node) > max_lines:
                    out.append((rel, name, _length(node)))
    return out


def test_the_source_folders_hold_python_files():
    for folder in SOURCE_FOLDERS:
        assert list((ROOT / folder).rglob("*.py")), f"{ROOT / folder}: no Python files (is the root right?)"


def test_no_function_is_longer_than_the_limit():
    too_long = [(path, name, n) for path, name, n in long_functions() if (path, name) not in ALLOWED]
    assert not too_long, (f"functions over {MAX_LINES} lines (split them into named parts): "
                          + "; ".join(f"{path} {name}: {n} lines" for path, name, n in too_long))


def test_the_allowed_functions_exist():
    # An entry that names no function any more is stale: remove it.
    names = set()
    for path, _ in ALLOWED:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        names |= {(path, name) for name, _ in _functions(tree)}
    assert ALLOWED <= names, f"allowed functions not found: {sorted(ALLOWED - names)}"


def test_the_check_finds_a_long_function(tmp_path):
    folder = tmp_path / "feeders"
    folder.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (folder / "m.py").write_text(f"class C:\n    @staticmethod\n    def long():\n{body.replace('    ', '        ')}\n"
                                 f"\n\ndef short():\n    return 1\n\n\ndef at_limit():\n"
                                 + "\n".join(f"    y{i} = {i}" for i in range(MAX_LINES - 1)) + "\n")
    for other in SOURCE_FOLDERS:
        (tmp_path / other).mkdir(exist_ok=True)
    assert long_functions(tmp_path) == [("feeders/m.py", "C.long", MAX_LINES + 1)]
