"""Mixture-of-experts models on rlk: the sparse block's patched forward and its checks.

:func:`moe_forward` replaces ``forward`` on Qwen3-MoE's ``Qwen3MoeSparseMoeBlock`` instances
(:func:`rlk_integrations.transformers.patch_model`); :func:`check_moe` refuses, before anything
is patched, the options it cannot honour.
"""

from __future__ import annotations

import torch
from torch import nn

import rlk
from rlk_integrations.architectures import Architecture


def moe_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's sparse block on rlk: ``[..., H]`` -> ``[..., H]``. The router's weights
    and the chosen experts are float32 / int64 ``[T, k]`` (:func:`rlk.moe_route`); the
    experts' outputs are added in rank order (:func:`rlk.moe_experts`)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1]).contiguous()
    router, experts = self.gate, self.experts
    logits = rlk.linear(x, router.weight)
    weights, indices = rlk.moe_route(logits, router.top_k, normalize=router.norm_topk_prob)
    out = rlk.moe_experts(x, indices, weights, experts.gate_up_proj, experts.down_proj)
    return out.view(shape)


def check_moe(model: nn.Module, arch: Architecture, leaves: int | None) -> None:
    """Refuse, before anything is patched, the mixture-of-experts options rlk does not run."""
    if not arch.moe:
        return
    cfg = model.config
    if getattr(cfg, "output_router_logits", False):
        raise NotImplementedError(
            "output_router_logits=True (the auxiliary load-balancing loss) is not supported: "
            "rlk's MoE block does not record the router's logits"
        )
    if leaves is not None:
        raise NotImplementedError("leaves (tree-ordered row-parallel linears) has no MoE layout")
    _, _, experts_cls = arch.moe_classes()
    for path, module in model.named_modules():
        if not isinstance(module, experts_cls):
            continue
        layout = {"is_transposed": False, "has_bias": False, "has_gate": True,
                  "is_concatenated": True}  # fmt: skip
        for name, want in layout.items():
            if getattr(module, name, want) != want:
                raise NotImplementedError(
                    f"{path}: experts with {name}={not want} are not supported"
                )
