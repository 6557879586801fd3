"""attention / paged_attention: accuracy, one set of numbers across paths, batch invariance,
deterministic backward, tuning invariance.

CPU tests run the real kernels (BLOCK_N = 64 KV tiles) under Triton's interpreter, so the
sequences are a little longer than 64 or 128 to cross tile boundaries, with small head dims and
one or two KV heads. GPU tests (``gpu``) check the same properties at real sizes on the GPU,
where the instruction kind of ``tl.dot`` matters.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import rlk_reference as ref
from rlk_triton import attention as attn
from rlk_triton import attention_bwd as attn_bwd
from rlk_triton import attention_fwd as attn_fwd
from rlk_triton import paged_attention as pattn
from rlk_triton import tuning

TABLE = {**attn.TUNING, **pattn.TUNING}
# Max error vs float64 relative to max(1, max|ref|): rounding of the output dominates.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}
GPU = torch.cuda.is_available()


def _cu(lens, device="cpu"):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def _qkv(n, hq, hk, d, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hk, hk))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _fwd(q, k, v, cu_q, cu_k, causal=True, table=TABLE):
    return attn.attention(q, k, v, cu_q, cu_k, causal, q.shape[-1] ** -0.5, table=table)


def _close(got, want, dtype, what):
    err = (got.double() - want.double()).abs().max().item()
    bound = TOL[dtype] * max(1.0, want.double().abs().max().item())
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g}"


def _paged_cache(seqs, page_size, seed=0, pad_pages=1):
    """Scatter the keys/values of each sequence into shuffled pages; unused slots hold NaN so a
    read outside the sequence would poison the result."""
    g = torch.Generator().manual_seed(seed)
    k0 = seqs[0][0]
    hk, d = k0.shape[1:]
    n_pages = [math.ceil(k.shape[0] / page_size) for k, _ in seqs]
    total = sum(n_pages) + pad_pages
    perm = torch.randperm(total, generator=g)
    kc = torch.full((total, page_size, hk, d), float("nan"), dtype=k0.dtype, device=k0.device)
    vc = kc.clone()
    width = max(n_pages) + 1
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    used = 0
    for b, ((k, v), npg) in enumerate(zip(seqs, n_pages, strict=True)):
        for p in range(npg):
            page = int(perm[used])
            used += 1
            bt[b, p] = page
            chunk = slice(p * page_size, min((p + 1) * page_size, k.shape[0]))
            kc[page, : chunk.stop - chunk.start] = k[chunk]
            vc[page, : chunk.stop - chunk.start] = v[chunk]
    return kc, vc, bt.to(k0.device)


def _paged(q, seqs, q_lens, page_size, table=TABLE, seed=0):
    kc, vc, bt = _paged_cache(seqs, page_size, seed)
    lens = torch.tensor([k.shape[0] for k, _ in seqs], dtype=torch.int32, device=q.device)
    cu_q = _cu(q_lens, q.device)
    return pattn.paged_attention(q, kc, vc, bt, lens, cu_q, q.shape[-1] ** -0.5, table=table)


def _path_outputs(q, k, v, chunkings, page_sizes, decode_from, other, table=TABLE):
    """Outputs of one sequence through every path; keys name the path."""
    n = q.shape[0]
    dev = q.device
    out = {}
    oq, ok_, ov = other
    # Training: packed with another sequence, our sequence second.
    packed = _fwd(
        torch.cat([oq, q]),
        torch.cat([ok_, k]),
        torch.cat([ov, v]),
        _cu([oq.shape[0], n], dev),
        _cu([ok_.shape[0], n], dev),
        table=table,
    )
    out["training"] = packed[oq.shape[0] :]
    out["prefill"] = _fwd(q, k, v, _cu([n], dev), _cu([n], dev), table=table)
    for chunks in chunkings:
        parts, start = [], 0
        for c in chunks:
            end = start + c
            parts.append(
                _fwd(q[start:end], k[:end], v[:end], _cu([c], dev), _cu([end], dev), table=table)
            )
            start = end
        assert start == n
        out[f"chunked{tuple(chunks)}"] = torch.cat(parts)
    # Decode one token at a time, batched with a decode of the other sequence.
    steps = []
    for t in range(decode_from, n):
        qq = torch.cat([oq[-1:], q[t : t + 1]])
        kk = torch.cat([ok_, k[: t + 1]])
        vv = torch.cat([ov, v[: t + 1]])
        o = _fwd(qq, kk, vv, _cu([1, 1], dev), _cu([ok_.shape[0], t + 1], dev), table=table)
        steps.append(o[1:])
    out["decode"] = torch.cat([out["prefill"][:decode_from], *steps])
    for ps in page_sizes:
        # Paged prefill of the whole sequence, our sequence first and the other one after it.
        o = _paged(torch.cat([q, oq[-3:]]), [(k, v), (ok_, ov)], [n, 3], ps, table=table, seed=ps)
        out[f"paged{ps}"] = o[:n]
        # Paged chunked prefill: two chunks, the second batched after the other's decode.
        c = n // 3
        o1 = _paged(q[:c], [(k[:c], v[:c])], [c], ps, table=table, seed=ps + 1)
        o2 = _paged(
            torch.cat([oq[-1:], q[c:]]),
            [(ok_, ov), (k, v)],
            [1, n - c],
            ps,
            table=table,
            seed=ps + 2,
        )
        out[f"paged{ps}-chunked"] = torch.cat([o1, o2[1:]])
        # Paged decode of the last tokens.
        dec = [
            _paged(q[t : t + 1], [(k[: t + 1], v[: t + 1])], [1], ps, table=table, seed=t)
            for t in range(n - 3, n)
        ]
        out[f"paged{ps}-decode"] = torch.cat([out[f"paged{ps}"][: n - 3], *dec])
    return out


def _assert_all_equal(outs):
    names = list(outs)
    base = outs[names[0]]
    for name in names[1:]:
        diff = (outs[name].float() - base.float()).abs()
        bad = (outs[name] != base).any(-1).any(-1).nonzero().flatten().tolist()
        assert not bad, f"{name} != {names[0]} at tokens {bad[:10]} (max diff {diff.max():.3g})"


# --------------------------------------------------------------------------------------------
# CPU (interpreter)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,d,hq,hk,causal",
    [
        (torch.bfloat16, 32, 4, 2, True),
        (torch.float16, 16, 3, 1, True),
        (torch.float32, 16, 2, 2, False),
        (torch.bfloat16, 24, 2, 1, False),
        (torch.float16, 64, 1, 1, True),
    ],
)
def test_forward_accuracy(dtype, d, hq, hk, causal):
    lens_q, lens_k = [70, 0, 5, 131], [70, 0, 9, 131]
    if not causal:
        lens_q = lens_k
    q, _, _ = _qkv(sum(lens_q), hq, hk, d, dtype, seed=1)
    _, k, v = _qkv(sum(lens_k), hq, hk, d, dtype, seed=2)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    got = _fwd(q, k, v, cu_q, cu_k, causal)
    want = ref.attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal, d**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, want, dtype, "output")


@pytest.mark.parametrize(
    "dtype,d,hq,hk,causal,lens_q,lens_k",
    [
        (torch.bfloat16, 32, 4, 2, True, [70, 3, 130], [70, 3, 130]),
        (torch.float32, 16, 3, 1, False, [80, 20], [80, 20]),
        (torch.float16, 16, 2, 1, True, [40, 66], [100, 66]),  # nq < nk
    ],
)
def test_backward_accuracy(dtype, d, hq, hk, causal, lens_q, lens_k):
    q, _, _ = _qkv(sum(lens_q), hq, hk, d, dtype, seed=3)
    _, k, v = _qkv(sum(lens_k), hq, hk, d, dtype, seed=4)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    _fwd(*leaves, cu_q, cu_k, causal).backward(do)
    leaves64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref.attention(*leaves64, cu_q, cu_k, causal, d**-0.5).backward(do.double())
    for name, a, b in zip("qkv", leaves, leaves64, strict=True):
        assert a.grad.dtype == dtype
        _close(a.grad, b.grad, dtype, f"d{name}")


def test_path_invariance():
    """training == prefill == chunked == decode == paged (16/32/64/128, shuffled pages)."""
    n, hq, hk, d = 150, 2, 1, 32
    q, k, v = _qkv(n, hq, hk, d, torch.bfloat16, seed=6)
    other = _qkv(77, hq, hk, d, torch.bfloat16, seed=7)
    outs = _path_outputs(
        q,
        k,
        v,
        chunkings=[(1, 63, 2, 64, 20), (100, 50), (64, 64, 22)],
        page_sizes=(16, 32, 64, 128),
        decode_from=n - 24,
        other=other,
    )
    _assert_all_equal(outs)
    want = ref.attention(q.double(), k.double(), v.double(), _cu([n]), _cu([n]), True, d**-0.5)
    _close(outs["training"], want, torch.bfloat16, "output")


def test_path_invariance_gqa_d64_fp16():
    n, hq, hk, d = 130, 4, 1, 64
    q, k, v = _qkv(n, hq, hk, d, torch.float16, seed=8)
    other = _qkv(20, hq, hk, d, torch.float16, seed=9)
    outs = _path_outputs(
        q, k, v, chunkings=[(65, 1, 64)], page_sizes=(16, 128), decode_from=n - 4, other=other
    )
    _assert_all_equal(outs)


def test_batch_invariance():
    """A sequence's output does not depend on what else is in the batch or where."""
    hq, hk, d = 2, 1, 16
    lens = [90, 1, 0, 140, 33]
    seqs = [_qkv(n, hq, hk, d, torch.bfloat16, seed=10 + i) for i, n in enumerate(lens)]

    def run(order):
        qs, ks, vs = zip(*(seqs[i] for i in order), strict=True)
        cu = _cu([lens[i] for i in order])
        o = _fwd(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu, cu)
        return dict(zip(order, torch.split(o, [lens[i] for i in order]), strict=True))

    full = run([0, 1, 2, 3, 4])
    for order in ([3], [4, 3, 2, 1, 0], [2, 0, 2, 3]):
        got = run(order)
        for i in order:
            assert torch.equal(got[i], full[i]), f"sequence {i} changed with batch {order}"
    # Non-causal too.
    cu = _cu([90, 140])
    q = torch.cat([seqs[0][0], seqs[3][0]])
    k = torch.cat([seqs[0][1], seqs[3][1]])
    v = torch.cat([seqs[0][2], seqs[3][2]])
    both = _fwd(q, k, v, cu, cu, causal=False)
    alone = _fwd(*seqs[3], _cu([140]), _cu([140]), causal=False)
    assert torch.equal(both[90:], alone)


