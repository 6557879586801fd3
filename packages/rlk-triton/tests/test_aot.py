"""rlk aot (rlk_triton.aot): every kernel compiled for AMD CDNA 2/3/4 and NVIDIA sm_80/90/100 on
this CPU, the contract checked in the generated code; each assertion fails on a planted
violation (aot_planted.py); every rlk kernel is built through rlk's jit; Triton's fusion default
changes no bit.

The smoke compile here (each op's first case and first config set, gfx942 and sm_90, no cache)
runs with the other tests; stage 2b of ``nox -s tests`` (``nox -s aot``) runs the matrix: every
config set of every table, six targets.
"""

from __future__ import annotations

import functools
import glob
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from rlk_triton import _triton, aot, aot_compile, aot_record, backend

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
import aot_planted as planted  # noqa: E402

ROOT = HERE.parents[2]


def _record(launch, platform: str, call: str, config: int) -> list[aot_record.Launch]:
    out: list[aot_record.Launch] = []

    def sink(kernel, args, kwargs):
        out.append(aot_record.launch_of(kernel, args, kwargs, platform, call, config))

    with aot_record.recording(sink):
        launch()
    return out


def _configs(n: int, tables: list[str]) -> list[dict]:
    return [{"op": "planted", "configs": {"planted.fwd": {"i": i}}, "tables": tables}
            for i in range(n)]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Reading the generated code
# --------------------------------------------------------------------------------------------


def test_analyse_reads_atomics_and_matrix_kinds():
    amd = {"amdgcn": "global_atomic_add_f32 v1, v2\n v_mfma_f32_32x32x8_bf16 a[0:15]",
           "llir": "%1 = atomicrmw fadd ptr addrspace(1) %p, float %v acq_rel"}  # fmt: skip
    assert aot_compile.analyse(amd) == {
        "float_atomics": ["global_atomic_add_f32", "llir: atomicrmw fadd float"],
        "matrix": ["v_mfma_f32_32x32x8_bf16"],
    }
    # gfx90a: a compare-and-swap loop counts where the IR holds a float atomic, not otherwise.
    cas = "global_atomic_cmpswap v0, v[2:3]"
    assert aot_compile.analyse({"amdgcn": cas, "llir": amd["llir"]})["float_atomics"] == [
        "global_atomic_cmpswap", "llir: atomicrmw fadd float"]  # fmt: skip
    assert aot_compile.analyse({"amdgcn": cas, "llir": "atomicrmw add ptr %p, i32 1"}) == {
        "float_atomics": [], "matrix": []}  # fmt: skip
    ptx = ("red.global.gpu.acq_rel.add.f32 [%rd1], %f1;\n atom.global.gpu.acq_rel.add.u32 %r1;\n"
           "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};\n"
           "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\n"
           "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {...};")  # fmt: skip
    got = aot_compile.analyse({"ptx": ptx})
    assert got["float_atomics"] == ["red.global.gpu.acq_rel.add.f32"]
    # wgmma's N follows the tile and is folded; K and the types are kept.
    assert got["matrix"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                             "wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Planted violations: each assertion of the contract fails on one
# --------------------------------------------------------------------------------------------


def test_cache_keys_do_not_hold_the_triton_installation_path():
    """A cache written in one checkout answers in another (CI's clone, its own virtual
    environment): the bundled libraries Triton passes in its options are keyed by file name."""
    import types

    def options(prefix):
        libs = (("libdevice", f"{prefix}/triton/backends/nvidia/lib/libdevice.10.bc"),)
        return types.SimpleNamespace(num_warps=4, extern_libs=libs, arch="sm90")

    here, there = (aot_compile.portable_options(options(p)) for p in ("/a/.venv", "/b/.nox"))
    assert here == there
    assert ("extern_libs", (("libdevice", "libdevice.10.bc"),)) in here
    assert not any("/" in repr(v) for _, v in here)


def test_planted_float_atomic_is_a_violation(monkeypatch):
    x, out = planted.inputs()["x"], torch.zeros(1)
    launches = []
    for platform in ("nvidia", "amd"):
        launches += _record(lambda: planted.atomic_sum_kernel[(2,)](x, out, 64, BLOCK=32),
                            platform, "sum", 0)  # fmt: skip
    targets = ("gfx90a", "gfx942", "sm_90")
    report, _ = aot.compile_report(launches, _configs(1, ["triton"]), targets)
    assert [r["ok"] for r in report["rows"]] == [True] * 3
    found = {r["target"]: r["float_atomics"] for r in report["rows"]}
    assert "global_atomic_add_f32" in found["gfx942"]
    assert "global_atomic_cmpswap" in found["gfx90a"]  # the CAS loop of CDNA 2
    assert any(a.startswith(("red.", "atom.")) and a.endswith(".f32") for a in found["sm_90"])
    bad = aot.violations(report)
    assert len(bad) == 3 and all(v.startswith("floating-point atomics") for v in bad), bad
    # A named, ordered accumulation is allowed.
    monkeypatch.setitem(aot.ORDERED_ACCUMULATIONS, "aot_planted:atomic_sum_kernel", "planted")
    assert aot.violations(report) == []


@pytest.mark.parametrize(
    "variant",
    [
        ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 64, "BLOCK_N": 64}),  # block sizes
        ({"matrix_instr_nonkdim": 16}, {"matrix_instr_nonkdim": 32}),  # the MFMA option
    ],
    ids=["block_sizes", "matrix_instr_nonkdim"],
)
def test_planted_table_mixing_mfma_shapes_is_a_violation(variant):
    ins = planted.inputs()
    a, b = ins["a"], ins["b"]
    launches = []
    for i, cfg in enumerate(variant):
        meta = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, **cfg}
        c = torch.empty(meta["BLOCK_M"], meta["BLOCK_N"])
        launches += _record(functools.partial(planted.dot_kernel[(1,)], a, b, c, **meta),
                            "amd", "dot", i)  # fmt: skip
    report, _ = aot.compile_report(launches, _configs(2, ["rocm"]), ("gfx942",))
    kinds = [r["matrix"] for r in report["rows"]]
    assert all(r["ok"] for r in report["rows"]) and kinds[0] != kinds[1], kinds
    assert all(k and k[0].startswith("v_mfma_f32_") for k in kinds), kinds
    bad = aot.violations(report)
    assert len(bad) == 1 and bad[0].startswith("matrix instructions differ"), bad


