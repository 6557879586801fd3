"""The log-probabilities vLLM returns for an rlk model's logits: :func:`rlk.logprobs`' bits.

Which distribution (the contract; :func:`rlk_integrations.engine.training.recompute_logprobs`
gives the same bits with the ``temperature`` named here):

- ``logprobs_mode="processed_logprobs"`` (what TRL's ``use_vllm`` and verl's vLLM server run):
  the value for a sampled token (and for each of the top ``k``) is
  ``log_softmax(logits / T)[token]`` with ``T`` the request's ``SamplingParams.temperature``
  (``T = 1`` for a greedy request, ``temperature=0``): recompute with ``temperature=T``. It is
  the tempered distribution over the whole vocabulary, *before* top-k / top-p / min-p
  truncation, penalties and logit bias. Those change which token vLLM samples but not the
  reported value: TRL 1.16 (``selective_log_softmax(logits / temperature)``) and verl 0.9.1
  (``logits.div_(temperature)`` then ``log_softmax``) recompute the untruncated tempered
  distribution, and this is that one. (Stock vLLM's processed values renormalise over the
  tokens top-k / top-p keep, so with truncation they are not what those trainers recompute.)
- ``logprobs_mode="raw_logprobs"``: ``log_softmax(logits)[token]`` whatever the request's
  temperature: recompute with ``temperature=1.0``.
- ``prompt_logprobs``: always ``log_softmax(logits)`` (temperature 1), in either mode (vLLM
  computes them from the raw logits).

How: vLLM 0.32's ``Sampler`` (``vllm.v1.sample.sampler``) computes the values it returns in a
few methods; :func:`install` wraps them on the class, and each wrapper changes nothing unless
its logits are ones an rlk model's ``compute_logits`` returned (:func:`mark`; a stock model in
the same process keeps vLLM's numbers):

- ``forward(logits, sampling_metadata)``: for rlk logits, keeps a copy of them (vLLM tempers
  its fp32 logits in place) and each row's temperature for the gathers inside it;
- ``compute_logprobs(logits)``: stays vLLM's (vLLM picks the top-k tokens and the sampled
  token's rank from it); remembers which rlk logits gave it (the prompt-logprobs path);
- ``gather_logprobs(logprobs, k, token_ids)`` (``SamplingParams(logprobs=k)``,
  ``prompt_logprobs``) and ``gather_specific_token_logprobs`` (vLLM's scoring API): vLLM's
  token ids and ranks, every value replaced by :func:`rlk.logprobs` of the logits at that token
  (one call per column and temperature: the sampled or prompt token, then each of the top
  ``k``).

``logprobs=-1`` (the whole vocabulary) would take one :func:`rlk.logprobs` call per vocabulary
column: a request for it, or for as many columns as the vocabulary has, is refused with a
``ValueError`` before it reaches the engine (:func:`install_request_check`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import rlk

#: id(logits) -> logits, for the logits rlk models returned (kept while vLLM holds them).
_RLK_LOGITS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
#: id(logprobs) -> (logprobs, the logits they came from), for compute_logprobs' results.
_SOURCES: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
#: The rlk logits and per-row temperatures of the sampler call in progress (else None).
_ACTIVE: list[tuple[torch.Tensor, list[float] | None]] = []
#: vLLM's threshold below which a temperature means greedy (its ``_SAMPLING_EPS``).
_SAMPLING_EPS = 1e-5


def mark(logits: torch.Tensor) -> torch.Tensor:
    """Record ``logits [N, V]`` as an rlk model's; returns them."""
    _RLK_LOGITS[id(logits)] = logits
    return logits


def _is_rlk(logits: torch.Tensor) -> bool:
    return _RLK_LOGITS.get(id(logits)) is logits


def _source(logprobs: torch.Tensor) -> tuple[torch.Tensor, list[float] | None] | None:
    """The rlk logits (and row temperatures) that ``logprobs [N, V]`` were computed from."""
    if _ACTIVE and _ACTIVE[-1][0].shape[0] == logprobs.shape[0]:
        return _ACTIVE[-1]
    entry = _SOURCES.get(id(logprobs))
    if entry is None or entry[0]() is not logprobs:
        return None
    return entry[1], None


def _forget_dead() -> None:
    for key in [k for k, (ref, _) in _SOURCES.items() if ref() is None]:
        del _SOURCES[key]


def rlk_values(
    logits: torch.Tensor, token_ids: torch.Tensor, temperatures: list[float] | None = None
) -> torch.Tensor:
    """:func:`rlk.logprobs` of ``logits [N, V]`` at each column of ``token_ids [N, K]`` ->
    float32 ``[N, K]`` (negative ids, vLLM's padding, give ``-inf``). ``temperatures``: one per
    row (None: 1.0 for all); rows of one temperature go to rlk together (its values of a row do
    not depend on the other rows)."""
    ids = token_ids.long()
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    temps = [1.0] * ids.shape[0] if temperatures is None else temperatures
    for t in sorted(set(temps)):
        rows = torch.tensor([i for i, ti in enumerate(temps) if ti == t], device=logits.device)
        every = rows.numel() == ids.shape[0]
        part = logits if every else logits.index_select(0, rows)
        for j in range(ids.shape[1]):
            col = ids[:, j] if every else ids.index_select(0, rows)[:, j]
            val = rlk.logprobs(part, col.clamp(min=0), temperature=t)
            val = val.masked_fill(col < 0, float("-inf"))
            if every:
                out[:, j] = val
            else:
                out[rows, j] = val
    return out


