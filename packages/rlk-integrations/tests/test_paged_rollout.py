"""Paged continuous-batching rollout: a request's tokens and log-probabilities are the same bits
as in the padded rollout, alone, and in the training recompute (auto backend: triton under the
interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations.engine import fused, paged, rollout, training  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

VOCAB = 512
LENGTHS = [5, 11, 3, 8]
SEEDS = [11, 12, 13, 14]
NEW = 6


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return rt.patch_model(zoo.load_model("tiny", dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def padded(model):
    return rollout.generate(model, _prompts(LENGTHS), NEW, seeds=SEEDS)


def _same(a: rollout.Sample, b: rollout.Sample) -> None:
    assert a.response == b.response
    assert a.logprobs.dtype == b.logprobs.dtype == torch.float32
    assert torch.equal(a.logprobs, b.logprobs), (a.logprobs, b.logprobs)


def test_paged_equals_padded_alone_and_training(model, padded):
    prompts = _prompts(LENGTHS)
    # 4 requests, 2 slots: requests queue; 6-token steps and 4-token chunks: prompts are
    # chunked and share steps with other requests' decodes.
    ro = paged.generate_paged(
        model, prompts, NEW, seeds=SEEDS, page_size=4, max_batch=2, max_step_tokens=6,
        prefill_chunk=4,
    )  # fmt: skip
    assert ro.extra["max_running"] == 2
    assert ro.extra["mixed_steps"] > 0
    assert ro.extra["prefill_chunks"] > len(prompts)  # some prompt took several chunks
    assert ro.logits_dtype == padded.logits_dtype == torch.bfloat16
    assert ro.new_tokens == len(prompts) * NEW
    for a, b in zip(padded.samples, ro.samples):
        assert len(b.response) == NEW and b.prompt == a.prompt and b.seed == a.seed
        _same(a, b)
    # Alone, with another page size and the prompt in one chunk.
    alone = paged.generate_paged(model, prompts[1:2], NEW, seeds=SEEDS[1:2], page_size=8)
    _same(alone.samples[0], ro.samples[1])
    # The training recompute (packed micro-batches of another composition) gives the same bits.
    train = training.recompute_logprobs(model, ro.samples, 3, order=[3, 1, 0, 2])
    for s, lp in zip(ro.samples, train):
        assert torch.equal(s.logprobs, lp), (s.logprobs, lp)


def test_paged_eos_and_page_limited_admission(model, padded):
    """Requests stop at EOS and free their pages early; the cache holds only two of the longest
    requests, so admission waits on pages (not slots)."""
    prompts = _prompts(LENGTHS)
    eos = padded.samples[0].response[2]
    page_size = 4
    need = max(-(-(n + NEW - 1) // page_size) for n in LENGTHS)
    ro = paged.generate_paged(
        model, prompts, NEW, seeds=SEEDS, eos_token_id=eos, page_size=page_size, max_batch=4,
        num_pages=2 * need,
    )  # fmt: skip
    assert ro.extra["max_running"] < len(prompts)
    for a, b in zip(padded.samples, ro.samples):
        cut = a.response.index(eos) + 1 if eos in a.response else len(a.response)
        assert b.response == a.response[:cut]
        assert torch.equal(b.logprobs, a.logprobs[:cut])
    assert ro.samples[0].response[-1] == eos and len(ro.samples[0].response) <= 3


def test_padded_decode_step_equals_the_eager_step(model, padded, monkeypatch):
    """Decode-only steps padded to a power-of-two batch, as the CUDA graphs replay them (run
    eagerly here): 3 requests in a bucket of 4, the padding row in the reserved pages, give the
    same bits as the unpadded step."""
    monkeypatch.setattr(paged, "_EAGER_PADDED_DECODE", True)
    ro = paged.generate_paged(model, _prompts(LENGTHS)[:3], NEW, seeds=SEEDS[:3], page_size=4)
    assert ro.extra["graph_steps"] == NEW - 1  # every step after the prefill
    for a, b in zip(padded.samples, ro.samples):
        _same(a, b)


def test_padded_decode_reads_late_and_stops_at_eos(model, padded, monkeypatch):
    """The padded decode steps (graphs, run eagerly here) launch step n + 1 before the host
    reads step n's tokens: the inputs of n + 1 come from the device. With EOS, queued requests
    (eager prompt steps between decode steps) and a cache that holds two requests, every
    request still gets the padded rollout's tokens and log-probabilities, cut at its EOS; the
    rows computed after an EOS are thrown away."""
    monkeypatch.setattr(paged, "_EAGER_PADDED_DECODE", True)
    prompts = _prompts(LENGTHS)
    eos = padded.samples[0].response[2]
    need = max(-(-(n + NEW - 1) // 4) for n in LENGTHS)
    ro = paged.generate_paged(
        model, prompts, NEW, seeds=SEEDS, eos_token_id=eos, page_size=4, max_batch=2,
        num_pages=2 * need,
    )  # fmt: skip
    assert ro.extra["graph_steps"] > 0 and ro.extra["late_rows"] > 0
    for a, b in zip(padded.samples, ro.samples):
        cut = a.response.index(eos) + 1 if eos in a.response else len(a.response)
        assert b.response == a.response[:cut]
        assert torch.equal(b.logprobs, a.logprobs[:cut])


def test_engine_keeps_its_cache_across_calls(model, padded, monkeypatch):
    """One PagedEngine serves several calls (the padded decode steps of the graphs, run
    eagerly here): each call gets the bits of a fresh generate_paged, whatever ran before in
    the same cache; a moved weight makes the engine build its decode graphs again."""
    monkeypatch.setattr(paged, "_EAGER_PADDED_DECODE", True)
    prompts = _prompts(LENGTHS)
    engine = paged.PagedEngine(model, max_len=max(LENGTHS) + NEW, page_size=4, max_batch=2)
    graphs = engine.graphs
    first = engine.generate(prompts, NEW, seeds=SEEDS)
    eos = padded.samples[0].response[2]
    second = engine.generate(prompts[::-1], NEW - 2, seeds=SEEDS[::-1], eos_token_id=eos)
    assert engine.graphs is graphs  # nothing moved: the same graphs
    for a, b in zip(padded.samples, first.samples):
        _same(a, b)
    fresh = paged.generate_paged(
        model, prompts[::-1], NEW - 2, seeds=SEEDS[::-1], eos_token_id=eos, page_size=4,
        max_batch=2,
    )  # fmt: skip
    for a, b in zip(fresh.samples, second.samples):
        _same(a, b)
    with pytest.raises(ValueError, match="exceeds the engine's max_len"):
        engine.generate(prompts, NEW + 1)
    weight = model.get_output_embeddings().weight
    old = weight.data
    try:
        weight.data = old.clone()  # the same values at another address
        third = engine.generate(prompts, NEW, seeds=SEEDS)
        assert engine.graphs is not graphs
    finally:
        weight.data = old
    for a, b in zip(padded.samples, third.samples):
        _same(a, b)


def test_paged_cuda_graphs_need_cuda(model):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA model"):
        paged.generate_paged(model, [[1]], 1, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        paged.generate_paged(model, [[1]], 1, cuda_graphs="yes")


def test_paged_cache_attend_matches_attention():
    """K/V written through slots into scattered pages, then paged attention == rlk.attention on
    the packed sequences (prefill of one sequence, decode of another)."""
    g = torch.Generator().manual_seed(0)
    hq, hk, d, page_size = 4, 2, 16, 4
    lens = [7, 5]  # tokens per sequence; the second decodes its last token
    nq = [7, 1]
    k_all = [torch.randn(n, hk, d, generator=g).bfloat16() for n in lens]
    v_all = [torch.randn(n, hk, d, generator=g).bfloat16() for n in lens]
    q = torch.randn(sum(nq), hq, d, generator=g).bfloat16()
    cache = paged.PagedKVCache(1, 6, page_size, hk, d, dtype=torch.bfloat16, device="cpu")
    pages = [[5, 0], [3, 1]]  # out of order on purpose
    slot = lambda b, p: pages[b][p // page_size] * page_size + p % page_size  # noqa: E731
    # Earlier tokens of sequence 1 are already cached.
    for p in range(lens[1] - 1):
        cache.k[0].view(-1, hk, d)[slot(1, p)] = k_all[1][p]
        cache.v[0].view(-1, hk, d)[slot(1, p)] = v_all[1][p]
    slots = torch.tensor([slot(0, p) for p in range(7)] + [slot(1, 4)])
    cu_q = torch.tensor([0, 7, 8], dtype=torch.int32)
    cache.set_step(slots, torch.tensor(pages, dtype=torch.int32), torch.tensor(lens).int(), cu_q)
    k_new = torch.cat([k_all[0], k_all[1][-1:]])
    v_new = torch.cat([v_all[0], v_all[1][-1:]])
    out = cache.attend(0, q, k_new, v_new, None)
    ref = rlk.attention(
        q, torch.cat(k_all), torch.cat(v_all), cu_q, torch.tensor([0, 7, 12]).int(), causal=True
    )
    assert torch.equal(out, ref)


def test_page_allocator():
    a = paged.PageAllocator(5)
    assert a.alloc(2) == [0, 1] and a.alloc(1) == [2] and a.free == 2
    a.release([1, 0])
    assert a.alloc(3) == [0, 1, 3]
    with pytest.raises(RuntimeError, match="asked for 2 pages, 1 free"):
        a.alloc(2)


def test_paged_rejects_bad_setups(model):
    with pytest.raises(ValueError, match="patched"):
        paged.generate_paged(torch.nn.Linear(2, 2), [[1]], 1)
    with pytest.raises(ValueError, match="needs 3 pages"):
        paged.generate_paged(model, [[1] * 9], 4, page_size=4, num_pages=2)
    with pytest.raises(ValueError, match="max_step_tokens"):
        paged.generate_paged(model, [[1]], 1, max_batch=4, max_step_tokens=2)
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        paged.PagedEngine(model, max_len=0)
    with pytest.raises(ValueError, match="patched"):
        paged.PagedEngine(torch.nn.Linear(2, 2), max_len=4)


def test_paged_progress(model, capsys):
    seen = []
    ro = paged.generate_paged(model, [[1, 2], [3]], 2, progress=True)
    err = capsys.readouterr().err
    assert "rollout" in err and "tok" in err and "running" in err  # tqdm's bar on stderr
    assert ro.new_tokens == 4
    paged.generate_paged(model, [[1, 2], [3]], 2)  # default: a bar only on a terminal
    paged.generate_paged(model, [[1, 2], [3]], 2, progress=False)
    assert capsys.readouterr().err == ""
    paged.generate_paged(model, [[1]], 20, progress=seen.append)  # a line every 16 steps
    assert seen == ["  paged step 16: 1 running, 0 waiting"]
    with pytest.raises(TypeError, match="progress must be a bool, a callable or None"):
        paged.generate_paged(model, [[1]], 1, progress="yes")


def test_paged_kv_memory_budget(model):
    # 2 (K and V) x layers x page_size x Hk x D x 2 bytes (bf16)
    assert paged.page_bytes(2, 16, 2, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
    page = paged.page_bytes(2, 16, 2, 16, torch.bfloat16)
    # The padding pages of the decode graphs come out of the budget too.
    assert paged.pages_for_memory(10 * page + 5, page, 8, 16) == 10 - 1
    assert paged.pages_for_memory(0, page, 8, 16) == 0
    with pytest.raises(ValueError, match="kv_memory_fraction needs a CUDA model"):
        paged.generate_paged(model, [[1]], 1, kv_memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\], got 1.5"):
        paged.generate_paged(model, [[1]], 1, kv_memory_fraction=1.5)
    with pytest.raises(ValueError, match="num_pages or kv_memory_fraction"):
        paged.generate_paged(model, [[1]], 1, num_pages=4, kv_memory_fraction=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2-0.5b", "qwen3-0.6b"])
def test_gpu_paged_equals_padded_and_training(name, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("RLK_VALIDATE", "0")  # value checks read the device: no graph capture
    model = rt.patch_model(zoo.load_model(name, dtype=torch.bfloat16, device="cuda"))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(16, 200, (24,), generator=g)
    ]
    seeds = list(range(100, 124))
    pad = rollout.generate(model, prompts, 64, seeds=seeds)
    ro = paged.generate_paged(
        model, prompts, 64, seeds=seeds, page_size=16, max_batch=16, max_step_tokens=512,
        prefill_chunk=128,
    )  # fmt: skip
    assert ro.extra["max_running"] == 16 and ro.extra["mixed_steps"] > 0
    assert ro.extra["graph_steps"] > 0  # decode-only steps replayed CUDA graphs
    eager = paged.generate_paged(
        model, prompts, 64, seeds=seeds, page_size=16, max_batch=16, max_step_tokens=512,
        prefill_chunk=128, cuda_graphs=False,
    )  # fmt: skip
    for a, b, c in zip(pad.samples, ro.samples, eager.samples):
        _same(a, b)
        _same(a, c)
    train = training.recompute_logprobs(model, ro.samples, 5, order=list(range(23, -1, -1)))
    for s, lp in zip(ro.samples, train):
        assert torch.equal(s.logprobs, lp.cpu())
    print(
        f"{name}: padded {pad.new_tokens / pad.seconds:.0f} tok/s, "
        f"paged {ro.new_tokens / ro.seconds:.0f} tok/s (graphs), "
        f"{eager.new_tokens / eager.seconds:.0f} tok/s (eager)"
    )


@pytest.mark.gpu
def test_gpu_engine_replays_its_graphs_and_recaptures_moved_weights(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("RLK_VALIDATE", "0")
    model = rt.patch_model(zoo.load_model("tiny", dtype=torch.bfloat16, device="cuda"))
    prompts = _prompts(LENGTHS * 2)
    seeds = list(range(len(prompts)))
    engine = paged.PagedEngine(model, max_len=max(LENGTHS) + NEW, max_batch=8)
    first = engine.generate(prompts, NEW, seeds=seeds)
    graphs, captured = engine.graphs, dict(engine.graphs.graphs)
    captured_qkv = fused.fused(model.model.layers[0].self_attn).weight.data_ptr()
    again = engine.generate(prompts, NEW, seeds=seeds)
    assert engine.graphs is graphs and engine.graphs.graphs == captured  # replayed, not captured
    assert first.extra["graph_steps"] == again.extra["graph_steps"] > 0
    for a, b in zip(first.samples, again.samples):
        _same(a, b)
    # New values at a new address: a graph replaying the old address would miss them. A moved
    # projection is fused again (its fused product would read the old buffer).
    attn = model.model.layers[0].self_attn
    for weight in (model.get_output_embeddings().weight, attn.v_proj.weight):
        weight.data = weight.data * 2
    moved = engine.generate(prompts, NEW, seeds=seeds)
    assert engine.graphs is not graphs
    assert fused.fused(attn).weight.data_ptr() != captured_qkv
    fresh = paged.generate_paged(model, prompts, NEW, seeds=seeds, max_batch=8)
    assert [s.response for s in moved.samples] != [s.response for s in first.samples]
    for a, b in zip(fresh.samples, moved.samples):
        _same(a, b)


@pytest.mark.gpu
def test_gpu_kv_memory_fraction_makes_requests_wait(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("RLK_VALIDATE", "0")
    model = rt.patch_model(zoo.load_model("tiny", dtype=torch.bfloat16, device="cuda"))
    cfg = model.config
    prompts = _prompts([30] * 8)
    page = paged.page_bytes(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, 16, torch.bfloat16)
    need = -(-(30 + NEW - 1) // 16)  # pages of one request
    free, _ = torch.cuda.mem_get_info()
    # A budget of about three requests' pages (plus the decode graphs' padding pages).
    fraction = (3 * need + paged.pad_pages(8, 16) + 0.5) * page / free
    ro = paged.generate_paged(model, prompts, NEW, seeds=list(range(8)), max_batch=8,
                              kv_memory_fraction=fraction)  # fmt: skip
    assert 1 <= ro.extra["max_running"] <= 3  # the others waited for pages
    full = paged.generate_paged(model, prompts, NEW, seeds=list(range(8)), max_batch=8)
    assert full.extra["max_running"] == 8
    for a, b in zip(ro.samples, full.samples):
        _same(a, b)
    with pytest.raises(ValueError, match="the longest request needs"):
        paged.generate_paged(model, prompts, NEW, kv_memory_fraction=page / free / 4)


@pytest.mark.slow
def test_consistency_cli_paged_row_zero(tmp_path):
    import json

    from rlk import cli

    out = tmp_path / "c.json"
    argv = ["consistency", "--prompts", "3", "--new-tokens", "3", "--micro-batch", "2"]
    argv += ["--rollout-mode", "paged", "--page-size", "4", "--max-batch", "2"]
    assert cli.main([*argv, "--json", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["side"], r["rollout_mode"]) for r in rows] == [("stock", "padded"), ("rlk", "paged")]
    assert rows[1]["tokens"] == 9 and rows[1]["max_abs_dlogp"] == 0.0
