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
``training.recompute_logprobs`` on the same checkpoint gives the same bits. The config's
``rlk_leaves`` (``engine_args(leaves=L)``) puts ``o_proj``/``down_proj`` on the tree-ordered
linear; with it, vLLM's ``tensor_parallel_size`` t > 1 shards the model over vLLM's TP workers
(:func:`rlk_integrations.models.tp.shard_tp`), each cutting its slice of every checkpoint
tensor it loads: the bits of one device.

Anything the classes cannot run raises at engine start, naming it (:func:`check_config`):
quantization, LoRA, speculative decoding, tensor parallelism above 1 without leaves or on a
mixture of experts, pipeline or context parallelism above 1, a
runner other than ``generate`` (pooling), prompt embeddings, a KV cache dtype other than the
model's, a ``logprobs_mode`` other than ``raw_logprobs`` / ``processed_logprobs``, vLLM's V2 model
runner, an architecture other than Llama / Qwen2 / Qwen3.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

import rlk.parallel
from rlk_integrations.adapters.vllm import LOGPROBS_MODES, check_vllm
from rlk_integrations.adapters.vllm import sampler as rlk_sampler
from rlk_integrations.engine.paged_step import forward_packed
from rlk_integrations.models.architectures import architecture
from rlk_integrations.models.tp import ROW_LINEARS, shard_tp
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
    tp, hf_config = pc.tensor_parallel_size, getattr(mc, "hf_config", None)
    if tp != 1 and not getattr(hf_config, "rlk_leaves", None):
        bad.append(
            f"tensor_parallel_size={tp} without leaves (engine_args(leaves=L): rlk's "
            "tree-ordered linears keep the bits of one device)"
        )
    if tp != 1 and getattr(hf_config, "num_experts", None):
        bad.append(f"tensor_parallel_size={tp} with a mixture of experts")
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
    if mc.logprobs_mode not in LOGPROBS_MODES:
        bad.append(
            f"logprobs_mode={mc.logprobs_mode!r} (only {' or '.join(map(repr, LOGPROBS_MODES))})"
        )
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
        # rlk_leaves: set by engine_args(leaves=...) or the dict hf_overrides.
        hf = patch_model(hf.eval(), leaves=getattr(cfg, "rlk_leaves", None))
        for p in hf.parameters():
            p.requires_grad_(False)
        #: Tensor parallelism: (rank, size) in vLLM's TP group, and the dimension along which
        #: each sharded parameter (by id) holds its rank's slice of the checkpoint's tensor.
        self._tp, self._shard_dim, self._views = (0, 1), {}, {}
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            self._shard(hf)
        # The transformers model is held outside the module tree; its two children are in it,
        # so parameter names are the checkpoint's.
        object.__setattr__(self, "hf", hf)
        self.model = hf.model
        self.lm_head = hf.get_output_embeddings()
        self.model.rotary_emb._rlk_table.reserve(mc.max_model_len + 1)
        attn0 = self.model.layers[0].self_attn
        world = self._tp[1]
        heads, kv_heads = cfg.num_attention_heads // world, cfg.num_key_value_heads // world
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
        #: ids of the parameters pushed since an incomplete update began; None: none is.
        self._pushed: set[int] | None = None

    def _shard(self, hf: nn.Module) -> None:
        """This worker's rank of vLLM's tensor-parallel group
        (:func:`rlk_integrations.models.tp.shard_tp` on vLLM's TP process group, the
        tree-ordered linears of ``leaves``: the bits of one device). A tied head becomes a
        view of this rank's rows of the (replicated) embedding, so that loading the
        embedding loads it."""
        from vllm.distributed import get_tp_group

        group = get_tp_group().device_group
        shard_tp(hf, group=group)
        rank, world = rlk.parallel.group_info(group)
        self._tp = (rank, world)
        head = hf.get_output_embeddings()
        if hf.config.tie_word_embeddings:
            embed = hf.get_input_embeddings().weight
            rows = embed.shape[0] // world
            head.weight = nn.Parameter(embed.data.narrow(0, rank * rows, rows),
                                       requires_grad=False)  # fmt: skip
            self._views[id(head.weight)] = id(embed)  # written when the embedding is
        for path, module in hf.named_modules():
            short = path.rsplit(".", 1)[-1]
            dim = 1 if short in ROW_LINEARS else 0
            if getattr(module, "_rlk_tp", None) is None or module is hf:
                continue
            if module is head and hf.config.tie_word_embeddings:
                continue  # a view of the embedding, loaded with it
            for p in (module.weight, module.bias):
                if p is not None and not (dim == 1 and p is module.bias):
                    self._shard_dim[id(p)] = dim

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
        self._check_fresh()
        return forward_packed(self.model, input_ids, positions, self._cache)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> logits ``[N, V]`` in the model's dtype (:func:`rlk.linear`), marked so
        that vLLM's sampler reports :func:`rlk.logprobs` of them."""
        return rlk_sampler.mark(self.lm_head(hidden_states.contiguous()))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy a bucket of ``(name, tensor)`` pairs into the model: any subset of the
        checkpoint's tensors, in any number of calls (vLLM's checkpoint load, ``collective_rpc``
        through :class:`~rlk_integrations.adapters.vllm.worker.RLKWorkerExtension`, TRL's and
        verl's weight sync and vLLM's weight-transfer engines all end here).

        Names are the checkpoint's (``model.layers.0.self_attn.q_proj.weight``; a Qwen3-MoE
        expert's ``model.layers.0.mlp.experts.3.gate_proj.weight``, which lands in its slice of
        the fused ``experts.gate_up_proj``) or the model's own parameter names (the fused
        expert tensors whole, as a trainer's ``named_parameters()`` gives them). Each tensor must
        have its destination's shape and a floating dtype. One of another precision (a trainer's
        fp32 master weights, an fp32 checkpoint served in bf16: what verl's bucketed sync and TRL
        send) is rounded to the model's dtype by ``copy_``, round to nearest even, the cast a
        mixed-precision trainer makes of its master weights for its own forward, so the rollout
        computes with the trainer's bits. The whole bucket is checked first, then copied: a
        ``ValueError`` naming every bad entry (unknown name, shape, a non-floating dtype)
        changes no weight.

        An update is complete when every tensor of the checkpoint has been pushed since the last
        complete one. While one is incomplete (a later bucket failed, or is still to come),
        :meth:`forward` refuses to run, naming how many tensors are stale;
        :meth:`declare_partial_update` accepts the mix on purpose. After an update reset vLLM's
        prefix cache (``llm.reset_prefix_cache()``; :func:`rlk_integrations.adapters.vllm.
        update_weights` does both), else a cached prefix serves the old weights' keys and values.

        Returns the names (as ``named_parameters()`` gives them) this bucket wrote to."""
        params = self._named_params()
        bucket = list(weights)
        errors, targets = [], []
        for name, tensor in bucket:
            target = _target(params, name)
            if target is None:
                errors.append(f"{name!r} is no parameter of the rlk model")
            elif not isinstance(tensor, torch.Tensor):
                errors.append(f"{name}: a {type(tensor).__name__}, not a torch.Tensor")
            elif tensor.shape != self._full_shape(target[1]):
                shape = tuple(self._full_shape(target[1]))
                errors.append(f"{name}: shape {tuple(tensor.shape)}, the model's {shape}")
            elif not tensor.dtype.is_floating_point:
                errors.append(f"{name}: dtype {tensor.dtype}, not a floating dtype")
            targets.append(target)
        if errors:
            raise ValueError(
                f"no weight changed, the bucket has {len(errors)} bad entries: {errors}"
            )
        written: set[tuple] = set()
        with torch.no_grad():
            for (keys, dest), (_, tensor) in zip(targets, bucket):
                dim = self._shard_dim.get(id(dest))
                if dim is not None:  # this rank's slice of the checkpoint's tensor
                    rank, world = self._tp
                    tensor = rlk.parallel.shard(tensor, dim, rank=rank, world_size=world)
                dest.copy_(tensor)
                written |= keys
        pushed = (self._pushed or set()) | written
        self._pushed = None if pushed >= set(_pieces(params)) else pushed
        ids = {key[0] for key in written}
        ids |= {view for view, of in self._views.items() if of in ids}
        return {n for n, p in self.named_parameters() if id(p) in ids}

    def _named_params(self) -> dict[str, nn.Parameter]:
        """Parameter name -> parameter, a tied head under both of its names (the embedding:
        sharded, the head is a view of it)."""
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        if self._tp[1] > 1 and self.hf.config.tie_word_embeddings:
            params["lm_head.weight"] = params["model.embed_tokens.weight"]
        return params

    def _full_shape(self, param: torch.Tensor) -> torch.Size:
        """The checkpoint's shape of a parameter (of its tensor's, for this rank's slice)."""
        dim = self._shard_dim.get(id(param))
        if dim is None:
            return param.shape
        shape = list(param.shape)
        shape[dim] *= self._tp[1]
        return torch.Size(shape)

    def stale_parameters(self) -> list[str]:
        """The checkpoint tensors not pushed since an incomplete update began (``[]``: none)."""
        if self._pushed is None:
            return []
        return [
            name for key, name in _pieces(self._named_params()).items() if key not in self._pushed
        ]

    def declare_partial_update(self) -> int:
        """Accept an incomplete update on purpose (e.g. only some layers trained): generation
        runs with the mix of new and old weights. Returns how many tensors stayed stale."""
        stale = len(self.stale_parameters())
        self._pushed = None
        return stale

    def _check_fresh(self) -> None:
        stale = self.stale_parameters()
        if stale:
            total = len(_pieces(self._named_params()))
            raise RuntimeError(
                "rlk's vLLM model refuses to generate with an incomplete weight update: "
                f"{len(stale)} of {total} tensors are stale (not pushed since the update "
                f"began, e.g. {stale[:3]}); push them, or call declare_partial_update() "
                "(llm.collective_rpc('rlk_declare_partial_update')) to sample with the mix"
            )


