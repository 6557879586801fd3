"""rms_norm (plain and fused residual), silu_and_mul and apply_rotary vs eager PyTorch and Liger.

    python benchmarks/run.py --only norm [--quick]
    python benchmarks/bench_norm.py [--quick]

Memory-bound ops: GB/s counts the bytes each op must move (inputs read once, outputs written
once; small vectors like the norm weight left out), to be read against the copy bandwidth the
harness prints. Forward and backward are timed separately; backward through
``torch.autograd.grad`` on a kept graph, so no ``.grad`` accumulation is counted.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_table, format_rows, median_ms, require_cuda, row  # noqa: E402

EPS = 1e-6


def _liger(name):
    try:
        if name == "rms_norm":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm

            return LigerRMSNorm
        if name == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction
        if name == "rope":
            from liger_kernel.ops.rope import LigerRopeFunction

            return LigerRopeFunction
    except ImportError:
        return None


def _eager_rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _fwd_bwd(rows, op, shape, dt, impl, fwd, inputs, fwd_bytes, bwd_bytes):
    """Times fwd() and the backward of all its outputs to ``inputs``."""
    rows.append(row(f"{op}.fwd", shape, dt, impl, median_ms(fwd), nbytes=fwd_bytes))
    out = fwd()
    outs = out if isinstance(out, tuple) else (out,)
    dys = [torch.randn_like(o) for o in outs]
    ms = median_ms(lambda: torch.autograd.grad(outs, inputs, dys, retain_graph=True))
    rows.append(row(f"{op}.bwd", shape, dt, impl, ms, nbytes=bwd_bytes))


def _norm_rows(T, H, dtype, table) -> list[dict]:
    from rlk_triton import norm

    dt = str(dtype).replace("torch.", "")
    es = torch.finfo(dtype).bits // 8
    shape = f"{T}x{H}"
    x = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(H, device="cuda", dtype=dtype, requires_grad=True)
    plain_fwd, plain_bwd = 2 * T * H * es, 3 * T * H * es
    fused_fwd, fused_bwd = 4 * T * H * es, 4 * T * H * es  # bwd: dy, ds, s in; dx out
    rows = []

    _fwd_bwd(
        rows, "rms_norm", shape, dt, "rlk",
        lambda: norm.rms_norm(x, w, EPS, None, table=table), (x, w), plain_fwd, plain_bwd,
    )  # fmt: skip
    _fwd_bwd(
        rows, "rms_norm+res", shape, dt, "rlk",
        lambda: norm.rms_norm(x, w, EPS, r, table=table), (x, r, w), fused_fwd, fused_bwd,
    )  # fmt: skip
    _fwd_bwd(
        rows, "rms_norm", shape, dt, "eager", lambda: _eager_rms_norm(x, w), (x, w),
        plain_fwd, plain_bwd,
    )  # fmt: skip
    liger = _liger("rms_norm")
    if liger is not None:
        mod = liger(H, eps=EPS).to(device="cuda", dtype=dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
        _fwd_bwd(
            rows, "rms_norm", shape, dt, "liger", lambda: mod(x), (x, mod.weight),
            plain_fwd, plain_bwd,
        )  # fmt: skip
    return rows


def _silu_rows(T, I, dtype, table) -> list[dict]:
    from rlk_triton import activation

    dt = str(dtype).replace("torch.", "")
    es = torch.finfo(dtype).bits // 8
    shape = f"{T}x2*{I}"
    x = torch.randn(T, 2 * I, device="cuda", dtype=dtype, requires_grad=True)
    fwd_b, bwd_b = 3 * T * I * es, 5 * T * I * es
    rows = []
    _fwd_bwd(
        rows, "silu_and_mul", shape, dt, "rlk",
        lambda: activation.silu_and_mul(x, table=table), (x,), fwd_b, bwd_b,
    )  # fmt: skip

    def eager():
        g, u = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    _fwd_bwd(rows, "silu_and_mul", shape, dt, "eager", eager, (x,), fwd_b, bwd_b)
    liger = _liger("silu")
    if liger is not None:
        g = x[:, :I].detach().clone().requires_grad_()
        u = x[:, I:].detach().clone().requires_grad_()
        _fwd_bwd(
            rows, "silu_and_mul", shape, dt, "liger", lambda: liger.apply(g, u), (g, u),
            fwd_b, bwd_b,
        )  # fmt: skip
    return rows


def _rotary_rows(T, NH, D, dtype, table) -> list[dict]:
    from rlk_triton import rotary

    dt = str(dtype).replace("torch.", "")
    es = torch.finfo(dtype).bits // 8
    shape = f"T={T} H={NH} D={D}"
    x = torch.randn(T, NH, D, device="cuda", dtype=dtype, requires_grad=True)
    ang = torch.rand(T, D // 2, device="cuda") * 100
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    nbytes = 2 * T * NH * D * es + 2 * T * D * 4
    rows = []
    _fwd_bwd(
        rows, "apply_rotary", shape, dt, "rlk",
        lambda: rotary.apply_rotary(x, cos, sin, table=table), (x,), nbytes, nbytes,
    )  # fmt: skip

    def eager():
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]

    _fwd_bwd(rows, "apply_rotary", shape, dt, "eager", eager, (x,), nbytes, nbytes)
    liger = _liger("rope")
    if liger is not None:
        # Liger rotates q and k together in [B, H, S, D]: give it x as q and a one-head k.
        q = x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
        k = x.detach()[:, :1].transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
        c, s = cos.to(dtype)[None], sin.to(dtype)[None]
        try:
            _fwd_bwd(
                rows, "apply_rotary", shape, dt, "liger(q+1 k head)",
                lambda: liger.apply(q, k, c, s), (q, k), nbytes, nbytes,
            )  # fmt: skip
        except Exception as e:  # Liger's rope signature changed between releases
            print(f"liger rope skipped: {e}", file=sys.stderr)
    return rows


def run(quick: bool) -> list[dict]:
    require_cuda()
    table = cuda_table()
    bf16 = torch.bfloat16
    rows: list[dict] = []
    if quick:
        norm_shapes = [(4096, 4096), (32768, 896)]
        silu_shapes = [(4096, 4864)]
        rot_shapes = [(16384, 16, 128)]
    else:
        norm_shapes = [(t, h) for t in (4096, 32768) for h in (896, 2048, 4096, 8192)]
        silu_shapes = [(4096, 4864), (16384, 4864), (4096, 18944), (16384, 18944)]
        rot_shapes = [(16384, 16, 128), (16384, 32, 128), (16384, 14, 64), (32768, 8, 128)]
    for T, H in norm_shapes:
        rows += _norm_rows(T, H, bf16, table)
    if not quick:
        rows += _norm_rows(4096, 4096, torch.float32, table)
        # Qwen3's per-head q/k norm: [T * heads, head_dim].
        rows += _norm_rows(16384 * 16, 128, bf16, table)
    for T, I in silu_shapes:
        rows += _silu_rows(T, I, bf16, table)
    for T, NH, D in rot_shapes:
        rows += _rotary_rows(T, NH, D, bf16, table)
    return rows


if __name__ == "__main__":
    require_cuda()
    print(format_rows(run(quick="--quick" in sys.argv)))
