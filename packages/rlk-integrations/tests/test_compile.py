"""``torch.compile(fullgraph=True)`` of patched Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE and
DeepSeek-V3 models
(:func:`rlk_integrations.engine.training.compiled_logprobs`: the packed training pass, decoder then
``rlk.linear_logprobs``), forward and backward, with no graph break and the bits of the eager
pass (:func:`~rlk_integrations.engine.training.packed_logprobs`): log-probabilities and every
parameter's gradient. On a GPU the same with ``mode="reduce-overhead"`` (CUDA graphs).

The ops that are not rlk's (the gradients' sums, the embedding) are Inductor's code: with
``emulate_precision_casts`` it rounds bf16 intermediates where eager rounds them, which is what
makes the whole step, and not only rlk's ops, bitwise the eager step. The MoE ops are opaque
operators whose compiled backward runs the op again and differentiates it: the eager kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.models.transformers import patch_model  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402


def _samples(vocab: int, lengths: list[tuple[int, int]]) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for p, r in lengths:
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(toks[:p], toks[p:], torch.zeros(r)))
    return out


def _step(model, fn, samples):
    model.zero_grad(set_to_none=True)
    lps = fn(samples)
    lp = torch.cat(lps)
    (lp * torch.linspace(0.5, 1.5, lp.numel(), device=lp.device)).sum().backward()
    return lp.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(model, samples, **compile_kwargs):
    # Imported here: Inductor imports triton, which must come after rlk (it picks the
    # interpreter on a CPU before triton loads).
    import torch._inductor.config as inductor_config

    want_lp, want_g = _step(model, lambda s: training.packed_logprobs(model, s), samples)
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = training.compiled_logprobs(model, **compile_kwargs)
        for _ in range(3 if compile_kwargs else 1):  # CUDA graphs: warm-up, record, replay
            got_lp, got_g = _step(model, compiled, samples)
    assert torch.equal(want_lp, got_lp)
    changed = [n for n in want_g if not torch.equal(want_g[n], got_g[n])]
    assert not changed, f"gradients that compiling changed: {changed}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["tiny-llama", "tiny", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-deepseek-v3"],
)
def test_compiled_training_pass_gives_the_eager_bits(name):
    torch._dynamo.reset()
    model = patch_model(zoo.load_model(name))
    _check(model, _samples(model.config.vocab_size, [(2, 3), (3, 4)]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["tiny-llama", "tiny", "tiny-qwen3"])
def test_reduce_overhead_gives_the_eager_bits_in_cuda_graphs(name):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = patch_model(zoo.load_model(name, device="cuda"))
    _check(model, _samples(model.config.vocab_size, [(5, 40), (9, 30)]), mode="reduce-overhead")
    # Inductor counts every graph it could not run as a CUDA graph (a CPU tensor, a host read,
    # a mutated input), with the reason.
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
