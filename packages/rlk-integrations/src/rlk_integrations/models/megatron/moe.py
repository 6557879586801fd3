"""Megatron-core's MoE layer on rlk: the router on :func:`rlk.linear` + :func:`rlk.moe_route`,
the experts and the token grouping / rank-ordered combine on :func:`rlk.moe_experts`: the bits
of rlk's own sparse block (:func:`rlk_integrations.models.moe.moe_forward`).

The classes subclass Megatron's (``MoELayer``, ``TopKRouter``, ``SequentialMLP``,
``SharedExpertMLP``), so the parameters and their names are Megatron's local-spec ones:
``mlp.router.weight [E, H]``, per expert ``j`` ``mlp.experts.local_experts.{j}.linear_fc1
.weight [2I, H]`` (gate rows then up rows) and ``...linear_fc2.weight [H, I]``, and Qwen2-MoE's
gated shared expert ``mlp.shared_experts.linear_fc1 / linear_fc2 / gate_weight``. The forward is
rlk's: Megatron routes with a sparse ``[T, E]`` probability map, permutes the tokens, runs each
expert and adds their outputs back in the dispatcher's order, rounding each sum; rlk keeps
``[T, k]`` weights and experts, and :func:`rlk.moe_experts` groups the tokens by expert and adds
a token's k outputs in rank order in float32, rounded once. Megatron's token dispatcher (built
by ``MoELayer``) is never called: at expert parallelism 1 the dispatch is the grouping inside
:func:`rlk.moe_experts`; at expert parallelism t > 1 (Megatron's expert-parallel group, rank r
holding experts ``r*E/t .. (r+1)*E/t`` as Megatron numbers them) the experts run as
:func:`rlk.parallel.expert_parallel_moe_experts`, whose all-to-alls send each (token, rank) row
to its expert's rank and bring the unweighted fp32 outputs back to be added in rank order: every
token's output and gradients are one device's bits, and each expert's weight gradient is one
device's for the EP ranks' batches concatenated in rank order. Every rank of the group must run
each forward (and backward) together. Tensor parallelism stays 1 with MoE layers (refused by
name). :class:`RoutingLog` records each token's experts (``rlk consistency``'s expert column).

Each forward stacks the local experts' ``[2I, H]`` / ``[H, I]`` weights into the ``[E, 2I, H]``
/ ``[E, H, I]`` tensors :func:`rlk.moe_experts` takes (a copy of the layer's expert weights,
kept for the backward); the stack's backward hands each expert its own gradient slice.

Example::

    mg = build_gpt_model(qwen3_moe.config)      # (models.megatron.model)
    type(mg.decoder.layers[0].mlp).__name__     # "RlkMoELayer"
    with RoutingLog(mg) as log:
        lps = packed_logprobs(mg, samples)      # == the rollout's, bit for bit
"""

from __future__ import annotations

from typing import Any

import torch

import rlk
import rlk.parallel
from rlk_integrations.models import moe
from rlk_integrations.models.megatron.modules import _positions


def _make_router():
    from megatron.core.transformer.moe.router import TopKRouter

    class RlkTopKRouter(TopKRouter):
        """Megatron's ``TopKRouter`` (its ``weight [E, H]`` in the model's dtype) on rlk:
        ``x [T, H]`` -> float32 weights and int64 experts ``[T, k]``, ranked by decreasing
        logit (:func:`rlk.moe_route`; ``normalize`` is ``not moe_router_pre_softmax``). The
        routing of every token depends on its own row alone."""

        def forward(self, input: torch.Tensor, padding_mask: Any = None):
            # padding_mask only feeds Megatron's load-balancing statistics, which are off
            # (moe_router_load_balancing_type "none", checked in megatron_config).
            logits = rlk.linear(input.contiguous(), self.weight)
            return rlk.moe_route(
                logits,
                self.config.moe_router_topk,
                normalize=not self.config.moe_router_pre_softmax,
            )

    return RlkTopKRouter


def _make_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP

    class RlkExperts(SequentialMLP):
        """Megatron's ``SequentialMLP`` (one ``MLP`` of ``linear_fc1 [2I, H]`` and
        ``linear_fc2 [H, I]`` per local expert) run as one :func:`rlk.moe_experts`:
        ``forward(x [T, H], indices [T, k], weights [T, k])`` -> ``[T, H]`` in x's dtype."""

        def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
            experts = list(self.local_experts)
            for e in experts:
                if e.linear_fc1.bias is not None or e.linear_fc2.bias is not None:
                    raise NotImplementedError("rlk's experts take no linear biases")
            gate_up = torch.stack([e.linear_fc1.weight for e in experts])
            down = torch.stack([e.linear_fc2.weight for e in experts])
            if self.ep_group.size() == 1:
                return rlk.moe_experts(x, indices, weights, gate_up, down)
            return rlk.parallel.expert_parallel_moe_experts(
                x, indices, weights, gate_up, down, group=self.ep_group
            )

    return RlkExperts


