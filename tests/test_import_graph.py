"""No import circle inside a package, no import inside a function that hides one, and
tnt-core used only through its public names.

An import circle works until someone imports its modules in another order; the usual
"fix" is an import moved into a function, which hides the circle from everyone else.
So each package's own imports are read statically (``ast``): the module-level graph
must be acyclic (a cycle is named), no function imports one of the package's own
modules, and every module imports alone in a fresh interpreter. Imports made only for
type checking (``if TYPE_CHECKING:``) count too: a circle among the types is the same
tangle of modules, kept from failing only by the guard.

tnt-core is used pluggy's way: through the names ``tnt_core/__init__.py`` exports and the
``tnt_core.testing`` sub-package; its modules are private. Every other package's sources
and tests, the repository's tests, benchmarks, examples, CI scripts and the docs'
extension are read for any other use of it.

A package joins the checks by one line in ``PACKAGES``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (distribution folder under packages/, top-level import package under its src/)
PACKAGES = [
    ("tnt-core", "tnt_core"),
    ("tnt-cli", "tnt_cli"),
    ("tnt-comm-gloo", "tnt_comm_gloo"),
    ("tnt-comm-mpi", "tnt_comm_mpi"),
    ("tnt-keras", "tarantella"),
]


@dataclass(frozen=True)
class Import:
    """One import statement's target inside the package, as written in ``module``."""

    module: str  # the importing module (dotted)
    target: str  # the imported module of the package (dotted)
    line: int
    in_function: bool


def _modules(top: str, src: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of package ``top`` (``__init__`` is the package)."""
    found = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _walk(node: ast.AST, in_function: bool = False):
    """Every import statement under ``node`` with whether a function body holds it.
    Those under ``if TYPE_CHECKING:`` are yielded like any other: they never run, but
    they tie the modules together all the same."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        else:
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _walk(child, inner)


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """What ``module`` imports of its own package, resolved to module names.

    ``from X import name`` imports ``X.name`` when that is a module, else ``X``. Importing
    ``a.b.c`` runs ``a.b`` first: the parent packages count as imported too, except the
    importing module's own ancestors, which are already running; but a name other than a
    module taken from an ancestor (``from .. import name``) needs the ancestor's
    ``__init__`` to have defined it, so that counts. A compiled module is known by the
    ``.pyi`` stub beside it (``tnt_comm_gloo._gloo``): importing it needs no ``__init__``
    name either, and it imports nothing of the package."""
    top = module.split(".")[0]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    found: list[Import] = []
    for node, in_function in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}"
                       if f"{origin}.{alias.name}" in modules or _is_compiled(origin, alias.name, modules)
                       else origin
                       for alias in node.names]
        for target in targets:
            if target.split(".")[0] != top:
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in modules and name not in ancestors and name != module:
                    found.append(Import(module, name, node.lineno, in_function))
            if isinstance(node, ast.ImportFrom) and target in ancestors:
                found.append(Import(module, target, node.lineno, in_function))
    return found


def _is_compiled(package: str, name: str, modules: dict[str, Path]) -> bool:
    """Whether ``package.name`` is a compiled module (a ``.pyi`` stub stands beside it)."""
    init = modules.get(package)
    return init is not None and init.name == "__init__.py" and (init.parent / f"{name}.pyi").is_file()