def _fwd_bwd(q, k, v, cu_q, cu_k, do, causal=True, table=TABLE):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = _fwd(*leaves, cu_q, cu_k, causal, table=table)
    o.backward(do)
    return [o.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("causal", [True, False])
def test_backward_determinism_and_batch_invariance(causal):
    hq, hk, d = 4, 2, 16
    lens = [100, 7, 70]
    q, k, v = _qkv(sum(lens), hq, hk, d, torch.bfloat16, seed=20)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16)
    cu = _cu(lens)
    first = _fwd_bwd(q, k, v, cu, cu, do, causal)
    again = _fwd_bwd(q, k, v, cu, cu, do, causal)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    # The last sequence alone gives the same gradients.
    s = slice(107, 177)
    alone = _fwd_bwd(q[s], k[s], v[s], _cu([70]), _cu([70]), do[s], causal)
    for name, a, b in zip(["o", "dq", "dk", "dv"], first, alone, strict=True):
        assert torch.equal(a[s], b), f"{name} depends on the batch"


@pytest.mark.parametrize("causal", [True, False])
def test_dkdv_loop_variants_change_no_bits(causal, monkeypatch):
    """The dK/dV kernel's unmasked loop (query chunks that see a whole KV tile) gives the bits
    of the masked loop alone, and so does issuing the dO V^T product early, with padding rows
    (group 3 packs 21 of 64 rows per token chunk), nq < nk, a ragged last tile and every
    backward config."""
    hq, hk, d = 6, 2, 16
    lens_q, lens_k = [150, 9, 64], [170, 9, 64]
    if not causal:
        lens_q = lens_k
    q, _, _ = _qkv(sum(lens_q), hq, hk, d, torch.bfloat16, seed=24)
    _, k, v = _qkv(sum(lens_k), hq, hk, d, torch.bfloat16, seed=25)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(26)).to(torch.bfloat16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    for cfg in TABLE["attention.bwd"].configs:
        got = {}
        for split, early in ((False, False), (True, False), (True, True), (False, True)):
            monkeypatch.setattr(attn_bwd, "_split_dkdv", lambda head_dim, split=split: split)
            monkeypatch.setattr(attn_bwd, "_early_dp", lambda head_dim, early=early: early)
            with tuning.force("attention", {"attention.bwd": cfg}):
                got[split, early] = _fwd_bwd(q, k, v, cu_q, cu_k, do, causal)
        for variant, res in got.items():
            for name, a, b in zip(["o", "dq", "dk", "dv"], got[False, False], res, strict=True):
                assert torch.equal(a, b), f"{name} changed with {variant} ({cfg})"


def test_length_bounds_change_no_bits():
    """Caller's bounds on the sequence lengths (no host read of the offsets) size the grids
    only: forward and backward give the bits of the bounds read from the offsets."""
    hq, hk, d = 4, 2, 16
    lens = [100, 7, 0, 70]
    q, k, v = _qkv(sum(lens), hq, hk, d, torch.bfloat16, seed=22)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(23)).to(torch.bfloat16)
    cu = _cu(lens)
    want = _fwd_bwd(q, k, v, cu, cu, do)
    for bq, bk in ((100, 100), (101, 333)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = attn.attention(
            *leaves, cu, cu, True, d**-0.5, max_seqlen_q=bq, max_seqlen_k=bk, table=TABLE
        )
        o.backward(do)
        for name, a, b in zip(["o", "dq", "dk", "dv"], want, [o] + [x.grad for x in leaves]):
            assert torch.equal(a, b), f"{name} changed with the bounds {bq}, {bk}"


def test_row_offsets_int32_and_int64_read_the_same_rows(monkeypatch):
    """Forward and backward compute row offsets in int32 when every element of the tensors they
    address lies below 2^31 (``OFF32``), else in int64: the same rows, so the same bits,
    packed (forward and backward) and paged; a bad page id is NaN either way. ``_span`` is one
    past the last element's offset."""
    x = torch.empty(5, 3, 4)
    assert attn_fwd._span(x) == 60 and attn_fwd._span(x[:, 1:]) == 56
    assert attn_fwd._span(x[::2]) == 60
    assert attn_fwd._span(torch.empty(0, 4)) == 0
    lens = [90, 33]
    q, k, v = _qkv(sum(lens), 4, 2, 16, torch.float16, seed=91)
    cu = _cu(lens)
    seqs = [(k[:90], v[:90]), (k[90:], v[90:])]
    q_dec = q[:2]
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(92)).to(torch.float16)

    def both():
        return *_fwd_bwd(q, k, v, cu, cu, do), _paged(q_dec, seqs, [1, 1], 16)

    narrow = both()
    monkeypatch.setattr(attn_fwd, "_span", lambda t: 2**31)
    wide = both()
    assert all(map(torch.equal, narrow, wide))
    kc, vc, bt = _paged_cache([seqs[0]], 16)
    bt[0, 2] = -1  # keys 32..47: a page id out of range
    monkeypatch.setattr(attn_fwd._bounds, "report", lambda ok, message: None)
    args = (q[:1], kc, vc, bt, torch.tensor([90], dtype=torch.int32), _cu([1]), 0.25)
    assert pattn.paged_attention(*args, table=TABLE).isnan().all()
    monkeypatch.undo()
    monkeypatch.setattr(attn_fwd._bounds, "report", lambda ok, message: None)
    assert pattn.paged_attention(*args, table=TABLE).isnan().all()


