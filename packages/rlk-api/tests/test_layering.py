"""The import graph runs one way: the integrations and the core (``rlk``) reach kernel packages
only through plugins, the shared kernels (``rlk_triton``) know none of their vendor users, and
inside rlk-api no two modules import each other, directly or through others (no circle).

Reads the sources with ``ast`` (nothing is imported): ``import x``, ``from x import y`` and
``importlib.import_module("x")`` / ``__import__("x")`` with a literal name, anywhere in a file
(inside functions too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]

#: source folder -> top-level packages its files must not import.
FORBIDDEN = {
    "rlk-api/src/rlk": ("rlk_triton", "rlk_cuda", "rlk_rocm", "rlk_ascend"),
    "rlk-api/src/rlk_cli.py": ("rlk_triton", "rlk_cuda", "rlk_rocm", "rlk_ascend"),
    "rlk-api/src/rlk_commands.py": ("rlk_triton", "rlk_cuda", "rlk_rocm", "rlk_ascend"),
    "rlk-triton/src/rlk_triton": ("rlk_cuda", "rlk_rocm", "rlk_ascend"),
    "rlk-reference/src/rlk_reference": ("rlk", "rlk_triton", "rlk_cuda", "rlk_rocm", "rlk_ascend"),
    # The integrations reach kernels through rlk only.
    "rlk-integrations/src/rlk_integrations": ("rlk_triton", "rlk_cuda", "rlk_rocm", "rlk_ascend"),
    "rlk-integrations/src/rlk_integrations_cli.py": ("rlk_triton", "rlk_cuda", "rlk_rocm"),
}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``, relative imports left out."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            f, arg = node.func, node.args[0]
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if (
                name in ("import_module", "__import__", "find_spec")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                found.append((node.lineno, arg.value))
    return found


def violations(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    assert files, f"no sources under {path}"
    bad = []
    for f in files:
        for line, mod in imported_modules(f.read_text()):
            if mod.split(".")[0] in forbidden:
                bad.append(f"{f.relative_to(PACKAGES)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_no_upward_or_vendor_imports(where):
    assert violations(PACKAGES / where, FORBIDDEN[where]) == []


def test_the_scan_sees_every_import_form():
    src = (
        "import rlk_triton\n"
        "from rlk_cuda.tables import NVIDIA\n"
        "def f():\n"
        "    import rlk_rocm.plugin as p\n"
        "    importlib.import_module('rlk_triton.gemm')\n"
        "from . import sibling\n"
    )
    mods = [m for _, m in imported_modules(src)]
    assert mods == ["rlk_triton", "rlk_cuda.tables", "rlk_rocm.plugin", "rlk_triton.gemm"]


def _distributions() -> dict[str, str]:
    """top-level package or module -> the distribution folder (``packages/<dist>``) holding it."""
    owner = {}
    for src in sorted(PACKAGES.glob("*/src")):
        for top in src.iterdir():
            if top.suffix == ".py" or (top.is_dir() and (top / "__init__.py").exists()):
                owner[top.stem] = src.parent.name
    return owner


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private name (a part starting with ``_``) that ``source``
    imports: ``import a._b``, ``from a._b import c``, ``from a import _b``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(ln, n) for ln, n in found if any(p.startswith("_") for p in n.split(".")[1:])]


def private_crossings() -> set[str]:
    owner = _distributions()
    bad = set()
    for f in sorted(PACKAGES.glob("*/src/**/*.py")):
        dist = f.relative_to(PACKAGES).parts[0]
        for _, name in private_imports(f.read_text()):
            top = name.split(".")[0]
            if top in owner and owner[top] != dist:
                bad.add(f"{f.relative_to(PACKAGES)} imports {name}")
    return bad


def test_no_private_name_crosses_a_distribution():
    # What another distribution needs is a documented public name (rlk.ops.CATALOG,
    # rlk.ops.REJECT_OPTIONS, rlk_triton.gemm.gemm_config, rlk.validate, ...).
    assert private_crossings() == set()


def test_the_private_scan_sees_every_form():
    src = "import rlk._ops\nfrom rlk._catalog import CATALOG\nfrom rlk.bench import _timing\n"
    src += "from rlk import ops\nfrom . import _sibling\n"
    assert [n for _, n in private_imports(src)] == [
        "rlk._ops",
        "rlk._catalog.CATALOG",
        "rlk.bench._timing",
    ]


#: Source folders (``packages/<dist>/src``) whose modules import one another without a circle:
#: every import, inside functions too, runs one way.
ACYCLIC = ("rlk-api/src",)


def module_files(src: Path) -> dict[str, Path]:
    """dotted module name -> file, for every module under ``src`` (a package is its
    ``__init__.py``)."""
    found = {}
    for f in sorted(src.rglob("*.py")):
        parts = f.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def module_graph(src: Path) -> dict[str, set[str]]:
    """module -> the modules under ``src`` it imports (the forms of :func:`imported_modules`,
    relative imports included). ``from a import b`` imports ``a.b`` where that is a module, else
    ``a``; importing ``a.b`` is not counted as importing ``a`` (every module would otherwise sit
    in a circle with its package's ``__init__``)."""
    files = module_files(src)
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                targets += [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, (ast.Import, ast.Call)):
                targets += [m for _, m in imported_modules(ast.unparse(node))]
        deps = set()
        for t in targets:
            while t and t not in files:  # the deepest module of the tree the name names
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per group of modules that import one another, as its shortest path from the
    group's first module back to it (``["a", "b", "a"]``)."""

    def path(start: str, goal: str) -> list[str] | None:
        came = {start: None}
        todo = [start]
        while todo:
            node = todo.pop(0)
            for nxt in sorted(graph[node]):
                if nxt == goal:
                    out = [goal]
                    while node is not None:
                        out.append(node)
                        node = came[node]
                    return out[::-1]
                if nxt not in came:
                    came[nxt] = node
                    todo.append(nxt)
        return None

    found, done = [], set()
    for start in sorted(graph):
        loop = None if start in done else path(start, start)
        if loop:
            found.append(loop)
            done |= {n for n in graph if path(start, n) and path(n, start)}
    return found


@pytest.mark.parametrize("src", ACYCLIC)
def test_no_import_circle(src):
    assert [" -> ".join(c) for c in circles(module_graph(PACKAGES / src))] == []


def test_the_circle_scan_finds_every_circle(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "def f():\n    from pkg.sub import c\n",  # (inside a function)
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\nimport torch\n",  # (relative)
        "pkg/d.py": "importlib.import_module('pkg.e')\n",
        "pkg/e.py": "from pkg.d import thing\nimport pkg.a\n",
        "top.py": "import pkg\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_graph(tmp_path)
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["top"] == {"pkg"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
    assert circles({**graph, "pkg.sub.c": set(), "pkg.e": {"pkg.a"}}) == []
