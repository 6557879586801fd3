"""rlk_integrations.engine.training: the graphed (static-bucket) log-prob pass against the eager
one.

On CPU the bucket runs with ``capture=False``: the same padded pass, without the graphs. The GPU
test captures and replays.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.engine.graphed import _capture_leaves  # noqa: E402
from rlk_integrations.models.transformers import patch_model  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402


def _samples(vocab: int, shapes: list[tuple[int, int]], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in shapes:
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(toks[:p], toks[p:], torch.zeros(r)))
    return out


def _model(name: str = "tiny", device: str = "cpu") -> torch.nn.Module:
    return patch_model(zoo.load_model(name, device=device))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, fn, samples) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    lps = fn(samples)
    weights = torch.linspace(0.5, 1.5, sum(lp.numel() for lp in lps))
    (torch.cat(lps) * weights.to(lps[0].device)).sum().backward()
    return [lp.detach() for lp in lps], _grads(model)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_bucket_gives_the_eager_bits(name):
    """Padding sequences, padding rows and empty offsets change no log-prob; the weights'
    gradients are the eager pass's too (padding rows have zero gradient)."""
    model = _model(name)
    samples = _samples(model.config.vocab_size, [(3, 9), (1, 20), (7, 4)])
    want_lp, want_g = _step(model, lambda s: training.packed_logprobs(model, s), samples)
    bucket = training.GraphedLogprobs(
        model, max_tokens=80, max_seqs=5, max_seq_len=24, max_rows=40, capture=False
    )
    got_lp, got_g = _step(model, bucket, samples)
    for a, b in zip(want_lp, got_lp, strict=True):
        assert torch.equal(a, b)
    assert want_g.keys() == got_g.keys()
    for n in want_g:
        assert torch.equal(want_g[n], got_g[n]), f"{n}: gradient changed by the padding"


def _entropy_step(model, fn, samples):
    model.zero_grad(set_to_none=True)
    lps, ents = fn(samples)
    (torch.cat(lps).sum() - 0.3 * torch.cat(ents).sum()).backward()
    return [lp.detach() for lp in lps], [e.detach() for e in ents], _grads(model)


def test_bucket_with_entropy_gives_the_eager_bits():
    model = _model("tiny-qwen3")
    samples = _samples(model.config.vocab_size, [(2, 7), (5, 11)], seed=4)
    want = _entropy_step(
        model, lambda s: training.packed_logprobs(model, s, return_entropy=True), samples
    )
    bucket = training.GraphedLogprobs.for_batches(
        model, [samples, samples[:1] * 3], return_entropy=True, capture=False
    )
    got = _entropy_step(model, bucket, samples)
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)
    for n in want[2]:
        assert torch.equal(want[2][n], got[2][n]), n
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="entropies"):
        training.grpo_step(model, opt, samples, torch.ones(2), 2, 2, graphed=bucket)


def test_bucket_for_batches_is_the_smallest_that_holds_each():
    model = _model()
    v = model.config.vocab_size
    batches = [_samples(v, [(3, 9), (1, 20)]), _samples(v, [(7, 4)] * 3, seed=1)]
    bucket = training.GraphedLogprobs.for_batches(model, batches, capture=False)
    assert (bucket.tokens, bucket.seqs, bucket.seq_len, bucket.rows) == (33, 3, 21, 29)
    for b in batches:
        bucket.pack(b)  # fits
    with pytest.raises(ValueError, match="non-empty"):
        training.GraphedLogprobs.for_batches(model, [[]], capture=False)


def test_bucket_rejects_what_does_not_fit():
    model = _model()
    bucket = training.GraphedLogprobs(
        model, max_tokens=32, max_seqs=2, max_seq_len=16, capture=False
    )
    v = model.config.vocab_size
    with pytest.raises(ValueError, match="3 sequences, the bucket holds 2"):
        bucket.pack(_samples(v, [(1, 2)] * 3))
    with pytest.raises(ValueError, match="17 tokens in one sequence"):
        bucket.pack(_samples(v, [(1, 16)]))
    with pytest.raises(ValueError, match="33 tokens, the bucket holds 32"):
        bucket.pack(_samples(v, [(1, 15), (2, 15)]))
    with pytest.raises(ValueError, match="prompt token"):
        bucket.pack([Sample([], [1, 2], torch.zeros(2))])
    with pytest.raises(ValueError, match="prompt token"):
        training.packed_logprobs(
            model, _samples(v, [(2, 3)]) + [Sample([], [1, 2], torch.zeros(2))]
        )
    with pytest.raises(TypeError, match="max_seqs"):
        training.GraphedLogprobs(model, max_tokens=32, max_seqs=2.0, capture=False)
    with pytest.raises(ValueError, match="max_seq_len = 64 exceeds max_tokens = 32"):
        training.GraphedLogprobs(model, max_tokens=32, max_seqs=2, max_seq_len=64, capture=False)
    with pytest.raises(ValueError, match="CUDA device"):
        training.GraphedLogprobs(model, max_tokens=32, max_seqs=2)
    with pytest.raises(ValueError, match="patch_model"):
        unpatched = zoo.load_model("tiny")
        training.GraphedLogprobs(unpatched, max_tokens=32, max_seqs=2, capture=False)