def test_paged_stores_new_kv_in_bounds(monkeypatch):
    """k_new/v_new stored by the call (one launch) equal index_copy_ then the call; a slot out
    of range is never written and fails the call (CPU: ValueError at once)."""
    q, k, v = _qkv(40, 4, 2, 16, torch.bfloat16, seed=5)
    kc, vc, bt = _paged_cache([(k, v)], 16)
    lens, cu = torch.tensor([40], dtype=torch.int32), _cu([2])
    pos = torch.tensor([38, 39])
    slots = bt[0].long()[pos // 16] * 16 + pos % 16
    want = pattn.paged_attention(q[38:], kc, vc, bt, lens, cu, 0.25, table=TABLE)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[slots // 16, slots % 16] = vc2[slots // 16, slots % 16] = 0.0
    kw = dict(k_new=k[38:], v_new=v[38:], slots=slots, table=TABLE)
    got = pattn.paged_attention(q[38:], kc2, vc2, bt, lens, cu, 0.25, **kw)
    assert torch.equal(got, want)
    assert torch.equal(kc2.nan_to_num(7.0), kc.nan_to_num(7.0))
    assert torch.equal(vc2.nan_to_num(7.0), vc.nan_to_num(7.0))
    before = kc2.clone()
    bad = torch.tensor([slots[0].item(), kc.shape[0] * 16])
    with pytest.raises(ValueError, match="slot outside"):
        pattn.paged_attention(q[38:], kc2, vc2, bt, lens, cu, 0.25, **{**kw, "slots": bad})
    assert torch.equal(kc2.nan_to_num(7.0), before.nan_to_num(7.0))  # row 0 rewritten alike


def _pointers_and_descriptors(cfg, q, k, v, cu_q, cu_k, causal=True):
    """The forward under ``cfg`` without and with ``TMA``."""
    plain = {key: val for key, val in cfg.items() if key != "TMA"}
    outs = []
    for c in (plain, {**plain, "TMA": True}):
        with tuning.force("attention", {"attention.fwd": c}):
            outs.append(_fwd(q, k, v, cu_q, cu_k, causal))
    return outs


def test_descriptor_loads_change_no_bits():
    """A forward config's ``TMA`` reads the full KV tiles through tensor descriptors: the bits
    of the pointer loads, and only the sequence's own keys (the first sequence's K and V are
    NaN; the others' rows stay finite, the second one's full tiles starting at row 70). A
    head_dim that is not a power of two keeps the pointer loads."""
    hq, hk = 4, 2
    lens = [70, 150, 9]
    cu = _cu(lens)
    for d in (16, 24):
        q, k, v = _qkv(sum(lens), hq, hk, d, torch.bfloat16, seed=24)
        k[:70], v[:70] = float("nan"), float("nan")
        assert attn_fwd._descriptors_fit(k, v, False) == (d == 16)
        # a contiguous view whose base is not 16-byte aligned keeps the pointer loads
        shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)
        assert not attn_fwd._descriptors_fit(shifted.copy_(k), v, False)
        for causal, cfg in itertools.product((True, False), TABLE["attention.fwd"].configs):
            want, got = _pointers_and_descriptors(cfg, q, k, v, cu, cu, causal)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            assert torch.isfinite(got[70:]).all()
    # fp16, queries that are each sequence's last tokens (chunked prefill)
    lens_q = [5, 100, 9]
    q, k, v = _qkv(sum(lens), hq, hk, 16, torch.float16, seed=28)
    q = q[: sum(lens_q)].contiguous()
    k[:70], v[:70] = float("nan"), float("nan")
    for cfg in TABLE["attention.fwd"].configs:
        want, got = _pointers_and_descriptors(cfg, q, k, v, _cu(lens_q), cu)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.isfinite(got[5:]).all()


def test_eager_small_calls_read_through_pointers(monkeypatch):
    """A chosen TMA config reads through pointers for an eager call under
    tuning.HOST_BOUND_FLOPS (the same bits), through descriptors above it."""
    import triton.tools.tensor_descriptor as td

    made = []

    class Recorded(td.TensorDescriptor):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(td, "TensorDescriptor", Recorded)
    tma = next(i for i, c in enumerate(TABLE["attention.fwd"].configs) if c.get("TMA"))
    table = {**TABLE, "attention.fwd": tuning.Rule(TABLE["attention.fwd"].configs, lambda **_: tma)}
    q, k, v = _qkv(150, 2, 1, 16, torch.bfloat16, seed=25)
    cu = _cu([150])
    want = _fwd(q, k, v, cu, cu, table=table)
    assert made == []
    monkeypatch.setattr(tuning, "HOST_BOUND_FLOPS", 0)
    assert torch.equal(_fwd(q, k, v, cu, cu, table=table), want) and made == [1, 1]


def _all_configs(op):
    return tuning.op_configs(TABLE, op)


def test_tuning_invariance_forward_and_backward():
    hq, hk, d = 6, 2, 16  # group 3: rows pack 3 heads x tokens
    lens = [150, 9]
    q, k, v = _qkv(sum(lens), hq, hk, d, torch.bfloat16, seed=30)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    cu = _cu(lens)
    results = []
    fwd_cfgs = _all_configs("attention")
    assert len(fwd_cfgs) >= 2 and len(TABLE["attention.fwd"].configs) >= 2
    assert len(TABLE["attention.bwd"].configs) >= 2
    for cfg in fwd_cfgs:
        with tuning.force("attention", cfg):
            results.append(_fwd_bwd(q, k, v, cu, cu, do))
    for res in results[1:]:
        for name, a, b in zip(["o", "dq", "dk", "dv"], results[0], res, strict=True):
            assert torch.equal(a, b), f"{name} changed with the tuning config"


def test_tuning_invariance_paged():
    hq, hk, d = 2, 1, 16
    n = 140
    q, k, v = _qkv(n, hq, hk, d, torch.bfloat16, seed=40)
    cfgs = _all_configs("paged_attention")
    assert len(cfgs) >= 2
    outs = {}
    for i, cfg in enumerate(cfgs):
        with tuning.force("paged_attention", cfg):
            outs[f"cfg{i}"] = _paged(q[n - 70 :], [(k, v)], [70], 32)
    _assert_all_equal(outs)
    outs["attention"] = _fwd(q, k, v, _cu([n]), _cu([n]))[n - 70 :]
    _assert_all_equal(outs)


def _split_table():
    """TABLE with every attention kernel on the one-program-per-split config."""
    rule = tuning.Rule(TABLE["paged_attention.fwd"].configs, lambda **_: pattn._SPLIT)
    return {**TABLE, "attention.fwd": rule, "paged_attention.fwd": rule}


@pytest.mark.parametrize("split,dtype", [(64, torch.float32), (128, torch.bfloat16)])
def test_kv_split_paths(monkeypatch, split, dtype):
    """Rows of more than KV_SPLIT keys: training, prefill, chunked prefill, decode and paged
    merge the same splits in the same order, whether one program runs a row's splits or one
    program runs each split (SPLIT configs, then the merge kernel); and the split is real (other
    bits than without it). fp32 outputs show a merge's last bits, which bf16 rounds away."""
    n, hq, hk, d = 300, 2, 1, 32
    q, k, v = _qkv(n, hq, hk, d, dtype, seed=80)
    other = _qkv(70, hq, hk, d, dtype, seed=81)
    paths = dict(chunkings=[(100, 200), (1, 129, 170)], page_sizes=(16, 64), decode_from=n - 3)
    unsplit = _fwd(q, k, v, _cu([n]), _cu([n]))
    monkeypatch.setattr(attn_fwd, "KV_SPLIT", split)
    outs = _path_outputs(q, k, v, other=other, **paths)
    split_grid = _path_outputs(q, k, v, other=other, table=_split_table(), **paths)
    _assert_all_equal({**outs, **{f"{name} (a program per split)": o
                                  for name, o in split_grid.items()}})  # fmt: skip
    want = ref.attention(q.double(), k.double(), v.double(), _cu([n]), _cu([n]), True, d**-0.5)
    _close(outs["training"], want, dtype, "output")
    # Rows within the first split have the unsplit bits; some row past it has others.
    assert torch.equal(outs["training"][:split], unsplit[:split])
    assert not torch.equal(outs["training"], unsplit)
    # Sequences that each fit in one split, under one set of offsets (cu_k is cu_q): the launch
    # compiles no split loop, and gives the bits of one that does (cu_k another tensor).
    cu = _cu([split, split // 2])
    t = int(cu[-1])
    assert torch.equal(_fwd(q[:t], k[:t], v[:t], cu, cu), _fwd(q[:t], k[:t], v[:t], cu, cu.clone()))


def test_kv_split_backward_and_bad_pages(monkeypatch):
    """With splits: the backward from the merged statistics is accurate and the same for both
    kinds of launch; a bad page makes the rows that see it NaN in either."""
    monkeypatch.setattr(attn_fwd, "KV_SPLIT", 64)
    lens = [200, 30]
    q, k, v = _qkv(sum(lens), 2, 1, 16, torch.float16, seed=82)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(83)).to(torch.float16)
    cu = _cu(lens)
    got = _fwd_bwd(q, k, v, cu, cu, do)
    with tuning.force("attention", {"attention.fwd": attn._FWD_CONFIGS[pattn._SPLIT]}):
        assert all(map(torch.equal, got, _fwd_bwd(q, k, v, cu, cu, do)))
    leaves64 = [x.double().requires_grad_() for x in (q, k, v)]
    ref.attention(*leaves64, cu, cu, True, 16**-0.5).backward(do.double())
    _close(got[0], ref.attention(q.double(), k.double(), v.double(), cu, cu, True, 0.25),
           torch.float16, "output")  # fmt: skip
    for name, a, b in zip("qkv", got[1:], leaves64, strict=True):
        _close(a, b.grad, torch.float16, f"d{name}")
    kc, vc, bt = _paged_cache([(k[:200], v[:200])], 16)
    bt[0, 6] = kc.shape[0] + 3  # keys 96..111: a page id out of range
    lens_t = torch.tensor([200], dtype=torch.int32)
    args = (q[190:200], kc, vc, bt, lens_t, _cu([10]), 0.25)
    for table in (TABLE, _split_table()):
        with pytest.raises(ValueError, match="page id"):
            pattn.paged_attention(*args, table=table)
    monkeypatch.setattr(attn_fwd._bounds, "report", lambda ok, message: None)
    for table in (TABLE, _split_table()):
        o = pattn.paged_attention(*args, table=table)
        assert o.isnan().all(), "rows that see the bad page must be NaN"


def test_paged_accuracy_and_nan_pages():
    hq, hk, d = 4, 2, 32
    lens, q_lens = [130, 5, 64], [1, 5, 3]
    seqs = [_qkv(n, hq, hk, d, torch.float16, seed=50 + i)[1:] for i, n in enumerate(lens)]
    q = _qkv(sum(q_lens), hq, hk, d, torch.float16, seed=60)[0]
    got = _paged(q, seqs, q_lens, 16)
    assert not got.isnan().any()
    want = ref.attention(
        q.double(),
        torch.cat([k for k, _ in seqs]).double(),
        torch.cat([v for _, v in seqs]).double(),
        _cu(q_lens),
        _cu(lens),
        True,
        d**-0.5,
    )
    _close(got, want, torch.float16, "paged output")


def test_backend_binds_both_ops():
    from rlk_triton import backend

    impl = backend.make_impl(backend.default_table())
    q, k, v = _qkv(70, 2, 1, 16, torch.bfloat16, seed=70)
    cu = _cu([70])
    assert torch.equal(impl.ops["attention"](q, k, v, cu, cu, True, 0.25), _fwd(q, k, v, cu, cu))
    kc, vc, bt = _paged_cache([(k, v)], 16)
    lens = torch.tensor([70], dtype=torch.int32)
    got = impl.ops["paged_attention"](q[-1:], kc, vc, bt, lens, _cu([1]), 0.25)
    assert torch.equal(got, _fwd(q, k, v, cu, cu)[-1:])


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_path_invariance(d):
    n, hq, hk = 1999, 8, 2
    q, k, v = _qkv(n, hq, hk, d, torch.bfloat16, seed=100, device="cuda")
    other = _qkv(300, hq, hk, d, torch.bfloat16, seed=101, device="cuda")
    outs = _path_outputs(
        q,
        k,
        v,
        chunkings=[(1, 63, 2, 64, 129, 1000, 740), (1024, 975), (511, 513, 975)],
        page_sizes=(16, 32, 64, 128),
        decode_from=n - 300,
        other=other,
    )
    _assert_all_equal(outs)
    want = ref.attention(
        q.double(), k.double(), v.double(), _cu([n], "cuda"), _cu([n], "cuda"), True, d**-0.5
    )
    _close(outs["training"], want, torch.bfloat16, "output")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,dtype", [(80, torch.bfloat16), (96, torch.float16), (256, torch.bfloat16)]
)
def test_gpu_path_invariance_other_dims(d, dtype):
    n, hq, hk = 700, 4, 4
    q, k, v = _qkv(n, hq, hk, d, dtype, seed=110, device="cuda")
    other = _qkv(65, hq, hk, d, dtype, seed=111, device="cuda")
    outs = _path_outputs(
        q,
        k,
        v,
        chunkings=[(1, 300, 399)],
        page_sizes=(16, 64, 128),
        decode_from=n - 70,
        other=other,
    )
    _assert_all_equal(outs)


@pytest.mark.gpu
def test_gpu_batch_invariance_and_tuning():
    hq, hk, d = 32, 8, 128
    lens = [2048, 1, 700, 64, 1500]
    seqs = [
        _qkv(n, hq, hk, d, torch.bfloat16, seed=120 + i, device="cuda") for i, n in enumerate(lens)
    ]
    alone = [_fwd(*s, _cu([n], "cuda"), _cu([n], "cuda")) for s, n in zip(seqs, lens, strict=True)]
    order = [4, 1, 0, 3, 2]
    cu = _cu([lens[i] for i in order], "cuda")
    for cfg in _all_configs("attention"):
        with tuning.force("attention", cfg):
            o = _fwd(*(torch.cat([seqs[i][j] for i in order]) for j in range(3)), cu, cu)
        for i, part in zip(order, torch.split(o, [lens[i] for i in order]), strict=True):
            assert torch.equal(part, alone[i]), f"sequence {i} differs (config {cfg})"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_backward_determinism_batch_and_tuning(causal, monkeypatch):
    hq, hk, d = 16, 4, 128
    lens = [1024, 333, 2000]
    q, k, v = _qkv(sum(lens), hq, hk, d, torch.bfloat16, seed=130, device="cuda")
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    cu = _cu(lens, "cuda")
    base = _fwd_bwd(q, k, v, cu, cu, do, causal)
    for _ in range(3):
        for a, b in zip(base, _fwd_bwd(q, k, v, cu, cu, do, causal), strict=True):
            assert torch.equal(a, b)
    for cfg in _all_configs("attention"):
        with tuning.force("attention", cfg):
            for name, a, b in zip(
                ["o", "dq", "dk", "dv"], base, _fwd_bwd(q, k, v, cu, cu, do, causal), strict=True
            ):
                assert torch.equal(a, b), f"{name} changed with config {cfg}"
    for split, early in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(attn_bwd, "_split_dkdv", lambda head_dim, split=split: split)
        monkeypatch.setattr(attn_bwd, "_early_dp", lambda head_dim, early=early: early)
        got = _fwd_bwd(q, k, v, cu, cu, do, causal)
        for name, a, b in zip(["o", "dq", "dk", "dv"], base, got, strict=True):
            assert torch.equal(a, b), f"{name} changed with the dK/dV loop {(split, early)}"
    monkeypatch.undo()
    s = slice(1024 + 333, sum(lens))
    alone = _fwd_bwd(q[s], k[s], v[s], _cu([2000], "cuda"), _cu([2000], "cuda"), do[s], causal)
    for name, a, b in zip(["o", "dq", "dk", "dv"], base, alone, strict=True):
        assert torch.equal(a[s], b), f"{name} depends on the batch"
    leaves64 = [x[s].double().requires_grad_() for x in (q, k, v)]
    ref.attention(*leaves64, _cu([2000], "cuda"), _cu([2000], "cuda"), causal, d**-0.5).backward(
        do[s].double()
    )
    for name, a, b in zip("qkv", alone[1:], leaves64, strict=True):
        _close(a, b.grad, torch.bfloat16, f"d{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_split", [attn_fwd.KV_SPLIT, 1024])
def test_gpu_paged_tuning_and_decode_batch(kv_split, monkeypatch):
    # At 1024 the sequences of 4096, 1000 and 2500 keys cross split boundaries: every config
    # (a program per split among them) and the packed prefill merge at the same positions.
    monkeypatch.setattr(attn_fwd, "KV_SPLIT", kv_split)
    hq, hk, d = 32, 8, 128
    lens = [4096, 17, 1000, 2500]
    seqs = [
        _qkv(n, hq, hk, d, torch.bfloat16, seed=140 + i, device="cuda") for i, n in enumerate(lens)
    ]
    q = torch.cat([s[0][-1:] for s in seqs])
    kv = [(s[1], s[2]) for s in seqs]
    outs = {}
    for i, cfg in enumerate(_all_configs("paged_attention")):
        with tuning.force("paged_attention", cfg):
            outs[f"paged-cfg{i}"] = _paged(q, kv, [1] * 4, 16, seed=i)
    for s, n in zip(seqs, lens, strict=True):
        o = _fwd(*s, _cu([n], "cuda"), _cu([n], "cuda"))[-1:]
        outs.setdefault("prefill", []).append(o)
    outs["prefill"] = torch.cat(outs["prefill"])
    _assert_all_equal(outs)