def test_planted_kernel_that_does_not_compile_for_a_claimed_target():
    x = torch.zeros(64, dtype=torch.int32)

    def launch():  # recorded first; the interpreter cannot run inline assembly
        with pytest.raises(Exception, match="inline_asm"):
            planted.nvidia_only_kernel[(1,)](x, 64, BLOCK=64)

    launches = _record(launch, "nvidia", "ptx", 0) + _record(launch, "amd", "ptx", 0)
    report, _ = aot.compile_report(launches, _configs(1, ["triton"]), ("gfx942", "sm_90"))
    ok = {r["target"]: r["ok"] for r in report["rows"]}
    assert ok == {"gfx942": False, "sm_90": True}
    bad = aot.violations(report)
    assert len(bad) == 1 and bad[0].startswith("does not compile") and "gfx942" in bad[0]
    # The same failure where no table holding the config claims the target is no violation.
    report["configs"] = _configs(1, ["cuda"])
    assert aot.violations(report) == []


def test_a_ptxas_failure_is_a_compile_result():
    """ptxas rejects the code: the row says so (Triton prints the PTX to the worker's stdout,
    which must not spoil the worker's results)."""
    x = torch.zeros(64, dtype=torch.int32)

    def launch():
        with pytest.raises(Exception, match="inline_asm"):
            planted.ptxas_error_kernel[(1,)](x, 64, BLOCK=64)

    report, _ = aot.compile_report(_record(launch, "nvidia", "ptxas", 0),
                                   _configs(1, ["triton"]), ("sm_90",))  # fmt: skip
    (row,) = report["rows"]
    assert not row["ok"] and row["error"].startswith("PTXASError: ") and "no_such_op" in row[
        "error"], row["error"]  # fmt: skip
    bad = aot.violations(report)
    assert len(bad) == 1 and bad[0].startswith("does not compile") and "sm_90" in bad[0]


def test_a_front_end_error_names_its_cause():
    """A CompilationError's own message ends with a caret under the source: the row gives its
    cause (here the input precision that gfx90a and gfx950 refuse and gfx942 accepts)."""
    a = torch.zeros(32, 32, dtype=torch.bfloat16)
    launch = functools.partial(planted.tf32_dot_kernel[(1,)], a, a, torch.empty(32, 32), BLOCK=32)
    report, _ = aot.compile_report(_record(launch, "amd", "tf32", 0), _configs(1, ["rocm"]),
                                   ("gfx90a", "gfx942"))  # fmt: skip
    rows = {r["target"]: r for r in report["rows"]}
    assert rows["gfx942"]["ok"] and not rows["gfx90a"]["ok"]
    assert rows["gfx90a"]["error"].startswith("CompilationError at ")
    assert "AssertionError: input_precision must be one of" in rows["gfx90a"]["error"]


