"""A PPO critic on a patched causal LM: a value head on the final hidden states, run on rlk.

:class:`ValueHead` maps a hidden state to a scalar value with :func:`rlk.linear` (fp32 weights,
the hidden state cast to fp32 exactly), so a token's value depends on its hidden state alone.
The patched decoder gives a token the same hidden state in a rollout's padded batch with a KV
cache and in a packed training micro-batch of any composition, so the values match bit for bit:
``rollout.generate(..., value_head=head)`` records each response token's value at sampling
time, and :func:`packed_logprobs_and_values` recomputes log-probabilities and values in one
packed forward for training.

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
from rlk_integrations.rollout import Sample


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
    it. Add it after :func:`~rlk_integrations.transformers.patch_model`."""
    device = next(model.parameters()).device
    head = ValueHead(model.config.hidden_size, init_std=init_std).to(device)
    model.rlk_value_head = head
    return head


def final_hidden_hook(model: nn.Module, sink: list[torch.Tensor]):
    """A forward hook on the decoder's final norm that appends each call's last position's
    output (``[B, H]``) to ``sink``; returns the hook's handle (``.remove()`` it)."""
    from rlk_integrations.transformers import decoder

    return decoder(model).norm.register_forward_hook(lambda m, i, out: sink.append(out[:, -1]))


def packed_logprobs_and_values(
    model: nn.Module,
    samples: list[Sample],
    *,
    value_head: ValueHead | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sample's response log-probabilities and values from one packed forward (rlk):
    two lists of float32 ``[len(response)]`` tensors, differentiable when grad is on.
    ``value_head`` defaults to ``model.rlk_value_head``. An unsharded model only (no TP, no
    FSDP)."""
    from rlk_integrations.training import FSDP_FORWARD, _pack
    from rlk_integrations.transformers import decoder, is_patched

    if not is_patched(model):
        raise ValueError("the model is not patched by rlk: patch_model(model) first")
    if getattr(model, "_rlk_tp", None) is not None or hasattr(model, FSDP_FORWARD):
        raise ValueError("packed_logprobs_and_values takes an unsharded model (no TP, no FSDP)")
    head = getattr(model, "rlk_value_head", None) if value_head is None else value_head
    if head is None:
        raise ValueError("no value head: pass value_head or add_value_head(model) first")
    ids, pos, rows, targets = _pack(samples, next(model.parameters()).device)
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state.squeeze(0).index_select(0, rows)
    lm_head = model.get_output_embeddings()
    lp = rlk.linear_logprobs(
        hidden,
        lm_head.weight,
        targets,
        bias=lm_head.bias,
        temperature=temperature if temperature > 0 else 1.0,
        logits_dtype=logits_dtype,
    )
    sizes = [len(s.response) for s in samples]
    return list(lp.split(sizes)), list(head(hidden).split(sizes))
