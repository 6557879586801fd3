"""The attention function rlk registers in transformers' ``AttentionInterface`` under the name
``"rlk"`` (``ATTN_NAME``): :func:`rlk_attention_forward` turns transformers' padded
``[B, H, S, D]`` tensors into :func:`rlk.attention`'s packed varlen form, dropping pad tokens,
for padded batches (a 2-D ``attention_mask``), packed sequences in one row (``position_ids``
that restart, or ``cu_seq_lens_q``/``cu_seq_lens_k``) and the dynamic / static KV caches;
:func:`rlk_attention_mask` is the mask function registered with it (the 2-D padding mask or
None, as for flash attention).

:func:`rlk_integrations.models.transformers.patch_model` registers both and sets the model's
attention implementation to ``"rlk"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import rlk

ATTN_NAME = "rlk"


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def _packed_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens [N + 1] of packed sequences in one row (positions restart), else None."""
    pos = position_ids.reshape(-1)
    if pos.numel() == 0:
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    if int(starts.sum()) <= 1:
        return None
    idx = torch.nonzero(starts).reshape(-1)
    cu = torch.empty(idx.numel() + 1, dtype=torch.int32, device=pos.device)
    cu[:-1] = idx
    cu[-1] = pos.numel()
    return cu


class _PerForward:
    """The index tensors derived from one forward's mask or position_ids. transformers hands
    the same tensor objects to every layer, so deriving them (which reads the device: a sync)
    happens once per forward, not once per layer. Keyed by object identity and version; the
    keys are held, so their ids cannot be reused while remembered."""

    def __init__(self) -> None:
        self.key: tuple = ()
        self.value: Any = None

    def get(self, tensors: tuple, extra: tuple, make: Any) -> Any:
        versions = tuple(getattr(t, "_version", None) for t in tensors)
        old = self.key
        same = bool(old) and all(a is b for a, b in zip(old[0], tensors))
        if not (same and old[1] == versions and old[2] == extra):
            self.value = make()
            self.key = (tensors, versions, extra)
        return self.value


_packed_memo = _PerForward()
_padded_memo = _PerForward()


def _padded_index(attention_mask, position_ids, b: int, s: int, skv: int, device):
    """(query row ids, key row ids, cu_q, cu_k) of the real tokens of a padded batch."""
    if attention_mask is None:
        if position_ids is not None and s < skv and b >= 1:
            # A static cache hands over all its slots: the real keys end at the last position.
            nk = position_ids.reshape(b if position_ids.shape[0] == b else 1, -1)[:, -1] + 1
            nk = nk.expand(b).to(torch.int64)
        else:
            nk = torch.full((b,), skv, dtype=torch.int64, device=device)
        kmask = torch.arange(skv, device=device)[None, :] < nk[:, None]
        qmask = torch.ones(b, s, dtype=torch.bool, device=device)
    else:
        m = attention_mask.to(device=device, dtype=torch.bool)
        length = m.shape[1]
        if length > skv or length < s:
            raise ValueError(f"attention_mask covers {length} tokens but there are {skv} keys")
        kmask = torch.zeros(b, skv, dtype=torch.bool, device=device)
        kmask[:, :length] = m
        qmask = m[:, length - s :]
    qi = qmask.reshape(-1).nonzero().reshape(-1)
    ki = kmask.reshape(-1).nonzero().reshape(-1)
    return qi, ki, _cu(qmask.sum(1)), _cu(kmask.sum(1))


def _packed_cu_static(position_ids: torch.Tensor) -> torch.Tensor:
    """:func:`_packed_cu_seqlens` without a host read, for ``torch.compile``: ``[T + 1]``
    offsets, the sequences' starts in order, then ``T`` repeated (empty sequences, which
    rlk.attention skips). One sequence or several, a row's bits are those of its sequence."""
    pos = position_ids.reshape(-1)
    n = pos.numel()
    idx = torch.arange(n, device=pos.device)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    firsts = torch.sort(torch.where(starts, idx, n)).values
    return torch.cat([firsts, idx.new_full((1,), n)]).to(torch.int32)


def _padded_order(attention_mask: torch.Tensor | None, b: int, s: int, device) -> tuple:
    """:func:`_padded_index` for a ``[B, S]`` batch without a cache under ``torch.compile``,
    with no shape that depends on the mask's values: ``(order, real, cu)``. ``order [B * S]``
    puts the real tokens first, row by row (those :func:`_padded_index` selects, in its order),
    then the pad tokens; ``cu [B + 2]`` holds the rows' real tokens as sequences, then the pad
    tokens as one sequence more, whose rows are dropped (``real [B * S]`` marks the real ones in
    ``order``). A sequence's rows depend on that sequence alone (rlk.attention's contract), so
    the real rows are the eager path's bits. Without a mask: every token, ``real`` None."""
    if attention_mask is None:
        cu = torch.arange(b + 1, dtype=torch.int32, device=device) * s
        return torch.arange(b * s, device=device), None, cu
    m = attention_mask.to(device=device, dtype=torch.bool)
    if m.shape[1] != s:
        raise ValueError(f"attention_mask covers {m.shape[1]} tokens but there are {s} keys")
    real = m.reshape(-1)
    order = torch.argsort((~real).to(torch.int32), stable=True)
    lengths = m.sum(1)
    cu = torch.cat([_cu(lengths), lengths.new_full((1,), b * s).to(torch.int32)])
    return order, real.index_select(0, order), cu


