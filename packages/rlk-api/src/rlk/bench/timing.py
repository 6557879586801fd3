"""Timing and result rows shared by the benchmark families (CUDA only): rlk's own and
rlk-integrations' e2e families (a public module for that reason: :data:`DEVICE`, :func:`row`,
:func:`left_out`).

Every figure is the median of ``triton.testing.do_bench`` (CUDA events) on random data. Calls
are timed as a CUDA graph of as many calls as make one replay at least :data:`MIN_US` long
(``timing: "graph xN"``): the GPU time of the work, whoever launches it. A plain median of
eager calls measures the host instead whenever launching takes longer than the kernels run,
which decode-size and memory-bound kernels do; that host cost is measured on its own by
:func:`eager_call_us` (rows ``*.eager_call``). Where capture fails (a peer that syncs the
host), the plain median is kept and the row says ``timing: "events"``, or ``"launch-bound"`` if
such a call is shorter than :data:`MIN_US`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

#: Shortest timed call, in microseconds, that measures the GPU and not the launch.
MIN_US = 50.0

#: Device the families allocate on. Benchmarks are for GPUs; tests set "cpu" to check that the
#: families run end to end (tiny quick shapes, timing stubbed).
DEVICE = "cuda"


_generators: dict[str, torch.Generator] = {}


def generator() -> torch.Generator:
    """The generator the families draw random inputs from (on :data:`DEVICE`, seeded 0).

    Not the default one: a failed graph capture (a peer that syncs the host) leaves the default
    CUDA generator refusing every later draw in the process."""
    if DEVICE not in _generators:
        _generators[DEVICE] = torch.Generator(device=DEVICE).manual_seed(0)
    return _generators[DEVICE]


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values on :data:`DEVICE` from :func:`generator`."""
    return torch.randn(*shape, device=DEVICE, dtype=dtype, generator=generator())


def median_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events, through triton's do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_call(fn: Callable[[], Any], *, graph: bool = True) -> tuple[float, str]:
    """``(ms per call, how it was timed)``: a CUDA graph of many calls (see the module
    docstring); with ``graph=False`` a plain median where the call is at least MIN_US long."""
    ms = median_ms(fn)
    if ms * 1e3 >= MIN_US and not graph:
        return ms, "events"
    n = max(2, math.ceil(2 * MIN_US / max(ms * 1e3, 1.0)))
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph_ = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_):
            for _ in range(n):
                fn()
        total = median_ms(graph_.replay)
    except Exception:  # a peer or op that cannot be captured (host syncs, allocator use)
        torch.cuda.synchronize()
        return ms, "events" if ms * 1e3 >= MIN_US else "launch-bound"
    return total / n, f"graph x{n}"


def eager_call_us(fn: Callable[[], Any], calls: int = 500) -> float:
    """Wall time per call, in microseconds, of ``calls`` back-to-back eager calls and one final
    synchronisation: what a caller without CUDA graphs pays, host and launch included."""
    import time

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _copy_gbs() -> float:
    n = 1 << 30  # 1 GiB each way, far above the 60 MB L2
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * n / median_ms(lambda: dst.copy_(src)) / 1e6


def _cublas_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9


@functools.cache
def copy_GBps() -> float:
    """Device-to-device copy bandwidth (GB/s, read + write), measured once per process: the
    report's ceiling, and what rows that give a share of the HBM roofline divide by."""
    return round(_copy_gbs(), 1)


def ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (GB/s, read + write) and cuBLAS bf16 TFLOP/s, measured
    in the same process as the rows so each table can be read against them."""
    return {"copy_GBps": copy_GBps(), "cublas_bf16_TFLOPs": round(_cublas_tflops(), 1)}


def row(
    op: str,
    shape: str,
    dtype: str,
    impl: str,
    ms: float,
    *,
    timing: str = "events",
    nbytes: float = 0.0,
    flops: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """One result: ``op`` (e.g. ``rms_norm.fwd``), ``shape``, ``dtype``, ``impl`` (``rlk`` or
    a peer's name), ``ms`` per call; GB/s and TFLOP/s from the bytes and flops the op must
    move and do."""
    r: dict[str, Any] = {"op": op, "shape": shape, "dtype": dtype, "impl": impl}
    r["ms"] = round(ms, 6)
    r["timing"] = timing
    if nbytes:
        r["GB/s"] = round(nbytes / ms / 1e6, 1)
    if flops:
        r["TFLOP/s"] = round(flops / ms / 1e9, 1)
    r.update(extra)
    return r


def extra_memory_gib(fn: Callable[[], Any]) -> float | None:
    """The peak memory one eager ``fn()`` allocates beyond what is allocated before it, its
    outputs (gradients, say) included, in GiB: the CUDA caching allocator's statistics, so
    what PyTorch allocates, not what it keeps reserved. None off CUDA (no such statistics)."""
    if torch.device(DEVICE).type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2**30


def left_out(op: str, shape: str, dtype: str, impl: str, error: Exception) -> dict[str, str]:
    """The record of a peer that raised ``error`` (its type and first line), which a family
    emits instead of the peer's row (it goes to the report's ``left_out``)."""
    first = (str(error).splitlines() or [""])[0][:200]
    return {"op": op, "shape": shape, "dtype": dtype, "impl": impl,
            "left_out": f"{type(error).__name__}: {first}"}  # fmt: skip


def timed(op: str, shape: str, dtype: str, impl: str, fn: Callable[[], Any], **kw) -> dict:
    """:func:`row` for ``fn`` timed by :func:`time_call`."""
    ms, how = time_call(fn)
    return row(op, shape, dtype, impl, ms, timing=how, **kw)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