# --------------------------------------------------------------------------------------------
# Every kernel through rlk's jit
# --------------------------------------------------------------------------------------------


def test_every_rlk_kernel_is_built_by_rlk_jit():
    mods = list(backend._modules().values())
    assert len(mods) > 10
    assert aot_record.bare_kernels(mods) == []
    # Every source file of every rlk distribution, imported here or not (engine adapters).
    pattern = str(ROOT / "packages" / "*" / "src" / "**" / "*.py")
    files = [f for f in glob.glob(pattern, recursive=True) if not f.endswith("/_triton.py")]
    assert len(files) > 50
    assert aot_record.bare_jit_sources(files) == []


def test_a_bare_triton_jit_kernel_is_found():
    assert aot_record.bare_kernels([planted]) == ["aot_planted:bare_kernel"]
    lines = [int(s.rsplit(":", 1)[1]) for s in aot_record.bare_jit_sources([planted.__file__])]
    src = pathlib.Path(planted.__file__).read_text().splitlines()
    assert [src[n - 1].strip() for n in lines] == ["@triton.jit"]


# --------------------------------------------------------------------------------------------
# Triton's fusion default changes no bit
# --------------------------------------------------------------------------------------------


_FUSION = """
import pickle, sys
from rlk_triton import aot_compile
args = pickle.loads(sys.stdin.buffer.read())
out = {}
for name, kw in (("aot_planted:mul_add_kernel", {"enable_fp_fusion": False}),
                 ("aot_planted:bare_kernel", {})):
    k = aot_compile._kernel(name)
    for t in ("sm_90", "gfx942"):
        asm = aot_compile._compile_one(k, args, dict(kw, BLOCK=64), t)[1].asm
        out[(name, t)] = asm.get("ptx") or asm.get("amdgcn")
sys.stdout.buffer.write(pickle.dumps(out))
"""


def _fusion_code(default: str) -> dict:
    """The generated code of ``x * y + x`` for sm_90 and gfx942, in a subprocess with
    ``TRITON_DEFAULT_FP_FUSION=default``: launched as rlk's jit launches it
    (``enable_fp_fusion=False``), and as a bare triton.jit launches it (Triton's default)."""
    import pickle

    x = planted.inputs()["x"]
    args = tuple(aot_record._stand_in(t) for t in (x, x, torch.empty_like(x))) + (64,)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION=default)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    res = subprocess.run([sys.executable, "-c", _FUSION], input=pickle.dumps(args), env=env,
                         capture_output=True, check=True)  # fmt: skip
    return pickle.loads(res.stdout)


def test_fusion_default_does_not_change_the_generated_code():
    code = {d: _fusion_code(d) for d in ("0", "1")}
    rlk = "aot_planted:mul_add_kernel"
    # rlk's launches: the same code whichever default Triton takes, and no contraction.
    for t in ("sm_90", "gfx942"):
        assert code["0"][(rlk, t)] == code["1"][(rlk, t)], t
    assert "fma.rn.f32" not in code["1"][(rlk, "sm_90")]
    # Negative control: a launch that leaves the option to Triton (a bare triton.jit's) gets
    # FMAs when the default is on, so the comparison above would see such a kernel.
    bare = "aot_planted:bare_kernel"
    assert "fma.rn.f32" in code["1"][(bare, "sm_90")]
    assert "fma.rn.f32" not in code["0"][(bare, "sm_90")]
    assert code["0"][(bare, "gfx942")] != code["1"][(bare, "gfx942")]


