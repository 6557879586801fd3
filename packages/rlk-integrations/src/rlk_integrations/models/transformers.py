"""Run a transformers Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 causal LM on rlk
ops.

:func:`patch_model` picks the patch of the model's architecture (:func:`patch_llama`,
:func:`patch_qwen2`, :func:`patch_qwen3`, :func:`patch_qwen3_moe`, :func:`patch_qwen2_moe`,
:func:`patch_deepseek_v3`), which replaces ``forward``
on the model's own instances of the module classes that :mod:`rlk_integrations.models.architectures`
names for it (no new classes, no weight copies, the state dict is unchanged), so that:

- every ``nn.Linear`` of the decoder and ``lm_head`` calls :func:`rlk.linear`;
- every ``*RMSNorm`` (input, post-attention, final, Qwen3's per-head q/k norm) calls
  :func:`rlk.rms_norm`; the post-attention norm is fused with the residual add before it
  (``*DecoderLayer``);
- the ``*MLP`` is ``down(silu_and_mul(gate(x), up(x)))`` with :func:`rlk.silu_and_mul`;
- Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``: the router's logits by :func:`rlk.linear`, the experts
  chosen by :func:`rlk.moe_route` (ties to the lower expert index) and run by
  :func:`rlk.moe_experts`, so that a token's experts and their output are the same bits in any
  batch (the rollout and the training recompute choose the same experts); Qwen2-MoE's
  ``Qwen2MoeSparseMoeBlock`` the same, plus its shared expert (an ``*MLP``) scaled by the
  sigmoid of its gate's :func:`rlk.linear` (:func:`rlk_integrations.models.moe.shared_expert`);
  DeepSeek-V3's ``DeepseekV3MoE`` routes by :func:`rlk.moe_route_grouped` (the router's logits
  by :func:`rlk.linear` in fp32, as transformers computes them) and adds its shared experts
  (an ``*MLP``);
- DeepSeek-V3's ``DeepseekV3Attention`` (multi-head latent attention): q, k and v by
  :func:`rlk_integrations.models.mla.mla_qkv` (v zero-padded to q's and k's head size), then
  the same attention as every model, its first ``v_head_dim`` columns to ``o_proj``;
- ``*RotaryEmbedding``: cos/sin come from :class:`rlk_integrations.models.rotary.RotaryTable`, built
  in fixed chunks of positions (so a position's values never depend on how many positions were
  asked for), and ``*Attention`` applies them with :func:`rlk.apply_rotary`;
- attention is the function registered as ``"rlk"`` in transformers' ``AttentionInterface``
  (``model.config._attn_implementation = "rlk"``; :mod:`rlk_integrations.models.attention`). It
  turns transformers' padded ``[B, H, S, D]`` tensors into :func:`rlk.attention`'s packed varlen
  form, dropping pad tokens, for: padded batches (a 2-D ``attention_mask``, left or right padding),
  packed sequences (``position_ids`` that restart, or ``cu_seq_lens_q``/``cu_seq_lens_k`` kwargs)
  and the dynamic / static KV caches (the cache's update returns all the keys; the new queries are a
  sequence's last tokens, rlk.attention's bottom-right convention).
- a :class:`rlk_integrations.engine.paged.PagedKVCache` passed as ``past_key_values`` takes the
  attention over instead: one packed ``[1, T]`` row, K/V written into its pages,
  :func:`rlk.paged_attention` (the continuous-batching rollout drives it). On that path a
  layer whose projections :func:`rlk_integrations.engine.fused.fuse_projections` has fused runs
  q/k/v and gate/up as one :func:`rlk.linear` each (the same bits).

The residual add at the end of a decoder layer stays a plain elementwise ``torch`` add (it is
batch-invariant by nature). Embedding lookups stay ``nn.Embedding`` (a gather).

:func:`unpatch_model` restores the original forwards and attention implementation.

Example::

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    patch_model(model)
    h = model.model(input_ids, position_ids=pos).last_hidden_state   # [1, T, H], packed
    lp = rlk.linear_logprobs(h[0, :-1], model.lm_head.weight, input_ids[0, 1:])
"""

