"""Host time per call of rlk's ops against their torch peers, with the GPU time beside it.

    python scripts/host_overhead.py

A model step whose kernels are short is limited by the host: the time Python, the dispatcher
and the launcher take per call. For each op and shape this prints

- ``host us``: the time to enqueue one call (50 calls after a device sync, not waited for, so
  the GPU never holds the host back), forward alone and forward + backward;
- ``gpu us``: ``triton.testing.do_bench`` median of the same call (forward alone).

The first table splits one ``rlk.linear`` call into its layers (validation, backend lookup,
``autograd.Function``, the launch with rlk's launch cache and through Triton's own ``run``),
host time only. The GEMM rows run each launch config family: rlk's default choice, its
pointer-kernel config with the same tiles, and its descriptor (TMA) config.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import triton.testing

import rlk
from rlk import ops
from rlk.selection import backend_impl
from rlk_triton import _triton, gemm, tuning
from rlk_triton.backend import default_table

N_CALLS = 50


def _host_us(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(N_CALLS):
        fn()
    seconds = time.perf_counter() - t
    torch.cuda.synchronize()
    return seconds / N_CALLS * 1e6


def _gpu_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3


def _fwd_bwd(fn):
    def run():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    return run


def _row(name, fwd, inputs):
    for t in inputs:
        t.grad = None
    host_f = _host_us(fwd)
    host_b = _host_us(_fwd_bwd(fwd))
    with torch.no_grad():
        gpu = _gpu_us(fwd)
    print(f"{name:<44} {host_f:9.1f} {host_b:10.1f} {gpu:9.1f}", flush=True)


def _parts(dev, bf) -> None:
    x = torch.randn(4096, 896, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(896, 896, device=dev, dtype=bf, requires_grad=True)
    c = torch.empty(4096, 896, device=dev, dtype=bf)
    table = default_table()
    cfg = dict(tuning.config(table, "linear.fwd", M=4096, N=896, K=896), TMA=False)

    def launch(fast):
        def run():
            _triton.FAST_LAUNCH = fast
            gemm._launch(x, w.t(), None, c, cfg)
            _triton.FAST_LAUNCH = True

        return run

    rows = [
        ("F.linear", lambda: F.linear(x, w)),
        ("rlk.linear", lambda: rlk.linear(x, w)),
        ("  check_linear", lambda: ops.check_linear(x, w, None)),
        ("  backend_impl", lambda: backend_impl(x.device)),
        ("  gemm.LinearFunction.apply", lambda: gemm.LinearFunction.apply(x, w, None, table)),
        ("  gemm._matmul", lambda: gemm._matmul(x, w.t(), None, bf, table, "linear.fwd")),
        ("  gemm._launch, launch cache", launch(True)),
        ("  gemm._launch, Triton's run", launch(False)),
        ("  torch.empty", lambda: torch.empty(4096, 896, device=dev, dtype=bf)),
    ]
    print(f"{'rlk.linear 4096x896->896, by layer':<44} {'host us':>9}")
    for name, fn in rows:
        print(f"{name:<44} {_host_us(fn):9.1f}", flush=True)
    print()


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    _parts(dev, bf)
    print(f"{'op':<44} {'host us':>9} {'fwd+bwd':>10} {'gpu us':>9}")
    for m, k, n in ((4096, 896, 896), (4096, 896, 4864), (4096, 4864, 896), (64, 896, 4864)):
        x = torch.randn(m, k, device=dev, dtype=bf, requires_grad=True)
        w = (torch.randn(n, k, device=dev, dtype=bf) / k**0.5).requires_grad_(True)
        shape = f"{m}x{k}->{n}"
        _row(f"F.linear {shape}", lambda x=x, w=w: F.linear(x, w), (x, w))
        _row(f"rlk.linear {shape} (default)", lambda x=x, w=w: rlk.linear(x, w), (x, w))
        for label, flag in (("pointer", False), ("tma", True)):
            configs = {}
            for key in ("linear.fwd", "linear.bwd_dx", "linear.bwd_dw"):
                shp = {
                    "linear.fwd": dict(M=m, N=n, K=k),
                    "linear.bwd_dx": dict(M=m, N=k, K=n),
                    "linear.bwd_dw": dict(M=n, N=k, K=m),
                }[key]
                cfg = dict(tuning.config(gemm.TUNING, key, **shp))
                cfg["TMA"] = flag
                cfg["PERSISTENT"] = flag and cfg.get("PERSISTENT", False)
                configs[key] = cfg
            with tuning.force("linear", configs):
                _row(f"rlk.linear {shape} ({label})", lambda x=x, w=w: rlk.linear(x, w), (x, w))
    t, h, hq, hk, d = 4096, 896, 14, 2, 64
    x = torch.randn(t, h, device=dev, dtype=bf, requires_grad=True)
    r = torch.randn(t, h, device=dev, dtype=bf, requires_grad=True)
    wn = torch.ones(h, device=dev, dtype=bf, requires_grad=True)
    _row("F.rms_norm 4096x896", lambda: F.rms_norm(x, (h,), wn, 1e-6), (x, wn))
    _row("rlk.rms_norm 4096x896", lambda: rlk.rms_norm(x, wn, 1e-6), (x, wn))
    _row("rlk.rms_norm residual 4096x896", lambda: rlk.rms_norm(x, wn, 1e-6, residual=r), (x,))
    g = torch.randn(t, 2 * 4864, device=dev, dtype=bf, requires_grad=True)
    _row("torch silu*mul 4096x9728", lambda: F.silu(g[:, :4864]) * g[:, 4864:], (g,))
    _row("rlk.silu_and_mul 4096x9728", lambda: rlk.silu_and_mul(g), (g,))
    q = torch.randn(t, hq, d, device=dev, dtype=bf, requires_grad=True)
    kk = torch.randn(t, hk, d, device=dev, dtype=bf, requires_grad=True)
    vv = torch.randn(t, hk, d, device=dev, dtype=bf, requires_grad=True)
    cos = torch.randn(t, d, device=dev)
    sin = torch.randn(t, d, device=dev)
    _row("rlk.apply_rotary q 4096x14x64", lambda: rlk.apply_rotary(q, cos, sin), (q,))
    cu = torch.arange(0, t + 1, 512, device=dev, dtype=torch.int32)
    _row(
        "rlk.attention 8x512 Hq14 Hk2 D64",
        lambda: rlk.attention(q, kk, vv, cu, cu, causal=True),
        (q, kk, vv),
    )
    qs, ks, vs = (u.detach().view(8, 512, -1, d).transpose(1, 2) for u in (q, kk, vv))
    for u in (qs, ks, vs):
        u.requires_grad_(True)
    _row(
        "SDPA 8x512 Hq14 Hk2 D64",
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True),
        (qs, ks, vs),
    )
    torch.cuda.synchronize()
    e = torch.empty(1, device=dev)
    print(f"{'torch.empty + fill_ (reference)':<44} {_host_us(lambda: e.fill_(1.0)):9.1f}")


if __name__ == "__main__":
    main()
