"""Tree-ordered linear (rlk.parallel.tree_linear): fused kernel vs unfused leaves vs rlk.linear.

Harness entry: ``run(quick)`` (called by benchmarks/run.py) times, in bf16 with 8 leaves, the
row-parallel projections of Qwen2-0.5B and Llama-3-8B at M in {512, 2048, 4096}:

- ``linear``: plain rlk.linear (the cuda table's chosen config), the reference;
- ``tree_linear``: what the op runs (tree_gemm.use_fused picks the path; same bits);
- ``tree fused``: the fused kernel (one launch, the chosen TREE_CONFIGS entry);
- ``tree unfused``: one fp32 GEMM launch per leaf, torch adds by the tree, bias, cast.

With ``--configs`` every TREE_CONFIGS entry is timed too, labelled by index and kernel:
``unrolled`` (_tree_kernel, pending sums in registers) or ``flat`` (_tree_flat_kernel, one
K loop over all leaves; ``r<REG_SLOTS>``: pending slots kept in registers, the others parked in
an fp32 scratch; ``halves``: the carry chain on column halves).

``ratio`` is linear's time over the row's (the target: tree fused >= 0.90 at M >= 512).
Standalone, for tuning the fused kernel's chooser::

    python benchmarks/bench_tree_gemm.py                         # the harness table
    python benchmarks/bench_tree_gemm.py --configs               # + every TREE_CONFIGS entry
    python benchmarks/bench_tree_gemm.py --shape 512,4864,896 --leaves 4,8,16 --configs
"""

from __future__ import annotations

import argparse

import torch

from rlk.bench import _table
from rlk.bench._timing import median_ms, row


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA/ROCm GPU")


def cuda_table():
    """The tuning table backend ``cuda`` runs with (the portable one if rlk-cuda is absent)."""
    from rlk_triton import backend

    tables = backend.known_tables()
    return tables.get("cuda", tables["triton"])


def format_rows(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return _table(cols, [[f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                          for c in cols] for r in rows])  # fmt: skip


# (model, projection, K, N): the row-parallel (K-split) projections.
SHAPES = [
    ("qwen2-0.5b", "o", 896, 896),
    ("qwen2-0.5b", "down", 4864, 896),
    ("llama3-8b", "o", 4096, 4096),
    ("llama3-8b", "down", 14336, 4096),
]
MS = [512, 2048, 4096]
QUICK_MS = [512, 4096]


def _short(cfg):
    s = "{BLOCK_M}x{BLOCK_N} g{GROUP_M} w{num_warps} s{num_stages}".format(**cfg)
    if cfg.get("VARIANT") != "flat":
        return s + " unrolled"
    return s + f" flat r{cfg['REG_SLOTS']}" + (" halves" if cfg.get("HALVES") else "")


def bench_shape(M, K, N, leaves=8, dtype=torch.bfloat16, *, configs=False, label=""):
    from rlk_triton import gemm, tree_gemm

    table = cuda_table()
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    flops = 2.0 * M * N * K
    shape = f"{label}M={M},K={K},N={N}"
    dt = str(dtype).replace("torch.", "")
    rows = []

    def add(impl, ms, ref, **extra):
        rows.append(row("tree_linear", shape, dt, impl, ms, flops=flops, ratio=ref / ms, **extra))

    lin_ms = median_ms(lambda: gemm.linear_forward(x, w, b, table))
    add("linear", lin_ms, lin_ms)
    cfg = tree_gemm.tree_config(table, "linear.fwd", M, N, K, leaves, x.element_size())
    path = "fused" if tree_gemm.use_fused(leaves) else "unfused"
    ms = median_ms(lambda: tree_gemm.tree_linear_forward(x, w, b, leaves, table))
    add(f"tree_linear L={leaves} ({path})", ms, lin_ms)
    wt = w.t()
    ms = median_ms(lambda: tree_gemm._fused(x, wt, b, leaves, dtype, table, "linear.fwd"))
    add(f"tree fused L={leaves}", ms, lin_ms, cfg=_short(cfg))
    ms = median_ms(lambda: tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table))
    add(f"tree unfused L={leaves}", ms, lin_ms)
    if configs:
        # Each candidate's bits against the unfused reference too: a race on the flat kernel's
        # parked sums would show only on a GPU, at sizes like these.
        ref = tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table)
        for i, c in enumerate(tree_gemm.TREE_CONFIGS):
            run = lambda c=c: tree_gemm._fused(x, wt, b, leaves, dtype, table, "", c)
            try:
                ms = median_ms(run)
            except Exception as e:  # e.g. out of shared memory: report, keep going
                rows.append({"shape": shape, "impl": f"fused cfg={i}", "error": str(e)[:80]})
                continue
            bits = "same" if torch.equal(run().view(torch.uint8), ref.view(torch.uint8)) else "DIFF"
            kind = c.get("VARIANT", "unrolled")
            add(f"tree fused L={leaves} cfg={i} {kind}", ms, lin_ms, cfg=_short(c), bits=bits)
    return rows


def run(quick: bool = False) -> list[dict]:
    require_cuda()
    rows = []
    for model, proj, K, N in SHAPES:
        for M in QUICK_MS if quick else MS:
            rows += bench_shape(M, K, N, label=f"{model}.{proj} ")
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", action="append", default=[], help="M,K,N (repeatable)")
    p.add_argument("--leaves", default="8", help="comma-separated leaf counts")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--configs", action="store_true", help="time every TREE_CONFIGS entry (both kernels)"
    )
    args = p.parse_args()
    require_cuda()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shape]
    if not shapes:
        shapes = [(M, K, N) for _, _, K, N in SHAPES for M in (QUICK_MS if args.quick else MS)]
    for M, K, N in shapes:
        for leaves in (int(v) for v in args.leaves.split(",")):
            print(format_rows(bench_shape(M, K, N, leaves, configs=args.configs)), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
