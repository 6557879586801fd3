"""Expert parallelism for the transformers integration, with the bits of one device.

:func:`shard_ep` turns a mixture-of-experts model patched by
:func:`rlk_integrations.models.transformers.patch_model` into rank ``r`` of an
expert-parallel group of ``t`` ranks, in place: every sparse block keeps experts ``r*E/t ..
(r+1)*E/t`` of its ``experts.gate_up_proj`` / ``down_proj`` (the parameters are replaced by
that shard) and its forward (:func:`rlk_integrations.models.moe.moe_forward`) runs
:func:`rlk.parallel.expert_parallel_moe_experts` over the group. The rest of the model
(embeddings, attention, norms, routers, Qwen2-MoE's shared expert, lm_head) stays whole on
every rank, and each rank runs its own sequences: the dense layers are data-parallel, the
experts' tokens move by all-to-all.

So a rollout (``rlk_integrations.engine.rollout.generate``) or a training recompute
(``rlk_integrations.engine.training.packed_logprobs``, forward and backward) gives every
sequence the log-probabilities, and every token the gradients, of the whole model on one
device, bit for bit; each expert's weight gradient is that device's, for the ranks' batches
concatenated in rank order. Every rank must run the same number of forwards (and backwards)
together: the padded rollout's fixed step count does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

import rlk.parallel as P
from rlk_integrations.models.architectures import architecture
from rlk_integrations.models.transformers import is_patched

#: The experts' parameters :func:`shard_ep` splits (dim 0: the expert).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def shard_ep(model: nn.Module, *, group: Any = None) -> nn.Module:
    """Make ``model`` (a mixture of experts patched by ``patch_model``) this process's rank of
    the expert-parallel group ``group`` (default: the world; one rank when torch.distributed
    is not initialised, which runs the same code path), in place. The group size must divide
    every block's number of experts. Returns ``model``.

    Example (in each of 4 processes of an initialised process group)::

        patch_model(model)
        shard_ep(model)
        lps = training.packed_logprobs(model, my_samples)   # the bits of one device
    """
    if not is_patched(model):
        raise ValueError("shard_ep needs a model patched by patch_model(model)")
    arch = architecture(model.config)
    if not arch.moe:
        raise ValueError(f"{model.config.model_type} has no mixture-of-experts layers")
    if getattr(model, "_rlk_tp", None) is not None:
        raise NotImplementedError("shard_ep of a tensor-parallel model (shard_tp) is not supported")
    if getattr(model, "_rlk_ep", None) is not None:
        raise ValueError("model is already expert-parallel")
    rank, world = P.group_info(group)
    blocks = [m for m in model.modules() if isinstance(m, arch.moe_classes()[0])]
    for block in blocks:
        experts = block.experts
        if experts.gate_up_proj.shape[0] % world:
            raise ValueError(
                f"the EP size {world} must divide the {experts.gate_up_proj.shape[0]} experts"
            )
    for block in blocks:
        experts = block.experts
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            shard = P.shard(p.data, 0, rank=rank, world_size=world)
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        block._rlk_ep = (rank, world, group)
    model._rlk_ep = (rank, world, group)
    return model


__all__ = ["EXPERT_PARAMS", "shard_ep"]
