"""Weights between a transformers ``*ForCausalLM`` state dict and Megatron-core's ``GPTModel``
(local spec): :func:`hf_to_megatron` / :func:`megatron_to_hf` at TP = 1 (views, ``cat`` and
``split`` only: the round trip is bitwise), :func:`shard_for_tp` for a rank's shard,
:func:`shard_for_ep` for an expert-parallel rank's experts, and :func:`load_hf_weights` into a
model.

Megatron's fused QKV is grouped per KV head: for each of the ``num_query_groups`` groups, that
group's q heads, then its k head, then its v head (weight rows and, for Qwen2, the bias).
``linear_fc1`` is ``cat(gate, up)``; a rank's fc1 shard is ``cat(gate_r, up_r)``. A sparse
(Qwen3-MoE) layer's router is ``mlp.gate.weight`` <-> ``mlp.router.weight``, and expert ``j``'s
rows of transformers' ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows then up rows, Megatron's
fc1 layout too) and ``down_proj [E, H, I]`` are ``mlp.experts.local_experts.{j}.linear_fc1``
/ ``linear_fc2`` (Megatron's ``SequentialMLP``): ``unbind`` one way, ``stack`` the other.
Qwen2-MoE's shared expert is ``mlp.shared_experts.linear_fc1`` (``cat(gate, up)``) /
``linear_fc2`` and its gate ``mlp.shared_expert_gate.weight`` <-> ``mlp.shared_experts
.gate_weight``.

Example::

    sd = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    assert all(torch.equal(a, hf_model.state_dict()[k])
               for k, a in megatron_to_hf(sd, hf_model.config).items())
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import rlk.parallel
from rlk_integrations.models.megatron.config import (
    _check_supported,
    _dims,
    _qk_norm,
    _qkv_bias,
    _tied,
    moe_layers,
)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Any) -> torch.Tensor:
    heads, kv, d = _dims(cfg)
    rest = q.shape[1:]
    g = heads // kv
    parts = (q.reshape(kv, g * d, *rest), k.reshape(kv, d, *rest), v.reshape(kv, d, *rest))
    return torch.cat(parts, dim=1).reshape(kv * (g + 2) * d, *rest)


def _split_qkv(w: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv, d = _dims(cfg)
    rest = w.shape[1:]
    g = heads // kv
    q, k, v = w.reshape(kv, (g + 2) * d, *rest).split([g * d, d, d], dim=1)
    return q.reshape(heads * d, *rest), k.reshape(kv * d, *rest), v.reshape(kv * d, *rest)


def _shared(cfg: Any) -> bool:
    """Whether the sparse layers have a (Qwen2-MoE) sigmoid-gated shared expert."""
    return bool(getattr(cfg, "shared_expert_intermediate_size", None))


def _layer_map(i: int, cfg: Any) -> list[tuple[str, str]]:
    """(transformers key, Megatron key) of the one-to-one tensors of layer ``i``."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [
        (h + "input_layernorm.weight", m + "input_layernorm.weight"),
        (h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight"),
        (h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight"),
    ]
    if _qk_norm(cfg):
        pairs += [
            (h + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight"),
            (h + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight"),
        ]
    return pairs


def hf_to_megatron(state_dict: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A transformers ``*ForCausalLM`` state dict -> Megatron ``GPTModel`` (local spec, TP=1).

    ``config``: the transformers config. Tied models: ``lm_head.weight`` (if present) must be
    the embedding and is dropped (Megatron shares ``embedding.word_embeddings.weight``).
    Raises on keys it does not know, so nothing is silently lost.
    """
    _check_supported(config)
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"hf_to_megatron: missing {key!r} in the transformers state dict")
        return sd.pop(key)

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    sparse = moe_layers(config)
    for i in range(config.num_hidden_layers):
        for hk, mk in _layer_map(i, config):
            out[mk] = take(hk)
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        q, k, v = take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(q, k, v, config)
        if _qkv_bias(config):
            qb, kb, vb = take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(qb, kb, vb, config)
        p = f"model.layers.{i}.mlp."
        if sparse[i]:
            out[m + "mlp.router.weight"] = take(p + "gate.weight")
            experts = zip(take(p + "experts.gate_up_proj"), take(p + "experts.down_proj"))
            for j, (gate_up, down) in enumerate(experts):
                out[m + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = gate_up
                out[m + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = down
            if _shared(config):
                se = p + "shared_expert."
                out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                    [take(se + "gate_proj.weight"), take(se + "up_proj.weight")]
                )
                out[m + "mlp.shared_experts.linear_fc2.weight"] = take(se + "down_proj.weight")
                out[m + "mlp.shared_experts.gate_weight"] = take(p + "shared_expert_gate.weight")
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(p + "gate_proj.weight"), take(p + "up_proj.weight")]
        )
        out[m + "mlp.linear_fc2.weight"] = take(p + "down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if _tied(config):
        head = sd.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, out["embedding.word_embeddings.weight"]):
            raise ValueError("tie_word_embeddings is set but lm_head.weight is not the embedding")
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    if sd:
        raise KeyError(f"hf_to_megatron: unexpected transformers keys {sorted(sd)[:5]}")
    return out


def megatron_to_hf(
    state_dict: dict[str, torch.Tensor], config: Any, *, include_tied_head: bool = True
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron` (Megatron ``_extra_state`` entries are ignored).

    Tied models get ``lm_head.weight`` = the embedding when ``include_tied_head`` (as
    transformers' own ``state_dict()`` lists it).
    """
    _check_supported(config)
    sd = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"megatron_to_hf: missing {key!r} in the Megatron state dict")
        return sd.pop(key)

    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")
    sparse = moe_layers(config)
    for i in range(config.num_hidden_layers):
        for hk, mk in _layer_map(i, config):
            out[hk] = take(mk)
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.weight"), config)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if _qkv_bias(config):
            q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.bias"), config)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        p = f"model.layers.{i}.mlp."
        if sparse[i]:
            out[p + "gate.weight"] = take(m + "mlp.router.weight")
            e = m + "mlp.experts.local_experts."
            n = config.num_experts
            fc1 = [take(e + f"{j}.linear_fc1.weight") for j in range(n)]
            fc2 = [take(e + f"{j}.linear_fc2.weight") for j in range(n)]
            out[p + "experts.gate_up_proj"] = torch.stack(fc1)
            out[p + "experts.down_proj"] = torch.stack(fc2)
            if _shared(config):
                se = m + "mlp.shared_experts."
                gate, up = take(se + "linear_fc1.weight").chunk(2, dim=0)
                out[p + "shared_expert.gate_proj.weight"] = gate
                out[p + "shared_expert.up_proj.weight"] = up
                out[p + "shared_expert.down_proj.weight"] = take(se + "linear_fc2.weight")
                out[p + "shared_expert_gate.weight"] = take(se + "gate_weight")
            continue
        gate, up = take(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate, up
        out[p + "down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if _tied(config):
        sd.pop("output_layer.weight", None)
        if include_tied_head:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("output_layer.weight")
    if sd:
        raise KeyError(f"megatron_to_hf: unexpected Megatron keys {sorted(sd)[:5]}")
    return out


def shard_for_tp(
    state_dict: dict[str, torch.Tensor], config: Any, *, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a TP=1 Megatron state dict (from :func:`hf_to_megatron`).

    Column-parallel (QKV rows, whole KV groups per rank; fc1 as ``cat(gate_r, up_r)``; the
    vocabulary of the embedding and output layer) and row-parallel (linear_proj, fc2: input
    columns) weights are cut in contiguous equal parts; norms are replicated.
    """
    _, kv, _ = _dims(config)
    if any(moe_layers(config)):
        raise NotImplementedError(
            "shard_for_tp: MoE layers are not split by tensor parallelism (rlk's Megatron MoE "
            "runs at tensor and expert parallelism 1)"
        )
    if kv % world_size:
        raise ValueError(f"{kv} KV heads do not split over {world_size} ranks")

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return rlk.parallel.shard(t, dim, rank=rank, world_size=world_size)

    out = {}
    for key, t in state_dict.items():
        if key.endswith("_extra_state"):
            continue
        if key.endswith(("linear_qkv.weight", "linear_qkv.bias")) or key in (
            "embedding.word_embeddings.weight",
            "output_layer.weight",
        ):
            out[key] = part(t, 0)
        elif key.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[key] = torch.cat([part(gate, 0), part(up, 0)])
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[key] = part(t, 1)
        else:
            out[key] = t
    return out


_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def shard_for_ep(
    state_dict: dict[str, torch.Tensor], config: Any, *, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Expert-parallel rank ``rank``'s part of a TP=1 Megatron state dict (from
    :func:`hf_to_megatron`): of every sparse layer's ``E`` experts it keeps ``rank*E/world_size
    .. (rank+1)*E/world_size``, renumbered from 0 (``local_experts.{j}``, as Megatron numbers
    a rank's experts); everything else is whole on every rank."""
    n = config.num_experts
    if world_size < 1 or n % world_size:
        raise ValueError(f"{n} experts do not split over {world_size} expert-parallel ranks")
    local = n // world_size
    out = {}
    for key, t in state_dict.items():
        m = _EXPERT.fullmatch(key)
        if m is None:
            out[key] = t
        elif int(m[2]) // local == rank:
            out[f"{m[1]}{int(m[2]) - rank * local}{m[3]}"] = t
    return out


def load_hf_weights(
    model: nn.Module,
    hf_state_dict: dict[str, torch.Tensor],
    hf_config: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
    ep_rank: int = 0,
    ep_world_size: int = 1,
):
    """Copy a transformers state dict into a ``GPTModel`` (bitwise; dtypes must match): the
    whole model at TP=1, or TP rank ``rank``'s :func:`shard_for_tp` shard of ``world_size``;
    an MoE model's experts as expert-parallel rank ``ep_rank`` of ``ep_world_size``
    (:func:`shard_for_ep`)."""
    sd = hf_to_megatron(hf_state_dict, hf_config)
    if world_size != 1:
        sd = shard_for_tp(sd, hf_config, rank=rank, world_size=world_size)
    if ep_world_size != 1:
        sd = shard_for_ep(sd, hf_config, rank=ep_rank, world_size=ep_world_size)
    own = model.state_dict()
    for key, t in sd.items():
        if key not in own:
            raise KeyError(f"load_hf_weights: the Megatron model has no {key!r}")
        if own[key].dtype != t.dtype or own[key].shape != t.shape:
            raise ValueError(
                f"load_hf_weights: {key} is {own[key].dtype} {tuple(own[key].shape)} in the "
                f"model but {t.dtype} {tuple(t.shape)} in the checkpoint"
            )
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"load_hf_weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model
