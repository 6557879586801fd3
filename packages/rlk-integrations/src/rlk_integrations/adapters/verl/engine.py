"""rlk's actor engine for verl's FSDP2: :class:`RLKEngineWithLMHead`.

verl's ``FSDPEngineWithLMHead`` (``verl/workers/engine/fsdp/transformer_impl.py``) packs each
micro-batch into one ``[1, T]`` row with restarting ``position_ids`` (``use_remove_padding``),
calls the model, and either takes ``output.logits`` through its own log-softmax or, on its
fused-kernel path, reads ``output.log_probs`` and ``output.entropy``
(``CausalLMOutputForPPO``). This engine is that class with four changes:

- the model is patched with :func:`~rlk_integrations.models.transformers.patch_model` after
  verl builds it (every decoder op on rlk), and the instance's ``forward`` (never the class's)
  returns ``CausalLMOutputForPPO`` with the log-probabilities and entropies of
  :func:`rlk.linear_logprobs` (:func:`rlk_forward`): no ``[T, vocab]`` logits, the bits of rlk's
  rollout whatever the micro-batch holds;
- every micro-batch takes the fused-kernel path that reads them;
- FSDP2's ``cast_forward_inputs`` is turned off: verl's policy casts every floating input of a
  sharded module to the compute dtype, which would round rlk's fp32 rotary tables (rlk refuses
  them). The parameters are still gathered in the compute dtype (``mixed_precision``), so the
  forward is that of a rollout holding the weights in that dtype;
- the forward runs outside verl's ``torch.autocast``: rlk's ops compute in the dtypes they are
  given.

Options rlk cannot honour raise ``NotImplementedError`` naming them when the engine is built,
before any weight is loaded (:func:`refused`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from verl.models.transformers.dense_common import CausalLMOutputForPPO
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

import rlk
from rlk_integrations.adapters.verl.release import check_verl, trl_conflict
from rlk_integrations.models.architectures import architecture, decoder

#: The lm_head method that computes log-probs and entropies (an FSDP forward method when
#: verl shards the head on its own, untied models).
HEAD_METHOD = "rlk_logprobs"
#: verl's fused-kernel backends: each replaces the model class's forward with verl's kernels.
VERL_FUSED_BACKENDS = ("triton", "torch", "liger")


def refused(
    *,
    strategy: str = "fsdp2",
    ulysses: int = 1,
    remove_padding: bool = True,
    lora_rank: int = 0,
    lora_adapter_path: str | None = None,
    use_liger: bool = False,
    tiled_mlp: bool = False,
    fused_kernels: bool = False,
    impl_backend: str | None = None,
    qat: bool = False,
) -> list[str]:
    """The options among these that rlk's engine cannot honour, each named with why."""
    bad = []
    if strategy != "fsdp2":
        bad.append(f"strategy={strategy!r} (rlk's engine is FSDP2's: strategy=fsdp2)")
    if ulysses > 1:
        bad.append(f"ulysses_sequence_parallel_size={ulysses} (rlk attention is not split)")
    if not remove_padding:
        bad.append("use_remove_padding=False (rlk's engine takes packed rows)")
    if lora_rank > 0 or lora_adapter_path:
        bad.append(f"lora_rank={lora_rank} / lora_adapter_path={lora_adapter_path!r} (LoRA)")
    if use_liger:
        bad.append("use_liger=True (Liger's kernels would replace rlk's)")
    if tiled_mlp:
        bad.append("tiled_mlp.enabled=True (verl's tiled MLP would replace rlk's)")
    if fused_kernels and impl_backend in VERL_FUSED_BACKENDS:
        bad.append(
            f"fused_kernel_options.impl_backend={impl_backend!r} (verl's fused forward would "
            "replace rlk's; use impl_backend=rlk)"
        )
    if qat:
        bad.append("qat.enable=True (quantization-aware training)")
    return bad


