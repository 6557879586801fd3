"""``rlk_integrations`` is four layers whose imports run one way: ``models`` < ``engine`` <
``adapters`` < ``tools`` (a module imports its own layer and the layers below it), with no import
circle between modules and no private name of another distribution.

Reads the sources with ``ast`` (nothing is imported). Every import counts, inside functions and
under ``TYPE_CHECKING`` too: ``import x``, ``from x import y``, relative imports and
``importlib.import_module("x")`` with a literal name. The command-line module beside the package
(``rlk_integrations_cli``) imports the engine registry at import time and nothing else of the
package (``rlk --help`` must not import torch); the command it runs imports its tool when it
runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = Path(__file__).resolve().parents[2]
PKG = "rlk_integrations"
CLI = "rlk_integrations_cli"
#: Bottom to top: a module may import its own layer and those before it.
LAYERS = ("models", "engine", "adapters", "tools")
#: What the command-line module may import of the package at import time (torch-free).
CLI_TOP_LEVEL = ("rlk_integrations.engine.registry",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in sorted((SRC / PKG).rglob("*.py"))}
    found[CLI] = SRC / f"{CLI}.py"
    return found


def imports(source: str, name: str, is_package: bool) -> list[tuple[int, str, bool]]:
    """``(line, imported module or module.name, at import time)`` for every import in
    ``source`` (module ``name``), relative ones resolved; "at import time": not inside a
    function."""
    tree = ast.parse(source)
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        top = id(node) not in in_function
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # "from a import b": b may be a module of a, or a name defined in a.
            found += [(node.lineno, f"{base}.{a.name}", top) for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            f, arg = node.func, node.args[0]
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            if called in ("import_module", "__import__") and literal:
                found.append((node.lineno, arg.value, top))
    return found


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that ``target`` (a module, or a module's attribute) names."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def edges(known: dict[str, Path]) -> list[tuple[str, str, int, bool]]:
    """``(importer, imported, line, at import time)`` between modules of the package. A module
    importing its own package (``from pkg import sub`` resolved to ``pkg.sub``) is an edge to
    the submodule."""
    out = []
    for name, path in known.items():
        for line, target, top in imports(path.read_text(), name, path.name == "__init__.py"):
            to = resolve(target, known)
            if to is not None and to != name:
                out.append((name, to, line, top))
    return out


def layer(name: str) -> int | None:
    """The index in :data:`LAYERS` of module ``name``'s layer; None outside the layers."""
    parts = name.split(".")
    if parts[0] != PKG or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def layer_violations(known: dict[str, Path]) -> list[str]:
    bad = []
    for src, dst, line, top in edges(known):
        where = f"{src}:{line} imports {dst}"
        if src == CLI:
            if top and dst not in CLI_TOP_LEVEL and dst != PKG and dst != f"{PKG}.engine":
                bad.append(f"{where} at import time (only {', '.join(CLI_TOP_LEVEL)})")
            continue
        if dst == CLI:
            bad.append(f"{where}: the command-line module is above every layer")
            continue
        lo, hi = layer(dst), layer(src)
        if lo is not None and hi is not None and lo > hi:
            bad.append(f"{where}: {LAYERS[hi]} is below {LAYERS[lo]}")
        if hi is None and src != PKG and dst != PKG:
            bad.append(f"{where}: {src} is in no layer")
    return bad


def circles(known: dict[str, Path]) -> list[list[str]]:
    """Each import circle between modules, once (a package and its submodules included:
    ``pkg`` -> ``pkg.sub`` -> ``pkg`` is a circle)."""
    graph: dict[str, set[str]] = {m: set() for m in known}
    for src, dst, _, _ in edges(known):
        graph[src].add(dst)
    found, seen = [], set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    found.append([*cycle, n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def foreign_tops() -> set[str]:
    """The top-level packages and modules of this repository's other distributions."""
    return {
        top.stem
        for src in PACKAGES.glob("*/src")
        if src.parent.name != "rlk-integrations"
        for top in src.iterdir()
        if top.suffix == ".py" or (top / "__init__.py").exists()
    }


def private_uses(source: str, foreign: set[str]) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of each private name (``_x``, not ``__x__``) of the top-level
    packages ``foreign`` that ``source`` reaches: by import (``import a._b``, ``from a._b
    import c``, ``from a import _b``) or by attribute on a name bound to such a module
    (``a._b`` after ``import a.b``; ``P._b`` after ``import a.b as P``; ``m._b`` after ``from a
    import m``)."""

    def private(dotted: str) -> str | None:
        """``dotted`` up to its first private part, or None when it has none."""
        parts = dotted.split(".")
        for i, p in enumerate(parts[1:], 1):
            if p.startswith("_") and not p.endswith("__"):
                return ".".join(parts[: i + 1])
        return None

    tree = ast.parse(source)
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in foreign:
                    if private(a.name):
                        found.append((node.lineno, private(a.name)))
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.level
            and node.module.split(".")[0] in foreign
        ):
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                if private(dotted):
                    found.append((node.lineno, private(dotted)))
                bound[a.asname or a.name] = dotted
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                hit = private(".".join([bound[base.id], *reversed(chain)]))
                if hit and (node.lineno, hit) not in found:
                    found.append((node.lineno, hit))
    return sorted(found)


def private_crossings(known: dict[str, Path]) -> list[str]:
    foreign = foreign_tops()
    return [
        f"{name}:{line} uses {dotted}, private to another distribution"
        for name, path in known.items()
        for line, dotted in private_uses(path.read_text(), foreign)
    ]


def test_every_module_is_in_a_layer():
    known = modules()
    assert {n.split(".")[1] for n in known if n.count(".") >= 1} == set(LAYERS)
    stray = [n for n in known if n not in (PKG, CLI) and layer(n) is None]
    assert stray == []


def test_imports_run_one_way():
    assert layer_violations(modules()) == []


def test_no_import_circle():
    assert circles(modules()) == []


def test_no_private_name_of_another_distribution():
    # What the integrations need of rlk is a public name (rlk.parallel.check_leaves, ...).
    assert private_crossings(modules()) == []


def test_the_scans_see_what_they_must():
    # A wrong-way import, at import time or inside a function, and relative.
    src = (
        "from rlk_integrations.tools import zoo\n"
        "def f():\n"
        "    from ..adapters import trl\n"
        "    importlib.import_module('rlk_integrations.engine.paged')\n"
    )
    got = imports(src, "rlk_integrations.models.moe", is_package=False)
    assert got == [
        (1, "rlk_integrations.tools.zoo", True),
        (3, "rlk_integrations.adapters.trl", False),
        (4, "rlk_integrations.engine.paged", False),
    ]
    # Private names by import and by attribute, through every binding form.
    src = (
        "import rlk.parallel as P\n"
        "import rlk.parallel\n"
        "from rlk import parallel\n"
        "from rlk.parallel import _leaves\n"
        "P._group_info(None)\n"
        "rlk.parallel._tp_leaves(8, 2)\n"
        "parallel._GatherColumns.apply\n"
        "P.shard(x, 0, rank=0, world_size=1)\n"
        "torch._dynamo.reset()\n"
    )
    assert [d for _, d in private_uses(src, {"rlk"})] == [
        "rlk.parallel._leaves",
        "rlk.parallel._group_info",
        "rlk.parallel._tp_leaves",
        "rlk.parallel._GatherColumns",
    ]
