"""Developer sessions: tests, lint, conformance, demo, bench.

On CPU machines everything installs against constraints.txt (torch 2.13.0 CPU build, the
Triton whose interpreter runs the kernels), never an unpinned torch. On the GPU machine, where
nothing can be downloaded, install with `pip install --no-deps --no-build-isolation -e
packages/<p>` instead (see docs/gpu.md).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

PACKAGES = [
    "packages/rlk-reference",
    "packages/rlk-api",
    "packages/rlk-triton",
    "packages/rlk-cuda",
    "packages/rlk-rocm",
    "packages/rlk-ascend",
]
BACKENDS = ["reference", "triton", "cuda", "rocm", "ascend"]


def _install(session: nox.Session, *extra: str) -> None:
    args = ["-c", "constraints.txt"]
    for p in PACKAGES:
        args += ["-e", p]
    session.install(*args, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, cross-package and conformance tests on CPU (Triton kernels under the interpreter)."""
    _install(session, "transformers", "megatron-core", "pytest", "pytest-xdist")
    session.run("rlk", "info")
    session.run(
        "pytest",
        "-n",
        "2",
        "-q",
        *session.posargs,
        env={"RLK_VALIDATE": "1", "PYTHONHASHSEED": "0"},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("backend", BACKENDS)
def conformance(session: nox.Session, backend: str) -> None:
    """`rlk conformance` for one backend (quick shapes; pass --full after -- on a GPU)."""
    _install(session)
    session.run("rlk", "conformance", "--backend", backend, *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: backends, then rollout vs training recompute with stock ops and with rlk.

    On a CPU machine `rlk consistency` uses the tiny model under Triton's interpreter (a few
    minutes); on a GPU pass a bigger built-in config after --, e.g. `-- --model qwen2-0.5b`.
    """
    _install(session, "transformers")
    session.run("rlk", "info")
    session.run("rlk", "consistency", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark harness (needs a GPU; prints a table per op family)."""
    _install(session)
    session.run("python", "benchmarks/run.py", *session.posargs)
