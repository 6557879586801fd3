"""The log-probabilities vLLM returns for an rlk model's logits: :func:`rlk.logprobs`' bits.

vLLM 0.32's ``Sampler`` (``vllm.v1.sample.sampler``) computes the log-probabilities it returns in
three methods; :func:`install` wraps those three on the class, and each wrapper changes nothing
unless its logits are ones an rlk model's ``compute_logits`` returned (:func:`mark`; a stock
model in the same process keeps vLLM's numbers):

- ``compute_logprobs(logits)`` (``logprobs_mode="raw_logprobs"``, the only mode the rlk models
  accept): the full ``[N, V]`` fp32 ``log_softmax``. It stays vLLM's, because vLLM picks the
  top-k tokens and the sampled token's rank from it (``log_softmax`` keeps the logits' order, so
  these are the same as rlk's would be); the wrapper remembers which logits gave it;
- ``gather_logprobs(logprobs, k, token_ids)`` (``SamplingParams(logprobs=k)`` and
  ``prompt_logprobs``): vLLM's token ids and ranks, and every returned value replaced by
  :func:`rlk.logprobs` of the logits at that token (one call per column: the sampled or prompt
  token, then each of the top ``k``);
- ``gather_specific_token_logprobs`` (vLLM's scoring API): the same replacement.

``logprobs=-1`` (the whole vocabulary) would need rlk's value for every token: it raises
``NotImplementedError`` for an rlk model. The values are those of ``softmax(logits)`` at
temperature 1 (vLLM's raw log-probabilities, taken before temperature and any logits
processor): the trainer recomputes them with ``temperature=1.0``.
"""

from __future__ import annotations

import weakref

import torch

import rlk

#: id(logits) -> logits, for the logits rlk models returned (kept while vLLM holds them).
_RLK_LOGITS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
#: id(logprobs) -> (logprobs, the logits they came from), for compute_logprobs' results.
_SOURCES: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def mark(logits: torch.Tensor) -> torch.Tensor:
    """Record ``logits [N, V]`` as an rlk model's; returns them."""
    _RLK_LOGITS[id(logits)] = logits
    return logits


def _is_rlk(logits: torch.Tensor) -> bool:
    return _RLK_LOGITS.get(id(logits)) is logits


def _source(logprobs: torch.Tensor) -> torch.Tensor | None:
    """The rlk logits that ``logprobs`` were computed from, else None."""
    entry = _SOURCES.get(id(logprobs))
    if entry is None or entry[0]() is not logprobs:
        return None
    return entry[1]


def _forget_dead() -> None:
    for key in [k for k, (ref, _) in _SOURCES.items() if ref() is None]:
        del _SOURCES[key]


def rlk_values(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """:func:`rlk.logprobs` of ``logits [N, V]`` at each column of ``token_ids [N, K]`` ->
    float32 ``[N, K]`` (negative ids, vLLM's padding, give ``-inf``)."""
    ids = token_ids.long()
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    for j in range(ids.shape[1]):
        col = ids[:, j]
        out[:, j] = rlk.logprobs(logits, col.clamp(min=0))
        out[:, j].masked_fill_(col < 0, float("-inf"))
    return out


def install() -> None:
    """Wrap vLLM's ``Sampler`` methods (once per process; the plugin calls it)."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_rlk_installed", False):
        return
    stock_compute = Sampler.compute_logprobs
    stock_gather = Sampler.gather_logprobs
    stock_specific = Sampler.gather_specific_token_logprobs

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        out = stock_compute(logits)
        if _is_rlk(logits):
            _forget_dead()
            # fp32 logits are the tensor vLLM then tempers in place: keep a copy of them.
            src = logits.clone() if logits.dtype == torch.float32 else logits
            _SOURCES[id(out)] = (weakref.ref(out), src)
        return out

    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
        res = stock_gather(logprobs, num_logprobs, token_ids)
        src = _source(logprobs)
        if src is None:
            return res
        return type(res)(
            res.logprob_token_ids, rlk_values(src, res.logprob_token_ids), res.selected_token_ranks
        )

    def gather_specific_token_logprobs(self, logprobs, logprob_token_ids, sampled):
        res = stock_specific(self, logprobs, logprob_token_ids, sampled)
        src = _source(logprobs)
        if src is None or res is None:
            return res
        values = rlk_values(src, res.logprob_token_ids)
        values = values.masked_fill(torch.isinf(res.logprobs) & (res.logprobs < 0), float("-inf"))
        return type(res)(res.logprob_token_ids, values, res.selected_token_ranks)

    Sampler.compute_logprobs = staticmethod(compute_logprobs)
    Sampler.gather_logprobs = staticmethod(gather_logprobs)
    Sampler.gather_specific_token_logprobs = gather_specific_token_logprobs
    Sampler._rlk_installed = True
    _install_full_vocab_guard(Sampler)


def _install_full_vocab_guard(sampler_cls: type) -> None:
    """``logprobs=-1`` with an rlk model raises instead of returning vLLM's values."""
    stock_forward = sampler_cls.forward

    def forward(self, logits, sampling_metadata, *args, **kwargs):
        if sampling_metadata.max_num_logprobs == -1 and _is_rlk(logits):
            raise NotImplementedError(
                "SamplingParams(logprobs=-1) (the whole vocabulary) is not supported by rlk's "
                "vLLM models: ask for logprobs=k >= 0"
            )
        return stock_forward(self, logits, sampling_metadata, *args, **kwargs)

    sampler_cls.forward = forward
