"""Train with Megatron-core's ``GPTModel`` on rlk ops, with the rollout's bits.

Two pieces:

- **Weights.** :func:`hf_to_megatron` / :func:`megatron_to_hf` convert between a transformers
  Llama / Qwen2 / Qwen3 ``*ForCausalLM`` state dict and the state dict of Megatron-core's
  ``GPTModel`` with the local (non-TransformerEngine) layer spec at tensor-parallel size 1.
  Only views, ``cat`` and ``split``: the round trip is bitwise. Megatron's fused QKV is grouped
  per KV head: for each of the ``num_query_groups`` groups, that group's q heads, then its k
  head, then its v head (weight rows and, for Qwen2, the bias). ``linear_fc1`` is
  ``cat(gate, up)``. :func:`shard_for_tp` cuts the TP=1 state dict into a rank's shard (fc1's
  shard is ``cat(gate_r, up_r)``, as Megatron lays it out).
- **Ops.** :func:`layer_spec` / :func:`block_spec` build a ``TransformerBlock`` spec whose
  modules run on rlk: column/row-parallel linears on :func:`rlk.linear` (TP=1) or on
  :mod:`rlk.parallel`'s tree-ordered linears (``leaves`` set, any power-of-two TP), RMSNorm on
  :func:`rlk.rms_norm` (q/k norm too), SwiGLU on :func:`rlk.silu_and_mul`, rotary on
  :func:`rlk.apply_rotary` with the *transformers* model's cos/sin table (the same chunked table
  as :mod:`rlk.integrations.transformers`, so the rollout's rotary bits), and core attention on
  :func:`rlk.attention` over packed sequences (``PackedSeqParams`` cu_seqlens, ``thd``) or one
  sequence per batch row (``sbhd``). :func:`build_gpt_model` makes such a ``GPTModel`` (or a
  stock one, ``use_rlk=False``) from a transformers config, and :func:`packed_logprobs` is the
  Megatron twin of :func:`rlk.integrations.training.packed_logprobs`.

:func:`init_single_process` (or :func:`init_model_parallel` on an initialised TP group) sets
up Megatron's model-parallel state and RNG tracker for these models and returns the teardown;
:func:`init_distributed` does it for one spawned TP rank (NCCL on ``cuda:<rank>``, gloo on
CPU), and :func:`load_hf_weights` loads a rank's shard (``rank=``, ``world_size=``).

The rlk model is built with ``position_embedding_type="none"``: rotary is applied inside
:class:`RlkSelfAttention` from per-token positions (restarting at each packed sequence), so
Megatron's own ``RotaryEmbedding`` (which is CUDA-only in 0.16 and computes its tables its own
way) is not used. The residual adds stay Megatron's (``bias_dropout_add`` with no bias and no
dropout: ``residual + out`` rounded once, the same bits as the transformers integration's fused
``rms_norm(..., residual=)``).

Versions: written against megatron-core 0.16.1 (Python 3.11) and meant for 0.19.x (Python
3.12). Version-sensitive spots are marked "mcore API".

Example::

    mg = build_gpt_model(hf_model.config, dtype=torch.bfloat16)
    load_hf_weights(mg, hf_model.state_dict(), hf_model.config)
    lps = packed_logprobs(mg, samples)          # == training.packed_logprobs(hf_model, samples)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import rlk
import rlk.parallel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def _import_quietly(name: str) -> Any:
    """Import a Megatron module without its "Transformer Engine and Apex are not installed"
    warnings (the local spec used here needs neither)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        return importlib.import_module(name)


