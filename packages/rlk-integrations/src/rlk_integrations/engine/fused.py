"""One GEMM for q, k and v, and one for gate and up, over a patched model's own weights.

:func:`rlk.linear` computes each output column as its own reduction over K, in an order no
launch config changes. So ``linear(x, cat(Wq, Wk, Wv))`` split by columns is bitwise
``(linear(x, Wq), linear(x, Wk), linear(x, Wv))``: one launch instead of three, and a narrow
projection (a GQA model's k or v: few output tiles, so few programs on a GPU of 132 SMs) shares
the wide one's programs.

:func:`fuse_projections` moves each group's weights (and biases) into one buffer and points the
parameters at its rows, so the model holds no second copy: the parameters stay the model's
own, and an optimizer step or ``load_state_dict`` (both in place) updates the buffer with them.
Only callers that ask run the fused products: the paged rollout's steps
(:mod:`rlk_integrations.engine.paged_step`), without autograd. Training calls the separate
projections, which read the same memory.

A group whose parameters have moved since (``param.data = ...``, ``model.to(...)``) is no
longer backed by its buffer: :func:`fused` returns None for it, and its caller runs the separate
products (the same bits); :func:`fuse_projections` fuses it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import rlk
from rlk_integrations.models.transformers import _linear_forward, decoder, is_patched

#: (the layer's submodule, its projections in output-column order).
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


@dataclass(frozen=True)
class Fused:
    """A group's concatenated ``weight [sum of N, K]`` (and ``bias [sum of N]`` or None),
    ``splits``: each projection's N, and the parameters it backs with their addresses."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    splits: tuple[int, ...]
    params: tuple[nn.Parameter, ...]
    ptrs: tuple[int, ...]


def fused(owner: nn.Module) -> Fused | None:
    """``owner``'s (an attention or MLP module) fused projections, or None when it has none or
    they no longer back its parameters."""
    f = getattr(owner, "_rlk_fused", None)
    if f is None or any(p.data_ptr() != ptr for p, ptr in zip(f.params, f.ptrs)):
        return None
    return f


def _fusable(mods: list) -> bool:
    if not all(
        isinstance(m, nn.Linear) and getattr(m.forward, "__func__", None) is _linear_forward
        for m in mods
    ):  # absent, wrapped (an adapter), or not run by rlk.linear: left as it is
        return False
    w0 = mods[0].weight
    same = all(
        m.weight.dtype == w0.dtype
        and m.weight.device == w0.device
        and m.in_features == mods[0].in_features
        and m.weight.is_contiguous()
        for m in mods
    )
    return same and len({m.bias is None for m in mods}) == 1


@torch.no_grad()
def _fuse(owner: nn.Module, mods: list[nn.Linear]) -> None:
    def into_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
        whole = torch.cat([t.detach() for t in tensors])
        start = 0
        for t in tensors:
            t.data = whole[start : start + t.shape[0]]
            start += t.shape[0]
        return whole

    weights = [m.weight for m in mods]
    biases = [m.bias for m in mods] if mods[0].bias is not None else []
    weight = into_rows(weights)
    bias = into_rows(biases) if biases else None
    params = tuple(weights + biases)
    owner._rlk_fused = Fused(
        weight,
        bias,
        tuple(w.shape[0] for w in weights),
        params,
        tuple(p.data_ptr() for p in params),
    )


def fuse_projections(model: nn.Module) -> int:
    """Fuse every decoder layer's q/k/v and gate/up projections of ``model`` (patched by
    :func:`~rlk_integrations.models.transformers.patch_model`) into one weight buffer per group; see
    the module's docstring. Groups already fused and still current are kept; a projection that
    rlk does not run as a plain :func:`rlk.linear` (an adapter, an MoE block's experts) leaves
    its group as it is. Returns the number of fused groups.

    Example::

        fuse_projections(model)  # the parameters now view one buffer per group
        q, k, v = qkv(model.model.layers[0].self_attn, x)  # one rlk.linear
    """
    if not is_patched(model):
        raise ValueError("fuse_projections needs a model patched by rlk's patch_model")
    count = 0
    for layer in decoder(model).layers:
        for attr, names in GROUPS:
            owner = getattr(layer, attr, None)
            mods = [getattr(owner, name, None) for name in names]
            if owner is None or not _fusable(mods):
                continue
            if fused(owner) is None:
                _fuse(owner, mods)
            count += 1
    return count


def qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` projections of ``x [..., H]`` by ``attn``: column views of one fused
    product when ``attn`` is fused and current, else its three projections (the same bits)."""
    f = fused(attn)
    if f is None:
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q, k, v = rlk.linear(x.contiguous(), f.weight, f.bias).split(f.splits, dim=-1)
    return q, k, v


def mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP ``module`` on ``x``: gate and up by one fused product, whose ``[..., 2I]``
    output :func:`rlk.silu_and_mul` takes whole, when ``module`` is fused and current; else
    ``module(x)`` (the same bits)."""
    f = fused(module)
    if f is None:
        return module(x)
    return module.down_proj(rlk.silu_and_mul(rlk.linear(x.contiguous(), f.weight, f.bias)))
