"""Bad index and per-row value inputs as a careless caller passes them, in default mode (no
host value checks).

On a GPU without ``RLK_VALIDATE`` the ops do not read index values on the host (that would
synchronise the device), so these inputs reach the kernels; the kernels must then touch no
memory out of range and still report the input (``rlk_triton._bounds``). On CPU the host checks
always run, so :func:`default_mode` switches them off to reproduce the GPU path under the
Triton interpreter.

Each case returns a function that runs the op (forward, and backward where there is one) and
the outcome the contract requires: ``"error"`` (a ``ValueError`` on CPU; on a GPU an error at
the next synchronisation, a device-side assertion), ``"-1"`` (``sample``'s token for a row it
cannot draw from) or ``"nan"`` (a loss or advantages of NaN). Besides the indices, the per-row
values that the host checks only with value checks on are here too: ``sample``'s temperature,
top-k and top-p, logits whose ``logit / temperature`` overflows fp32, and a loss mask holding a
value other than 0 or 1 (:data:`VALUE_CASES`).
``scripts/bad_inputs.py`` runs them one per process, under ``compute-sanitizer`` on a GPU
(``scripts/gpu_sanitize.sh``); ``tests/test_bad_inputs.py`` runs them on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch

import rlk
from rlk import _validate

I32 = torch.int32


@contextlib.contextmanager
def default_mode() -> Iterator[None]:
    """Host value checks off, as for a CUDA tensor without ``RLK_VALIDATE``."""
    with mock.patch.object(_validate, "value_checks_enabled", lambda t: False):
        yield


def _cu(*offsets: int, device) -> torch.Tensor:
    return torch.tensor(offsets, dtype=I32, device=device)


def _randn(*shape: int, device, grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=g).to(device).requires_grad_(grad)


def _attention(
    cu_q: tuple, cu_k: tuple, train: bool = False, bounds: tuple | None = None
) -> Callable:
    """q of 5 tokens, k/v of 7, 4 query heads on 2 KV heads, head dim 16; ``bounds``: the
    ``(max_seqlen_q, max_seqlen_k)`` passed."""
    extra = {} if bounds is None else {"max_seqlen_q": bounds[0], "max_seqlen_k": bounds[1]}

    def build(device):
        q = _randn(5, 4, 16, device=device, grad=train)
        k = _randn(7, 2, 16, device=device, grad=train)
        v = _randn(7, 2, 16, device=device, grad=train)

        def run():
            cu_q_t, cu_k_t = _cu(*cu_q, device=device), _cu(*cu_k, device=device)
            o = rlk.attention(q, k, v, cu_q_t, cu_k_t, **extra)
            if train:
                o.sum().backward()
            return o

        return run

    return build


def _paged(block_table: list, seq_lens: list) -> Callable:
    """A 4-page cache of 16-token pages; two sequences of one new query each."""

    def build(device):
        q = _randn(2, 4, 16, device=device)
        kc, vc = _randn(4, 16, 2, 16, device=device), _randn(4, 16, 2, 16, device=device)
        bt = torch.tensor(block_table, dtype=I32, device=device)
        lens = torch.tensor(seq_lens, dtype=I32, device=device)
        return lambda: rlk.paged_attention(q, kc, vc, bt, lens, _cu(0, 1, 2, device=device))

    return build


def _logprobs(targets: list, fused: bool = False) -> Callable:
    """Vocabulary of 300, one target per row, with the backward."""

    def build(device):
        t = torch.tensor(targets, dtype=torch.int64, device=device)
        logits = _randn(len(targets), 300, device=device, grad=True)
        hidden = _randn(len(targets), 32, device=device, grad=True)
        weight = _randn(300, 32, device=device, grad=True)

        def run():
            lp = rlk.linear_logprobs(hidden, weight, t) if fused else rlk.logprobs(logits, t)
            lp.sum().backward()
            return lp

        return run

    return build


def _sample_nan(device):
    logits = _randn(3, 300, device=device)
    logits[1, 17] = float("nan")
    seeds = torch.arange(3, device=device)
    return lambda: rlk.sample(logits, seeds, torch.zeros_like(seeds), temperature=0.7)


def _sample_param(which: str, value: float, filters: bool = True) -> Callable:
    """Three rows of 1100 logits (three vocabulary blocks: the filters' split threshold on a
    GPU, and under the interpreter), row 1's ``which`` set to ``value``; with ``filters``,
    per-row top-k 5 and top-p 0.9 (else temperature alone)."""

    def build(device):
        logits = _randn(3, 1100, device=device)
        seeds = torch.arange(3, device=device)
        kw = {"temperature": torch.full((3,), 0.8, device=device)}
        if filters:
            kw["top_k"] = torch.full((3,), 5, dtype=torch.int64, device=device)
            kw["top_p"] = torch.full((3,), 0.9, device=device)
        kw[which][1] = value
        return lambda: rlk.sample(logits, seeds, torch.zeros_like(seeds), **kw)

    return build


def _sample_overflow(device):
    """Row 1 outside the domain: logits of 3e38 at temperature 1e-3 overflow fp32 (with top-k
    and top-p, so that the filters' block maxima must mark the block)."""
    logits = _randn(3, 1100, device=device)
    logits[1, 600:603] = 3e38
    seeds = torch.arange(3, device=device)
    return lambda: rlk.sample(logits, seeds, torch.zeros_like(seeds), temperature=1e-3,
                              top_k=5, top_p=0.9)  # fmt: skip


def _loss_mask(value: float, op: str = "policy_loss") -> Callable:
    """A ``[2, 5]`` float mask of ones but ``value`` at ``[1, 2]``: ``policy_loss`` or
    ``value_loss`` (with the backward), the REINFORCE++ or OPO ``grpo_advantages`` (one group) or
    the whitened ``gae_advantages``."""

    def build(device):
        mask = torch.ones(2, 5, device=device)
        mask[1, 2] = value
        if op == "grpo_advantages":
            rewards = _randn(2, device=device)
            return lambda: rlk.grpo_advantages(rewards, estimator="reinforce++", mask=mask)
        if op == "grpo_advantages opo":
            rewards = _randn(2, device=device)
            return lambda: rlk.grpo_advantages(rewards, 2, estimator="opo", mask=mask)
        x = _randn(2, 5, device=device, grad=True)
        old, other = _randn(2, 5, device=device) - 0.1, _randn(2, 5, device=device)
        if op == "gae_advantages":
            return lambda: rlk.gae_advantages(other, old, mask, lam=0.9)[0]

        def run():
            if op == "value_loss":
                loss, _ = rlk.value_loss(x, old, other, mask)
            else:
                loss, _ = rlk.policy_loss(x, old, other[:, 0].contiguous(), mask)
            loss.backward()
            return loss

        return run

    return build


NAN = float("nan")


#: name -> (builder(device) -> run(), required outcome).
CASES: dict[str, tuple[Callable, str]] = {
    "control: valid attention": (_attention((0, 2, 5), (0, 3, 7), train=True), "ok"),
    "attention cu_seqlens_q[-1] > T": (_attention((0, 2, 7), (0, 3, 7)), "error"),
    "attention cu_seqlens_q[-1] < T": (_attention((0, 2, 4), (0, 3, 7)), "error"),
    "attention cu_seqlens_q decreasing": (_attention((0, 4, 2, 5), (0, 3, 5, 7)), "error"),
    "attention cu_seqlens_q[0] < 0": (_attention((-3, 2, 5), (0, 3, 7)), "error"),
    "attention cu_seqlens_q huge": (_attention((0, 2, 2**31 - 1), (0, 3, 7)), "error"),
    "attention cu_seqlens_k[-1] > T (training)": (
        _attention((0, 2, 5), (0, 3, 9), train=True),
        "error",
    ),
    "attention cu_seqlens_k[0] < 0 (training)": (
        _attention((0, 2, 5), (-2, 3, 7), train=True),
        "error",
    ),
    "control: attention within max_seqlen": (
        _attention((0, 2, 5), (0, 3, 7), train=True, bounds=(3, 4)),
        "ok",
    ),
    "attention longer than max_seqlen_q": (
        _attention((0, 2, 5), (0, 3, 7), bounds=(2, 4)),
        "error",
    ),
    "attention longer than max_seqlen_k (training)": (
        _attention((0, 2, 5), (0, 3, 7), train=True, bounds=(3, 3)),
        "error",
    ),
    "control: valid paged_attention": (_paged([[0, 1], [2, 3]], [20, 3]), "ok"),
    "paged page id = num_pages": (_paged([[0, 4], [2, 3]], [20, 3]), "error"),
    "paged page id -7": (_paged([[0, 1], [-7, 3]], [20, 3]), "error"),
    "paged page id 1e8": (_paged([[0, 10**8], [2, 3]], [20, 3]), "error"),
    "paged seq_lens over capacity": (_paged([[0, 1], [2, 3]], [20, 40]), "error"),
    "paged seq_lens < queries": (_paged([[0, 1], [2, 3]], [20, -4]), "error"),
    "logprobs target = V": (_logprobs([3, 300, 5]), "error"),
    "logprobs target -1": (_logprobs([3, -1, 5]), "error"),
    "logprobs target 2**40": (_logprobs([2**40, 1]), "error"),
    "linear_logprobs target = V": (_logprobs([3, 300], fused=True), "error"),
    "linear_logprobs target -5": (_logprobs([-5, 2], fused=True), "error"),
    "sample NaN logits": (_sample_nan, "-1"),
}
#: The per-row values that the host checks only with value checks on (a row with a bad one
#: draws no token, a loss mask with one gives NaN): no CUDA context is lost on them, so they
#: can run in one process, on any backend.
VALUE_CASES: dict[str, tuple[Callable, str]] = {
    "control: valid sample parameters": (_sample_param("temperature", 0.5), "ok"),
    "sample temperature -1": (_sample_param("temperature", -1.0), "-1"),
    "sample temperature NaN": (_sample_param("temperature", NAN), "-1"),
    "sample temperature inf": (_sample_param("temperature", float("inf")), "-1"),
    "sample temperature -1 (no filter)": (_sample_param("temperature", -1.0, False), "-1"),
    "sample top_k -1": (_sample_param("top_k", -1), "-1"),
    "sample top_p 1.5": (_sample_param("top_p", 1.5), "-1"),
    "sample top_p 0": (_sample_param("top_p", 0.0), "-1"),
    "sample top_p NaN": (_sample_param("top_p", NAN), "-1"),
    "sample logits / temperature overflows": (_sample_overflow, "-1"),
    "control: valid policy_loss mask": (_loss_mask(0.0), "ok"),
    "policy_loss mask 0.5": (_loss_mask(0.5), "nan"),
    "policy_loss mask NaN": (_loss_mask(NAN), "nan"),
    "policy_loss mask 2": (_loss_mask(2.0), "nan"),
    "grpo_advantages (reinforce++) mask 0.5": (_loss_mask(0.5, "grpo_advantages"), "nan"),
    "grpo_advantages (opo) mask 0.5": (_loss_mask(0.5, "grpo_advantages opo"), "nan"),
    "value_loss mask 0.5": (_loss_mask(0.5, "value_loss"), "nan"),
    "gae_advantages mask NaN": (_loss_mask(NAN, "gae_advantages"), "nan"),
    "control: valid gae_advantages mask": (_loss_mask(0.0, "gae_advantages"), "ok"),
}
CASES.update(VALUE_CASES)


def run(name: str, device: str | torch.device) -> tuple[str, str]:
    """Run case ``name`` in default mode: ``(outcome, detail)``, outcome ``"ok"``, ``"error"``,
    ``"-1"`` (a row of -1 tokens) or ``"nan"`` (every value NaN). On a GPU the device is
    synchronised before returning, so that an asynchronous error surfaces here."""
    device = torch.device(device)
    build, _ = CASES[name]
    try:
        with default_mode():
            out = build(device)()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except (ValueError, RuntimeError) as e:
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if out.dtype == torch.int64 and bool((out == -1).any()):
        return "-1", f"tokens {out.tolist()}"
    nan = int(out.isnan().sum()) if out.is_floating_point() else 0
    outcome = "nan" if nan and nan == out.numel() else "ok"
    return outcome, f"returned {tuple(out.shape)}, {nan} NaN"