def init_model_parallel(tensor_parallel: int = 1) -> Callable[[], None]:
    """Set up Megatron's model-parallel state (tensor parallelism ``tensor_parallel``, no
    pipeline) and its RNG tracker; returns the teardown function.

    Without an initialised ``torch.distributed`` (one process) it first makes a 1-rank gloo
    group (file rendezvous), which the teardown destroys; with one (the caller's TP workers) it
    uses it and leaves it alone. Dropout is 0 in :func:`megatron_config`, so the tracker is
    Megatron's inference tracker (its fork is a no-op and needs no CUDA RNG).
    """
    import os
    import tempfile

    import torch.distributed as dist

    ps = _import_quietly("megatron.core.parallel_state")
    mrandom = _import_quietly("megatron.core.tensor_parallel.random")
    path = None
    if not dist.is_initialized():
        if tensor_parallel != 1:
            raise ValueError(
                f"tensor_parallel = {tensor_parallel} needs torch.distributed initialised by "
                "the caller (one process per rank)"
            )
        fd, path = tempfile.mkstemp(prefix="rlk-megatron-")
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    def teardown() -> None:
        ps.destroy_model_parallel()
        # mcore API: no public reset; the next initialize_rng_tracker builds a fresh one.
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        if path is not None:
            dist.destroy_process_group()
            with contextlib.suppress(OSError):
                os.unlink(path)

    return teardown


def init_distributed(
    rank: int, world: int, init_file: str, device: str | torch.device = "cpu"
) -> tuple[torch.device, Callable[[], None]]:
    """One rank of a spawned TP group: ``torch.distributed`` (file rendezvous at ``init_file``;
    NCCL on ``cuda:<rank>`` for a CUDA ``device``, gloo on the CPU otherwise) and then
    :func:`init_model_parallel` at TP = ``world``. Returns the rank's device and the teardown
    (Megatron's state, then the process group)."""
    import torch.distributed as dist

    if torch.device(device).type == "cuda":
        if torch.cuda.device_count() < world:
            raise RuntimeError(f"TP = {world} needs {world} GPUs, {torch.cuda.device_count()} seen")
        dev, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        teardown_mp = init_model_parallel(world)
    except BaseException:
        dist.destroy_process_group()
        raise

    def teardown() -> None:
        try:
            teardown_mp()
        finally:
            dist.destroy_process_group()

    return dev, teardown


def init_single_process() -> Callable[[], None]:
    """:func:`init_model_parallel` at TP=1 in this process alone (a 1-rank gloo group unless
    ``torch.distributed`` is already initialised); returns the teardown function."""
    return init_model_parallel(1)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _dims(cfg: Any) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, kv, head_dim


def _check_supported(cfg: Any) -> None:
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"rlk's Megatron integration supports {SUPPORTED_MODEL_TYPES}, "
            f"not model_type={cfg.model_type!r}"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"needs hidden_act='silu', got {cfg.hidden_act!r}")
    if getattr(cfg, "mlp_bias", False):
        raise NotImplementedError("MLP biases are not supported")
    if cfg.model_type == "llama" and getattr(cfg, "attention_bias", False):
        # Llama's attention_bias also puts a bias on o_proj, which the local spec would need
        # add_bias_linear for (and then on every linear).
        raise NotImplementedError("Llama attention_bias=True is not supported")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise NotImplementedError("sliding-window layers are not supported")


def _qkv_bias(cfg: Any) -> bool:
    return cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))


