"""The import structure of the package (docs/architecture.md, "Dependency
rules"), read from the source with ``ast``: every ``import`` counts, those
inside functions too, so that a lazy import cannot hide a cycle.

Each top-level folder of the repository is one area (``PACKAGE_DIRS``,
pyproject.toml's package-dir): ``core/`` is ``seqcache``, ``cli/`` is
``seqcache.cli``, and so on. The core (``CORE``: the codec, the manifest's
fields, the layout, the format, the file system, bounded JSON and YAML, compression,
the process's settings, mixing rates, sequence lengths) is in no import
cycle, and imports nothing of seqcache but the core: never the areas (tasks,
pipelines, feeders, training) nor the application (``seqcache.cli``: the executable, the click
group and its commands, verify, report). The areas import downwards only
(``ALLOWED``).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Module prefix -> source folder, relative to the repository root (pyproject's package-dir):
# one top-level folder an area, none of them named ``seqcache``.
PACKAGE_DIRS = {
    "seqcache": "core",
    "seqcache.cli": "cli",
    "seqcache.tasks": "tasks",
    "seqcache.pipelines": "pipelines",
    "seqcache.feeders": "feeders",
    "seqcache.training": "training",
}
CORE = frozenset({
    "seqcache.codec", "seqcache.compression", "seqcache.fs", "seqcache.bounded_json", "seqcache.bounded_yaml",
    "seqcache.manifest", "seqcache.manifest_entries", "seqcache.source_table",
    "seqcache.layout", "seqcache.format", "seqcache.process", "seqcache.rates", "seqcache.lengths",
})
# Area -> the areas it may import (besides itself). The trainer room
# (``seqcache.feeders.trainers``) is an area of its own inside ``feeders/``: it
# imports the feeder, the feeder never imports it. Only the application imports
# ``training``; nothing imports the application (``cli``).
ALLOWED = {
    "core": set(),
    "tasks": {"core"},
    "pipelines": {"core", "tasks", "feeders"},  # feeders: the overlap scan reads caches (pipelines/overlap.py)
    "feeders": {"core", "tasks"},
    "feeders.trainers": {"core", "tasks", "feeders"},
    "training": {"core", "tasks", "feeders"},
    "cli": {"core", "tasks", "pipelines", "feeders", "feeders.trainers", "training"},
}
AREAS = ("cli", "tasks", "pipelines", "feeders.trainers", "feeders", "training")


def package_modules(root: pathlib.Path = ROOT, package_dirs=PACKAGE_DIRS) -> dict[str, pathlib.Path]:
    """Module name -> source file of every module of the package under ``root``
    (a package's ``__init__.py`` under the package's name)."""
    modules = {}
    for prefix, folder in package_dirs.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if name in modules and modules[name] != path:  # no area folder inside another's: one source each
                raise AssertionError(f"{name}: two source files, {modules[name]} and {path}")
            modules[name] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The module names an ``import`` or ``from ... import`` node names, relative
    imports resolved (``from seqcache import fs`` names ``seqcache`` and
    ``seqcache.fs``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: pathlib.Path = ROOT, package_dirs=PACKAGE_DIRS) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (at
    the top, inside functions, under ``if``), not counting the packages that
    contain it (importing ``seqcache.fs`` runs ``core/__init__.py``, which
    imports nothing of the package; nor do ``cli/__init__.py`` and
    ``feeders/trainers/__init__.py``)."""
    modules = package_modules(root, package_dirs)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(m for m in _imported(node, name, path.name == "__init__.py") if m in modules)
        graph[name] = {m for m in found if m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one
    module (each an import cycle, or several sharing modules), sorted
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def area_of(module: str) -> str:
    """The area of one of the package's modules: a key of ``ALLOWED``."""
    for area in AREAS:
        prefix = f"seqcache.{area}"
        if module == prefix or module.startswith(prefix + "."):
            return area
    return "core"


def test_the_package_modules_are_found():
    modules = package_modules()
    assert CORE <= set(modules), f"core modules without a source file: {sorted(CORE - set(modules))}"
    assert {"seqcache.tasks", "seqcache.pipelines.build", "seqcache.feeders.feeder", "seqcache.cli.main",
            "seqcache.cli.executable", "seqcache.cli.commands.build", "seqcache.feeders.trainers.t5x"} <= set(modules)


def test_the_package_dirs_are_pyproject_s():
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    # Every mapped folder lies inside the folder of one area, as its module lies inside the area's package.
    for name, folder in mapping.items():
        area = max((p for p in PACKAGE_DIRS if name == p or name.startswith(p + ".")), key=len)
        inside = name[len(area):].lstrip(".").replace(".", "/")
        assert folder == "/".join(filter(None, [PACKAGE_DIRS[area], inside])), (name, folder)
    assert {n: f for n, f in mapping.items() if n in PACKAGE_DIRS} == PACKAGE_DIRS
    assert not (ROOT / "seqcache" / "__init__.py").exists(), "a seqcache/ package at the root shadows the installed one"


def test_the_core_folder_holds_the_core_alone():
    in_core = {m for m, path in package_modules().items() if (ROOT / "core") in path.parents}
    assert in_core == CORE | {"seqcache"}, sorted(in_core ^ (CORE | {"seqcache"}))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"module -> imported"`` for every import of ``graph`` from one area
    into an area it may not import (``ALLOWED``), sorted."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if area_of(t) != area_of(m) and area_of(t) not in ALLOWED[area_of(m)])


def test_the_areas_import_downwards_only():
    bad = upward_imports(import_graph())
    assert not bad, f"imports against the hierarchy of areas (docs/architecture.md, Dependency rules): {bad}"


def test_the_area_check_sees_an_upward_import():
    graph = {"seqcache.feeders.reader": {"seqcache.feeders.trainers.t5x", "seqcache.fs"},
             "seqcache.feeders.trainers.t5x": {"seqcache.feeders.reader"},
             "seqcache.training.loop": {"seqcache.cli.commands.train"},
             "seqcache.fs": {"seqcache.cli.interrupts"}, "seqcache.cli.main": {"seqcache.pipelines.workers"}}
    assert upward_imports(graph) == ["seqcache.feeders.reader -> seqcache.feeders.trainers.t5x",
                                     "seqcache.fs -> seqcache.cli.interrupts",
                                     "seqcache.training.loop -> seqcache.cli.commands.train"]


def test_the_cycle_finder_counts_imports_inside_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    (tmp_path / "pkg" / "d.py").write_text("from pkg import a, b\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"},
                     "pkg.d": {"pkg.a", "pkg.b"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    (tmp_path / "pkg" / "c.py").write_text("import numpy\n")
    assert cycles(import_graph(tmp_path, {"pkg": "pkg"})) == []


def test_the_core_is_in_no_import_cycle():
    bad = [c for c in cycles(import_graph()) if CORE & set(c)]
    assert not bad, f"import cycles through the core (docs/architecture.md, Dependency rules): {bad}"


def test_the_core_imports_only_the_core():
    graph = import_graph()
    bad = {m: sorted(graph[m] - CORE) for m in sorted(CORE) if graph[m] - CORE}
    assert not bad, f"core modules importing above the core (docs/architecture.md, Dependency rules): {bad}"


def test_the_format_re_exports_every_name_of_the_codec():
    import types

    from seqcache import codec
    from seqcache import format as fmt

    names = [n for n, v in vars(codec).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
             and getattr(v, "__module__", codec.__name__) == codec.__name__]
    assert {"CacheError", "FeatureSpec", "encode_batch", "ShardTable", "MANIFEST_NAME"} <= set(names)
    missing = [n for n in names if getattr(fmt, n, None) is not getattr(codec, n)]
    assert not missing, f"seqcache.format does not re-export these names of seqcache.codec: {missing}"


def test_the_package_is_in_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles (docs/architecture.md, Dependency rules): {found}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_names(tree: ast.AST, module: str, is_package: bool, modules) -> dict[str, str]:
    """Local name -> the package's module it is bound to by an import
    (``from seqcache import codec``, ``import seqcache.codec as codec``)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _imported(node, module, is_package)[0]
            bound.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules})
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    return bound


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def private_names_across_modules(root: pathlib.Path = ROOT, package_dirs=PACKAGE_DIRS) -> list[tuple[str, int, str]]:
    """``(file, line, "module._name")`` of every private name of one of the
    package's modules that another of its modules uses: ``from X import _y``
    (a re-export too), ``X._y`` and ``pkg.X._y``."""
    modules = package_modules(root, package_dirs)
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        bound = _module_names(tree, name, is_package, modules)
        where = str(path.relative_to(root))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _imported(node, name, is_package)[0]
                out += [(where, node.lineno, f"{base}.{a.name}") for a in node.names
                        if base in modules and base != name and _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = _dotted(node.value)
                owner = bound.get(owner, owner)
                if owner in modules and owner != name:
                    out.append((where, node.lineno, f"{owner}.{node.attr}"))
    return sorted(out)


def test_the_private_name_finder_sees_imports_attributes_and_re_exports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("_x = 1\ndef _f():\n    return _x\nclass C:\n    _n = 2\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg.a import _f, C  # re-exported\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg import a as m\nimport pkg.a\ndef g(o):\n"
                                           "    return m._x + pkg.a._x + o._y + m.C._n + m.__name__\n")
    found = private_names_across_modules(tmp_path, {"pkg": "pkg"})
    assert found == [("pkg/b.py", 1, "pkg.a._f"), ("pkg/c.py", 4, "pkg.a._x"), ("pkg/c.py", 4, "pkg.a._x")]


def test_no_private_name_crosses_a_module():
    # A name another module needs is public, with a docstring; attributes of
    # other libraries' objects (Beam's, click's) are not the package's names.
    found = private_names_across_modules()
    assert not found, f"private names of a seqcache module used from another one (make them public): {found}"


# The packages pyproject.toml requires (import names). An import of any other
# package (jax, torch, boto3, the trainers, ...) is of an optional dependency.
REQUIRED = frozenset({"seqcache", "apache_beam", "array_record", "sentencepiece", "tokenizers", "pyarrow", "numpy",
                      "click", "rich", "matplotlib", "jinja2", "psutil", "msgspec", "grpc", "google"})  # google: protobuf
# Imports inside functions of the standard library, the required packages and
# seqcache itself, each with a comment saying why (Beam kept out of the feeder's
# and the light commands' import and out of `seqcache build --help`, the tasks out
# of `seqcache --help`, pyarrow.parquet and protobuf out of the tasks', modules
# that need JAX, the command line imported by the executable after its signal
# handlers): at most this many.
LAZY_REQUIRED_LIMIT = 28


def function_imports(root: pathlib.Path = ROOT, package_dirs=PACKAGE_DIRS) -> list[tuple[str, int, set[str], str]]:
    """``(file, line, top-level package names, the line's text)`` of every
    ``import`` inside a function (nested functions and methods included)."""
    out = []
    for path in package_modules(root, package_dirs).values():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        seen = set()
        for function in functions:
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in seen:
                    seen.add(node.lineno)
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        ["seqcache" if node.level else (node.module or "")]
                    out.append((str(path.relative_to(root)), node.lineno, {n.split(".")[0] for n in names},
                                lines[node.lineno - 1]))
    return sorted(out)


def _lazy_required(imports):
    return [(f, n, text.strip()) for f, n, tops, text in imports
            if tops & (REQUIRED | set(sys.stdlib_module_names))]


def test_imports_inside_functions_are_of_optional_packages_or_say_why():
    lazy = _lazy_required(function_imports())
    silent = [item for item in lazy if "#" not in item[2]]
    assert not silent, ("imports inside functions of the standard library, a required package or seqcache "
                        f"without a comment saying why (move them to the module's top): {silent}")
    stdlib = [item for item in lazy if not {item[2].split()[1].split(".")[0]} - set(sys.stdlib_module_names)]
    assert not stdlib, f"the standard library is imported at the module's top: {stdlib}"
    assert len(lazy) <= LAZY_REQUIRED_LIMIT, (f"{len(lazy)} imports inside functions of required packages "
                                              f"(at most {LAZY_REQUIRED_LIMIT}): {lazy}")


def test_the_function_import_count_sees_nested_and_relative_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import os\n")
    (tmp_path / "pkg" / "a.py").write_text(
        "def f():\n    import json\n    def g():\n        from . import b  # why\n"
        "class C:\n    def m(self):\n        import jax  # optional\n")
    found = function_imports(tmp_path, {"pkg": "pkg"})
    assert [(n, tops) for _, n, tops, _ in found] == [(2, {"json"}), (4, {"seqcache"}), (7, {"jax"})]
    assert [(n, text) for _, n, text in _lazy_required(found)] == [(2, "import json"), (4, "from . import b  # why")]


def test_the_feeder_imports_numpy_array_record_and_msgspec_only(tmp_path):
    # Trainer environments install seqcache --no-deps beside their own pins
    # (docs/trainers/*.md), and numpy, array_record and msgspec (the manifest
    # model): importing the feeder, its state and its trainer modules (but the
    # torch one) needs no other package. msgspec imports typing_extensions
    # only where it is installed (it falls back to typing).
    code = ("import sys, seqcache.feeders, seqcache.feeders.trainers.t5x, seqcache.feeders.trainers.levanter\n"
            "print(sorted({m.split('.')[0] for m in sys.modules if not m.startswith('_')}"
            " - set(sys.stdlib_module_names)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert set(eval(done.stdout)) <= {"seqcache", "numpy", "array_record", "msgspec", "typing_extensions"}, done.stdout


def test_the_architecture_page_gives_the_counts_the_tests_enforce():
    """docs/architecture.md states the in-function import count, its limit and
    the function length limit; each must be what the tests hold."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    text = " ".join(page.split())
    spec = importlib.util.spec_from_file_location("function_length", ROOT / "tests" / "test_function_length.py")
    lengths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths)
    found = re.search(r"counts these imports: (\d+) of required packages", text)
    assert found, "docs/architecture.md no longer states the count of in-function imports"
    assert int(found.group(1)) == len(_lazy_required(function_imports())), "the page's count is not the code's"
    assert f"`LAZY_REQUIRED_LIMIT = {LAZY_REQUIRED_LIMIT}`" in text
    assert f"`MAX_LINES = {lengths.MAX_LINES}`" in text and f"longer than {lengths.MAX_LINES} lines" in text
