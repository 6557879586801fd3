"""linear_logprobs: bitwise equal to the unfused ops, accurate, deterministic, row-invariant."""

from __future__ import annotations

import pytest
import torch

import rlk_reference as ref
from rlk_triton import fused_logprobs as fl
from rlk_triton.backend import default_table
from rlk_triton.gemm import linear
from rlk_triton.logprobs import logprobs

TABLE = default_table()


def _inputs(t, h, v, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    tgt = torch.randint(0, v, (t,), generator=g)
    return hid, w, b, tgt


@pytest.fixture(autouse=True)
def small_slices(monkeypatch, request):
    # Several vocabulary slices (and one partial) at CPU-sized shapes; same code path. The GPU
    # tests keep the real sizes.
    if request.node.get_closest_marker("gpu"):
        return
    monkeypatch.setattr(fl, "VOCAB_SLICE", 128)
    monkeypatch.setattr(fl, "_FWD_SLICE_ELEMS", 3 * 300)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
def test_fused_equals_unfused_bitwise(dtype, logits_dtype):
    hid, w, b, tgt = _inputs(7, 64, 300, dtype, bias=True)
    lp, ent = fl.linear_logprobs(hid, w, tgt, b, 0.7, True, logits_dtype, table=TABLE)
    logits = linear(hid, w, b, table=TABLE) if logits_dtype in (None, dtype) else None
    if logits is None:  # fp32 logits of bf16 inputs: the GEMM kernel writing fp32
        logits = fl._logits(hid, w, b, logits_dtype, TABLE)
    lp_u, ent_u = logprobs(logits, tgt, 0.7, True, table=TABLE)
    assert torch.equal(lp, lp_u) and torch.equal(ent, ent_u)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_accuracy_and_gradients_vs_float64(dtype, tol):
    hid, w, b, tgt = _inputs(6, 48, 300, dtype, bias=True, seed=1)
    args = [x.clone().requires_grad_() for x in (hid, w, b)]
    lp, ent = fl.linear_logprobs(args[0], args[1], tgt, args[2], 1.3, True, table=TABLE)
    r_args = [x.detach().double().requires_grad_() for x in (hid, w, b)]
    r_lp, r_ent = ref.linear_logprobs(r_args[0], r_args[1], tgt, r_args[2], 1.3, True, dtype)
    torch.testing.assert_close(lp.double(), r_lp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent.double(), r_ent, atol=tol, rtol=tol)
    g1, g2 = torch.randn(6), torch.randn(6)
    ((lp * g1).sum() + (ent * g2).sum()).backward()
    ((r_lp * g1.double()).sum() + (r_ent * g2.double()).sum()).backward()
    for a, r in zip(args, r_args):
        err = (a.grad.double() - r.grad).norm() / r.grad.norm()
        assert err < tol, err


def test_backward_deterministic_and_rows_invariant():
    hid, w, _, tgt = _inputs(9, 32, 300, torch.bfloat16, seed=2)

    def run(rows):
        h = hid[rows].clone().requires_grad_()
        wq = w.clone().requires_grad_()
        lp = fl.linear_logprobs(h, wq, tgt[rows], table=TABLE)
        lp.backward(torch.linspace(-1, 1, lp.numel()))
        return lp, h.grad, wq.grad

    a, b = run(slice(0, 9)), run(slice(0, 9))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for i in (0, 4, 8):
        lp1 = fl.linear_logprobs(hid[i : i + 1], w, tgt[i : i + 1], table=TABLE)
        assert torch.equal(lp1, a[0][i : i + 1])


@pytest.mark.parametrize("dtype,logits_dtype", [(torch.bfloat16, None), (torch.bfloat16,
                         torch.float32), (torch.float32, None)])  # fmt: skip
@pytest.mark.parametrize("V", [300, 1200])
def test_backward_bits_do_not_depend_on_the_slice_size(monkeypatch, dtype, logits_dtype, V):
    # V=300: 8 leaves of 38 rows. VOCAB_SLICE 128 puts 3 leaves in a slice, 1000 all of them,
    # 16 one leaf (sub-slices are at least 64 rows, a multiple of every BLOCK_K). V=1200: 8
    # leaves of 150 rows, whole in slices of 1000 rows; VOCAB_SLICE 128 cuts each into
    # sub-slices of 128 and 22 rows, 16 with a forward slice of fewer rows of 7 tokens (112
    # elements) into 64, 64 and 22: their dh products accumulate into the leaf's.
    hid, w, b, tgt = _inputs(7, 64, V, dtype, bias=True, seed=3)
    g1, g2 = torch.randn(7), torch.randn(7)

    def grads(vocab_slice, fwd_elems=3 * 300):
        monkeypatch.setattr(fl, "VOCAB_SLICE", vocab_slice)
        monkeypatch.setattr(fl, "_FWD_SLICE_ELEMS", fwd_elems)
        args = [x.clone().requires_grad_() for x in (hid, w, b)]
        lp, ent = fl.linear_logprobs(
            args[0], args[1], tgt, args[2], 0.9, True, logits_dtype, table=TABLE
        )
        ((lp * g1).sum() + (ent * g2).sum()).backward()
        return [a.grad for a in args]

    want = grads(128)
    for vocab_slice, fwd_elems in ((16, 7 * 16), (16, 3 * 300), (1000, 3 * 300), (100, 7 * 16)):
        got = grads(vocab_slice, fwd_elems)
        for name, x, y in zip(("dhidden", "dW", "dbias"), got, want):
            assert torch.equal(x, y), (vocab_slice, fwd_elems, name)


@pytest.mark.parametrize("dtype,logits_dtype", [(torch.bfloat16, None), (torch.bfloat16,
                         torch.float32), (torch.float32, None)])  # fmt: skip
def test_two_pass_backward_equals_one_pass(monkeypatch, dtype, logits_dtype):
    # 150 tokens: dh in chunks of 40 tokens (4 chunks, the last of 30); dW and dbias in slices
    # of 128 vocabulary rows (3, the last of 44), each over chunks of 64 tokens (64, 64, 22)
    # whose products continue one K chain. Every gradient must keep the one-pass bits.
    hid, w, b, tgt = _inputs(150, 32, 300, dtype, bias=True, seed=4)
    g1, g2 = torch.randn(150), torch.randn(150)

    def grads(bwd_tokens):
        monkeypatch.setattr(fl, "BWD_TOKENS", bwd_tokens)
        monkeypatch.setattr(fl, "DH_TOKENS", 40)
        monkeypatch.setattr(fl, "DW_SLICE", 128)
        monkeypatch.setattr(fl, "DW_TOKENS", 64)
        args = [x.clone().requires_grad_() for x in (hid, w, b)]
        lp, ent = fl.linear_logprobs(
            args[0], args[1], tgt, args[2], 0.9, True, logits_dtype, table=TABLE
        )
        ((lp * g1).sum() + (ent * g2).sum()).backward()
        return [a.grad for a in args]

    want = grads(10**6)
    got = grads(40)
    for name, x, y in zip(("dhidden", "dW", "dbias"), got, want):
        assert torch.equal(x, y), name
    # The element bound alone (40 tokens of H = 32) takes the same chunks.
    assert fl.bwd_tokens(32) == 40
    monkeypatch.setattr(fl, "BWD_ELEMS", 40 * 32)
    assert fl.bwd_tokens(32) == 40 and fl.bwd_tokens(10**6) == 1
    for name, x, y in zip(("dhidden", "dW", "dbias"), grads(10**6), want):
        assert torch.equal(x, y), name


def test_two_pass_backward_of_a_vocabulary_rank(monkeypatch):
    # A vocabulary-parallel rank's backward (rows 152..303 of a 304-row lm_head: 4 of its 8
    # leaves) takes the two passes as one device does: its fp32 dh subtree value, dW and
    # dbias keep the one-pass bits (the targets are in whole-vocabulary ids).
    hid, w, b, tgt = _inputs(150, 32, 304, torch.bfloat16, bias=True, seed=5)
    _, lse, ent = fl.linear_logprobs_forward(hid, w, tgt, b, 0.9, True, torch.bfloat16, TABLE)
    g = torch.Generator().manual_seed(6)
    g_lp, g_ent = torch.randn(150, generator=g), torch.randn(150, generator=g)

    def rank_grads(bwd_tokens):
        monkeypatch.setattr(fl, "BWD_TOKENS", bwd_tokens)
        monkeypatch.setattr(fl, "DH_TOKENS", 40)
        monkeypatch.setattr(fl, "DW_SLICE", 64)
        monkeypatch.setattr(fl, "DW_TOKENS", 64)
        return fl.backward(
            hid, w[152:], tgt, b[152:], lse, ent, g_lp, g_ent, 0.9, torch.bfloat16, TABLE,
            True, True, True, torch.float32, 304, 152,
        )  # fmt: skip

    want = rank_grads(10**6)
    assert want[0].dtype == torch.float32
    for name, x, y in zip(("dhidden", "dW", "dbias"), rank_grads(40), want):
        assert torch.equal(x, y), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [896, 4096])
