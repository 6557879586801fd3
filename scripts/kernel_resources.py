"""Registers, spills and shared memory of the attention kernels, compiled for sm_90 without a GPU.

    python3 scripts/kernel_resources.py [--maxnreg N] [--head-dims 64,128] [--loops]

Compiles ``rlk_triton.attention_fwd``'s forward (packed and paged) and
``rlk_triton.attention_bwd``'s dQ and dK/dV kernels at every
launch config of the tuning table, for an H100/H200 (sm_90), with the specialisations a real
launch gets (pointers and the harness shapes' strides divisible by 16), and prints what
``cuobjdump --dump-resource-usage`` reports: registers per thread, stack bytes (spills) and
shared memory. With those specialisations the figures match Nsight Compute's on the H200 (the
dQ kernel at head_dim 64, GQA 7: 136 registers); without them every kernel looks spilled.

``--loops`` adds, per kernel, the machine instructions of each loop body (one warp's count per
iteration, from ``cuobjdump --dump-sass``) and the ``cp.async.wait_group`` depths of its PTX
(0: an iteration waits for every copy in flight, so nothing is prefetched): the issue cost of a
tile, which bounds a latency-bound launch (a few programs, one warpgroup each, as small-batch
decode runs).

Runs on a CPU machine: Triton's wheel brings the NVIDIA compiler and ``cuobjdump``. The figures
are those of the installed Triton; the GPU image runs Triton 3.6.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (before rlk imports triton)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rlk_triton import attention, attention_bwd, attention_fwd, paged_attention  # noqa: E402

#: Integer arguments that the harness shapes make divisible by 16 (strides and head_dim).
DIV16 = {
    "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_kp", "stride_vt", "stride_vh",
    "stride_vp", "stride_ot", "stride_oh", "stride_btb", "D",
}  # fmt: skip
POINTERS = {
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16",
    "DK": "*bf16", "DV": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "CU_Q": "*i32",
    "CU_K": "*i32", "SEQ_LENS": "*i32", "BT": "*i32", "OK": "*i32", "SCR": "*fp32",
    "PART": "*fp32", "PART_ML": "*fp32",
}  # fmt: skip
FLOATS = {"qk_scale", "scale"}


def resources(kernel, consts: dict, num_warps: int, num_stages: int, maxnreg: int | None):
    """``(registers, stack bytes, shared bytes, compiled kernel)`` of ``kernel`` compiled for
    sm_90."""
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ("K_DESC", "V_DESC"):
            sig[p] = f"tensordesc<bf16[{consts['BLOCK_N']},{consts['BLOCK_D']}]>"
        elif p in POINTERS:
            sig[p] = POINTERS[p]
        else:
            sig[p] = "fp32" if p in FLOATS else "i32"
    attrs = {
        (params.index(p),): [["tt.divisibility", 16]]
        for p in params
        if p in DIV16 or (p in POINTERS and p not in consts)
    }
    src = ASTSource(
        fn=kernel, signature=sig, attrs=attrs,
        constexprs={(params.index(k),): v for k, v in consts.items()},
    )  # fmt: skip
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": False}
    if maxnreg:
        options["maxnreg"] = maxnreg
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    out = _cuobjdump(ck, "--dump-resource-usage")
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, stack, ck.metadata.shared, ck


def _cuobjdump(ck, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def loops(ck) -> str:
    """The instruction count of each loop body of the compiled kernel ``ck`` (a backward branch
    and its target; nested loops count their inner loops too, the largest last), and the
    distinct ``cp.async.wait_group`` depths of its PTX."""
    sass = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(ck, "--dump-sass"))
    index = {int(a, 16): i for i, (a, _) in enumerate(sass)}
    sizes = []
    for i, (a, text) in enumerate(sass):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < int(a, 16) and int(m.group(1), 16) in index:
            sizes.append(i - index[int(m.group(1), 16)] + 1)
    waits = sorted({int(w) for w in re.findall(r"cp\.async\.wait_group\s+(\d+)", ck.asm["ptx"])})
    return f"loops {sorted(sizes)} instructions; cp.async waits {waits}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--maxnreg", type=int, default=None, help="cap every kernel's registers")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--loops", action="store_true", help="each loop's instructions per iteration")
    args = ap.parse_args()
    # (head_dim, query heads per KV head) of the harness shapes; HG packs the whole group.
    groups = {64: 7, 128: 4}
    print(f"triton {triton.__version__}, sm_90, maxnreg {args.maxnreg}")
    print(f"{'kernel':8} {'D':>4} {'config':56} {'regs':>5} {'stack':>6} {'smem':>7}")
    for d in (int(x) for x in args.head_dims.split(",")):
        group = groups.get(d, 1)
        runs = []
        for key, paged in (("attention.fwd", False), ("paged_attention.fwd", True)):
            for cfg in {**attention.TUNING, **paged_attention.TUNING}[key].configs:
                consts = dict(
                    HG=attention_fwd._group_tile(group, cfg["BLOCK_M"]), BLOCK_M=cfg["BLOCK_M"],
                    BLOCK_N=attention_fwd.BLOCK_N, BLOCK_D=d, CAUSAL=True, PAGED=paged,
                    PAGE_SIZE=32 if paged else 1, STORE_LSE=not paged, DOT_PREC="ieee",
                    TMA=bool(cfg.get("TMA")) and not paged, OFF32=True,
                )  # fmt: skip
                if not consts["TMA"]:
                    consts.update(K_DESC=None, V_DESC=None)
                name = "paged" if paged else "fwd"
                runs.append((name, attention_fwd._fwd_kernel, consts, cfg))
        for cfg in attention.TUNING["attention.bwd"].configs:
            common = dict(BLOCK_D=d, CAUSAL=True, DOT_PREC="ieee", OFF32=True)
            dq = dict(HG=attention_fwd._group_tile(group, cfg["BLOCK_M"]), BLOCK_M=cfg["BLOCK_M"],
                      BLOCK_N=attention_fwd.BLOCK_N, **common)  # fmt: skip
            dkdv = dict(HG=attention_fwd._group_tile(group, attention_bwd.BWD_BLOCK_M),
                        BLOCK_M=attention_bwd.BWD_BLOCK_M, BLOCK_N=cfg["BLOCK_N"],
                        SPLIT=attention_bwd._split_dkdv(d), EARLY_DP=attention_bwd._early_dp(d),
                        **common)  # fmt: skip
            runs.append(("dq", attention_bwd._dq_kernel, dq, cfg))
            runs.append(("dkdv", attention_bwd._dkdv_kernel, dkdv, cfg))
        for name, kernel, consts, cfg in runs:
            stages = attention_fwd._stages(cfg, d)
            cap = args.maxnreg or cfg.get("maxnreg")
            regs, stack, smem, ck = resources(kernel, consts, cfg["num_warps"], stages, cap)
            desc = f"BLOCK_M {consts['BLOCK_M']} BLOCK_N {consts['BLOCK_N']} "
            desc += f"warps {cfg['num_warps']} stages {stages}"
            desc += " TMA" if consts.get("TMA") else ""
            desc += f" maxnreg {cap}" if cap else ""
            print(f"{name:8} {d:>4} {desc:56} {regs:>5} {stack:>6} {smem:>7}", flush=True)
            if args.loops:
                print(f"{'':14}{loops(ck)}", flush=True)


if __name__ == "__main__":
    main()
