"""Beam's private names live in one module, pipelines/beam_internals.py
(docs/architecture.md, "Running elsewhere"): read from the package's source
with ``ast``, every use of a Beam name outside it is of Beam's public API, and
the module's docstring lists exactly the private names it uses.

A use is an ``import`` of a Beam module or name, an attribute chain rooted in
one (``beam.io.filesystems.FileSystems``, also through ``import_beam()``,
which returns ``apache_beam``), and a dotted Beam name in a string (a command
line such as ``-m apache_beam.runners.worker.sdk_worker_main``, a runner's
class path); docstrings and logger names (``logging.getLogger(...)``: labels,
not Beam's code) are not uses. Private: a name with a part starting with
``_`` (dunders aside) or named ``internal``, and any name outside Beam's
public API (``is_public``: the package's own names, ``PUBLIC_MODULES``).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

from test_architecture import PACKAGE_DIRS, ROOT, package_modules

INTERNALS = "seqcache.pipelines.beam_internals"
# Beam's public API, as far as the package uses it: the modules Beam's users
# program against (transforms, I/O and file systems, options, coders, metrics,
# type hints), the runner classes ``--runner`` names by path, and the
# portability API (the model protos and the standard URNs generated from
# them: the contract every SDK and runner speaks). Not here: Beam's runners'
# machinery, its worker, ``apache_beam.internal``, ``apache_beam.utils``, the
# Python SDK's own URNs (``portability.python_urns``).
PUBLIC_MODULES = (
    "apache_beam.io", "apache_beam.options", "apache_beam.transforms", "apache_beam.pvalue", "apache_beam.coders",
    "apache_beam.metrics", "apache_beam.typehints", "apache_beam.portability.api",
    "apache_beam.portability.common_urns", "apache_beam.runners.dask.dask_runner",
)
_DOTTED = re.compile(r"\bapache_beam(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def is_public(name: str) -> bool:
    """Whether the dotted Beam name ``name`` is of Beam's public API."""
    parts = name.split(".")
    if any(p == "internal" or (p.startswith("_") and not (p.startswith("__") and p.endswith("__"))) for p in parts):
        return False
    if len(parts) == 1 or (len(parts) == 2 and parts[1][:1].isupper()):  # apache_beam, beam.Pipeline, beam.FlatMap
        return True
    return any(name == m or name.startswith(m + ".") for m in PUBLIC_MODULES)


def _is_beam(module: str | None) -> bool:
    return module is not None and (module == "apache_beam" or module.startswith("apache_beam."))


