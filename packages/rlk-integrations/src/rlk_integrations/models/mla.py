"""Multi-head latent attention (DeepSeek-V3's ``DeepseekV3Attention``) on rlk ops.

:func:`mla_qkv` computes the queries, keys and values as transformers does, every product by
:func:`rlk.linear`, every norm by :func:`rlk.rms_norm` and the rotation by
:func:`rlk.apply_rotary`:

- ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` without ``q_lora_rank``),
  ``[T, heads, qk_nope + qk_rope]``;
- ``kv_a_proj_with_mqa(x)`` splits into the latent ``[T, kv_lora_rank]`` and one rope key
  ``[T, qk_rope]`` shared by every head; ``kv_b_proj(kv_a_layernorm(latent))`` gives each head's
  ``k_nope [qk_nope]`` and ``v [v_head_dim]``;
- the rope parts of q and k rotated; DeepSeek lays them out in interleaved pairs
  (``rope_interleave``), rotated by transformers into the "rotate half" layout, which is
  ``rlk.apply_rotary`` of the de-interleaved vector (an exact gather of columns);
- ``k = [k_nope, k_rope]`` per head and ``v`` zero-padded from ``v_head_dim`` to the
  ``qk_nope + qk_rope`` of q and k, the one head size :func:`rlk.attention` and
  :func:`rlk.paged_attention` take. An output column of attention is the sum over keys of
  ``p_j * v[j, column]``, so the padded columns come out zero and the real ones do not
  depend on them (``test_deepseek.py`` checks it bit for bit); the caller keeps the first
  ``v_head_dim`` columns.

Every path of a patched model (the padded rollout's dynamic cache, the paged cache, the
training pass) runs these same ops on each token's own row, so the keys and values a rollout
caches are the bits the training pass recomputes; the paged cache holds them expanded (heads x
``qk_nope + qk_rope``). Weight absorption (attention over the latent) is not used: it changes the
order of the sums.

Example::

    q, k, v = mla_qkv(attn, x, cos, sin)   # [B, S, heads, qk_nope + qk_rope] each
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import rlk


def check_mla(cfg: Any) -> None:
    """Refuse, before anything is patched, the MLA configurations :func:`mla_qkv` does not run
    (``NotImplementedError`` naming the option)."""
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
    if kv_heads not in (None, heads):
        # transformers expands K/V to every head, then repeat_kv would repeat them again.
        raise NotImplementedError(
            f"MLA with num_key_value_heads={kv_heads} != num_attention_heads={heads}"
        )
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.v_head_dim > qk:
        raise NotImplementedError(
            f"MLA with v_head_dim={cfg.v_head_dim} > qk_nope_head_dim + qk_rope_head_dim={qk}"
        )
    if getattr(cfg, "attention_dropout", 0.0):
        raise NotImplementedError("attention_dropout > 0: rlk attention has no dropout")


def _rope_layout(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x [T, H, R]`` in the "rotate half" layout: DeepSeek's interleaved pairs ``(x0, x1),
    (x2, x3), ...`` de-interleaved to ``[x0, x2, ..., x1, x3, ...]`` (what transformers'
    ``apply_rotary_pos_emb_interleave`` rotates into), else as it is."""
    if attn.config.rope_interleave:
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return x.contiguous()


def mla_qkv(
    attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries, keys and zero-padded values of the patched ``DeepseekV3Attention``
    ``attn`` for ``x [B, S, hidden]`` (cos/sin: fp32 ``[B * S, qk_rope_head_dim]`` rows) ->
    three ``[B, S, heads, qk_nope_head_dim + qk_rope_head_dim]`` tensors in x's dtype (see the
    module docstring); the attention's output keeps its first ``v_head_dim`` columns."""
    b, s, _ = x.shape
    heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    dv, d = attn.v_head_dim, nope + rope
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(b * s, heads, d)
    latent, k_rope = attn.kv_a_proj_with_mqa(x).view(b * s, -1).split([attn.kv_lora_rank, rope], -1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(b * s, heads, nope + dv)
    q_rope, k_rope = rlk.apply_rotary(
        _rope_layout(attn, q[..., nope:]), cos, sin, k=_rope_layout(attn, k_rope[:, None, :])
    )
    q = torch.cat([q[..., :nope], q_rope], dim=-1)
    k = torch.cat([kv[..., :nope], k_rope.expand(-1, heads, -1)], dim=-1)
    v = F.pad(kv[..., nope:], (0, d - dv))
    shape = (b, s, heads, d)
    return q.view(shape), k.view(shape), v.view(shape)
