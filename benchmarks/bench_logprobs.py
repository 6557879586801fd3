"""logprobs (and entropy) from logits vs eager PyTorch and Liger-Kernel's cross-entropy (CUDA).

    python benchmarks/run.py --only logprobs [--quick]
    python benchmarks/bench_logprobs.py [--quick]

Rows: forward (bytes: logits read once) and backward (logits read + dlogits written), in GB/s;
compare with the copy bandwidth the harness prints. Eager is ``log_softmax`` + ``gather`` in
fp32; Liger is its cross-entropy with ``reduction="none"`` (per-token losses, what RL needs).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_table, format_rows, median_ms, require_cuda, row  # noqa: E402

SHAPES = [(4096, 32000), (16384, 32000), (32768, 32000), (4096, 151936), (16384, 151936)]
QUICK = [(16384, 151936)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _liger():
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except ImportError:
        return None
    return LigerCrossEntropyFunction


def _rows_for(t, v, dname, table, liger) -> list[dict]:
    from rlk_triton import logprobs as lpmod

    dt = DTYPES[dname]
    shape = f"T={t} V={v}"
    logits = torch.randn(t, v, device="cuda", dtype=dt)
    tgt = torch.randint(0, v, (t,), device="cuda")
    g = torch.randn(t, device="cuda")
    size = logits.element_size()
    fwd_bytes = t * v * size
    bwd_bytes = 2 * t * v * size
    rows = []

    def rlk_fwd(entropy):
        return lambda: lpmod.logprobs(logits, tgt, 1.0, entropy, table=table)

    rows.append(
        row("logprobs.fwd", shape, dname, "rlk", median_ms(rlk_fwd(False)), nbytes=fwd_bytes)
    )
    rows.append(
        row("logprobs+entropy.fwd", shape, dname, "rlk", median_ms(rlk_fwd(True)), nbytes=fwd_bytes)
    )
    x = logits.clone().requires_grad_()
    lp = lpmod.logprobs(x, tgt, 1.0, False, table=table)
    ms = median_ms(lambda: torch.autograd.grad(lp, x, g, retain_graph=True))
    rows.append(row("logprobs.bwd", shape, dname, "rlk", ms, nbytes=bwd_bytes))

    def eager():
        return torch.log_softmax(logits.float(), -1).gather(1, tgt[:, None])[:, 0]

    rows.append(row("logprobs.fwd", shape, dname, "eager", median_ms(eager), nbytes=fwd_bytes))
    xe = logits.clone().requires_grad_()
    lpe = torch.log_softmax(xe.float(), -1).gather(1, tgt[:, None])[:, 0]
    ms = median_ms(lambda: torch.autograd.grad(lpe, xe, g, retain_graph=True))
    rows.append(row("logprobs.bwd", shape, dname, "eager", ms, nbytes=bwd_bytes))

    if liger is not None:
        # Liger computes its gradient inside the forward when logits require grad; time the
        # inference-style forward (no grad) and the forward that also writes dlogits.
        def lig(x):
            return liger.apply(x, tgt, None, -100, 0.0, 0.0, "none")[0]

        with torch.no_grad():
            rows.append(
                row(
                    "logprobs.fwd",
                    shape,
                    dname,
                    "liger",
                    median_ms(lambda: lig(logits)),
                    nbytes=fwd_bytes,
                )
            )
        xl = logits.clone().requires_grad_()
        rows.append(
            row(
                "logprobs.fwd+grad",
                shape,
                dname,
                "liger",
                median_ms(lambda: lig(xl)),
                nbytes=bwd_bytes,
            )
        )
    return rows


def run(quick: bool = False) -> list[dict]:
    """Benchmark rows (op, shape, dtype, impl, ms, GB/s) for every shape and dtype."""
    require_cuda()
    table, liger = cuda_table(), _liger()
    rows = []
    for t, v in QUICK if quick else SHAPES:
        for dname in ("bf16",) if quick else DTYPES:
            rows += _rows_for(t, v, dname, table, liger)
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    print(format_rows(run(quick="--quick" in sys.argv)))
