"""Mixture-of-experts models on rlk: the sparse block's patched forward and its checks.

:func:`moe_forward` replaces ``forward`` on Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``,
Qwen2-MoE's ``Qwen2MoeSparseMoeBlock`` and DeepSeek-V3's ``DeepseekV3MoE`` instances
(:func:`rlk_integrations.models.transformers.patch_model`), Qwen2-MoE's with its sigmoid-gated
shared expert (:func:`shared_expert`), DeepSeek-V3's with its shared experts and its router
(:func:`route`); :func:`check_moe` refuses, before anything is patched,
the options it cannot honour. :class:`RoutingLog` records which experts each
token went to in a rollout and in a training pass, and :func:`routing_differ` gives the share of
tokens whose experts differ between the two (``rlk consistency``'s expert column).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import rlk
import rlk.parallel
from rlk_integrations.models.architectures import Architecture, architecture, decoder


def moe_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's and Qwen2-MoE's sparse block on rlk: ``[..., H]`` -> ``[..., H]``. The
    router's weights and the chosen experts are float32 / int64 ``[T, k]``
    (:func:`rlk.moe_route`); the experts' outputs are added in rank order
    (:func:`rlk.moe_experts`, or with its experts sharded by
    :func:`rlk_integrations.models.ep.shard_ep` :func:`rlk.parallel.expert_parallel_moe_experts`,
    the same bits); a block with a shared expert (Qwen2-MoE) then adds :func:`shared_expert`'s
    output, as transformers does."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1]).contiguous()
    experts = self.experts
    weights, indices = route(self.gate, x)
    ep = getattr(self, "_rlk_ep", None)  # (rank, world, group), set by models.ep.shard_ep
    if ep is None:
        out = rlk.moe_experts(x, indices, weights, experts.gate_up_proj, experts.down_proj)
    else:
        out = rlk.parallel.expert_parallel_moe_experts(
            x, indices, weights, experts.gate_up_proj, experts.down_proj, group=ep[2]
        )
    if getattr(self, "shared_expert", None) is not None:
        out = out + shared_expert(self, x)  # elementwise, one rounding per element
    if getattr(self, "shared_experts", None) is not None:  # DeepSeek-V3: an ungated MLP
        out = out + self.shared_experts(x)
    return out.view(shape)


def route(router: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``router`` module's ``(weights, indices)`` for ``x [T, H]``, float32 / int64 ``[T,
    k]``: DeepSeek-V3's ``DeepseekV3TopkRouter`` (it has an ``e_score_correction_bias``) by
    :func:`rlk.moe_route_grouped` over its logits computed in fp32 as transformers does
    (``x`` and the weight upcast, exactly, then :func:`rlk.linear`), with its groups,
    ``norm_topk_prob`` and ``routed_scaling_factor``; the Qwen routers by :func:`rlk.moe_route`
    over ``rlk.linear(x, weight)``.

    Example::

        weights, indices = route(block.gate, x)
    """
    if hasattr(router, "e_score_correction_bias"):
        logits = rlk.linear(x.float(), router.weight.float())
        return rlk.moe_route_grouped(
            logits, router.e_score_correction_bias, router.top_k, router.num_group,
            router.topk_group, normalize=router.norm_topk_prob,
            scale=float(router.routed_scaling_factor),
        )  # fmt: skip
    logits = rlk.linear(x, router.weight)
    return rlk.moe_route(logits, router.top_k, normalize=router.norm_topk_prob)


def sigmoid(z: torch.Tensor) -> torch.Tensor:
    """``sigmoid(z)`` of ``z [T, 1]`` (bf16/fp16/fp32) as float32 ``[T, 1]``, each row's bits
    depending on that row alone: the softmax of ``[z, 0]`` at ``z``, which is
    :func:`rlk.moe_route`'s routing weight of expert 0 over those two logits (exp(z) / (exp(z)
    + 1)). ``torch.sigmoid`` is no substitute on a CPU: ATen runs the vectorised loop on
    whole vectors and a scalar loop on the tail, whose float32 results differ in the last
    bit for some inputs, so a token's value would depend on where the batch puts it.
    Differentiable (moe_route's weights are).

    Example::

        sigmoid(torch.tensor([[0.0]]))  # tensor([[0.5]])
    """
    weights, indices = rlk.moe_route(torch.cat([z, torch.zeros_like(z)], 1), 2)
    # Ranked by decreasing logit (z at rank 0 when z >= 0): pick expert 0's weight.
    return torch.where(indices[:, :1] == 0, weights[:, :1], weights[:, 1:])


