"""How samples are laid out for a packed recompute: :func:`micro_batches` (indices in groups),
:func:`pack_samples` (whole sequences in one ``[1, T]`` row, positions restarting at 0, no
padding), :func:`pad_rows` (per-sample tensors back to a padded ``[B, L]`` batch), and
``FSDP_FORWARD``, the attribute that marks a model sharded by
:func:`rlk_integrations.engine.training.shard_model`.

No model runs here; :mod:`rlk_integrations.engine.training` (the recompute and the GRPO / PPO
updates) and :mod:`rlk_integrations.engine.graphed` (the CUDA-graph recompute) build on it.
"""

from __future__ import annotations

import torch

from rlk_integrations.engine.engines import Sample

# The name under which shard_model registers the packed log-prob forward on the root module.
FSDP_FORWARD = "_rlk_fsdp_logprobs"


def micro_batches(n: int, size: int, order: list[int] | None = None) -> list[list[int]]:
    """Split sample indices (in ``order``, default ``0..n-1``) into groups of ``size``."""
    order = list(range(n)) if order is None else list(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _pack_lists(samples: list[Sample]) -> tuple[list[int], ...]:
    """``samples`` packed into one row, as host lists: token ids, positions (0 up per sample),
    offsets (``[0, end_1, ...]``), the rows whose hidden state predicts a response token, and
    those tokens."""
    ids, pos, cu, rows, targets = [], [], [0], [], []
    for s in samples:
        p, n = len(s.prompt), len(s.tokens)
        if p < 1:  # its first row would be the previous sequence's last token
            raise ValueError("every sample needs a prompt token (its first logprob's context)")
        # The hidden state at position j predicts the token at j + 1.
        rows += range(cu[-1] + p - 1, cu[-1] + n - 1)
        targets += s.response
        ids += s.tokens
        pos += range(n)
        cu.append(cu[-1] + n)
    return ids, pos, cu, rows, targets


def pack_samples(samples: list[Sample], device: torch.device):
    """``samples`` packed into one row on ``device``: int64 ``ids [1, T]`` and ``positions
    [1, T]`` (0 up per sample), the ``rows [R]`` whose hidden state predicts a response token
    and those ``targets [R]`` (R: the responses' tokens). The layout every packed recompute
    (transformers, the value head, Megatron) reads.

    Example::

        ids, pos, rows, targets = pack_samples(samples, torch.device("cpu"))
    """
    ids, pos, _, rows, targets = _pack_lists(samples)
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return as_long(ids)[None], as_long(pos)[None], as_long(rows), as_long(targets)


def pad_rows(
    rows: list[torch.Tensor], width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D tensors into ``[B, L]`` (zero padded) and a bool mask of the real entries."""
    width = max((r.numel() for r in rows), default=0) if width is None else width
    out = torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.numel())) for r in rows])
    idx = torch.arange(width, device=out.device)
    mask = torch.stack([idx < r.numel() for r in rows])
    return out, mask
