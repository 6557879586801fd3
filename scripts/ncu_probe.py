"""One op's kernels at one shape, for Nsight Compute: two warm-up calls, then the call to read.

    ncu --clock-control none -k regex:'_dkdv_kernel|_dq_kernel' --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 scripts/ncu_probe.py attention-bwd

Probes (bf16, CUDA):

- ``attention-bwd``: causal varlen attention forward + backward, B=16 S=2048 Hq=14 Hk=2 D=64
  (Qwen2-0.5B's heads), the harness shape where rlk's backward is slowest against SDPA; its
  kernels are ``_dkdv_kernel`` and ``_dq_kernel`` (one launch each per call).
- ``linear-decode``: ``rlk.linear`` then ``F.linear`` (cuBLAS) at M=1, K=14336, N=4096 (the
  Llama-3-8B down projection in decode): one ``_matmul_kernel`` launch, then cuBLAS's kernel.
- ``norm-bwd``: ``rms_norm`` forward + backward at T=65536, H=896 (Qwen2-0.5B's hidden size),
  the harness shape where rlk's backward is slowest against ``torch.compile``; its kernels are
  ``_rms_norm_fwd_kernel``, ``_rms_norm_bwd_kernel`` and the dweight partial sums.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import rlk


def attention_bwd() -> None:
    b, s, hq, hk, d = 16, 2048, 14, 2, 64
    t = b * s
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for h in (hq, hk, hk)
    )
    do = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(0, t + 1, s, device="cuda", dtype=torch.int32)
    for _ in range(3):
        torch.autograd.grad(rlk.attention(q, k, v, cu, cu, causal=True), (q, k, v), do)


def linear_decode() -> None:
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) / 120
    for _ in range(3):
        rlk.linear(x, w)
        F.linear(x, w)


def norm_bwd() -> None:
    x = torch.randn(65536, 896, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(896, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(65536, 896, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.autograd.grad(rlk.rms_norm(x, w, 1e-6), (x, w), dy)


PROBES = {"attention-bwd": attention_bwd, "linear-decode": linear_decode, "norm-bwd": norm_bwd}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        sys.exit(f"usage: ncu_probe.py {{{','.join(PROBES)}}}")
    PROBES[sys.argv[1]]()
    torch.cuda.synchronize()
