"""Rollout vs recompute in miniature: one token's log-probability computed alone (decode) and
inside a batch (training recompute), with stock PyTorch and with rlk.

Runs anywhere: on a CPU machine rlk's Triton kernels run under Triton's interpreter, so the
shapes are kept small. Prints the largest difference each way; rlk's must be exactly 0.
"""

from __future__ import annotations

import torch

import rlk


def main() -> int:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = device == "cpu"
    t, h, vocab = (48, 256, 1000) if small else (2048, 4096, 151936)
    # CPU BLAS varies its fp32 reduction order with the row count (bf16 happens not to here);
    # GPU libraries do it for bf16.
    dtype = torch.float32 if small else torch.bfloat16
    x = torch.randn(t, h, device=device, dtype=dtype)
    w = (torch.randn(vocab, h, device=device) * h**-0.5).to(dtype)
    tokens = torch.randint(0, vocab, (t,), device=device)

    def stock(rows):
        logits = torch.mm(x[rows], w.t()).float()
        return torch.log_softmax(logits, -1).gather(1, tokens[rows, None])[:, 0]

    def with_rlk(rows):
        return rlk.logprobs(rlk.linear(x[rows], w), tokens[rows])

    print(f"device {device}, backend {rlk.current_backend(device)}, T={t} H={h} V={vocab} {dtype}")
    worst = {}
    for name, fn in (("stock torch", stock), ("rlk", with_rlk)):
        batch = fn(slice(0, t))
        alone = torch.cat([fn(slice(i, i + 1)) for i in range(0, t, max(1, t // 8))])
        ref = batch[:: max(1, t // 8)]
        worst[name] = (alone - ref).abs().max().item()
        differ = (alone != ref).float().mean().item()
        print(
            f"{name:>12}: max |logp(alone) - logp(in batch)| = {worst[name]:.3g} "
            f"({differ:.0%} of checked tokens differ)"
        )
    if worst["rlk"] != 0.0:
        print("FAIL: rlk must give identical bits")
        return 1
    print("OK: rlk gives identical bits alone and in a batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
