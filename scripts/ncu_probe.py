"""One op's kernels at one shape, for Nsight Compute: two warm-up calls, then the call to read.

    ncu --clock-control none -k regex:'_dkdv_kernel|_dq_kernel' --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 scripts/ncu_probe.py attention-bwd

Probes (bf16, CUDA):

- ``attention-bwd``: causal varlen attention forward + backward, B=16 S=2048 Hq=14 Hk=2 D=64
  (Qwen2-0.5B's heads), the harness shape where rlk's backward is slowest against SDPA; its
  kernels are ``_dkdv_kernel`` and ``_dq_kernel`` (one launch each per call). Another shape:
  ``PROBE_ATTN=B,S,Hq,Hk,D``.
- ``linear-decode``: ``rlk.linear`` then ``F.linear`` (cuBLAS) at M=1, K=14336, N=4096 (the
  Llama-3-8B down projection in decode): one ``_matmul_kernel`` launch, then cuBLAS's kernel.
- ``linear-shortk``: ``rlk.linear`` then ``F.linear`` at M=1024, K=896, N=4864 (the Qwen2-0.5B
  up projection in prefill, the harness shape where rlk's GEMM is slowest against cuBLAS): one
  ``_matmul_tma_kernel`` launch, then cuBLAS's kernel.
- ``linear-mid``: ``rlk.linear`` then ``F.linear`` at M=1024, K=3584, N=4608 (the Qwen2.5-7B
  q/k/v projection in prefill; another shape: ``PROBE_LINEAR=M,K,N``), where 128x256 tiles
  leave a nearly empty second wave.
- ``paged-b1``: ``rlk.paged_attention`` decode at B=1, ctx 8192, Hq=32, Hk=8, D=128, pages of
  16 (the harness's small-batch decode): one ``_fwd_kernel`` launch per call. Another shape:
  ``PROBE_PAGED=B,ctx,Hq,Hk,D,page``.
- ``norm-bwd``: ``rms_norm`` forward + backward at T=65536, H=896 (Qwen2-0.5B's hidden size),
  the harness shape where rlk's backward is slowest against ``torch.compile``; its kernels are
  ``_rms_norm_fwd_kernel``, ``_rms_norm_bwd_kernel`` and the dweight partial sums.
- ``rotary-d64``: ``apply_rotary`` of q and k at T=65536, Hq=14, Hk=2, D=64 (Qwen2-0.5B), where
  rlk's forward is slowest against Liger, then Liger's in-place rope on copies (when installed):
  ``_rotary_kernel``, then Liger's kernel.
- ``sample-topkp``: ``rlk.sample`` at B=256 (or ``PROBE_B``), V=151936 with temperature 0.8,
  top-k 50 and top-p 0.9 (the harness shape), and with temperature alone: every kernel of both
  calls.
- ``sample-mixed``: ``rlk.sample`` on 8 rows of V=151936 that take every path (top-k rows with
  few candidates, with too many, top-p alone, a NaN row, greedy), split and one program per
  row; for ``compute-sanitizer`` (with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``) more than ncu.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import rlk


def attention_bwd() -> None:
    b, s, hq, hk, d = (int(x) for x in os.environ.get("PROBE_ATTN", "16,2048,14,2,64").split(","))
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


def _linear(m: int, k: int, n: int) -> None:
    """``rlk.linear`` then ``F.linear`` of ``[m, k]`` by ``[n, k]``, three times. rlk's call is
    the chosen config forced, so a descriptor config runs its descriptor kernel as under CUDA
    graphs in ``rlk bench`` (eager products below ``tuning.HOST_BOUND_FLOPS`` otherwise take
    the pointer kernel on the same tiles)."""
    from rlk.selection import backend_impl
    from rlk_triton import tuning

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    table = backend_impl(x.device).ops["linear"].keywords["table"]
    cfg = tuning.config(table, "linear.fwd", M=m, N=n, K=k)
    for _ in range(3):
        with tuning.force("linear", {"linear.fwd": cfg}):
            rlk.linear(x, w)
        F.linear(x, w)


def linear_decode() -> None:
    _linear(1, 14336, 4096)


def norm_bwd() -> None:
    x = torch.randn(65536, 896, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(896, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(65536, 896, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.autograd.grad(rlk.rms_norm(x, w, 1e-6), (x, w), dy)


def rotary_d64() -> None:
    from rlk.bench import norm
    from rlk.bench._peers import liger

    q = torch.randn(65536, 14, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(65536, 2, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = norm._rope_cos_sin(65536, 64)
    rope = liger("LigerRopeFunction")
    ql, kl = q.clone(), k.clone()
    for _ in range(3):
        rlk.apply_rotary(q, cos, sin, k=k)
        if rope is not None:
            rope.apply(norm._hf_layout(ql), norm._hf_layout(kl), cos, sin)


def sample_topkp() -> None:
    b, v = int(os.environ.get("PROBE_B", "256")), 151936
    logits = torch.randn(b, v, device="cuda") * 3
    seeds = torch.arange(b, device="cuda")
    offsets = torch.zeros(b, dtype=torch.int64, device="cuda")
    for _ in range(3):
        rlk.sample(logits, seeds, offsets, temperature=0.8, top_k=50, top_p=0.9)
        rlk.sample(logits, seeds, offsets, temperature=0.8)


def linear_shortk() -> None:
    _linear(1024, 896, 4864)


def linear_mid() -> None:
    _linear(*(int(v) for v in os.environ.get("PROBE_LINEAR", "1024,3584,4608").split(",")))


def paged_b1() -> None:
    from rlk.bench.attention import decode_inputs

    shape = os.environ.get("PROBE_PAGED", "1,8192,32,8,128,16")
    inputs = decode_inputs(*(int(v) for v in shape.split(",")), device="cuda")
    for _ in range(3):
        rlk.paged_attention(*inputs)


def sample_mixed() -> None:
    from rlk_triton import backend, sampling, tuning

    b, v = 8, 151936
    logits = torch.randn(b, v, device="cuda") * 3
    logits[1] = logits[1].round()  # ties: more candidates than FEW_CAP at k = 1000
    logits[5, 77] = float("nan")
    seeds = torch.arange(b, device="cuda")
    offsets = torch.zeros(b, dtype=torch.int64, device="cuda")
    kw = dict(
        temperature=torch.tensor([0.8, 1.0, 0.7, 1.2, 0.9, 1.0, 0.0, 0.6], device="cuda"),
        top_k=torch.tensor([50, 1000, 0, 5, 1, 20, 50, 200], device="cuda"),
        top_p=torch.tensor([0.9, 0.9, 0.8, 1.0, 0.5, 0.9, 0.9, 0.95], device="cuda"),
    )
    rule = backend.default_table()["sample.fwd"]
    tokens = []
    for cfg in rule.configs:
        with tuning.force("sample", {"sample.fwd": cfg}):
            tokens.append(rlk.sample(logits, seeds, offsets, **kw))
    assert all(torch.equal(tokens[0], t) for t in tokens), tokens
    print("sample-mixed tokens", tokens[0].tolist(), "FEW_CAP", sampling.FEW_CAP)


PROBES = {
    "attention-bwd": attention_bwd,
    "linear-decode": linear_decode,
    "linear-shortk": linear_shortk,
    "linear-mid": linear_mid,
    "paged-b1": paged_b1,
    "norm-bwd": norm_bwd,
    "rotary-d64": rotary_d64,
    "sample-topkp": sample_topkp,
    "sample-mixed": sample_mixed,
}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        sys.exit(f"usage: ncu_probe.py {{{','.join(PROBES)}}}")
    PROBES[sys.argv[1]]()
    torch.cuda.synchronize()