from __future__ import annotations

import inspect
import re
import types
import warnings
from typing import Any

import torch
from torch import nn

import rlk
import rlk.parallel
from rlk_integrations.models.architectures import (
    DEEPSEEK_V3,
    LLAMA,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    SUPPORTED_MODEL_TYPES,  # noqa: F401  (public: the model types patch_model takes)
    Architecture,
    architecture,
    decoder,
)
from rlk_integrations.models.attention import (  # noqa: F401  (public: the attention function)
    ATTN_NAME,
    _register_attention,
    rlk_attention_forward,
    rlk_attention_mask,
)
from rlk_integrations.models.mla import check_mla, mla_qkv
from rlk_integrations.models.moe import check_moe, moe_forward
from rlk_integrations.models.rotary import RotaryTable

# The linears that are row-parallel under tensor parallelism (K split over the ranks): the ones
# patch_model(leaves=...) runs on rlk.parallel.tree_linear.
ROW_PARALLEL_LINEARS = ("o_proj", "down_proj")
#: The oldest and newest transformers releases (major.minor) this integration is tested with:
#: ``nox -s tests`` (its stage 3) runs the integration tests and ``rlk consistency`` on both.
#: ``rlk[transformers]`` declares the same range.
TESTED_TRANSFORMERS = ((5, 17), (5, 24))


# --------------------------------------------------------------------------------------------
# Module forwards (bound to the model's own instances)
# --------------------------------------------------------------------------------------------


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rlk.linear(x.contiguous(), self.weight, self.bias)


