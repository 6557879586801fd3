"""Built-in random-init model configs, and loading a local transformers checkpoint.

``tiny`` (and ``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen3-moe``, a mixture of 16 experts with
4 per token, ``tiny-qwen2-moe``, the same with Qwen2-MoE's sigmoid-gated shared expert, all with
head_dim 32, which stock vLLM's CPU attention takes; and ``tiny-mha`` /
``tiny-mha8`` whose 4 / 8 key/value heads split over 4 / 8 tensor-parallel ranks; and
``tiny-deepseek-v3``, DeepSeek-V3's multi-head latent attention, group-limited router and shared
expert at tiny size) are small enough for the Triton interpreter on a CPU; ``qwen2-0.5b``,
``qwen3-0.6b``, ``llama3-8b-4layers``, ``qwen3-4b-4layers``, ``qwen3-30b-a3b-4layers`` (128
experts, 8 per token) and
``deepseek-v3-4layers`` (DeepSeek-V3's layers with 64 of its 256 experts) have the shapes of the
real models (random weights, nothing downloaded) for GPU runs.

``llama3.2-1b-4layers`` and ``qwen2.5-1.5b-4layers`` (:data:`HELDOUT`) are held out: the layer
shapes of Llama-3.2-1B (head_dim 64, llama3 rope scaling, tied embeddings) and Qwen2.5-1.5B
(q/k/v bias, GQA 6) with 4 layers. No kernel configuration is chosen by measuring them; the
benchmarks and ``rlk consistency`` run them to show that speed and the contract carry over to
shapes the tuning never saw.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# head_dim 32: the smallest vLLM's CPU attention takes (its supported sizes are 32, 64, 80, ...),
# so that stock vLLM runs the tiny models too; hidden = heads * head_dim, which vLLM's Qwen2
# assumes (it derives head_dim from them). 4 query heads share 2 key/value heads (GQA), which 2
# tensor-parallel ranks split.
_TINY = dict(
    num_hidden_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)

# The tiny mixtures of experts: every layer sparse, 16 experts of 32 intermediate units, 4 per
# token.
_TINY_MOE = dict(
    _TINY,
    hidden_size=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=True,
)


#: DeepSeek-V3's YaRN rope scaling less its factor and original length (mscale and mscale_all_dim
#: 1: the softmax scale gets (0.1 ln(factor) + 1)^2, the rotary table no extra factor).
_DEEPSEEK_YARN = dict(rope_type="yarn", beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


# What the DeepSeek-V3 configs share with the real model: one shared expert, layer 0 dense,
# renormalised routing weights scaled by 2.5.
_DEEPSEEK = dict(
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3's rope scaling (the 8B's factor 8, the 3.2 models' 32)."""
    return dict(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("qwen2", dict(_TINY, tie_word_embeddings=True)),
    "tiny-llama": ("llama", dict(_TINY, tie_word_embeddings=False)),
    "tiny-qwen3": ("qwen3", dict(_TINY, tie_word_embeddings=True)),
    # As many key/value heads as query heads, 4 of 16 dimensions: splits over 4 tensor-parallel
    # ranks (hidden 64 keeps the 4 and 8 spawned ranks' interpreter runs short).
    "tiny-mha": (
        "qwen3",
        dict(
            _TINY,
            hidden_size=64,
            num_key_value_heads=4,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
    # 8 query and key/value heads of 8 dimensions: splits over 8 tensor-parallel ranks.
    "tiny-mha8": (
        "qwen3",
        dict(
            _TINY,
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=8,
            tie_word_embeddings=True,
        ),
    ),
    # Mixture of experts (_TINY_MOE), the top 4's weights renormalised
    # (enough near-ties at the top-k boundary that stock bf16 routes some tokens differently
    # in training than in the rollout: 5 of 189 in rlk consistency's default run).
    "tiny-qwen3-moe": ("qwen3_moe", dict(_TINY_MOE, norm_topk_prob=True)),
    # Qwen2-MoE (Qwen1.5-MoE's architecture): 16 experts of 32 units, 4 per token with the
    # softmax over all 16 (norm_topk_prob False, as Qwen1.5-MoE-A2.7B), and a shared expert of
    # 64 units scaled by its sigmoid gate; q/k/v biases, every layer sparse.
    "tiny-qwen2-moe": (
        "qwen2_moe",
        dict(_TINY_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False, qkv_bias=True),
    ),
    "qwen2-0.5b": (
        "qwen2",
        dict(
            num_hidden_layers=24,
            hidden_size=896,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            num_hidden_layers=28,
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    "llama3-8b-4layers": (
        "llama",
        dict(
            num_hidden_layers=4,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(8.0),
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-4B's layers (q/k norms, 32/8 heads of 128 over a hidden size of 2560), 4 of its 36.
    "qwen3-4b-4layers": (
        "qwen3",
        dict(
            num_hidden_layers=4,
            hidden_size=2560,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9728,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 per token, renormalised), 4 of its 48.
    "qwen3-30b-a3b-4layers": (
        "qwen3_moe",
        dict(
            num_hidden_layers=4,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3's layers at tiny size: MLA (a q latent of 48, a kv latent of 32, 4 heads of
    # q/k 24 + 8 rope dims, interleaved rope with YaRN scaling, so an mscale in the softmax
    # scale), layer 0 dense, then 16 experts in 4 groups, 2 groups and 4 experts per token,
    # renormalised and scaled by 2.5, and a shared expert. v has q/k's 32 dims: with unequal
    # head sizes stock sdpa on a CPU takes its math path, which at this size is batch-invariant
    # (the stock row of rlk consistency would show 0, telling nothing); rlk's padding of a
    # smaller v (DeepSeek-V3's 128 < 192) is tested in test_deepseek.py.
    "tiny-deepseek-v3": (
        "deepseek_v3",
        dict(
            _DEEPSEEK,
            num_hidden_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=24,
            qk_rope_head_dim=8,
            v_head_dim=32,
            vocab_size=512,
            max_position_embeddings=4096,
            rope_scaling=_DEEPSEEK_YARN | dict(factor=4.0, original_max_position_embeddings=1024),
        ),
    ),
    # DeepSeek-V3's dimensions (hidden 7168, 128 heads, q/kv latents 1536/512, q/k 128 + 64
    # rope, v 128, experts of 2048, YaRN factor 40) in 4 layers: layer 0 dense, layers 1-3 with
    # 64 of its 256 experts (8 groups of 8; the real 4 groups and 8 experts per token) so that
    # its bf16 weights (11.6e9 parameters, 23 GB) leave room on one 80 GB GPU.
    "deepseek-v3-4layers": (
        "deepseek_v3",
        dict(
            _DEEPSEEK,
            num_hidden_layers=4,
            hidden_size=7168,
            num_attention_heads=128,
            num_key_value_heads=128,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=64,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=129280,
            max_position_embeddings=163840,
            rope_scaling=_DEEPSEEK_YARN | dict(factor=40.0, original_max_position_embeddings=4096),
        ),
    ),
    "llama3.2-1b-4layers": (
        "llama",
        dict(
            num_hidden_layers=4,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_llama3_rope(32.0),
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2 layers always carry q/k/v biases.
    "qwen2.5-1.5b-4layers": (
        "qwen2",
        dict(
            num_hidden_layers=4,
            hidden_size=1536,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
}

#: The held-out shapes (see the module docstring).
HELDOUT = ("llama3.2-1b-4layers", "qwen2.5-1.5b-4layers")


def make_config(name: str) -> Any:
    """The transformers config of a built-in name."""
    from transformers import AutoConfig

    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}: built-ins are {', '.join(CONFIGS)}")
    model_type, kw = CONFIGS[name]
    kw = dict(kw)
    rope = dict(rope_type="default", rope_theta=kw.pop("rope_theta"))
    rope.update(kw.pop("rope_scaling", {}))
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.rope_parameters = rope
    return cfg


def load_model(
    name_or_dir: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A built-in config with seeded random weights, or a local checkpoint directory
    (``config.json`` + safetensors; never downloads, and never reads pickled ``.bin`` weights)."""
    from transformers import AutoModelForCausalLM

    if os.path.isdir(name_or_dir):
        model = AutoModelForCausalLM.from_pretrained(
            name_or_dir,
            dtype=dtype,
            local_files_only=True,
            use_safetensors=True,  # a pickled checkpoint (.bin) could run code when loaded
            attn_implementation=attn_implementation,
        ).to(device)
    else:
        cfg = make_config(name_or_dir)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation=attn_implementation
            )
        if cfg.model_type == "deepseek_v3":
            _random_score_bias(model, seed)
    return model.eval()


@torch.no_grad()
def _random_score_bias(model: torch.nn.Module, seed: int) -> None:
    """DeepSeek-V3's routers' ``e_score_correction_bias`` (zeros at init, learned in a trained
    model), seeded random at a trained model's scale, so that the choice differs from the
    weights' order as in a real checkpoint."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.01)