def shared_expert(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared expert scaled by its gate, ``sigmoid(x @ w_gate) * mlp(x)``:
    ``x [T, H]`` -> ``[T, H]`` in x's dtype. ``block.shared_expert`` is a patched SwiGLU MLP
    (rlk ops), the gate's logit :func:`rlk.linear` by ``block.shared_expert_gate``'s ``[1, H]``
    weight and its :func:`sigmoid` float32; the product is one float32 multiplication per
    element (elementwise: no reduction, so no order to fix), rounded once to x's dtype.

    Example::

        y = shared_expert(model.model.layers[0].mlp, x)
    """
    scale = sigmoid(rlk.linear(x, block.shared_expert_gate.weight))
    return (scale * block.shared_expert(x).float()).to(x.dtype)


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


def _is_patched(block: nn.Module) -> bool:
    return getattr(getattr(block, "forward", None), "__func__", None) is moe_forward


@torch.no_grad()
def chosen_experts(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The experts the sparse ``block`` routes each token of ``hidden_states [..., H]`` to,
    int64 ``[tokens, k]``, as its own forward chooses them: rlk's routing on a patched block
    (batch-invariant, so recomputing it gives the forward's bits), the router module's
    ``torch.topk`` on a stock one (the same call in the same batch)."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
    if _is_patched(block):
        return route(block.gate, x)[1]
    return block.gate(x)[2]


class RoutingLog:
    """The experts every token was routed to, per MoE layer, over the model's forwards while
    the log is active (``with RoutingLog(model) as log: ...``).

    ``calls`` holds one ``(positions [B, S], valid [B, S], experts [B, S, layers, k])`` entry
    (CPU tensors) per forward of the base model: its ``position_ids`` (0.. per row when none
    is given), which tokens are real (a 2-D ``attention_mask``'s last S columns; all without
    one) and each MoE layer's choice (:func:`chosen_experts`). A rollout that drives the layers
    itself (the paged one) does not go through the base model's forward, so it is not logged.
    """

    def __init__(self, model: nn.Module):
        arch = architecture(model.config)
        if not arch.moe:
            raise ValueError(f"{model.config.model_type} has no mixture-of-experts layers")
        self.model = model
        self.blocks = [m for m in model.modules() if isinstance(m, arch.moe_classes()[0])]
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending: list[Any] = []
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingLog:
        self._handles.append(
            decoder(self.model).register_forward_pre_hook(self._on_forward, with_kwargs=True)
        )
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._on_block))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._flush()

    def _flush(self) -> None:
        if self._pending:
            pos, valid, layers = self._pending
            b, s = pos.shape
            experts = torch.stack([e.reshape(b, s, -1) for e in layers], dim=2)
            self.calls.append((pos, valid, experts))
            self._pending = []

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._flush()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("RoutingLog needs forwards given input_ids")
        b, s = ids.shape
        pos = kwargs.get("position_ids")
        pos = torch.arange(s).expand(b, s) if pos is None else pos.expand(b, s).cpu()
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            valid = mask[:, -s:].bool().cpu()
        else:
            valid = torch.ones(b, s, dtype=torch.bool)
        self._pending = [pos, valid, []]

    def _on_block(self, block: nn.Module, args: tuple) -> None:
        if self._pending:
            self._pending[2].append(chosen_experts(block, args[0]).cpu())


def _by_token(entries: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict:
    """``{(sample, position): one sorted tuple of experts per layer}`` from entries ``(sample
    ids [S], positions [S], valid [S], experts [S, layers, k])``; a later entry of a token
    replaces an earlier one."""
    out: dict[tuple[int, int], tuple] = {}
    for samples, pos, valid, experts in entries:
        for j in torch.nonzero(valid).reshape(-1).tolist():
            key = (int(samples[j]), int(pos[j]))
            out[key] = tuple(tuple(sorted(e)) for e in experts[j].tolist())
    return out


def padded_routing(log: RoutingLog) -> dict:
    """A padded rollout's log (row b of every forward is sample b) by (sample, position)."""
    entries = []
    for pos, valid, experts in log.calls:
        for b in range(pos.shape[0]):
            entries.append((torch.full_like(pos[b], b), pos[b], valid[b], experts[b]))
    return _by_token(entries)


def packed_routing(log: RoutingLog, groups: list[list[int]]) -> dict:
    """A packed training log (forward c packs the samples ``groups[c % len(groups)]`` in one
    row, positions restarting at 0 per sample) by (sample, position)."""
    entries = []
    for c, (pos, valid, experts) in enumerate(log.calls):
        group = torch.tensor(groups[c % len(groups)])
        segment = torch.cumsum((pos[0] == 0).long(), 0) - 1
        entries.append((group[segment], pos[0], valid[0], experts[0]))
    return _by_token(entries)


def routing_differ(rollout: dict, training: dict) -> tuple[float, int]:
    """``(share, tokens)``: of the tokens both sides routed, the share whose experts (as a set,
    in any layer) differ between the rollout and the training pass."""
    common = rollout.keys() & training.keys()
    if not common:
        return 0.0, 0
    return sum(rollout[k] != training[k] for k in common) / len(common), len(common)


def routing_logs(model: nn.Module, on: bool) -> tuple[Any, Any]:
    """Two contexts, for a padded rollout and a packed training pass: :class:`RoutingLog` s of
    ``model`` when ``on`` and it has MoE layers, else ones that log nothing."""
    if on and architecture(model.config).moe:
        return RoutingLog(model), RoutingLog(model)
    return contextlib.nullcontext(), contextlib.nullcontext()


def expert_differ(rollout: Any, training: Any, groups: list[list[int]]) -> float | None:
    """:func:`routing_differ`'s share for :func:`routing_logs`' two logs after the passes
    (``groups``: the training forwards' samples); None when nothing was logged."""
    if not isinstance(rollout, RoutingLog) or not rollout.calls or not training.calls:
        return None
    return routing_differ(padded_routing(rollout), packed_routing(training, groups))[0]