def _uncast_policy(**kwargs: Any):
    """FSDP2's ``MixedPrecisionPolicy(**kwargs)`` with ``cast_forward_inputs=False``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(**{**kwargs, "cast_forward_inputs": False})


def _head_logprobs(head: torch.nn.Module, hidden, labels, temperature):
    """Log-probs and entropies ``([N], [N])`` float32 of ``labels [N]`` under the head's
    logits of ``hidden [N, H]``, tempered."""
    return rlk.linear_logprobs(
        hidden, head.weight, labels, bias=head.bias, temperature=temperature, return_entropy=True
    )


def rlk_forward(
    self: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    shift_labels: torch.Tensor | None = None,
    use_cache: bool = False,
    return_dict: bool = True,
    **kwargs: Any,
) -> CausalLMOutputForPPO:
    """The ``forward`` of a patched ``*ForCausalLM`` instance under verl's fused-kernel contract.

    ``input_ids``, ``position_ids``: ``[1, T]`` int64, sequences packed with positions
    restarting at 0 (verl's ``use_remove_padding``); ``shift_labels [1, T]``: the token each
    position predicts (default: ``input_ids`` rolled left by one); ``temperature``: a float.
    Returns ``CausalLMOutputForPPO`` with ``log_probs`` and ``entropy`` ``[1, T]`` float32 (the
    last position of each sequence predicts a token of the next: verl drops it).
    ``ValueError`` for a padded batch (an ``attention_mask``) or embeddings in place of ids."""
    if attention_mask is not None:
        raise ValueError("rlk's verl forward takes packed rows, got an attention_mask")
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("rlk's verl forward takes input_ids, not inputs_embeds")
    if isinstance(temperature, torch.Tensor):
        raise ValueError("rlk's verl forward takes one temperature (a float), not one per sample")
    with torch.autocast(input_ids.device.type, enabled=False):
        hidden = decoder(self)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = hidden.last_hidden_state
        labels = shift_labels if shift_labels is not None else torch.roll(input_ids, -1, 1)
        lp, entropy = getattr(self.get_output_embeddings(), HEAD_METHOD)(
            hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), float(temperature)
        )
    return CausalLMOutputForPPO(log_probs=lp.view(1, -1), entropy=entropy.view(1, -1))


class RLKEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's FSDP2 actor/reference engine with the log-probabilities of rlk's rollout (see the
    module's docstring). Built like its parent:
    ``EngineRegistry.new("language_model", "fsdp2", model_config, engine_config,
    optimizer_config, checkpoint_config)`` with ``VERL_ENGINE_VENDOR=rlk``."""

    #: False runs verl's own log-probs (full logits, its log-softmax) on the same rlk-patched
    #: decoder: the negative control of the tests, never a fallback.
    rlk_logprobs = True

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        check_verl()
        conflict = trl_conflict()
        if conflict is not None:
            raise RuntimeError(conflict)
        architecture(model_config.hf_config, "verl")
        bad = refused(
            strategy=engine_config.strategy,
            ulysses=engine_config.ulysses_sequence_parallel_size,
            remove_padding=model_config.use_remove_padding,
            lora_rank=model_config.lora_rank,
            lora_adapter_path=model_config.lora_adapter_path,
            use_liger=model_config.use_liger,
            tiled_mlp=bool((model_config.tiled_mlp or {}).get("enabled", False)),
            fused_kernels=model_config.use_fused_kernels,
            impl_backend=(model_config.fused_kernel_options or {}).get("impl_backend"),
            qat=bool(getattr(engine_config.qat, "enable", False)),
        )
        if bad:
            raise NotImplementedError("rlk's verl engine does not support " + "; ".join(bad))
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def _build_module(self):
        from rlk_integrations.models.transformers import patch_model

        # rlk replaces attention: the implementation the model is loaded with only has to exist.
        self.model_config.hf_config._attn_implementation = "sdpa"
        module = super()._build_module()
        patch_model(module)
        if self.rlk_logprobs:
            module.forward = types.MethodType(rlk_forward, module)
        return module

    def _build_fsdp_module(self, module):
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        # verl builds MixedPrecisionPolicy(..., cast_forward_inputs=True) inside this method:
        # for its duration the name makes the same policy without the input casting.
        saved = transformer_impl.MixedPrecisionPolicy
        transformer_impl.MixedPrecisionPolicy = _uncast_policy
        try:
            module = super()._build_fsdp_module(module)
        finally:
            transformer_impl.MixedPrecisionPolicy = saved
        head = module.get_output_embeddings()
        setattr(head, HEAD_METHOD, types.MethodType(_head_logprobs, head))
        if isinstance(head, FSDPModule):  # sharded on its own: gather it around the method
            register_fsdp_forward_method(head, HEAD_METHOD)
        return module

    def prepare_model_inputs(self, micro_batch):
        if not tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            raise NotImplementedError(
                "rlk's verl engine takes packed rows: use_remove_padding=False"
            )
        # The fused-kernel path is the one that reads CausalLMOutputForPPO's log_probs/entropy.
        tu.assign_non_tensor(micro_batch, use_fused_kernels=self.rlk_logprobs)
        return super().prepare_model_inputs(micro_batch)