def _package_imports(folder: str, top: str) -> tuple[dict[str, Path], list[Import]]:
    modules = _modules(top, ROOT / "packages" / folder / "src")
    return modules, [imp for name, path in modules.items() for imp in _imports(name, path, modules)]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as its modules in import order (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state and (cycle := visit(succ)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_find_cycle_names_the_circle():
    """The checker itself: a circle is found and named in import order; a DAG passes."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_resolution_of_relative_and_parent_imports(tmp_path):
    """The checker itself: relative levels, ``from . import submodule``, the parent
    package a submodule import runs, function-level and TYPE_CHECKING imports (the
    latter count as module-level: the circle test sees them)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("from . import b\nfrom .sub.c import y\n"
                              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "d.py").write_text("from . import _native\n")
    (pkg / "_native.pyi").write_text("")  # a compiled module's stub: not the package's __init__
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import b\nfrom ..a import x\nfrom .. import thing\n"
                                      "import pkg.d\n")
    modules = _modules("pkg", tmp_path)
    got = {(i.module, i.target, i.in_function) for name, path in modules.items()
           for i in _imports(name, path, modules)}
    assert got == {("pkg", "pkg.a", False), ("pkg.a", "pkg.b", False), ("pkg.a", "pkg.sub", False),
                   ("pkg.a", "pkg.sub.c", False), ("pkg.a", "pkg.d", False), ("pkg.b", "pkg.sub", True),
                   ("pkg.b", "pkg.sub.c", True), ("pkg.sub.c", "pkg.b", False),
                   ("pkg.sub.c", "pkg.a", False), ("pkg.sub.c", "pkg", False),
                   ("pkg.sub.c", "pkg.d", False)}


@pytest.mark.parametrize(("folder", "top"), PACKAGES)
def test_module_level_imports_form_no_circle(folder, top):
    modules, imports = _package_imports(folder, top)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports:
        if not imp.in_function:
            graph[imp.module].add(imp.target)
    cycle = _find_cycle(graph)
    assert cycle is None, f"{top} has an import circle: {' -> '.join(cycle or [])}"


#: imports left inside a function on purpose: (importer, imported) -> why. Each keeps a
#: module out of processes that never need it; checked in a fresh interpreter below (the
#: importer alone does not load it). A circle is never a reason.
DEFERRED = {
    ("tnt_comm_gloo", "tnt_comm_gloo.backend"):
        "loads the native module: a broken build must not stop the package from importing",
    ("tnt_comm_gloo.plugin", "tnt_comm_gloo.backend"):
        "loads the native module: a broken build must not stop tnt-core listing the other backends",
    ("tnt_comm_mpi.plugin", "tnt_comm_mpi.backend"):
        "every process loads the plugin, also those on Gloo: the MPI backend loads when chosen",
}


@pytest.mark.parametrize(("folder", "top"), PACKAGES)
def test_no_function_imports_its_own_package(folder, top):
    """An import of the package's own module inside a function hides a circle (or an
    order the module graph does not show); import at the top instead."""
    modules, imports = _package_imports(folder, top)
    inside = sorted({f"{modules[i.module].relative_to(ROOT)}:{i.line} imports {i.target}"
                     for i in imports if i.in_function and (i.module, i.target) not in DEFERRED})
    assert not inside, "imports inside functions:\n  " + "\n  ".join(inside)


class _FreshImports:
    """``tests/fresh_imports.py`` as a server: each module imported in a child forked from an
    interpreter that has loaded the third-party libraries and none of the repository's
    modules (a fresh interpreter for the order of our imports, without paying TensorFlow's
    start-up once per module)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fresh_imports.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def round(self, names: list[str]) -> dict[str, tuple[str | None, set[str]]]:
        """``name -> (what went wrong or None, the modules importing it loaded)``."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(names) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"tests/fresh_imports.py ended (exit {self.proc.wait(timeout=10)})"
        return {name: (problem, set(seen)) for name, (problem, seen) in json.loads(line).items()}

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """The order a user (or an entry point, or ``python -m``) imports a module in must not
    matter: each imports alone, in a fresh interpreter, and the deferrals of ``DEFERRED``
    hold. Importing ``a.b`` runs ``a`` first; when that already loads ``a.b``, importing
    ``a.b`` alone is importing ``a``, so the packages go first and only the modules they
    do not load get an interpreter of their own (a sub-package its parent loads too): a
    fraction of the start-ups. Each "fresh interpreter" is forked from one that has loaded
    only the third-party libraries (``tests/fresh_imports.py``)."""
    modules: dict[str, Path] = {}
    for folder, top in PACKAGES:
        found = _modules(top, ROOT / "packages" / folder / "src")
        modules.update((name, path) for name, path in found.items() if not name.endswith("__main__"))
    assert {importer for importer, _ in DEFERRED} <= set(modules), "DEFERRED names a module that is gone"
    problems: dict[str, str] = {}
    loaded: dict[str, set[str]] = {}
    # packages by depth, then the other modules: each only when no package run before
    # already loaded it (importing it alone would import that package again)
    depth = max(name.count(".") for name in modules)
    rounds = [[name for name, path in modules.items() if path.name == "__init__.py"
               and name.count(".") == d] for d in range(depth + 1)]
    rounds.append([name for name, path in modules.items() if path.name != "__init__.py"])
    server = _FreshImports()
    try:
        for round_ in rounds:
            round_ = [name for name in round_ if name not in loaded and not any(
                name in loaded.get(parent, ()) for parent in _parents(name))]
            for name, (problem, seen) in server.round(round_).items():
                if problem:
                    problems[name] = problem
                loaded[name] = seen
    finally:
        server.close()
    for name in modules:  # what importing a module loads: its own run's, else its package's
        if name not in loaded:
            loaded[name] = next(loaded[p] for p in _parents(name) if name in loaded.get(p, ()))
    for (importer, target) in DEFERRED:
        if target in loaded[importer]:
            problems[importer] = f"loads {target}, which DEFERRED says it keeps out"
    assert not problems, "modules that fail to import alone:\n  " + "\n  ".join(
        f"{name}: {problem}" for name, problem in sorted(problems.items()))


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a"]``: the packages importing ``name`` runs first, nearest first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


# -- tnt-core through its public names only -------------------------------------------------

#: where code that uses tnt-core lives, besides tnt-core itself (whose own tests may look
#: inside it): every other package's sources and tests, and the repository's
OUTSIDE_TNT_CORE = [*(f"packages/{folder}" for folder, _ in PACKAGES if folder != "tnt-core"),
                    "tests", "benchmarks", "examples", "ci", "docs"]
_SKIPPED_PARTS = {"build", "_build", "__pycache__"}


def _outside_sources() -> list[Path]:
    found = []
    for folder in OUTSIDE_TNT_CORE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if not any(part in _SKIPPED_PARTS or part.startswith(".") for part in parts):
                found.append(path)
    return found


def _private_uses(tree: ast.AST, public: set[str]) -> list[tuple[int, str]]:
    """Where ``tree`` uses tnt-core other than through ``public`` (its ``__all__``) and
    ``tnt_core.testing``: ``(line, what)``. Reads imports (``import tnt_core.x``, ``from
    tnt_core.x import y``, ``from tnt_core import y``) and attributes of a name bound to
    the package (``tnt_core.x``, also when imported under another name)."""
    def allowed(dotted: str) -> bool:  # a name below tnt_core; dunders are Python's own
        return dotted == "testing" or dotted.startswith("testing.") or (
            dotted.startswith("__") and dotted.endswith("__"))

    found = []
    aliases = {"tnt_core"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tnt_core":
                    aliases.add(alias.asname or "tnt_core")
                elif alias.name.startswith("tnt_core.") and not allowed(alias.name[9:]):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("tnt_core.") and not allowed(node.module[9:]):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "tnt_core":
                found += [(node.lineno, f"from tnt_core import {alias.name}")
                          for alias in node.names if alias.name not in public and not allowed(alias.name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and node.attr not in public and not allowed(node.attr):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(found)


def test_the_public_names_checker_finds_every_way_in():
    """The checker itself: each way of reaching past ``__all__`` is found, the public
    names and ``tnt_core.testing`` pass."""
    source = ("import tnt_core\nimport tnt_core as core\nimport tnt_core._backend\n"
              "import tnt_core.testing.suite\nfrom tnt_core._settings import bad_input\n"
              "from tnt_core import CommError, _errors, settings\nfrom tnt_core.testing import launch_ranks\n"
              "x = tnt_core.CommError, tnt_core._native.MAX_TAG, core.native, tnt_core.testing, "
              "tnt_core.__all__\n")
    got = _private_uses(ast.parse(source), {"CommError"})
    assert got == [(3, "import tnt_core._backend"), (5, "from tnt_core._settings import ..."),
                   (6, "from tnt_core import _errors"), (6, "from tnt_core import settings"),
                   (8, "core.native"), (8, "tnt_core._native")], got


def test_other_packages_use_tnt_core_through_its_public_names_only():
    """pluggy's way: public names in ``tnt_core/__init__.py``, the modules behind them
    private; so tnt-core can move code between its modules without breaking anyone."""
    import tnt_core

    public = set(tnt_core.__all__)
    sources = _outside_sources()
    assert len(sources) > 100, "the scan found too few files: has the layout moved?"
    texts = {path: path.read_text() for path in sources}
    problems = [f"{path.relative_to(ROOT)}:{line}: {what}" for path, text in texts.items()
                if "tnt_core" in text  # no other way to reach it: the rest need no parse
                for line, what in _private_uses(ast.parse(text, str(path)), public)]
    assert not problems, ("tnt-core used other than through its public names (export the name "
                          "from tnt_core/__init__.py if it is a contract):\n  " + "\n  ".join(problems))