def test_capture_leaves_alias_the_parameters():
    # The capture differentiates new leaves on the parameters' memory (tied weights by one),
    # and the model has its own parameters back afterwards.
    model = _model("tiny")
    params = [p for p in model.parameters() if p.requires_grad]
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.weight is embed.weight  # tied
    with _capture_leaves(model, params) as leaves:
        assert len(leaves) == len(params)
        for p, leaf in zip(params, leaves, strict=True):
            assert leaf is not p and leaf.data_ptr() == p.data_ptr() and leaf.is_leaf
        assert head.weight is embed.weight and head.weight is not params[0]
        assert {id(p) for p in model.parameters()} == {id(x) for x in leaves}
    assert [id(p) for p in model.parameters() if p.requires_grad] == [id(p) for p in params]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_gpu_graphs_give_the_eager_bits(name, monkeypatch):
    """Captured and replayed over micro-batches of other sizes: the eager log-probs and
    gradients bit for bit; a stale backward raises."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("RLK_VALIDATE", "0")  # value checks read the device: no capture
    model = _model(name, device="cuda")
    v = model.config.vocab_size
    graphed = training.GraphedLogprobs(model, max_tokens=256, max_seqs=6, max_seq_len=96)
    for seed, shapes in enumerate([[(5, 40), (2, 60)], [(9, 30)] * 5, [(1, 95), (3, 3)]]):
        samples = _samples(v, shapes, seed)
        want_lp, want_g = _step(model, lambda s: training.packed_logprobs(model, s), samples)
        got_lp, got_g = _step(model, graphed, samples)
        for a, b in zip(want_lp, got_lp, strict=True):
            assert torch.equal(a, b)
        for n in want_g:
            assert torch.equal(want_g[n], got_g[n]), f"{n}: gradient differs ({shapes})"
    first = torch.cat(graphed(_samples(v, [(2, 10)])))
    graphed(_samples(v, [(2, 10)], seed=9))
    with pytest.raises(RuntimeError, match="overwritten by a later call"):
        first.sum().backward()
    again = torch.cat(graphed(_samples(v, [(2, 10)])))
    again.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        again.sum().backward()
    # A replaced weight (not an in-place update) moves an address the graphs read: the next
    # call captures again, and follows the new weight.
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach() * 2)
    samples = _samples(v, [(3, 20)], seed=11)
    want_lp, want_g = _step(model, lambda s: training.packed_logprobs(model, s), samples)
    got_lp, got_g = _step(model, graphed, samples)
    assert torch.equal(want_lp[0], got_lp[0])
    for n in want_g:
        assert torch.equal(want_g[n], got_g[n]), f"{n}: gradient differs after the recapture"
    with torch.no_grad():  # a call without grad: the same log-probs, nothing to backward
        assert torch.equal(graphed(samples)[0], want_lp[0])


@pytest.mark.gpu
def test_gpu_graphs_with_entropy_give_the_eager_bits(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("RLK_VALIDATE", "0")
    model = _model("tiny", device="cuda")
    samples = _samples(model.config.vocab_size, [(4, 30), (9, 17)], seed=5)
    want = _entropy_step(
        model, lambda s: training.packed_logprobs(model, s, return_entropy=True), samples
    )
    graphed = training.GraphedLogprobs.for_batches(model, [samples], return_entropy=True)
    for _ in range(2):  # the first call captures, the second replays
        got = _entropy_step(model, graphed, samples)
        for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
            assert torch.equal(a, b)
        for n in want[2]:
            assert torch.equal(want[2][n], got[2][n]), n


def test_grpo_step_with_the_bucket_gives_the_eager_gradients():
    model = _model()
    samples = _samples(model.config.vocab_size, [(2, 6), (4, 3), (1, 8), (3, 5)], seed=3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    eager = training.grpo_step(model, opt, samples, rewards, 2, 2, temperature=0.7)
    want = _grads(model)
    bucket = training.GraphedLogprobs(
        model, max_tokens=24, max_seqs=2, max_seq_len=12, temperature=0.7, capture=False
    )
    got = training.grpo_step(model, opt, samples, rewards, 2, 2, temperature=0.7, graphed=bucket)
    assert got == eager
    for n, g in _grads(model).items():
        assert torch.equal(g, want[n]), n
    with pytest.raises(ValueError, match="temperature 0.7"):
        training.grpo_step(model, opt, samples, rewards, 2, 2, graphed=bucket)
    with pytest.raises(ValueError, match="logits_dtype torch.bfloat16; this step asks for 0.7 and"):
        kw = dict(temperature=0.7, logits_dtype=torch.float32, graphed=bucket)
        training.grpo_step(model, opt, samples, rewards, 2, 2, **kw)
    # None is lm_head's dtype: the same setting as bf16 said aloud.
    kw = dict(temperature=0.7, logits_dtype=torch.bfloat16, graphed=bucket)
    assert training.grpo_step(model, opt, samples, rewards, 2, 2, **kw) == eager
