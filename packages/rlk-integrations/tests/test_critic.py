"""The value head: the rollout's values equal the packed training pass's, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from rlk_integrations.engine import critic, rollout, training  # noqa: E402
from rlk_integrations.models.transformers import patch_model  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402


def test_rollout_values_equal_the_packed_training_values():
    model = patch_model(zoo.load_model("tiny", device="cpu"))
    head = critic.add_value_head(model, init_std=0.5)  # nonzero values, different per state
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3], [11, 6]]
    ro = rollout.generate(model, prompts, 5, seeds=[3, 4, 5], value_head=head)
    assert all(s.values is not None and s.values.numel() == len(s.response) for s in ro.samples)
    # Another composition than the rollout's padded batch: packed, in a different order.
    order = [2, 0, 1]
    lps, values = training.packed_logprobs_and_values(
        model, [ro.samples[i] for i in order], logits_dtype=ro.logits_dtype
    )
    for i, lp, v in zip(order, lps, values):
        assert torch.equal(lp, ro.samples[i].logprobs)
        assert torch.equal(v, ro.samples[i].values)
    assert len({float(v) for s in ro.samples for v in s.values}) > 3
    # With grad: the head and the decoder get gradients through the values.
    _, values = training.packed_logprobs_and_values(model, ro.samples[:1])
    values[0].sum().backward()
    assert head.summary.weight.grad is not None and bool(head.summary.weight.grad.abs().sum() > 0)


def test_a_zero_head_gives_zeros_and_needs_a_patched_model():
    model = zoo.load_model("tiny", device="cpu")
    with pytest.raises(ValueError, match="not patched"):
        training.packed_logprobs_and_values(model, [])
    patch_model(model)
    with pytest.raises(ValueError, match="no value head"):
        training.packed_logprobs_and_values(model, [])
    head = critic.add_value_head(model)
    assert model.rlk_value_head is head
    assert torch.equal(head(torch.randn(4, model.config.hidden_size)), torch.zeros(4))
