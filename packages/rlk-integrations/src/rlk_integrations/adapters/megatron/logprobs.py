"""The training recompute on rlk's ``GPTModel``: one packed ``thd`` forward, then
:func:`rlk.linear_logprobs` (or, at TP > 1, the vocabulary-parallel
:func:`rlk.parallel.vocab_parallel_linear_logprobs`): the Megatron twin of
:func:`rlk_integrations.engine.training.packed_logprobs`, with the rollout's bits.

Example::

    lps = packed_logprobs(mg, samples, logits_dtype=torch.bfloat16)   # one [len(response)] each
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.nn.functional as dist_fn
from torch import nn

import rlk
import rlk.parallel
from rlk_integrations.engine.engines import logprob_temperature
from rlk_integrations.engine.training import pack_samples


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
    return torch.cat(dist_fn.all_gather(w, group=parallel_state.get_tensor_model_parallel_group()))


def packed_logprobs(
    model: nn.Module,
    samples: list[Any],
    *,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Megatron twin of :func:`rlk_integrations.engine.training.packed_logprobs`: one packed ``thd``
    forward of the samples (``prompt + response`` each), :func:`rlk.linear_logprobs` on the
    rows that predict the response tokens. One float32 ``[len(response)]`` per sample.

    At TP > 1 the vocabulary-parallel head goes to
    :func:`rlk.parallel.vocab_parallel_linear_logprobs` (same bits, no gather of the weight;
    :func:`output_weight`'s gather if the vocabulary does not split into its leaves)."""
    device = next(model.parameters()).device
    ids, _, rows, targets = pack_samples(samples, device)
    params = packed_seq_params([len(s.tokens) for s in samples], device)
    hidden = hidden_states(model, ids, params)[:, 0].index_select(0, rows)
    kw = dict(temperature=logprob_temperature(temperature), logits_dtype=logits_dtype)
    local = _local_output_weight(model)
    from megatron.core import parallel_state

    world = parallel_state.get_tensor_model_parallel_world_size()
    if world > 1 and rlk.parallel.vocab_splits(local.shape[0] * world, world):
        # This rank's vocabulary rows; one-device bits without gathering the weight.
        group = parallel_state.get_tensor_model_parallel_group()
        lp = rlk.parallel.vocab_parallel_linear_logprobs(hidden, local, targets, group=group, **kw)
    else:
        lp = rlk.linear_logprobs(hidden, output_weight(model), targets, **kw)
    return list(lp.split([len(s.response) for s in samples]))