#: A Qwen3-MoE expert's tensor in the checkpoint: its slice of the fused ``experts.*`` parameter.
_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate|up|down)_proj\.weight$")


def _fused_parts(name: str) -> tuple[str, ...]:
    """The checkpoint's per-expert parts of a fused expert parameter (none for another one)."""
    if name.endswith(".experts.gate_up_proj"):
        return ("gate", "up")
    if name.endswith(".experts.down_proj"):
        return ("down",)
    return ()


def _pieces(params: dict[str, nn.Parameter]) -> dict[tuple, str]:
    """Every checkpoint tensor of the model: ``(id(param),)`` or ``(id(fused), expert, part)``
    -> its checkpoint name (a tied head counted once)."""
    out: dict[tuple, str] = {}
    for name, p in params.items():
        parts = _fused_parts(name)
        if not parts:
            out.setdefault((id(p),), name)
            continue
        base = name.rsplit(".", 1)[0]
        for e in range(p.shape[0]):
            for part in parts:
                out.setdefault((id(p), e, part), f"{base}.{e}.{part}_proj.weight")
    return out


def _target(params: dict[str, nn.Parameter], name: str) -> tuple[set[tuple], torch.Tensor] | None:
    """The piece keys a checkpoint name covers and the tensor it is copied into (a parameter,
    or an expert's slice of a fused one), None for a name the model does not have."""
    p = params.get(name)
    if p is not None:
        parts = _fused_parts(name)
        if not parts:
            return {(id(p),)}, p
        return {(id(p), e, part) for e in range(p.shape[0]) for part in parts}, p
    m = _EXPERT.match(name)
    fused_name = m and m["base"] + (".down_proj" if m["part"] == "down" else ".gate_up_proj")
    fused = params.get(fused_name) if m else None
    if fused is None or int(m["e"]) >= fused.shape[0]:
        return None
    e, part = int(m["e"]), m["part"]
    half = fused.shape[1] // 2
    dest = {"gate": fused[e, :half], "up": fused[e, half:], "down": fused[e]}[part]
    return {(id(fused), e, part)}, dest


class RLKLlamaForCausalLM(RLKForCausalLM):
    """Llama on rlk ops (vLLM)."""


class RLKQwen2ForCausalLM(RLKForCausalLM):
    """Qwen2 on rlk ops (vLLM)."""


class RLKQwen3ForCausalLM(RLKForCausalLM):
    """Qwen3 on rlk ops (vLLM)."""


class RLKQwen3MoeForCausalLM(RLKForCausalLM):
    """Qwen3-MoE on rlk ops (vLLM): the router and experts of :mod:`rlk_integrations.models.moe`,
    the trainer's routing."""
