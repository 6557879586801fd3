"""``torch.compile(fullgraph=True)`` of patched Llama, Qwen2 and Qwen3 models: the packed
training pass (decoder, then ``rlk.linear_logprobs``), forward and backward, with no graph
break and the bits of the eager pass (log-probabilities and every parameter's gradient).

The ops that are not rlk's (the gradients' sums, the embedding) are Inductor's code: with
``emulate_precision_casts`` it rounds bf16 intermediates where eager rounds them, which is what
makes the whole step, and not only rlk's ops, bitwise the eager step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations import models  # noqa: E402
from rlk_integrations.transformers import decoder, patch_model  # noqa: E402


def _batch(vocab: int, lengths: list[int]):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    ids = torch.randint(0, vocab, (1, t), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.arange(t - 1)
    return ids, pos, cu, rows, ids[0, 1:].clone()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny", "tiny-qwen3"])
def test_compiled_training_pass_gives_the_eager_bits(name, monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)
    torch._dynamo.reset()
    model = patch_model(models.load_model(name))
    lengths = [5, 7]
    ids, pos, cu, rows, targets = _batch(model.config.vocab_size, lengths)
    longest = max(lengths)

    def step(ids, pos, cu, rows, targets):
        # The offsets and their bound, as training.GraphedLogprobs passes them: nothing is read
        # on the host.
        h = decoder(model)(
            input_ids=ids,
            position_ids=pos,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
            use_cache=False,
        ).last_hidden_state.squeeze(0)
        head = model.get_output_embeddings()
        return rlk.linear_logprobs(h.index_select(0, rows), head.weight, targets, bias=head.bias)

    weights = torch.linspace(0.5, 1.5, rows.numel())

    def run(fn):
        model.zero_grad(set_to_none=True)
        lp = fn(ids, pos, cu, rows, targets)
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad for n, p in model.named_parameters()}

    want_lp, want_g = run(step)  # (also fills the rotary table the compiled pass looks up)
    got_lp, got_g = run(torch.compile(step, fullgraph=True))
    assert torch.equal(want_lp, got_lp)
    assert all(g is not None for g in want_g.values())
    changed = [n for n in want_g if not torch.equal(want_g[n], got_g[n])]
    assert not changed, f"gradients that compiling changed: {changed}"
