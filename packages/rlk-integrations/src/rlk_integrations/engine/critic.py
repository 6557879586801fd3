"""A PPO critic on a patched causal LM: a value head on the final hidden states, run on rlk.

:class:`ValueHead` maps a hidden state to a scalar value with :func:`rlk.linear` (fp32 weights,
the hidden state cast to fp32 exactly), so a token's value depends on its hidden state alone.
The patched decoder gives a token the same hidden state in a rollout's padded batch with a KV
cache and in a packed training micro-batch of any composition, so the values match bit for bit:
``rollout.generate(..., value_head=head)`` records each response token's value at sampling
time, and :func:`rlk_integrations.engine.training.packed_logprobs_and_values` recomputes
log-probabilities and values in one packed forward for training.

A value belongs to the state before its token, as in verl's critic: the value of response
token ``t`` is the head on the hidden state that predicts token ``t`` (the row that
``linear_logprobs`` reads for it).

Example::

    patch_model(model)
    head = add_value_head(model)
    ro = rollout.generate(model, prompts, 16, seeds=seeds, value_head=head)
    lps, values = packed_logprobs_and_values(model, ro.samples)
    assert all(torch.equal(s.values, v) for s, v in zip(ro.samples, values))
"""

from __future__ import annotations

import torch
from torch import nn

import rlk
from rlk_integrations.models.transformers import decoder


class ValueHead(nn.Module):
    """``hidden [..., H]`` -> fp32 values ``[...]``: one fp32 ``nn.Linear(H, 1)`` computed by
    :func:`rlk.linear` (``init_std`` 0 gives a critic that starts at 0)."""

    def __init__(self, hidden_size: int, *, init_std: float = 0.0) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1, dtype=torch.float32)
        with torch.no_grad():
            self.summary.weight.normal_(0.0, init_std) if init_std else self.summary.weight.zero_()
            self.summary.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = rlk.linear(hidden.float().contiguous(), self.summary.weight, self.summary.bias)
        return out.squeeze(-1)


def add_value_head(model: nn.Module, *, init_std: float = 0.0) -> ValueHead:
    """A :class:`ValueHead` of ``model``'s hidden size on its device, registered as
    ``model.rlk_value_head`` (so ``model.parameters()`` and its state dict hold it); returns
    it. Add it after :func:`~rlk_integrations.models.transformers.patch_model`."""
    device = next(model.parameters()).device
    head = ValueHead(model.config.hidden_size, init_std=init_std).to(device)
    model.rlk_value_head = head
    return head


def final_hidden_hook(model: nn.Module, sink: list[torch.Tensor]):
    """A forward hook on the decoder's final norm that appends each call's last position's
    output (``[B, H]``) to ``sink``; returns the hook's handle (``.remove()`` it)."""
    return decoder(model).norm.register_forward_hook(lambda m, i, out: sink.append(out[:, -1]))
