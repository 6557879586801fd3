"""The import graph runs one way: the integrations and the core (``rlk``) reach kernel packages
only through plugins, and the shared kernels (``rlk_triton``) know none of their vendor users.

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