def _row_temperatures(sampler: Any, metadata: Any, override: Any) -> list[float] | None:
    """Each row's temperature of the values reported (None: 1.0 for all), as vLLM applies it:
    a greedy row (temperature below vLLM's epsilon) is divided by 1."""
    mode = override or sampler.logprobs_mode
    if mode == "raw_logprobs" or metadata.all_greedy or metadata.temperature is None:
        return None
    if mode != "processed_logprobs":  # check_config refuses the rest at engine start
        raise NotImplementedError(f"rlk's vLLM models do not support logprobs_mode={mode!r}")
    temps = metadata.temperature.float().cpu().tolist()
    return [1.0 if t < _SAMPLING_EPS else t for t in temps]


def install() -> None:
    """Wrap vLLM's ``Sampler`` methods (once per process; the plugin calls it)."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_rlk_installed", False):
        return
    stock_forward = Sampler.forward
    stock_compute = Sampler.compute_logprobs
    stock_gather = Sampler.gather_logprobs
    stock_specific = Sampler.gather_specific_token_logprobs

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):  # fmt: skip  # noqa: E501
        if not _is_rlk(logits):
            return stock_forward(
                self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override
            )
        if sampling_metadata.max_num_logprobs == -1:
            raise NotImplementedError(
                "SamplingParams(logprobs=-1) (the whole vocabulary) is not supported by rlk's "
                "vLLM models: ask for logprobs=k >= 0"
            )
        temps = _row_temperatures(self, sampling_metadata, logprobs_mode_override)
        # vLLM divides fp32 logits by the temperature in place: keep the model's own.
        src = logits.clone() if logits.dtype == torch.float32 else logits
        _ACTIVE.append((src, temps))
        try:
            return stock_forward(
                self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override
            )
        finally:
            _ACTIVE.pop()

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        out = stock_compute(logits)
        if _is_rlk(logits):
            _forget_dead()
            src = logits.clone() if logits.dtype == torch.float32 else logits
            _SOURCES[id(out)] = (weakref.ref(out), src)
        return out

    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
        res = stock_gather(logprobs, num_logprobs, token_ids)
        src = _source(logprobs)
        if src is None:
            return res
        values = rlk_values(src[0], res.logprob_token_ids, src[1])
        return type(res)(res.logprob_token_ids, values, res.selected_token_ranks)

    def gather_specific_token_logprobs(self, logprobs, logprob_token_ids, sampled):
        res = stock_specific(self, logprobs, logprob_token_ids, sampled)
        src = _source(logprobs)
        if src is None or res is None:
            return res
        values = rlk_values(src[0], res.logprob_token_ids, src[1])
        values = values.masked_fill(torch.isinf(res.logprobs) & (res.logprobs < 0), float("-inf"))
        return type(res)(res.logprob_token_ids, values, res.selected_token_ranks)

    Sampler.forward = forward
    Sampler.compute_logprobs = staticmethod(compute_logprobs)
    Sampler.gather_logprobs = staticmethod(gather_logprobs)
    Sampler.gather_specific_token_logprobs = gather_specific_token_logprobs
    Sampler._rlk_installed = True


def is_rlk_model(model_config: Any) -> bool:
    """Whether vLLM's ``model_config`` names one of rlk's model classes."""
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    return any(str(a).startswith("RLK") for a in archs)


def _request_error() -> type:
    """vLLM's ``VLLMValidationError`` (the server answers it with 400) that is also a
    ``ValueError`` (what a bad argument raises in rlk)."""
    global _REQUEST_ERROR
    if _REQUEST_ERROR is None:
        from vllm.exceptions import VLLMValidationError

        _REQUEST_ERROR = type("RLKRequestError", (VLLMValidationError, ValueError), {})
    return _REQUEST_ERROR


_REQUEST_ERROR: type | None = None


def install_request_check() -> None:
    """Refuse, in the process that takes requests (``LLM.generate``, the OpenAI server's 400),
    ``logprobs=-1`` / ``prompt_logprobs=-1`` and counts as large as the vocabulary for an rlk
    model: rlk would run once per vocabulary column (2 tokens of a 150k vocabulary: minutes)."""
    from vllm.sampling_params import SamplingParams

    if getattr(SamplingParams, "_rlk_checked", False):
        return
    stock = SamplingParams._validate_logprobs

    def _validate_logprobs(self, model_config):
        if is_rlk_model(model_config):
            vocab = model_config.get_vocab_size()
            for field in ("logprobs", "prompt_logprobs"):
                k = getattr(self, field)
                if k is not None and (k == -1 or k >= vocab):
                    raise _request_error()(
                        f"rlk's vLLM models do not serve {field}={k} (the whole vocabulary of "
                        f"{vocab}: one rlk.logprobs call per column); ask for {field}=k < {vocab}",
                        parameter=field,
                        value=k,
                    )
        return stock(self, model_config)

    SamplingParams._validate_logprobs = _validate_logprobs
    SamplingParams._rlk_checked = True