def test_two_pass_backward_equals_one_pass_gpu(monkeypatch, H):
    # Qwen's vocabulary at 2500 tokens: dh in three chunks, dW in 75 vocabulary slices over one
    # token chunk, dbias too; then, with DW_TOKENS = 1024, over three chunks of tokens.
    T, V = 2500, 151936
    g = torch.Generator(device="cuda").manual_seed(H)
    hid = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    b = (torch.randn(V, device="cuda", generator=g) * 0.1).bfloat16()
    tgt = torch.randint(0, V, (T,), device="cuda", generator=g)
    g1 = torch.randn(T, device="cuda", generator=g)

    def grads(bwd_tokens, dw_tokens=fl.DW_TOKENS):
        monkeypatch.setattr(fl, "BWD_TOKENS", bwd_tokens)
        monkeypatch.setattr(fl, "DW_TOKENS", dw_tokens)
        args = [x.clone().requires_grad_() for x in (hid, w, b)]
        (fl.linear_logprobs(args[0], args[1], tgt, args[2], table=TABLE) * g1).sum().backward()
        return [a.grad for a in args]

    want = grads(10**6)
    for got in (grads(1024), grads(1024, 1024)):
        for name, x, y in zip(("dhidden", "dW", "dbias"), got, want):
            assert torch.equal(x, y), name