def _rope(cfg: Any) -> dict[str, Any]:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if not rope:  # older transformers configs
        rope = dict(getattr(cfg, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return rope


def megatron_config(hf_config: Any, *, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A ``TransformerConfig`` with the transformers model's sizes (no dropout, no fusions,
    CPU initialisation, ``softmax_scale = head_dim ** -0.5`` as in transformers)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_supported(hf_config)
    heads, kv, head_dim = _dims(hf_config)
    kw: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=kv,
        kv_channels=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=_qkv_bias(hf_config),
        qk_layernorm=hf_config.model_type == "qwen3",
        softmax_scale=head_dim**-0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


# --------------------------------------------------------------------------------------------
# Weight conversion (TP = 1 layout)
# --------------------------------------------------------------------------------------------


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


def _layer_map(i: int, cfg: Any) -> list[tuple[str, str]]:
    """(transformers key, Megatron key) of the one-to-one tensors of layer ``i``."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [
        (h + "input_layernorm.weight", m + "input_layernorm.weight"),
        (h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight"),
        (h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight"),
        (h + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight"),
    ]
    if cfg.model_type == "qwen3":
        pairs += [
            (h + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight"),
            (h + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight"),
        ]
    return pairs


def _tied(cfg: Any) -> bool:
    return bool(getattr(cfg, "tie_word_embeddings", False))


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
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(p + "gate_proj.weight"), take(p + "up_proj.weight")]
        )
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
    for i in range(config.num_hidden_layers):
        for hk, mk in _layer_map(i, config):
            out[hk] = take(mk)
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.weight"), config)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if _qkv_bias(config):
            q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.bias"), config)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        gate, up = take(m + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[f"model.layers.{i}.mlp.gate_proj.weight"] = gate
        out[f"model.layers.{i}.mlp.up_proj.weight"] = up
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


# --------------------------------------------------------------------------------------------
# rlk modules for Megatron's spec
# --------------------------------------------------------------------------------------------


def _tp_world(module: nn.Module) -> tuple[Any, int]:
    group = getattr(module, "tp_group", None)  # mcore API: an attribute since 0.13
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group, torch.distributed.get_world_size(group)


def _column_parallel_base():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear


def _row_parallel_base():
    from megatron.core.tensor_parallel import RowParallelLinear

    return RowParallelLinear


def _make_linears():
    """The rlk linear classes (subclasses of Megatron's, so checkpoints and sharded state dicts
    see the same parameters); built lazily so that importing this module needs no Megatron."""
    col_base, row_base = _column_parallel_base(), _row_parallel_base()

    class RlkColumnParallelLinear(col_base):
        """``ColumnParallelLinear`` on rlk: :func:`rlk.linear` at TP=1 without ``rlk_leaves``;
        :func:`rlk.parallel.column_parallel_linear` otherwise (the forward bits are those of
        ``rlk.linear``'s N-slice; dX reduces N by the ``rlk_leaves`` tree)."""

        def __init__(self, *args: Any, rlk_leaves: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rlk_leaves = rlk_leaves

        def forward(self, input_, weight=None, runtime_gather_output=None):
            if self.sequence_parallel:
                raise NotImplementedError("rlk ColumnParallelLinear: no sequence parallelism")
            w = self.weight if weight is None else weight
            bias = None if self.skip_bias_add else self.bias
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            group, world = _tp_world(self)
            x = input_.contiguous()
            if self.rlk_leaves is None:
                if world != 1:
                    raise ValueError("tensor parallelism > 1 needs rlk_leaves (see layer_spec)")
                y = rlk.linear(x, w, bias)
            else:
                y = rlk.parallel.column_parallel_linear(
                    x, w, bias, leaves=self.rlk_leaves, gather_output=bool(gather), group=group
                )
            return y, (self.bias if self.skip_bias_add else None)

    class RlkRowParallelLinear(row_base):
        """``RowParallelLinear`` on rlk: :func:`rlk.linear` at TP=1 without ``rlk_leaves``;
        :func:`rlk.parallel.row_parallel_linear` otherwise (K reduced by the fixed
        ``rlk_leaves`` tree whatever the TP size: the bits of ``rlk.parallel.tree_linear``)."""

        def __init__(self, *args: Any, rlk_leaves: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rlk_leaves = rlk_leaves

        def forward(self, input_):
            if self.sequence_parallel:
                raise NotImplementedError("rlk RowParallelLinear: no sequence parallelism")
            if not self.input_is_parallel:
                raise NotImplementedError("rlk RowParallelLinear needs input_is_parallel=True")
            bias = None if self.skip_bias_add else self.bias
            group, world = _tp_world(self)
            x = input_.contiguous()
            if self.rlk_leaves is None:
                if world != 1:
                    raise ValueError("tensor parallelism > 1 needs rlk_leaves (see layer_spec)")
                y = rlk.linear(x, self.weight, bias)
            else:
                y = rlk.parallel.row_parallel_linear(
                    x, self.weight, bias, leaves=self.rlk_leaves, group=group
                )
            return y, (self.bias if self.skip_bias_add else None)

    return RlkColumnParallelLinear, RlkRowParallelLinear


class RlkRMSNorm(nn.Module):
    """RMSNorm on :func:`rlk.rms_norm`; the constructor takes Megatron's norm arguments."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__()
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError("zero-centred gamma is not supported")
        self.eps = eps
        device = "cpu" if getattr(config, "use_cpu_initialization", False) else None
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rlk.rms_norm(x.contiguous(), self.weight, self.eps)


class RlkCoreAttention(nn.Module):
    """Causal core attention on :func:`rlk.attention`, in Megatron's layouts.

    ``query [S, B, Hq, D]``, ``key``/``value [S, B, Hk, D]`` (one sequence per batch row) or,
    with ``packed_seq_params``, ``[T, H, D]`` packed sequences (``cu_seqlens_q/kv``). Returns
    ``[S, B, Hq * D]`` (or ``[T, Hq * D]``).
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        if getattr(config, "attention_dropout", 0.0):
            raise NotImplementedError("rlk attention has no dropout")
        scale = kwargs.get("softmax_scale") or config.softmax_scale
        self.scale = scale if scale is not None else config.kv_channels**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("rlk attention takes no attention_bias")
        if packed_seq_params is not None:
            cu_q = packed_seq_params.cu_seqlens_q.to(torch.int32)
            cu_k = packed_seq_params.cu_seqlens_kv.to(torch.int32)
            out = rlk.attention(
                query.contiguous(), key.contiguous(), value.contiguous(), cu_q, cu_k,
                causal=True, scale=self.scale,
            )  # fmt: skip
            return out.reshape(out.shape[0], -1)
        s, b, hq, d = query.shape

        def rows(t: torch.Tensor) -> torch.Tensor:  # [S, B, H, D] -> [B * S, H, D]
            return t.transpose(0, 1).reshape(b * t.shape[0], t.shape[2], d)

        cu_q = torch.arange(b + 1, dtype=torch.int32, device=query.device) * s
        cu_k = torch.arange(b + 1, dtype=torch.int32, device=query.device) * key.shape[0]
        out = rlk.attention(rows(query), rows(key), rows(value), cu_q, cu_k, scale=self.scale)
        return out.reshape(b, s, hq * d).transpose(0, 1).contiguous()


def _positions(packed_seq_params: Any, s: int, b: int, device: torch.device) -> torch.Tensor:
    """Per-token positions in the flattened token order of the attention's tensors."""
    if packed_seq_params is not None:
        cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        start = torch.repeat_interleave(cu[:-1], lengths)
        return torch.arange(int(cu[-1]), device=device) - start
    return torch.arange(s, device=device).repeat_interleave(b)  # [S, B] order


def _make_self_attention():
    from megatron.core.transformer.attention import SelfAttention

    class RlkSelfAttention(SelfAttention):
        """Megatron's ``SelfAttention`` with rotary on :func:`rlk.apply_rotary` (cos/sin from
        ``rlk_rotary``, positions restarting per packed sequence) and rlk core attention.
        Megatron's own ``rotary_pos_emb`` argument is ignored (the model has none)."""

        def __init__(self, *args: Any, rlk_rotary: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if rlk_rotary is None:
                raise ValueError("RlkSelfAttention needs rlk_rotary (see rotary_table)")
            if getattr(self.config, "attention_output_gate", False):
                raise NotImplementedError("gated attention output is not supported")
            self.rlk_rotary = rlk_rotary

        def forward(
            self,
            hidden_states: torch.Tensor,
            attention_mask: Any = None,
            key_value_states: Any = None,
            inference_context: Any = None,
            rotary_pos_emb: Any = None,
            *args: Any,
            packed_seq_params: Any = None,
            **kwargs: Any,
        ):
            if inference_context is not None or kwargs.get("inference_params") is not None:
                raise NotImplementedError("rlk SelfAttention: no Megatron inference context")
            if key_value_states is not None:
                raise NotImplementedError("rlk SelfAttention: self-attention only")
            # mcore API: positional (hidden_states, key_value_states) works on 0.16 and 0.19.
            q, k, v = self.get_query_key_value_tensors(hidden_states, None)
            s, b = hidden_states.shape[:2]
            if packed_seq_params is not None:
                if b != 1:
                    raise ValueError(f"packed sequences take one [T, 1, H] row, got batch {b}")
                q, k, v = q[:, 0], k[:, 0], v[:, 0]
            d = q.shape[-1]
            cos, sin = self.rlk_rotary.gather(
                _positions(packed_seq_params, s, b, hidden_states.device)
            )
            shape_q, shape_k = q.shape, k.shape
            q = rlk.apply_rotary(q.reshape(-1, shape_q[-2], d).contiguous(), cos, sin)
            k = rlk.apply_rotary(k.reshape(-1, shape_k[-2], d).contiguous(), cos, sin)
            out = self.core_attention(
                q.reshape(shape_q),
                k.reshape(shape_k),
                v,
                attention_mask,
                packed_seq_params=packed_seq_params,
            )
            if packed_seq_params is not None:
                out = out.unsqueeze(1)  # [T, 1, Hq * D]
            return self.linear_proj(out)

    return RlkSelfAttention


def _make_mlp():
    from megatron.core.transformer.mlp import MLP

    class RlkMLP(MLP):
        """Megatron's ``MLP`` with the gated activation on :func:`rlk.silu_and_mul` (fc1's
        output is ``[gate | up]`` on each rank, Megatron's own layout).

        mcore API: see :func:`_mlp_spec` for how the layer builds it (0.16 vs 0.19)."""

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
            h, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                raise NotImplementedError("rlk MLP: no fc1 bias")
            out, out_bias = self.linear_fc2(rlk.silu_and_mul(h))
            return out, out_bias

    return RlkMLP


def _mlp_spec(mlp_cls: type, submodules: Any) -> Any:
    """The ``mlp`` entry of a ``TransformerLayerSubmodules`` for an ``MLP`` subclass.

    mcore API: 0.16 builds a ``ModuleSpec`` (passing ``tp_group`` only to the exact ``MLP``
    class, so the subclass takes the default TP group); 0.19 calls the entry with
    ``pg_collection=`` and wants ``functools.partial(cls.as_mlp_submodule, submodules=...)``
    (a ``ModuleSpec`` of a subclass would get ``pg_collection`` in ``MLP.__init__``)."""
    if hasattr(mlp_cls, "as_mlp_submodule"):
        import functools

        return functools.partial(mlp_cls.as_mlp_submodule, submodules=submodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=mlp_cls, submodules=submodules)


def rotary_table(hf_config: Any) -> Any:
    """The fp32 cos/sin table of the transformers model, computed by transformers' own rotary
    module in the transformers integration's fixed chunks: the rollout's rotary bits."""
    from rlk.integrations.transformers import _RotaryTable

    t = hf_config.model_type
    mod = importlib.import_module(f"transformers.models.{t}.modeling_{t}")
    rotary = getattr(mod, f"{_CLASS_PREFIX[t]}RotaryEmbedding")(config=hf_config)
    return _RotaryTable(rotary, rotary.forward)


def layer_spec(rotary: Any, *, qk_layernorm: bool = False, leaves: int | None = None):
    """A ``TransformerLayer`` spec on rlk ops (see the module docstring).

    ``rotary``: :func:`rotary_table`'s object. ``leaves``: None for TP=1 on :func:`rlk.linear`;
    a power of two for :mod:`rlk.parallel`'s tree-ordered linears, whose bits do not depend on
    the TP size (the rollout must then run o_proj/down_proj as ``tree_linear`` with the same
    ``leaves``).
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    col_cls, row_cls = _make_linears()
    col = ModuleSpec(module=col_cls, params={"rlk_leaves": leaves})
    row = ModuleSpec(module=row_cls, params={"rlk_leaves": leaves})
    qk_norm = RlkRMSNorm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RlkRMSNorm,
            self_attention=ModuleSpec(
                module=_make_self_attention(),
                params={"attn_mask_type": AttnMaskType.causal, "rlk_rotary": rotary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=col,
                    core_attention=RlkCoreAttention,
                    linear_proj=row,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RlkRMSNorm,
            mlp=_mlp_spec(_make_mlp(), MLPSubmodules(linear_fc1=col, linear_fc2=row)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(config: Any, rotary: Any, *, leaves: int | None = None):
    """A ``TransformerBlock`` spec: :func:`layer_spec` for every layer and an rlk final norm
    (``GPTModel`` would otherwise build the final norm from Megatron's global norm class)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    spec = layer_spec(rotary, qk_layernorm=config.qk_layernorm, leaves=leaves)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[spec] * config.num_layers, layer_norm=RlkRMSNorm
        ),
    )


def build_gpt_model(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    use_rlk: bool = True,
    leaves: int | None = None,
    **config_overrides: Any,
):
    """A Megatron-core ``GPTModel`` with the transformers config's architecture.

    ``use_rlk=True``: :func:`block_spec` (rotary inside the attention, so
    ``position_embedding_type="none"``). ``use_rlk=False``: Megatron's stock local spec with its
    own RoPE (default rope type only; llama3 scaling maps to ``rope_scaling``), for reference.
    Needs Megatron's model-parallel state initialised.
    """
    from megatron.core.models.gpt import GPTModel

    config = megatron_config(hf_config, dtype=dtype, **config_overrides)
    rope = _rope(hf_config)
    common = dict(
        config=config,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        share_embeddings_and_output_weights=_tied(hf_config),
    )
    if use_rlk:
        spec = block_spec(config, rotary_table(hf_config), leaves=leaves)
        model = GPTModel(transformer_layer_spec=spec, position_embedding_type="none", **common)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        kind = rope.get("rope_type", "default")
        if kind not in ("default", "llama3"):
            raise NotImplementedError(f"stock Megatron RoPE for rope_type {kind!r}")
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        model = GPTModel(
            transformer_layer_spec=spec,
            position_embedding_type="rope",
            rotary_base=rope.get("rope_theta", 10000.0),
            rope_scaling=kind == "llama3",
            rope_scaling_factor=rope.get("factor", 8.0),
            **common,
        )
        # Megatron's local norms ignore params_dtype (training wraps the model in
        # Float16Module, which casts it whole): cast here so that every weight has ``dtype``.
        model.to(dtype)
    model._rlk_hf_config = hf_config
    return model


def load_hf_weights(
    model: nn.Module,
    hf_state_dict: dict[str, torch.Tensor],
    hf_config: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
):
    """Copy a transformers state dict into a ``GPTModel`` (bitwise; dtypes must match): the
    whole model at TP=1, or TP rank ``rank``'s :func:`shard_for_tp` shard of ``world_size``."""
    sd = hf_to_megatron(hf_state_dict, hf_config)
    if world_size != 1:
        sd = shard_for_tp(sd, hf_config, rank=rank, world_size=world_size)
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


# --------------------------------------------------------------------------------------------
# Training recompute
# --------------------------------------------------------------------------------------------


def packed_seq_params(lengths: list[int], device: torch.device):
    """``PackedSeqParams`` (``thd``) of causal self-attention over packed sequences."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    longest = max(lengths, default=0)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def hidden_states(model: nn.Module, input_ids: torch.Tensor, params: Any = None) -> torch.Tensor:
    """Final (normed) hidden states ``[S, B, H]`` of an rlk ``GPTModel`` for ``input_ids
    [B, S]`` (``params``: packed sequences in one ``[1, T]`` row)."""
    emb = model.embedding(input_ids=input_ids, position_ids=None)
    return model.decoder(hidden_states=emb, attention_mask=None, packed_seq_params=params)


def _local_output_weight(model: nn.Module) -> torch.Tensor:
    """This rank's rows of the output weight (tied or not)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def output_weight(model: nn.Module) -> torch.Tensor:
    """The full ``[V, H]`` output weight (tied or not), gathered over the TP group if sharded."""
    w = _local_output_weight(model)
    from megatron.core import parallel_state

    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return w
    # Vocab-parallel head: gather the vocabulary shards (differentiable), then one
    # linear_logprobs over the whole vocabulary gives the one-device bits on every rank.
    import torch.distributed.nn.functional as dist_fn

    return torch.cat(dist_fn.all_gather(w, group=parallel_state.get_tensor_model_parallel_group()))


def packed_logprobs(
    model: nn.Module,
    samples: list[Any],
    *,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Megatron twin of :func:`rlk.integrations.training.packed_logprobs`: one packed ``thd``
    forward of the samples (``prompt + response`` each), :func:`rlk.linear_logprobs` on the
    rows that predict the response tokens. One float32 ``[len(response)]`` per sample.

    At TP > 1 the vocabulary-parallel head goes to
    :func:`rlk.parallel.vocab_parallel_linear_logprobs` (same bits, no gather of the weight;
    :func:`output_weight`'s gather if the vocabulary does not split into its leaves)."""
    from rlk.integrations.training import _pack

    device = next(model.parameters()).device
    ids, _, rows, targets = _pack(samples, device)
    params = packed_seq_params([len(s.tokens) for s in samples], device)
    hidden = hidden_states(model, ids, params)[:, 0].index_select(0, rows)
    kw = dict(temperature=temperature if temperature > 0 else 1.0, logits_dtype=logits_dtype)
    local = _local_output_weight(model)
    from megatron.core import parallel_state

    world = parallel_state.get_tensor_model_parallel_world_size()
    if world > 1 and _vocab_splits(local.shape[0] * world, world):
        # This rank's vocabulary rows; one-device bits without gathering the weight.
        group = parallel_state.get_tensor_model_parallel_group()
        lp = rlk.parallel.vocab_parallel_linear_logprobs(hidden, local, targets, group=group, **kw)
    else:
        lp = rlk.linear_logprobs(hidden, output_weight(model), targets, **kw)
    return list(lp.split([len(s.response) for s in samples]))


def _vocab_splits(vocab: int, world: int) -> bool:
    """Whether :func:`rlk.parallel.vocab_parallel_linear_logprobs` takes this vocabulary split
    (a multiple of the vocabulary leaves, over a power-of-two group dividing them)."""
    from rlk_triton.logprobs import VOCAB_LEAVES

    return vocab % VOCAB_LEAVES == 0 and VOCAB_LEAVES % world == 0 and not world & (world - 1)


__all__ = [
    "RlkCoreAttention",
    "RlkRMSNorm",
    "block_spec",
    "build_gpt_model",
    "hf_to_megatron",
    "hidden_states",
    "init_distributed",
    "init_model_parallel",
    "init_single_process",
    "layer_spec",
    "load_hf_weights",
    "megatron_config",
    "megatron_to_hf",
    "output_weight",
    "packed_logprobs",
    "packed_seq_params",
    "rotary_table",
    "shard_for_tp",
]
