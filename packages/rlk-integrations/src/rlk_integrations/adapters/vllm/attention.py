"""vLLM attention backend ``RLK``: vLLM's paged KV cache, attention by :func:`rlk.paged_attention`.

vLLM owns the cache (it allocates the blocks, and its scheduler fills the block tables, the slot
mapping and the sequence lengths of every step, with prefix caching, chunked prefill and
preemption); this backend only reads those and computes with rlk:

- the builder (:class:`RLKMetadataBuilder`) keeps vLLM's common metadata of a step as
  :class:`RLKMetadata`: ``query_start_loc`` int32 ``[B + 1]``, ``seq_lens`` int32 ``[B]``
  (cached tokens including the step's new ones), ``block_table`` int32 ``[B, max_blocks]``,
  ``slot_mapping`` int64 ``[T]`` (``block * block_size + offset``);
- the layer's cache tensor is vLLM's logical ``[blocks, Hk, block_size, 2 * D]`` (keys in the
  first ``D`` of the last axis, values in the second, whatever the physical layout vLLM chose);
  :func:`kv_views` turns it into rlk's ``[pages, page_size, Hk, D]`` key and value views
  without a copy (rlk's kernel reads strides; only ``D`` must be contiguous);
- :class:`RLKAttentionImpl` writes the new keys and values into their slots and calls
  :func:`rlk.paged_attention`, whose bits equal :func:`rlk.attention` on the same sequence
  whatever the block size, the placement of blocks or the batch: so a prefix-cache hit, a
  chunked prefill, a decode and the training forward give the same bits.

The backend is registered with vLLM under the name ``RLK`` by
:func:`rlk_integrations.adapters.vllm.register`; the rlk model classes pass it to their
``Attention`` layers, so no other model uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

import rlk

#: vLLM's name of this backend (an ``AttentionBackendEnum`` member registered by the plugin).
BACKEND_NAME = "RLK"


def kv_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rlk's ``k_cache``/``v_cache [blocks, block_size, Hk, D]`` views of one layer's vLLM cache
    ``[blocks, Hk, block_size, 2 * D]`` (no copy)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
        raise ValueError(
            f"expected vLLM's [blocks, Hk, block_size, 2 * {head_dim}] KV cache, got "
            f"{tuple(kv_cache.shape)}"
        )
    k = kv_cache[..., :head_dim].transpose(1, 2)
    v = kv_cache[..., head_dim:].transpose(1, 2)
    return k, v


@dataclass
class RLKMetadata:
    """One step's attention metadata, from vLLM's :class:`CommonAttentionMetadata`."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class RLKMetadataBuilder(AttentionMetadataBuilder[RLKMetadata]):
    """Keeps the step's common metadata; no CUDA graph support (vLLM then runs eagerly)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> RLKMetadata:
        m = common_attn_metadata
        if not isinstance(m.causal, bool) or not m.causal:
            raise NotImplementedError("rlk's vLLM attention is causal decoder attention only")
        n = m.num_reqs
        return RLKMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc[: n + 1].to(torch.int32),
            seq_lens=m.seq_lens[:n].to(torch.int32),
            block_table=m.block_table_tensor[:n].to(torch.int32),
            slot_mapping=m.slot_mapping[: m.num_actual_tokens].to(torch.int64),
        )


class RLKAttentionImpl(AttentionImpl):
    """Causal GQA attention on vLLM's paged cache through :func:`rlk.paged_attention`."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto",
            f"attn_type={attn_type!r}": attn_type != AttentionType.DECODER,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
            f"{sorted(extra)}": bool(extra),
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise NotImplementedError(f"rlk's vLLM attention does not support {', '.join(bad)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: RLKMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key``/``value [T, Hk, D]`` -> ``output [T, Hq, D]`` (written in
        place). Rows past ``num_actual_tokens`` (vLLM's padding) are zeroed."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("rlk's vLLM attention has no fused output quantization")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs: no cache yet
            return output.zero_()
        t = attn_metadata.num_actual_tokens
        kc, vc = kv_views(kv_cache, self.head_size)
        # The step's keys and values go into their slots in the same call.
        out = rlk.paged_attention(
            query[:t],
            kc,
            vc,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            scale=self.scale,
            k_new=key[:t].to(kc.dtype),
            v_new=value[:t].to(vc.dtype),
            slots=attn_metadata.slot_mapping,
        )
        output[:t].copy_(out.view(output[:t].shape))
        output[t:].zero_()
        return output


class RLKAttentionBackend(AttentionBackend):
    """vLLM's view of the ``RLK`` backend: the classes above, and what they accept."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[RLKAttentionImpl]:
        return RLKAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RLKMetadataBuilder]:
        return RLKMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size rlk's attention takes

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
