"""The transformers architectures rlk runs, and which of their module classes it replaces.

One :class:`Architecture` per supported ``model_type`` names the transformers module that
defines the model and, by name, each module class whose computation rlk replaces
(:func:`rlk_integrations.models.transformers.patch_model` for transformers, the rotary table of
:mod:`rlk_integrations.models.rotary` for Megatron too). Every ``nn.Linear`` of the decoder and the
head is replaced as well; embeddings and the model classes themselves are kept. A
mixture-of-experts architecture (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3) also names its sparse block,
whose forward is replaced, and the router and experts classes that block runs (their own forwards
are then never called); Qwen2-MoE's shared expert is an ``*MLP`` and its gate an ``nn.Linear``,
patched as such and run by the block, as are DeepSeek-V3's shared experts (an ``*MLP``).
DeepSeek-V3's ``*Attention`` is multi-head latent attention (:attr:`Architecture.mla`).

Example::

    arch = architecture(model.config)       # raises for an unsupported model_type
    arch.rms_norm                            # "Qwen2RMSNorm"
    arch.cls("rotary")                       # transformers' Qwen2RotaryEmbedding class
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

#: The module roles of an architecture, in the order a decoder layer runs them.
ROLES = ("rotary", "decoder_layer", "rms_norm", "attention", "mlp")


@dataclass(frozen=True)
class Architecture:
    """The transformers classes of one ``model_type`` that rlk replaces, by role."""

    model_type: str
    #: The transformers module defining the classes.
    modeling: str
    rotary: str
    decoder_layer: str
    rms_norm: str
    attention: str
    mlp: str
    #: Mixture of experts: (sparse block, router, experts) class names; () for a dense model.
    moe: tuple[str, ...] = ()
    #: Multi-head latent attention (DeepSeek-V3): the patched ``*Attention`` takes its q, k and
    #: v from :func:`rlk_integrations.models.mla.mla_qkv`.
    mla: bool = False

    def classes(self) -> dict[str, type]:
        """Each role's transformers class. Raises ``RuntimeError`` naming a class the installed
        transformers does not define (a release that renamed it)."""
        mod = importlib.import_module(self.modeling)
        out = {}
        for role in ROLES:
            name = getattr(self, role)
            cls = getattr(mod, name, None)
            if not isinstance(cls, type):
                raise RuntimeError(
                    f"{self.modeling} defines no {name}: this transformers release is not one "
                    "rlk's integration knows"
                )
            out[role] = cls
        return out

    def moe_classes(self) -> tuple[type, ...]:
        """The classes named by :attr:`moe` (sparse block, router, experts); () for a dense
        architecture."""
        mod = importlib.import_module(self.modeling)
        out = tuple(getattr(mod, name, None) for name in self.moe)
        for name, cls in zip(self.moe, out):
            if not isinstance(cls, type):
                raise RuntimeError(f"{self.modeling} defines no {name}: a transformers release "
                                   "rlk's integration does not know")  # fmt: skip
        return out

    def cls(self, role: str) -> type:
        """The transformers class of ``role`` (one of :data:`ROLES`)."""
        return self.classes()[role]


def _arch(
    model_type: str, prefix: str, moe: tuple[str, ...] = (), mla: bool = False
) -> Architecture:
    return Architecture(
        model_type=model_type,
        modeling=f"transformers.models.{model_type}.modeling_{model_type}",
        rotary=f"{prefix}RotaryEmbedding",
        decoder_layer=f"{prefix}DecoderLayer",
        rms_norm=f"{prefix}RMSNorm",  # input, post-attention, final; Qwen3's q/k norms too
        attention=f"{prefix}Attention",
        mlp=f"{prefix}MLP",  # every MLP of a dense model; an MoE model's dense layers
        moe=tuple(f"{prefix}{name}" for name in moe),
        mla=mla,
    )


LLAMA = _arch("llama", "Llama")
QWEN2 = _arch("qwen2", "Qwen2")
QWEN3 = _arch("qwen3", "Qwen3")
QWEN3_MOE = _arch("qwen3_moe", "Qwen3Moe", moe=("SparseMoeBlock", "TopKRouter", "Experts"))
# Qwen1.5-MoE checkpoints are model_type "qwen2_moe" too.
QWEN2_MOE = _arch("qwen2_moe", "Qwen2Moe", moe=("SparseMoeBlock", "TopKRouter", "Experts"))
# DeepSeek-V3 (and R1, V3.1: the same model_type): MLA, the group-limited sigmoid router, shared
# experts, the first first_k_dense_replace layers dense.
DEEPSEEK_V3 = _arch("deepseek_v3", "DeepseekV3", moe=("MoE", "TopkRouter", "Experts"), mla=True)

#: The supported architectures by ``config.model_type``.
ARCHITECTURES = {a.model_type: a for a in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN2_MOE, DEEPSEEK_V3)}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


def architecture(config: Any, integration: str = "transformers") -> Architecture:
    """The :class:`Architecture` of a transformers ``config``; ``NotImplementedError`` naming
    the unsupported ``model_type`` and the supported ones otherwise (``integration`` names the
    caller in the message)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise NotImplementedError(
            f"rlk's {integration} integration supports {SUPPORTED_MODEL_TYPES}, "
            f"not model_type={model_type!r}"
        )
    return ARCHITECTURES[model_type]


def decoder(model: Any) -> Any:
    """The base model (``model.model``) of a transformers ``*ForCausalLM``: the module whose
    ``layers``, ``norm`` and ``rotary_emb`` the patches and engines reach."""
    return getattr(model, model.base_model_prefix, model)