def _skipped_strings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are no uses: docstrings and the
    arguments of ``getLogger``."""
    skipped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skipped.add(id(body[0].value))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger":
            skipped.update(id(n) for arg in node.args for n in ast.walk(arg))
    return skipped


def _bindings(tree: ast.AST) -> tuple[dict[str, str], list[tuple[int, str]]]:
    """(local name -> the Beam name it is bound to, the imports' ``(line, name)``)."""
    bound, imports = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_beam(a.name):
                    bound[a.asname or "apache_beam"] = a.name if a.asname else "apache_beam"
                    imports.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_beam(node.module):
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                imports.append((node.lineno, f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Assign) and _is_import_beam(node.value):
            bound.update({t.id: "apache_beam" for t in node.targets if isinstance(t, ast.Name)})
    return bound, imports


def _is_import_beam(node: ast.AST) -> bool:
    """A call of ``import_beam()`` (``process.import_beam()``): it returns ``apache_beam``."""
    return isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_beam"


def _resolve(node: ast.AST, bound: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, bound)
        return f"{owner}.{node.attr}" if owner else None
    return "apache_beam" if _is_import_beam(node) else None


def beam_uses(source: str) -> set[tuple[int, str]]:
    """``(line, dotted Beam name)`` of every use of a Beam name in ``source``
    (the module docstring says what counts). An import whose name a longer
    use in the code extends counts as that use only."""
    tree = ast.parse(source)
    bound, imports = _bindings(tree)
    skipped = _skipped_strings(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and id(node) not in inner:
            name = _resolve(node, bound)
        elif isinstance(node, ast.Call) and id(node) not in inner and _is_import_beam(node):
            name = "apache_beam"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            used.update((node.lineno, m) for m in _DOTTED.findall(node.value))
            continue
        else:
            continue
        if name:
            used.add((node.lineno, name))
    names = {n for _, n in used}
    return used | {(line, n) for line, n in imports if not any(u.startswith(n + ".") for u in names)}


def private_beam_uses(root: pathlib.Path = ROOT, package_dirs=PACKAGE_DIRS,
                      internals: str = INTERNALS) -> tuple[list[tuple[str, int, str]], set[str]]:
    """(``(file, line, name)`` of every private Beam name used outside
    ``internals``, sorted; the private Beam names ``internals`` uses)."""
    outside, inside = [], set()
    for module, path in package_modules(root, package_dirs).items():
        for line, name in beam_uses(path.read_text(encoding="utf-8")):
            if is_public(name):
                continue
            if module == internals:
                inside.add(name)
            else:
                outside.append((str(path.relative_to(root)), line, name))
    return sorted(outside), inside


def listed_names(docstring: str) -> set[str]:
    """The names of the docstring's list of private names: its items' first
    ````name```` (``- ``apache_beam...``:``)."""
    return set(re.findall(r"^- ``(apache_beam[^`]*)``", docstring, flags=re.MULTILINE))


def _internals_docstring() -> str:
    path = package_modules()[INTERNALS]
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def test_the_finder_sees_imports_attributes_calls_and_strings(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text(
        '"""Uses apache_beam.runners.worker.sdk_worker_main in its docstring only."""\n'
        "import logging\n"
        "import apache_beam as beam\n"
        "from apache_beam.options import pipeline_options as po\n"
        "from apache_beam.runners.portability.fn_api_runner import fn_runner\n"
        "from seqcache import process\n"
        "class E(fn_runner.FnApiRunner):\n"
        "    pass\n"
        "def f():\n"
        "    b = process.import_beam()\n"
        "    b.transforms.core._private_thing(po.DirectOptions, beam.FlatMap)\n"
        "    logging.getLogger('apache_beam.runners.worker.logs')\n"
        "    return process.import_beam().utils.retry, '-m apache_beam.runners.worker.sdk_worker_main'\n")
    (tmp_path / "pkg" / "inside.py").write_text(
        "from apache_beam.internal.cloudpickle import cloudpickle\n"
        "def g(m):\n    cloudpickle.register_pickle_by_value(m)\n")
    outside, inside = private_beam_uses(tmp_path, {"pkg": "pkg"}, "pkg.inside")
    assert outside == [("pkg/a.py", 7, "apache_beam.runners.portability.fn_api_runner.fn_runner.FnApiRunner"),
                       ("pkg/a.py", 11, "apache_beam.transforms.core._private_thing"),
                       ("pkg/a.py", 13, "apache_beam.runners.worker.sdk_worker_main"),
                       ("pkg/a.py", 13, "apache_beam.utils.retry")], outside
    assert inside == {"apache_beam.internal.cloudpickle.cloudpickle.register_pickle_by_value"}
    assert not is_public("apache_beam.runners.runner.create_runner") and is_public("apache_beam.Pipeline")
    assert is_public("apache_beam.portability.api.beam_fn_api_pb2.LogEntry")
    assert not is_public("apache_beam.portability.python_urns.SUBPROCESS_SDK")


def test_no_private_beam_name_is_used_outside_beam_internals():
    outside, _ = private_beam_uses()
    assert not outside, ("Beam names that are not Beam's public API, used outside pipelines/beam_internals.py "
                         "(move the use there and list it in its docstring; or, for a name of Beam's public "
                         f"API, add its module to PUBLIC_MODULES here): {outside}")


def test_beam_internals_lists_exactly_the_private_names_it_uses():
    _, inside = private_beam_uses()
    listed = listed_names(_internals_docstring())
    assert inside, "pipelines/beam_internals.py uses no private Beam name: the finder no longer sees them"
    assert listed == inside, (f"used but not listed in its docstring: {sorted(inside - listed)}; "
                              f"listed but not used: {sorted(listed - inside)}")


def test_every_listed_private_name_exists_in_the_installed_beam():
    # What a Beam upgrade that moves or removes one of them breaks first: a
    # name the docstring lists, looked up as a module or an attribute path.
    from seqcache.pipelines import beam_internals  # noqa: F401  imports Beam as the build does

    missing = []
    for name in sorted(listed_names(_internals_docstring())):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        try:
            for part in parts[cut:]:
                found = getattr(found, part)
        except AttributeError:
            missing.append(name)
    assert not missing, f"private Beam names beam_internals.py relies on, absent from this Beam: {missing}"
