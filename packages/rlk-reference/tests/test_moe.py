"""rlk_reference's MoE ops against per-token loops written from their definitions."""

import torch
import torch.nn.functional as F

import rlk_reference._moe as ref


def test_moe_route_definition():
    torch.manual_seed(0)
    logits = torch.randn(6, 8, dtype=torch.bfloat16)
    logits[0, 2] = logits[0, 5] = 4.0  # a tie: the lower index ranks first
    for normalize in (False, True):
        w, idx = ref.moe_route(logits, 3, normalize)
        assert w.dtype == torch.float32 and idx.dtype == torch.int64
        assert idx[0, :2].tolist() == [2, 5]
        p = torch.softmax(logits.double(), -1)
        for t in range(6):
            order = sorted(range(8), key=lambda e: (-float(logits[t, e]), e))[:3]
            assert idx[t].tolist() == order
            want = p[t, order] / (p[t, order].sum() if normalize else 1.0)
            torch.testing.assert_close(w[t], want.float())


def test_moe_experts_definition():
    torch.manual_seed(1)
    T, E, k, H, I = 5, 4, 2, 8, 6
    x = torch.randn(T, H, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k, dtype=torch.float64)
    gate_up, down = torch.randn(E, 2 * I, H, dtype=torch.float64), torch.randn(E, H, I).double()
    out = ref.moe_experts(x, idx, w, gate_up, down)
    for t in range(T):
        want = torch.zeros(H, dtype=torch.float64)
        for r in range(k):
            e = idx[t, r]
            g, u = (gate_up[e] @ x[t]).chunk(2)
            want += w[t, r] * (down[e] @ (F.silu(g) * u))
        torch.testing.assert_close(out[t], want)
