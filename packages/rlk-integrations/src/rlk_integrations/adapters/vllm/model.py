"""rlk-backed Llama / Qwen2 / Qwen3 causal LMs as vLLM model classes.

A model class builds the transformers model of the checkpoint's config and patches it with
:func:`rlk_integrations.models.transformers.patch_model` (every linear, norm, activation and rotary
on rlk ops; the same module code the training recompute of :mod:`rlk_integrations.engine.training`
runs), and one vLLM ``Attention`` layer per decoder layer with the ``RLK`` backend
(:mod:`rlk_integrations.adapters.vllm.attention`), so that vLLM allocates and schedules the paged KV
cache. A vLLM step runs the packed row of its tokens through the paged rollout's forward
(:func:`rlk_integrations.engine.paged_step.forward_packed`), whose attention goes to those layers;
``compute_logits`` is the patched ``lm_head`` (:func:`rlk.linear`), and vLLM's sampler reports
:func:`rlk.logprobs` of these logits (:mod:`rlk_integrations.adapters.vllm.sampler`).

Weights are the checkpoint's own tensors, copied by name (``load_weights``); so
``training.recompute_logprobs`` on the same checkpoint gives the same bits.

Anything the classes cannot run raises at engine start, naming it (:func:`check_config`):
quantization, LoRA, speculative decoding, tensor, pipeline or context parallelism above 1, a
runner other than ``generate`` (pooling), prompt embeddings, a KV cache dtype other than the
model's, a ``logprobs_mode`` other than ``raw_logprobs``, vLLM's V2 model
runner, an architecture other than Llama / Qwen2 / Qwen3.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rlk_integrations.adapters.vllm import check_vllm
from rlk_integrations.adapters.vllm import sampler as rlk_sampler
from rlk_integrations.engine.paged_step import forward_packed
from rlk_integrations.models.architectures import architecture
from rlk_integrations.models.transformers import patch_model


def check_config(vllm_config: Any) -> None:
    """Raise ``NotImplementedError`` naming each option of ``vllm_config`` the rlk models do not
    support (never a silent fallback to vLLM's kernels)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    bad = []
    if getattr(mc, "quantization", None):
        bad.append(f"quantization={mc.quantization!r}")
    if getattr(vllm_config, "lora_config", None) is not None:
        bad.append("LoRA (enable_lora=True)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        bad.append("speculative decoding (speculative_config)")
    if pc.tensor_parallel_size != 1:
        bad.append(f"tensor_parallel_size={pc.tensor_parallel_size}")
    if pc.pipeline_parallel_size != 1:
        bad.append(f"pipeline_parallel_size={pc.pipeline_parallel_size}")
    for cp in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(pc, cp, 1) != 1:
            bad.append(f"{cp}={getattr(pc, cp)}")
    if getattr(mc, "runner_type", "generate") != "generate":
        bad.append(f"runner={mc.runner_type!r} (only 'generate')")
    if getattr(mc, "enable_prompt_embeds", False):
        bad.append("enable_prompt_embeds=True (token ids only)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        bad.append(f"kv_cache_dtype={cache_dtype!r}")
    if mc.logprobs_mode != "raw_logprobs":
        bad.append(f"logprobs_mode={mc.logprobs_mode!r} (only 'raw_logprobs')")
    if getattr(vllm_config, "use_v2_model_runner", False):
        bad.append("vLLM's V2 model runner")
    if bad:
        raise NotImplementedError(f"rlk's vLLM models do not support {'; '.join(bad)}")


def _hf_config(vllm_config: Any) -> Any:
    """The checkpoint's transformers config with its own architecture name back in place."""
    cfg = copy.deepcopy(vllm_config.model_config.hf_config)
    cfg.architectures = [a.removeprefix("RLK") for a in (cfg.architectures or [])]
    return cfg


class _Cache:
    """What the patched attention sees as ``past_key_values``: layer ``i``'s new ``q``/``k``/``v``
    go to vLLM's ``Attention`` layer ``i`` (which writes the cache and attends)."""

    rlk_paged = True

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers

    def attend(self, layer_idx: int, q, k, v, scale) -> torch.Tensor:
        out = self.layers[layer_idx](q, k, v)
        return out.view(q.shape)


class RLKForCausalLM(nn.Module):
    """A vLLM text-generation model on rlk ops (see the module docstring). Parameter names are
    the checkpoint's (``model.*``, ``lm_head.*``)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        check_vllm()
        check_config(vllm_config)
        # vLLM's modules (and the attention backend, which subclasses them) are imported where
        # the model is built: vLLM is an optional dependency of this package.
        from transformers import AutoModelForCausalLM
        from vllm.model_executor.layers.attention import Attention

        from rlk_integrations.adapters.vllm.attention import RLKAttentionBackend

        cfg = _hf_config(vllm_config)
        architecture(cfg, integration="vLLM")  # NotImplementedError for another model_type
        mc = vllm_config.model_config
        hf = AutoModelForCausalLM.from_config(cfg, dtype=mc.dtype, attn_implementation="sdpa")
        hf = patch_model(hf.eval())
        for p in hf.parameters():
            p.requires_grad_(False)
        # The transformers model is held outside the module tree; its two children are in it,
        # so parameter names are the checkpoint's.
        object.__setattr__(self, "hf", hf)
        self.model = hf.model
        self.lm_head = hf.get_output_embeddings()
        self.model.rotary_emb._rlk_table.reserve(mc.max_model_len + 1)
        attn0 = self.model.layers[0].self_attn
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.attn = nn.ModuleList(
            Attention(
                heads,
                attn0.head_dim,
                attn0.scaling,
                num_kv_heads=kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}{'.' if prefix else ''}attn.{i}",
                attn_backend=RLKAttentionBackend,
            )
            for i in range(len(self.model.layers))
        )
        self._cache = _Cache(self.attn)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` int64 ``[T]`` (vLLM's packed step) -> hidden ``[T, H]``."""
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError("rlk's vLLM models take token ids (no inputs_embeds)")
        return forward_packed(self.model, input_ids, positions, self._cache)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> logits ``[N, V]`` in the model's dtype (:func:`rlk.linear`), marked so
        that vLLM's sampler reports :func:`rlk.logprobs` of them."""
        return rlk_sampler.mark(self.lm_head(hidden_states.contiguous()))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's tensors by name; raises ``ValueError`` for a name the model has
        no parameter for, and for a parameter the checkpoint lacks."""
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        seen = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"the checkpoint's {name!r} is no parameter of the rlk model")
            p = params[name]
            if p.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint {tuple(tensor.shape)}, model {tuple(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(tensor)
            seen.add(id(p))
        missing = [n for n, p in params.items() if id(p) not in seen]
        if missing:
            raise ValueError(f"the checkpoint lacks {missing}")
        return {name for name, _ in self.named_parameters()}


class RLKLlamaForCausalLM(RLKForCausalLM):
    """Llama on rlk ops (vLLM)."""


class RLKQwen2ForCausalLM(RLKForCausalLM):
    """Qwen2 on rlk ops (vLLM)."""


class RLKQwen3ForCausalLM(RLKForCausalLM):
    """Qwen3 on rlk ops (vLLM)."""
