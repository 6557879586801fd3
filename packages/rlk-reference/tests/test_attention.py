import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import rlk_reference as ref
from rlk_reference import _attention as attention_module


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _sdpa(q, k, v, cu_q, cu_k, causal, scale):
    """Independent oracle: F.scaled_dot_product_attention per sequence with an explicit mask."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks = q[cu_q[b] : cu_q[b + 1]].double(), k[cu_k[b] : cu_k[b + 1]].double()
        vs = v[cu_k[b] : cu_k[b + 1]].double()
        nq, nk = qs.shape[0], ks.shape[0]
        mask = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            mask = torch.tril(mask, diagonal=nk - nq)
        kh = ks.repeat_interleave(group, dim=1).transpose(0, 1)
        vh = vs.repeat_interleave(group, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), kh, vh, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (6, 1)])
def test_attention_matches_sdpa(causal, hq, hk):
    torch.manual_seed(0)
    lens_k = [5, 1, 9, 3]
    lens_q = [5, 1, 4, 1]  # training, single token, chunked prefill, decode
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    D = 8
    q = torch.randn(sum(lens_q), hq, D, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hk, D, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hk, D, dtype=torch.float64)
    out = ref.attention(q, k, v, cu_q, cu_k, causal, 0.3)
    want = _sdpa(q, k, v, cu_q.tolist(), cu_k.tolist(), causal, 0.3)
    assert out.dtype == torch.float64 and out.shape == q.shape
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_low_precision_rounds_once(dtype):
    torch.manual_seed(1)
    cu = _cu([3, 6])
    q, k, v = (torch.randn(9, 2, 16, dtype=dtype) for _ in range(3))
    out = ref.attention(q, k, v, cu, cu, True, None)
    assert out.dtype == dtype
    want = ref.attention(q.double(), k.double(), v.double(), cu, cu, True, 16**-0.5)
    assert torch.equal(out, want.to(dtype))


def test_attention_query_chunking_does_not_change_results(monkeypatch):
    torch.manual_seed(2)
    cu_q, cu_k = _cu([7, 2]), _cu([11, 5])
    q = torch.randn(9, 2, 4, dtype=torch.float64)
    k, v = torch.randn(16, 1, 4, dtype=torch.float64), torch.randn(16, 1, 4, dtype=torch.float64)
    whole = ref.attention(q, k, v, cu_q, cu_k, True, 0.5)
    monkeypatch.setattr(attention_module, "_MAX_SCORE_ELEMENTS", 2 * 11 * 3)  # 3 queries a chunk
    torch.testing.assert_close(ref.attention(q, k, v, cu_q, cu_k, True, 0.5), whole,
                               rtol=1e-14, atol=1e-14)  # fmt: skip


def test_attention_empty_sequence():
    cu_q, cu_k = _cu([0, 2]), _cu([3, 2])
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    k, v = torch.randn(5, 2, 4, dtype=torch.float64), torch.randn(5, 2, 4, dtype=torch.float64)
    out = ref.attention(q, k, v, cu_q, cu_k, True, 0.5)
    torch.testing.assert_close(out, _sdpa(q, k, v, cu_q.tolist(), cu_k.tolist(), True, 0.5))


def test_attention_gradcheck():
    torch.manual_seed(3)
    cu_q, cu_k = _cu([3, 1]), _cu([3, 4])
    q = torch.randn(4, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 1, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v: ref.attention(q, k, v, cu_q, cu_k, True, 0.5)  # noqa: E731
    assert gradcheck(fn, (q, k, v))


def _paginate(k, v, cu_k, page_size, generator):
    """Scatter each sequence's KV into pages of a shared cache, page ids shuffled."""
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    n_pages = [(n + page_size - 1) // page_size for n in lens]
    total = sum(n_pages) + 3  # some pages belong to nobody
    perm = torch.randperm(total, generator=generator)
    k_cache = torch.randn(total, page_size, *k.shape[1:], dtype=k.dtype, generator=generator)
    v_cache = torch.randn(total, page_size, *k.shape[1:], dtype=k.dtype, generator=generator)
    table = torch.full((len(lens), max(n_pages) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        for j in range(n):
            page = int(perm[used + j // page_size])
            k_cache[page, j % page_size] = k[cu_k[b] + j]
            v_cache[page, j % page_size] = v[cu_k[b] + j]
        table[b, : n_pages[b]] = perm[used : used + n_pages[b]].to(torch.int32)
        used += n_pages[b]
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_paged_attention_equals_attention(page_size, dtype):
    g = torch.Generator().manual_seed(page_size)
    lens_k, lens_q = [5, 1, 17, 8], [1, 1, 6, 8]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q = torch.randn(sum(lens_q), 4, 8, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), 2, 8, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), 2, 8, generator=g).to(dtype)
    k_cache, v_cache, table, seq_lens = _paginate(k, v, cu_k, page_size, g)
    paged = ref.paged_attention(q, k_cache, v_cache, table, seq_lens, cu_q, 0.25)
    assert paged.dtype == dtype
    assert torch.equal(paged, ref.attention(q, k, v, cu_q, cu_k, True, 0.25))