def rlk_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function backed by :func:`rlk.attention`.

    Shapes: ``query [B, Hq, S, D]``, ``key``/``value [B, Hk, Skv, D]`` (transformers' layout,
    after the cache update); ``attention_mask``: None or the 2-D ``[B, L]`` padding mask
    (``L <= Skv``, True/1 = real token; a static cache holds its first ``L`` slots) that the
    ``"rlk"`` mask function passes through. Returns ``([B, S, Hq, D], None)``; the rows of pad
    queries are zero.

    Which tokens are real: with a mask, the ones it marks (the queries are the last ``S``
    columns of the mask); without one, all of them, except that ``B == 1`` rows whose
    ``position_ids`` restart (or that come with ``cu_seq_lens_q``/``cu_seq_lens_k``) are split
    into packed sequences; a static cache without a mask is cut at the last position + 1.
    ``cu_seq_lens_q`` with ``max_length_q`` (and ``max_length_k``) go to :func:`rlk.attention`
    as the offsets and their ``max_seqlen_q/k`` bounds: nothing is read on the host (the
    packed pass of ``training.GraphedLogprobs``).
    """
    if dropout:
        raise NotImplementedError("rlk attention has no dropout (attention_dropout must be 0)")
    b, hq, s, d = query.shape
    skv = key.shape[2]
    if sliding_window is not None and skv > sliding_window:
        raise NotImplementedError(
            f"rlk attention has no sliding window (window {sliding_window} < {skv} keys)"
        )
    q = query.transpose(1, 2)  # [B, S, Hq, D]
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    position_ids = kwargs.get("position_ids")
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    # transformers' names for bounds on the sequence lengths: given with the offsets, rlk
    # attention reads nothing on the host (capturable in a CUDA graph).
    bounds = {}
    if cu_q is not None and kwargs.get("max_length_q") is not None:
        bounds = {
            "max_seqlen_q": int(kwargs["max_length_q"]),
            "max_seqlen_k": int(kwargs.get("max_length_k") or kwargs["max_length_q"]),
        }
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "rlk attention takes a 2-D padding mask; got a "
            f"{attention_mask.dim()}-D mask (set the model's attention to 'rlk' before masks "
            "are built, e.g. with rlk_integrations.models.transformers.patch_model)"
        )
    if (
        attention_mask is None
        and b == 1
        and s == skv
        and (cu_q is not None or position_ids is not None)
    ):
        if cu_q is None and torch.compiler.is_compiling():
            cu_q = cu_k = _packed_cu_static(position_ids)
        elif cu_q is None:
            cu_q = _packed_memo.get((position_ids,), (), lambda: _packed_cu_seqlens(position_ids))
            cu_k = cu_q
        if cu_q is not None:  # packed sequences in one row
            # squeeze, not [0]: its gradient is a view, where select's fills a zero tensor and
            # copies into it (two kernels per tensor per layer in the backward).
            out = rlk.attention(
                q.squeeze(0).contiguous(),
                k.squeeze(0).contiguous(),
                v.squeeze(0).contiguous(),
                cu_q.to(torch.int32),
                (cu_k if cu_k is not None else cu_q).to(torch.int32),
                causal=True,
                scale=scaling,
                **bounds,
            )
            return out.unsqueeze(0), None
    if torch.compiler.is_compiling():
        if s != skv:
            raise NotImplementedError(
                "rlk attention under torch.compile takes a batch without a KV cache "
                f"({s} queries, {skv} keys)"
            )
        qi, real, cu_q = _padded_order(attention_mask, b, s, query.device)
        ki, cu_k = qi, cu_q
    else:
        qi, ki, cu_q, cu_k = _padded_memo.get(
            (attention_mask, position_ids),
            (b, s, skv, query.device),
            lambda: _padded_index(attention_mask, position_ids, b, s, skv, query.device),
        )
        real = None
    # Index gathers and an index scatter: no host read (boolean indexing would sync per layer).
    out_flat = rlk.attention(
        q.reshape(b * s, hq, d).index_select(0, qi),
        k.reshape(b * skv, -1, d).index_select(0, ki),
        v.reshape(b * skv, -1, d).index_select(0, ki),
        cu_q,
        cu_k,
        causal=True,
        scale=scaling,
    )
    if real is not None:  # the pad tokens' own sequence (torch.compile): dropped
        out_flat = torch.where(real[:, None, None], out_flat, 0.0)
    out = query.new_zeros(b * s, hq, d)
    out.index_copy_(0, qi, out_flat)
    return out.view(b, s, hq, d), None


def rlk_attention_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """The mask transformers hands rlk attention: the 2-D padding mask or None, as for flash
    attention (rlk attention is unpadded too). Eagerly flash attention's function, which
    drops a mask without padding; under ``torch.compile`` the mask's last ``kv_length``
    columns as they are (whether it pads is a value, which the graph cannot branch on; a mask
    of ones gives the bits of none)."""
    from transformers.masking_utils import flash_attention_mask

    if torch.compiler.is_compiling():
        kv_length = kwargs.get("kv_length", args[2] if len(args) > 2 else None)
        return None if attention_mask is None else attention_mask[:, -kv_length:]
    return flash_attention_mask(*args, attention_mask=attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, rlk_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, rlk_attention_mask)
