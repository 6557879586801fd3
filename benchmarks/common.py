"""Timing helpers shared by the bench_* scripts (CUDA only).

Medians of ``triton.testing.do_bench`` on random data; the copy-bandwidth and cuBLAS ceilings
are measured in the same process so every table can be read against them.
"""

from __future__ import annotations

import torch


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks need a CUDA/ROCm GPU; on CPU run the tests instead")


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events, through triton's do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (GB/s, read + write) and cuBLAS bf16 TFLOP/s."""
    n = 1 << 30  # 1 GiB of bf16 each way, far above the 60 MB L2
    bufs = [torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)]
    bufs.append(torch.empty_like(bufs[0]))
    ms = median_ms(lambda: bufs[1].copy_(bufs[0]))
    copy_gbs = 2 * n / ms / 1e6
    bufs.clear()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b)
    return {"copy_GBps": copy_gbs, "cublas_bf16_TFLOPs": 2 * 8192**3 / ms / 1e9}


def cuda_table():
    """The tuning table backend ``cuda`` runs with (the portable one if rlk-cuda is absent)."""
    from rlk_triton import backend

    tables = backend.known_tables()
    return tables.get("cuda", tables["triton"])


def row(
    op: str,
    shape: str,
    dtype: str,
    impl: str,
    ms: float,
    *,
    nbytes: float = 0.0,
    flops: float = 0.0,
    **extra,
) -> dict:
    r = {"op": op, "shape": shape, "dtype": dtype, "impl": impl, "ms": ms}
    if nbytes:
        r["GB/s"] = nbytes / ms / 1e6
    if flops:
        r["TFLOP/s"] = flops / ms / 1e9
    r.update(extra)
    return r


def format_rows(rows: list[dict]) -> str:
    cols = ["op", "shape", "dtype", "impl", "ms", "GB/s", "TFLOP/s"]
    extra = sorted({k for r in rows for k in r} - set(cols))
    cols += extra

    def cell(r, c):
        v = r.get(c, "")
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    table = [cols] + [[cell(r, c) for c in cols] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(t, widths)) + " |" for t in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