def _make_shared_experts():
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    class RlkSharedExperts(SharedExpertMLP):
        """Megatron's ``SharedExpertMLP`` (``linear_fc1 [2Is, H]``, ``linear_fc2 [H, Is]``,
        ``gate_weight [1, H]``) with Qwen2-MoE's sigmoid gate as rlk runs it
        (:func:`rlk_integrations.models.moe.shared_expert`): ``x [T, H]`` -> ``[T, H]``, the
        SwiGLU MLP on rlk's linears and :func:`rlk.silu_and_mul`, scaled by the float32
        :func:`rlk_integrations.models.moe.sigmoid` of ``rlk.linear(x, gate_weight)``, rounded
        once to x's dtype."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, bias = self.linear_fc1(x)
            if bias is not None:
                raise NotImplementedError("rlk's shared experts take no fc1 bias")
            out, _ = self.linear_fc2(rlk.silu_and_mul(h))
            if not self.use_shared_expert_gate:
                return out
            scale = moe.sigmoid(rlk.linear(x, self.gate_weight))
            return (scale * out.float()).to(x.dtype)  # elementwise: one rounding per element

    return RlkSharedExperts


def _make_moe_layer():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class RlkMoELayer(MoELayer):
        """Megatron's ``MoELayer`` on rlk: ``[S, B, H]`` -> (``[S, B, H]``, None), the bits of
        :func:`rlk_integrations.models.moe.moe_forward` for every token whatever the batch.
        Any expert parallelism; tensor parallelism 1 only (``NotImplementedError`` otherwise,
        at construction)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            if self.tp_group.size() != 1:
                raise NotImplementedError(
                    f"tensor_model_parallel_size={self.tp_group.size()} with MoE layers: the "
                    "rollout has no tree-ordered (leaves) MoE layout to match"
                )

        def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                    padding_mask: Any = None):  # fmt: skip
            if intermediate_tensors is not None:
                raise NotImplementedError("rlk MoELayer: no partial (CUDA-graph) forward")
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1]).contiguous()
            weights, indices = self.router(x, padding_mask)
            out = self.experts(x, indices, weights)
            if self.shared_experts is not None:  # Qwen2-MoE, as rlk's block adds it
                out = out + self.shared_experts(x)  # elementwise, one rounding per element
            return out.view(shape), None

    return RlkMoELayer


def moe_spec(col: Any, row: Any) -> Any:
    """The ``mlp`` entry of a sparse ``TransformerLayer`` spec: :func:`_make_moe_layer`'s
    layer with :func:`_make_router`'s router, :func:`_make_experts`' experts, whose ``MLP`` s
    are built from the linear specs ``col`` / ``row`` (their forwards never run:
    :func:`rlk.moe_experts` reads their weights), and, when the config has them,
    :func:`_make_shared_experts`' shared experts on ``col`` / ``row``."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = ModuleSpec(
        module=_make_experts(), submodules=MLPSubmodules(linear_fc1=col, linear_fc2=row)
    )
    # mcore API: MoESubmodules.router (0.16) builds the router; a ModuleSpec of an MoELayer
    # subclass gets Megatron's default process groups (TransformerLayer passes pg_collection
    # to the exact MoELayer class only), which are the same groups.
    shared = ModuleSpec(
        module=_make_shared_experts(),
        submodules=MLPSubmodules(linear_fc1=col, linear_fc2=row),
    )
    return ModuleSpec(
        module=_make_moe_layer(),
        submodules=MoESubmodules(experts=experts, shared_experts=shared, router=_make_router()),
    )


class RoutingLog(moe.RoutingLog):
    """The experts every token was routed to, per MoE layer, over an rlk ``GPTModel``'s
    forwards while the log is active (``with RoutingLog(mg) as log: ...``): the Megatron twin
    of :class:`rlk_integrations.models.moe.RoutingLog`, whose ``calls`` format it shares, so
    :func:`~rlk_integrations.models.moe.packed_routing` and
    :func:`~rlk_integrations.models.moe.expert_differ` read it.

    ``calls`` holds one ``(positions [B, S], valid [B, S], experts [B, S, layers, k])`` entry
    (CPU tensors) per forward of ``model.decoder``: positions restart at 0 per packed sequence
    (``packed_seq_params``; one ``[1, T]`` row) or count 0.. per batch row (``sbhd``), every
    token is valid, and each MoE layer's experts are its router's ``[T, k]`` indices.
    """

    def __init__(self, model: Any):
        self.model = model
        self.routers = [
            layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")
        ]
        if not self.routers:
            raise ValueError("the model has no mixture-of-experts layers")
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending: list[Any] = []
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingLog:
        hook = self.model.decoder.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        self._handles.append(hook)
        for router in self.routers:
            self._handles.append(router.register_forward_hook(self._on_router))
        return self

    def _on_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._flush()
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        s, b = hidden.shape[:2]
        params = kwargs.get("packed_seq_params")
        pos = _positions(params, s, b, torch.device("cpu"))
        pos = pos.reshape(1, s) if params is not None else pos.reshape(s, b).transpose(0, 1)
        self._pending = [pos.contiguous(), torch.ones(b, s, dtype=torch.bool), []]

    def _on_router(self, module: Any, args: tuple, output: Any) -> None:
        if self._pending:
            b, s = self._pending[0].shape
            # Router rows are in the [S, B] order of Megatron's hidden states; the log's [B, S].
            experts = output[1].detach().cpu().reshape(s, b, -1).transpose(0, 1)
            self._pending[2].append(experts.reshape(b * s, -1))