def _tree_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return rlk.parallel.tree_linear(x.contiguous(), self.weight, self.bias, leaves=self._rlk_leaves)


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Qwen3's q/k norm on a fused q/k/v product gets column views [..., heads, head_dim]:
    # rlk.rms_norm reads those in place; any other layout is copied first.
    heads_view = x.dim() >= 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    if not (heads_view or x.is_contiguous()):
        x = x.contiguous()
    return rlk.rms_norm(x, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # cat(gate(x), up(x)) == linear(x, cat(Wg, Wu)) bit for bit: each output column is its own
    # K-reduction, so concatenating activations is the same math as a fused gate_up weight.
    return self.down_proj(rlk.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    """Returns fp32 ``(cos, sin)`` ``[B, S, D]`` for ``position_ids [B, S]``."""
    return self._rlk_table.gather(position_ids)


def rotary_rows(
    position_embeddings: tuple[torch.Tensor, torch.Tensor], b: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The patched rotary module's fp32 ``(cos, sin)`` ``[B, S, D]`` as ``[B * S, D]`` rows,
    :func:`rlk.apply_rotary`'s form; a table that is not rlk's fp32 one is an error."""
    cos, sin = position_embeddings
    cos = cos.expand(b, s, -1).reshape(b * s, -1).contiguous()
    sin = sin.expand(b, s, -1).reshape(b * s, -1).contiguous()
    if cos.dtype != torch.float32:
        raise RuntimeError("rotary tables are not rlk's: patch the whole model with patch_model")
    return cos, sin


def attend(
    self: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """The attention of the module ``self`` over its rotated ``q [B, S, Hq, D]`` and ``k``/``v
    [B, S, Hk, D]`` -> ``[B, S, Hq, D]``: a paged KV cache's :meth:`attend` (one packed row, K/V
    into its pages, :func:`rlk.paged_attention`), else the cache's update (if any) and the
    ``"rlk"`` attention function (:func:`rlk.attention`) at ``self.scaling``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    b, s = q.shape[:2]
    if getattr(past_key_values, "rlk_paged", False):
        # rlk_integrations.engine.paged: one packed row, K/V into pages, rlk.paged_attention.
        if b != 1:
            raise ValueError(f"the paged KV cache takes one packed row, got a batch of {b}")
        out = past_key_values.attend(self.layer_idx, q[0], k[0], v[0], self.scaling)
        return out.view(b, s, *out.shape[1:])
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    out, _ = attn(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),
        **kwargs,
    )
    return out


def _attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``hidden_states [B, S, H]`` -> ``([B, S, H], None)``; q/k norm (Qwen3) and rotary on rlk.

    The KV cache arrives as ``past_key_values`` (transformers < 5.24) or ``cache`` (>= 5.24)."""
    past_key_values = _take_cache(past_key_values, kwargs)

    b, s, _ = hidden_states.shape
    hidden_shape = (b, s, -1, self.head_dim)
    if _fused_step(past_key_values):  # the cache runs the projections (one product if fused)
        q, k, v = past_key_values.qkv(self, hidden_states)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over each head
        q = self.q_norm(q)
        k = self.k_norm(k)
    cos, sin = rotary_rows(position_embeddings, b, s)
    q, k = rlk.apply_rotary(
        q.reshape(b * s, -1, self.head_dim), cos, sin, k=k.reshape(b * s, -1, self.head_dim)
    )
    q, k = q.view(hidden_shape), k.view(hidden_shape)
    out = attend(self, q, k, v, attention_mask, past_key_values, **kwargs)
    return self.o_proj(out.reshape(b, s, -1).contiguous()), None


def _mla_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """DeepSeek-V3's multi-head latent attention: ``hidden_states [B, S, H]`` -> ``([B, S, H],
    None)``; q, k and v by :func:`rlk_integrations.models.mla.mla_qkv`, then :func:`attend`
    (any cache, the paged one included), the first ``v_head_dim`` columns to ``o_proj``."""
    past_key_values = _take_cache(past_key_values, kwargs)
    b, s, _ = hidden_states.shape
    q, k, v = mla_qkv(self, hidden_states, *rotary_rows(position_embeddings, b, s))
    out = attend(self, q, k, v, attention_mask, past_key_values, **kwargs)
    return self.o_proj(out[..., : self.v_head_dim].reshape(b, s, -1)), None


def _decoder_layer_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The HF pre-norm decoder layer with the post-attention RMSNorm fused with its residual add."""
    past_key_values = _take_cache(past_key_values, kwargs)
    out, residual = layer_step(
        self,
        hidden_states,
        None,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    return residual + out


def _fused_step(cache: Any) -> bool:
    """Whether a step on ``cache`` runs its projections through the cache: rlk's paged cache
    says so (``PagedKVCache.fuse_projections``) and then provides ``cache.qkv(attn, x)`` and
    ``cache.mlp(mlp, x)`` (one product per group where the engine fused the weights, the same
    bits). The fused weight buffers are the engine's: the patch never imports it. Other
    caches, vLLM's paged one included, lack the flag."""
    return getattr(cache, "fuse_projections", False)


def layer_step(
    layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, **attn_kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One patched pre-norm decoder layer, its closing residual add left to the caller: returns
    ``(mlp_out, residual)``, the layer's output being ``residual + mlp_out``.

    ``residual`` None: ``h`` is the layer's input. Otherwise ``h`` is the previous layer's
    ``mlp_out`` and its add to ``residual`` is fused into this layer's input RMSNorm
    (``rms_norm(h, residual=r)`` rounds ``h + r`` once and normalises it: the bits of the add
    then the norm, one kernel fewer). ``attn_kwargs`` go to the attention module."""
    norm = layer.input_layernorm
    if residual is None:
        x, residual = norm(h), h
    else:
        x, residual = rlk.rms_norm(h, norm.weight, norm.variance_epsilon, residual=residual)
    a, _ = layer.self_attn(hidden_states=x, **attn_kwargs)
    norm = layer.post_attention_layernorm
    x, residual = rlk.rms_norm(a, norm.weight, norm.variance_epsilon, residual=residual)
    if _fused_step(attn_kwargs.get("past_key_values")):
        return attn_kwargs["past_key_values"].mlp(layer.mlp, x), residual
    return layer.mlp(x), residual


# --------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------


def _check_supported(model: nn.Module) -> Architecture:
    """The model's :class:`~rlk_integrations.models.architectures.Architecture`; raises
    ``NotImplementedError`` for an architecture or a config option rlk cannot run."""
    cfg = model.config
    arch = architecture(cfg)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"rlk MLP needs hidden_act='silu', got {cfg.hidden_act!r}")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        raise NotImplementedError("pretraining_tp > 1 is not supported")
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope_type {rope!r} depends on the sequence length")
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise NotImplementedError("sliding-window layers are not supported by rlk attention")
    if arch.mla:
        check_mla(cfg)
    return arch


def _take_cache(past_key_values: Any, kwargs: dict) -> Any:
    """The KV cache of a layer or attention call, under either of its names.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` inside the models (the old name
    is deprecated). A cache passed under a name the patched forward did not read would be
    silently dropped (the decode steps would attend to the new token alone), so both are read
    here, and both given at once is an error."""
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("got two KV caches: past_key_values and cache")
    return past_key_values if past_key_values is not None else cache


def cache_kwarg(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``"cache"`` on
    transformers >= 5.24, ``"past_key_values"`` before."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


_version_warned = False


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


def _check_transformers(model: nn.Module, arch: Architecture) -> None:
    """Warn (once) on a transformers release outside :data:`TESTED_TRANSFORMERS`; raise where
    the model's forwards do not follow the conventions the patched forwards rely on.

    A convention that changed silently (as ``past_key_values`` -> ``cache`` did in 5.24) would
    otherwise give wrong log-probabilities without an error, so what can be checked from the
    code's signatures is checked here, before anything is patched.
    """
    global _version_warned
    (lo, hi), found = TESTED_TRANSFORMERS, _installed_transformers()
    m = re.match(r"(\d+)\.(\d+)", found)
    if m and not (lo <= (int(m[1]), int(m[2])) <= hi) and not _version_warned:
        _version_warned = True
        warnings.warn(
            f"rlk's transformers integration is tested with transformers "
            f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, this is {found}: run `rlk consistency` "
            "(both rollout modes must give 0) before trusting its log-probabilities",
            RuntimeWarning,
            stacklevel=3,
        )
    problems = []
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import (  # noqa: F401
            ALL_MASK_ATTENTION_FUNCTIONS,
            flash_attention_mask,
        )
    except ImportError as e:
        problems.append(f"the attention registry is not where rlk registers ({e})")
    classes = arch.classes()
    needs = {
        classes["decoder_layer"]: ("hidden_states", "attention_mask", "position_embeddings"),
        classes["attention"]: ("hidden_states", "position_embeddings", "attention_mask"),
    }
    seen = {type(model)}
    for module in model.modules():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        for base, names in needs.items():
            if not isinstance(module, base):
                continue
            params = inspect.signature(cls.forward).parameters
            missing = [n for n in names if n not in params]
            if "past_key_values" not in params and "cache" not in params:
                missing.append("past_key_values or cache")
            if missing:
                problems.append(f"{cls.__name__}.forward takes no {', '.join(missing)}")
    params = inspect.signature(type(model).forward).parameters
    if "past_key_values" not in params and "cache" not in params:
        problems.append(f"{type(model).__name__}.forward takes no past_key_values or cache")
    if problems:
        raise RuntimeError(
            f"transformers {found} changed conventions rlk's patched forwards rely on "
            f"(tested: {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}): " + "; ".join(problems)
        )


#: The patched forward of each role of an architecture (see
#: :data:`rlk_integrations.models.architectures.ROLES`).
FORWARDS = {
    "rotary": _rotary_forward,
    "decoder_layer": _decoder_layer_forward,
    "rms_norm": _rms_norm_forward,
    "attention": _attention_forward,
    "mlp": _mlp_forward,
}


def _plan(model: nn.Module, arch: Architecture, leaves: int | None) -> list[tuple[nn.Module, Any]]:
    """(module, forward) for every module ``patch_model`` replaces; raises before anything is
    patched if the model holds a module of the architecture that rlk does not replace."""
    from transformers import PreTrainedModel

    classes = arch.classes()
    # The MoE block runs its router and experts itself (their forwards are never called).
    block, *run_by_block = arch.moe_classes() or (None,)
    plan, unknown = [], []
    for path, module in model.named_modules():
        role = next((r for r, cls in classes.items() if isinstance(module, cls)), None)
        if block is not None and isinstance(module, block):
            plan.append((module, moe_forward))
        elif run_by_block and isinstance(module, tuple(run_by_block)):
            continue
        elif isinstance(module, nn.Linear) and leaves and path.endswith(ROW_PARALLEL_LINEARS):
            if module.in_features % leaves:
                raise ValueError(f"leaves = {leaves} must divide {path}'s K = {module.in_features}")
            plan.append((module, _tree_linear_forward))
        elif isinstance(module, nn.Linear):
            plan.append((module, _linear_forward))
        elif role == "attention" and arch.mla:
            plan.append((module, _mla_forward))
        elif role is not None:
            plan.append((module, FORWARDS[role]))
        elif type(module).__module__ == arch.modeling and not isinstance(module, PreTrainedModel):
            unknown.append(f"{path} ({type(module).__name__})")
    if unknown:
        replaced = ", ".join(cls.__name__ for cls in (*classes.values(), *arch.moe_classes()))
        raise NotImplementedError(
            f"rlk's {arch.model_type} patch replaces {replaced} and nn.Linear; this model also "
            f"holds {', '.join(unknown[:5])}, which it would leave stock"
        )
    return plan


def _patch(model: nn.Module, arch: Architecture, leaves: int | None) -> nn.Module:
    """Replace the forwards of ``model``'s modules of ``arch`` (see :func:`patch_model`)."""
    if getattr(model, "_rlk_patched", None) is not None:
        if getattr(model, "_rlk_leaves", None) != leaves:
            raise ValueError(
                f"model already patched with leaves={model._rlk_leaves}; unpatch_model first"
            )
        return model
    if _check_supported(model) is not arch:
        raise ValueError(
            f"this {arch.model_type} patch got a model_type={model.config.model_type!r} model: "
            "use patch_model, which picks the patch of the model's architecture"
        )
    _check_transformers(model, arch)
    check_moe(model, arch, leaves)
    if leaves is not None:
        leaves = rlk.parallel.check_leaves(leaves)
    plan = _plan(model, arch, leaves)
    _register_attention()
    for module, fn in plan:
        if fn is _tree_linear_forward:
            module._rlk_leaves = leaves
        if fn is _rotary_forward:
            module._rlk_table = RotaryTable.for_module(module)
            # Its first chunk now: a forward under torch.compile cannot build the table.
            module._rlk_table.reserve(1)
        module.forward = types.MethodType(fn, module)
    model._rlk_patched = ([m for m, _ in plan], model.config._attn_implementation)
    model._rlk_leaves = leaves
    model.config._attn_implementation = ATTN_NAME
    return model


def patch_llama(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Run a transformers Llama model on rlk (see :func:`patch_model`): the forwards of its
    ``LlamaRotaryEmbedding``, ``LlamaDecoderLayer``, ``LlamaRMSNorm``, ``LlamaAttention``,
    ``LlamaMLP`` and ``nn.Linear`` modules are replaced."""
    return _patch(model, LLAMA, leaves)


def patch_qwen2(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Run a transformers Qwen2 model on rlk (see :func:`patch_model`): the forwards of its
    ``Qwen2RotaryEmbedding``, ``Qwen2DecoderLayer``, ``Qwen2RMSNorm``, ``Qwen2Attention``,
    ``Qwen2MLP`` and ``nn.Linear`` modules are replaced."""
    return _patch(model, QWEN2, leaves)


def patch_qwen3(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Run a transformers Qwen3 model on rlk (see :func:`patch_model`): the forwards of its
    ``Qwen3RotaryEmbedding``, ``Qwen3DecoderLayer``, ``Qwen3RMSNorm`` (the q/k norms too),
    ``Qwen3Attention``, ``Qwen3MLP`` and ``nn.Linear`` modules are replaced."""
    return _patch(model, QWEN3, leaves)


def patch_qwen3_moe(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Run a transformers Qwen3-MoE model on rlk (see :func:`patch_model`): the forwards of its
    ``Qwen3MoeRotaryEmbedding``, ``Qwen3MoeDecoderLayer``, ``Qwen3MoeRMSNorm``,
    ``Qwen3MoeAttention``, ``Qwen3MoeMLP`` (dense layers), ``Qwen3MoeSparseMoeBlock`` (which
    then runs its ``Qwen3MoeTopKRouter`` and ``Qwen3MoeExperts`` on rlk) and ``nn.Linear``
    modules are replaced. ``leaves`` and ``output_router_logits=True`` are refused."""
    return _patch(model, QWEN3_MOE, leaves)


def patch_qwen2_moe(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Run a transformers Qwen2-MoE (or Qwen1.5-MoE) model on rlk (see :func:`patch_model`):
    as :func:`patch_qwen3_moe`, its ``Qwen2Moe*`` classes, the ``Qwen2MoeSparseMoeBlock`` also
    running its shared expert (a ``Qwen2MoeMLP``) and the expert's sigmoid gate (an
    ``nn.Linear``) on rlk. ``leaves`` and ``output_router_logits=True`` are refused."""
    return _patch(model, QWEN2_MOE, leaves)


def patch_deepseek_v3(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Run a transformers DeepSeek-V3 (or R1, V3.1) model on rlk (see :func:`patch_model`): the
    forwards of its ``DeepseekV3RotaryEmbedding``, ``DeepseekV3DecoderLayer``,
    ``DeepseekV3RMSNorm`` (the q and kv latents' norms too), ``DeepseekV3Attention`` (multi-head
    latent attention, :func:`rlk_integrations.models.mla.mla_qkv`), ``DeepseekV3MLP`` (the
    dense layers and the shared experts), ``DeepseekV3MoE`` (which then runs its
    ``DeepseekV3TopkRouter`` by :func:`rlk.moe_route_grouped` and ``DeepseekV3Experts`` by
    :func:`rlk.moe_experts`) and ``nn.Linear`` modules are replaced. ``leaves``,
    ``output_router_logits=True``, ``num_key_value_heads`` other than the heads and a
    ``v_head_dim`` above the q/k head size are refused."""
    return _patch(model, DEEPSEEK_V3, leaves)


#: The patch of each supported ``model_type``.
PATCHES = {
    "llama": patch_llama,
    "qwen2": patch_qwen2,
    "qwen3": patch_qwen3,
    "qwen3_moe": patch_qwen3_moe,
    "qwen2_moe": patch_qwen2_moe,
    "deepseek_v3": patch_deepseek_v3,
}


def patch_model(model: nn.Module, leaves: int | None = None) -> nn.Module:
    """Make a transformers ``LlamaForCausalLM``/``Qwen2ForCausalLM``/``Qwen3ForCausalLM``/
    ``Qwen3MoeForCausalLM``/``Qwen2MoeForCausalLM``/``DeepseekV3ForCausalLM`` (or its base
    model) run every decoder op on rlk: :func:`patch_llama`, :func:`patch_qwen2`,
    :func:`patch_qwen3`, :func:`patch_qwen3_moe`, :func:`patch_qwen2_moe` or
    :func:`patch_deepseek_v3` by ``model.config.model_type``; ``NotImplementedError`` naming
    any other architecture. In place; returns ``model``. Idempotent
    (patching again with other ``leaves`` raises).

    What runs after patching (the module classes are named by
    :mod:`rlk_integrations.models.architectures`):

    - ``nn.Linear`` (every projection and ``lm_head``): :func:`rlk.linear`;
    - ``*RMSNorm``: :func:`rlk.rms_norm`;
    - ``*MLP``: ``down(silu_and_mul(gate(x), up(x)))`` with :func:`rlk.silu_and_mul`;
    - ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``: :func:`rlk.linear` (router
      logits), :func:`rlk.moe_route`, :func:`rlk.moe_experts`; Qwen2-MoE's shared expert is an
      ``*MLP`` and its gate ``sigmoid(rlk.linear(x, w))`` by :func:`rlk.moe_route` over
      ``[z, 0]`` (:func:`rlk_integrations.models.moe.shared_expert`);
    - ``DeepseekV3MoE``: :func:`rlk.linear` (the router's logits, in fp32),
      :func:`rlk.moe_route_grouped`, :func:`rlk.moe_experts`, plus the shared experts (an
      ``*MLP``);
    - ``DeepseekV3Attention``: :func:`rlk_integrations.models.mla.mla_qkv`, then the attention
      below;
    - ``*RotaryEmbedding``: the fp32 table of :class:`rlk_integrations.models.rotary.RotaryTable`;
    - ``*Attention``: q/k norm (Qwen3), :func:`rlk.apply_rotary`, then the ``"rlk"`` attention
      function (:func:`rlk.attention`) or a paged KV cache's :func:`rlk.paged_attention`;
    - ``*DecoderLayer``: the pre-norm layer with the post-attention norm fused with its
      residual add (``rlk.rms_norm(..., residual=)``).

    A model holding another module class of the architecture's modeling file is refused
    before anything is patched.

    ``leaves``: None runs every linear on :func:`rlk.linear`. A power of two runs ``o_proj``
    and ``down_proj`` (the row-parallel layers under tensor parallelism) on
    :func:`rlk.parallel.tree_linear` with that many K-leaves, whose bits are those of
    :func:`rlk.parallel.row_parallel_linear` at any power-of-two TP size dividing ``leaves``
    (e.g. Megatron's :func:`rlk_integrations.adapters.megatron.build_gpt_model` with the same
    ``leaves``). It must divide those layers' input sizes; it needs a backend with the
    tree-ordered GEMM (triton, cuda, rocm).

    Works with ``model(...)``, ``model.generate(...)`` and transformers' dynamic and static KV
    caches; inputs may be padded (``attention_mask``) or packed (``position_ids`` restarting at
    0 in a ``[1, T]`` row). Undo with :func:`unpatch_model`.
    """
    return PATCHES[architecture(model.config).model_type](model, leaves)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the class forwards and the previous attention come back."""
    state = getattr(model, "_rlk_patched", None)
    if state is None:
        return model
    patched, attn_impl = state
    for module in patched:
        del module.forward
        if hasattr(module, "_rlk_table"):
            del module._rlk_table
        if hasattr(module, "_rlk_leaves"):
            del module._rlk_leaves
        if hasattr(module, "_rlk_fused"):  # fused.fuse_projections (the weights stay views)
            del module._rlk_fused
    model.config._attn_implementation = attn_impl
    model._rlk_patched = None
    model._rlk_leaves = None
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_rlk_patched", None) is not None


def graph_reads(model: nn.Module, device: torch.device) -> tuple[int, ...]:
    """The addresses a CUDA graph of a patched model's pass reads besides its own buffers:
    every parameter and buffer of ``model`` and the device copy of the rotary table. A graph
    replays those addresses, so once any of them moves (weights replaced rather than updated
    in place, a table grown by a longer sequence) its graphs must be captured again."""
    table = decoder(model).rotary_emb._rlk_table.on.get(device)
    ptrs = [t.data_ptr() for t in model.parameters()] + [t.data_ptr() for t in model.buffers()]
    return tuple(ptrs + ([t.data_ptr() for t in table] if table is not None else []))
