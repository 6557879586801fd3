"""linear_logprobs vs eager PyTorch and Liger-Kernel's fused linear cross-entropy (CUDA).

Time (median, do_bench) and peak extra memory (beyond inputs and outputs) for forward and
forward+backward. Liger is run with reduction="sum" (its compute-in-forward fast path, which a
per-token RL loss cannot use) and reduction="none" (per-token gradients, what RL needs).
"""

from __future__ import annotations

import torch
from common import median_ms, require_cuda, row

SHAPES = [(8192, 4096, 151936), (16384, 896, 151936)]
MEMORY_ONLY = [(65536, 4096, 151936)]


def _inputs(t, h, v):
    hid = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16)
    tgt = torch.randint(0, v, (t,), device="cuda")
    return hid, w, tgt


def _impls():
    import rlk

    def rlk_fn(h, w, t):
        return rlk.linear_logprobs(h, w, t)

    def eager(h, w, t):
        logits = (h @ w.t()).float()
        return torch.log_softmax(logits, -1).gather(1, t[:, None])[:, 0]

    impls = {"rlk": rlk_fn, "eager": eager}
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction as F,
        )

        impls["liger(sum)"] = lambda h, w, t: (
            -F.apply(h, w, t, None, None, -100, 0.0, 0.0, "sum")[0]
        )
        impls["liger(none)"] = lambda h, w, t: (
            -F.apply(h, w, t, None, None, -100, 0.0, 0.0, "none")[0]
        )
    except ImportError:
        pass
    return impls


def _peak_extra(fn, base):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def run(quick: bool = False) -> list[dict]:
    require_cuda()
    rows = []
    for t, h, v in SHAPES[:1] if quick else SHAPES:
        hid, w, tgt = _inputs(t, h, v)
        g = torch.randn(t, device="cuda")
        flops_f = 2 * t * h * v
        for name, fn in _impls().items():
            hg, wg = hid.clone().requires_grad_(), w.clone().requires_grad_()

            def fwd():
                with torch.no_grad():
                    return fn(hid, w, tgt)

            def fwd_bwd():
                hg.grad = wg.grad = None
                out = fn(hg, wg, tgt)
                (out * g).sum().backward() if out.dim() else out.backward()

            base = torch.cuda.memory_allocated()
            mem_f = _peak_extra(fwd, base)
            ms_f = median_ms(fwd)
            # inputs' gradients are outputs: count them as such, not as extra memory
            base_b = base + hid.numel() * 2 + w.numel() * 2
            mem_b = _peak_extra(fwd_bwd, base_b)
            ms_b = median_ms(fwd_bwd, rep=50)
            shape = f"T={t} H={h} V={v}"
            rows.append(
                row(
                    "linear_logprobs fwd", shape, "bf16", name, ms_f, flops=flops_f, extra_GiB=mem_f
                )
            )
            rows.append(
                row(
                    "linear_logprobs fwd+bwd",
                    shape,
                    "bf16",
                    name,
                    ms_b,
                    flops=3 * flops_f,
                    extra_GiB=mem_b,
                )
            )
        del hid, w, tgt
        torch.cuda.empty_cache()
    if not quick:
        import rlk

        for t, h, v in MEMORY_ONLY:
            hid, w, tgt = _inputs(t, h, v)
            hg, wg = hid.clone().requires_grad_(), w.clone().requires_grad_()
            base = torch.cuda.memory_allocated() + hid.numel() * 2 + w.numel() * 2

            def step():
                rlk.linear_logprobs(hg, wg, tgt).sum().backward()

            rows.append(
                row(
                    "linear_logprobs fwd+bwd (memory)",
                    f"T={t} H={h} V={v}",
                    "bf16",
                    "rlk",
                    float("nan"),
                    extra_GiB=_peak_extra(step, base),
                )
            )
    return rows


if __name__ == "__main__":
    from common import format_rows

    print(format_rows(run()))