_BITS = """
import hashlib, sys, torch
from rlk import testing
from rlk.testing import case_tools, checks
from rlk_triton import backend
impl = backend.make_impl(backend.default_table())
h = hashlib.sha256()
for op in sys.argv[1:]:
    for case in testing.build_cases(op, True, torch.device("cpu")).invariance[:1]:
        for k, v in sorted(checks.run_case(impl.ops[op], case_tools.batch_of(case)).items()):
            h.update(k.encode()); h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
def test_fusion_default_does_not_change_bits_under_the_interpreter():
    """The kit's first case of a few ops, forward and backward, in a subprocess per setting of
    TRITON_DEFAULT_FP_FUSION (and unset): the same bits."""
    ops = ["linear", "rms_norm", "silu_and_mul", "apply_rotary", "logprobs", "kl_penalty"]
    digests = set()
    for default in ("0", "1", None):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
        if default is not None:
            env["TRITON_DEFAULT_FP_FUSION"] = default
        res = subprocess.run([sys.executable, "-c", _BITS, *ops], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        digests.add(res.stdout.strip())
    assert len(digests) == 1, digests


# --------------------------------------------------------------------------------------------
# The check itself: every kernel of every op, every config set, compiled
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded():
    """Every op's launches (all cases, every config set of every table, both vendors)."""
    return aot_record.record()


def test_every_launched_kernel_is_recorded(recorded):
    """Every kernel an rlk_triton module launches is recorded by some op (a kernel the check
    never sees would go unchecked), and each recorded kernel is one a module launches."""
    launches, configs = recorded
    launched = set(aot_record.launched_kernels(aot_record._kernel_modules()))
    found = {ln.kernel for ln in launches}
    assert launched - found == set(aot_record.NOT_RECORDED)
    assert found <= launched
    # Every config set of every table was run, on both vendors.
    tables = {t for c in configs for t in c["tables"]}
    assert {"triton", "cuda", "rocm"} <= tables
    assert {(ln.config, ln.platform) for ln in launches} == {
        (i, p) for i in range(len(configs)) for p in aot_record.PLATFORMS
    }
    assert all(ln.kwargs["enable_fp_fusion"] is False for ln in launches)


@pytest.mark.slow
def test_kernels_compile_and_keep_the_contract_smoke():
    """Each op's first case with its first config set, compiled for gfx942 and sm_90, with no
    cache (the whole matrix is stage 2b of ``nox -s tests``)."""
    launches, configs = aot_record.record(quick=True)
    first_config: dict[str, int] = {}
    first_case: dict[str, str] = {}
    some = []
    for ln in launches:
        op, case = configs[ln.config]["op"], ln.call.rsplit(" #", 1)[0]
        if first_config.setdefault(op, ln.config) == ln.config and (
            first_case.setdefault(op, case) == case
        ):
            some.append(ln)
    report, _ = aot.compile_report(some, configs, ("gfx942", "sm_90"), jobs=2)
    assert {r["kernel"] for r in report["rows"]} == {ln.kernel for ln in some}
    assert len({ln.kernel for ln in some}) > 25
    assert {r["target"] for r in report["rows"]} == {"gfx942", "sm_90"}
    assert aot.violations(report) == []
    # The GEMM uses MFMA on CDNA 3 and wgmma on Hopper for bf16.
    gemm = [r for r in report["rows"] if r["kernel"] == "rlk_triton.gemm:_matmul_kernel"]
    assert any(k.startswith("v_mfma_f32_") for r in gemm for k in r["matrix"])
    assert any(k.startswith("wgmma.") for r in gemm for k in r["matrix"])


def test_the_recorder_sees_the_launch_options():
    launches = _record(lambda: backend.make_impl(backend.default_table()).ops["rms_norm"](
        torch.randn(3, 64), torch.ones(64), 1e-6, None), "nvidia", "rms", 0)  # fmt: skip
    assert launches and all(ln.kwargs["enable_fp_fusion"] is False for ln in launches)
    assert _triton.LAUNCH_RECORDER is None


def test_an_amd_launch_leaves_out_the_nvidia_register_cap():
    """Attention's forward config with ``maxnreg`` (paged decode at head dim 64 takes it on
    NVIDIA) launches without it as on an AMD GPU: Triton's AMD backend has no such option."""
    from rlk_triton import attention, tuning

    cfg = next(c for c in attention._FWD_CONFIGS if "maxnreg" in c)
    forced = {"paged_attention.fwd": cfg}
    paged = backend.make_impl(backend.default_table()).ops["paged_attention"]
    for platform, cap in (("nvidia", [cfg["maxnreg"]]), ("amd", [None])):
        caps = []

        def sink(kernel, args, kwargs, caps=caps):
            if aot_record.kernel_name(kernel) == "rlk_triton.attention_fwd:_fwd_kernel":
                caps.append(kwargs.get("maxnreg"))
            return True  # recorded, not run

        with aot_record.recording(sink), aot_record._platform(platform), \
                tuning.force("paged_attention", forced):  # fmt: skip
            aot_record._paged_store(paged)
        assert caps == cap, platform
