"""Packaging: wheels of all seven packages build, and ``pip install "rlk[<extra>]"`` from a local
wheelhouse into a fresh virtual environment pulls exactly the right rlk packages.

Why not ``python -m venv --system-site-packages``: the development environment has the rlk
packages installed (editable), so in such a venv pip answers "requirement already satisfied" for
every rlk package and the test could not fail. Instead the venv gets one ``.pth`` line naming a
directory of links to this interpreter's site-packages *minus* everything rlk: torch, pluggy,
triton and numpy are found installed (nothing is downloaded; ``--no-index``), while rlk, its
backends and their entry points can only come from the wheels just built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "rlk-reference",
    "rlk-api",
    "rlk-triton",
    "rlk-cuda",
    "rlk-rocm",
    "rlk-ascend",
    "rlk-integrations",
]
DISTS = {"rlk", "rlk-reference", "rlk-triton", "rlk-cuda", "rlk-rocm", "rlk-ascend",
         "rlk-integrations"}  # fmt: skip

#: extra -> (rlk distributions it must install, backends registered by their entry points).
EXPECTED = {
    "cuda": ({"rlk", "rlk-reference", "rlk-triton", "rlk-cuda"}, {"reference", "triton", "cuda"}),
    "rocm": ({"rlk", "rlk-reference", "rlk-triton", "rlk-rocm"}, {"reference", "triton", "rocm"}),
    "ascend": ({"rlk", "rlk-reference", "rlk-ascend"}, {"reference", "ascend"}),
    # The integrations (transformers comes from the environment, as torch does).
    "transformers": ({"rlk", "rlk-reference", "rlk-integrations"}, {"reference"}),
    # The integrations with TRL (TRL too comes from the environment).
    "trl": ({"rlk", "rlk-reference", "rlk-integrations"}, {"reference"}),
}
#: extra -> the tuning tables its vendor package declares to rlk-triton (entry points).
TABLES = {"cuda": ["cuda"], "rocm": ["rocm"], "ascend": [], "transformers": [], "trl": []}

_RLK_ENTRY = re.compile(r"^(rlk([-_.].*)?|__editable__.*|.*\.pth|.*\.egg-link)$", re.IGNORECASE)

_PROBE = r"""
import importlib.metadata as md, json, sys
import rlk
from rlk import selection
dists = {d.metadata["Name"].lower(): d.version for d in md.distributions()
         if d.metadata["Name"].lower().startswith("rlk")}
try:
    npu = md.version("torch-npu")
except md.PackageNotFoundError:
    npu = None
commands = sorted(ep.name for ep in md.entry_points(group="rlk.commands"))
tables = sorted(ep.name for ep in md.entry_points(group="rlk_triton.tables"))
print(json.dumps({"dists": dists, "torch_npu": npu, "rlk_file": rlk.__file__,
                  "backends": sorted(selection.registry().specs), "commands": commands,
                  "tables": tables}))
"""


def _run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """Wheels of every package, each built from a copy of its sources: setuptools builds in the
    source tree (build/, *.egg-info), and test processes running side by side (pytest -n) must
    not build in the same directory."""
    out = tmp_path_factory.mktemp("wheelhouse")
    src = tmp_path_factory.mktemp("sources")
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    for p in PACKAGES:
        shutil.copytree(ROOT / "packages" / p, src / p, ignore=skip)
        _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "-w", str(out), str(src / p))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def site_without_rlk(tmp_path_factory) -> Path:
    """Links to every entry of this interpreter's site-packages except rlk's."""
    farm = tmp_path_factory.mktemp("site_without_rlk")
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    for d in dirs:
        for entry in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            link = farm / entry
            if not _RLK_ENTRY.match(entry) and not link.exists():
                link.symlink_to(os.path.join(d, entry))
    return farm


@pytest.mark.slow
def test_wheels_build(wheelhouse):
    names = sorted(p.name for p in wheelhouse.glob("*.whl"))
    assert len(names) == len(PACKAGES), names
    built = {re.sub(r"-[^-]+-py3-none-any\.whl$", "", n).replace("_", "-") for n in names}
    assert built == DISTS


@pytest.mark.slow
@pytest.mark.parametrize("extra", sorted(EXPECTED))
def test_extra_installs_the_right_packages(extra, wheelhouse, site_without_rlk, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    py = str(venv / "bin" / "python") if os.name != "nt" else str(venv / "Scripts" / "python.exe")
    purelib = _run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    Path(purelib.stdout.strip(), "_site_without_rlk.pth").write_text(f"{site_without_rlk}\n")
    # Before: no rlk at all in the venv, so whatever is there afterwards came from the wheels.
    before = _run(py, "-c", "import importlib.util as u; print(u.find_spec('rlk') is None)")
    assert before.stdout.strip() == "True"

    _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index",
         "--find-links", str(wheelhouse), f"rlk[{extra}]")  # fmt: skip

    got = json.loads(_run(py, "-c", _PROBE, cwd=str(tmp_path)).stdout.strip().splitlines()[-1])
    dists, backends = EXPECTED[extra]
    assert set(got["dists"]) == dists
    assert all(v == "0.1.0" for v in got["dists"].values()), got["dists"]
    assert set(got["backends"]) == backends
    assert got["tables"] == TABLES[extra]
    # rlk aot comes with rlk-triton, rlk consistency with rlk-integrations, and only with them.
    commands = [c for c, d in (("aot", "rlk-triton"), ("consistency", "rlk-integrations"))
                if d in dists]  # fmt: skip
    assert got["commands"] == commands
    assert Path(got["rlk_file"]).resolve().is_relative_to(venv.resolve()), got["rlk_file"]
    assert got["torch_npu"] is None  # rlk[ascend] never pulls torch-npu: it needs CANN
