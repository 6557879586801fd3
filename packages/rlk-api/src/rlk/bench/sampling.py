"""``rlk bench`` family ``sampling``: ``rlk.sample`` against the PyTorch sampler rollout engines
run, eager and under ``torch.compile``.

Impls, on the same random fp32 logits ``[B, V]`` and the same per-row parameters (``[B]``
tensors, as an engine batches requests), drawing from the same distribution:

- ``rlk``: ``rlk.sample(logits, seeds, offsets, temperature=..., top_k=..., top_p=...)``;
- ``torch``: softmax of ``logits / temperature``, filtered by top-k then top-p with one sort
  (vLLM's PyTorch filter), then ``torch.multinomial``;
- ``compile``: ``torch.compile`` of that code, compiled once per shape, before the timing (its
  rows are left out, recorded in the report's ``left_out``, where it does not compile).

Rows: ``sample.temperature`` (temperature 0.8 alone) and ``sample.top_k_top_p`` (temperature
0.8, top_k 50, top_p 0.9). Each impl is called once before it is timed.

Bytes: the logits read once, B*V*4; a sampler that reads them several times (a sort, rlk's radix
passes) moves more than it is credited with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import rlk
from rlk.bench import timing as _timing
from rlk.bench._peers import compiled, measure

#: ``(B, V)``, quick takes the first: a rollout step of 256, 1024, 64 and 1 sequences, Qwen's
#: vocabulary.
SHAPES: list[tuple[int, int]] = [(256, 151936), (1024, 151936), (64, 151936), (1, 151936)]
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9


def _torch_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    return torch.multinomial(probs, 1)[:, 0]


def _torch_top_k_top_p(logits, temperature, top_k, top_p):
    """vLLM's PyTorch top-k/top-p filter, then multinomial (in sorted order, mapped back)."""
    z, index = (logits / temperature[:, None]).sort(dim=-1)  # ascending
    # top-k: drop what is below the k-th largest (ties kept).
    kth = z.gather(1, (z.shape[1] - top_k)[:, None])
    z = z.masked_fill(z < kth, float("-inf"))
    # top-p: drop the smallest tokens while the mass up to them is <= 1 - top_p; keep the top.
    below = z.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
    below[:, -1] = False
    z = z.masked_fill(below, float("-inf"))
    picked = torch.multinomial(z.softmax(dim=-1), 1)
    return index.gather(1, picked)[:, 0]


def _sample(emit, B: int, V: int) -> None:
    dev = _timing.DEVICE
    logits = torch.randn(B, V, device=dev, dtype=torch.float32)
    seeds = torch.arange(B, device=dev, dtype=torch.int64)
    offsets = torch.zeros(B, device=dev, dtype=torch.int64)
    t = torch.full((B,), TEMPERATURE, device=dev)
    k = torch.full((B,), TOP_K, device=dev, dtype=torch.int64)
    p = torch.full((B,), TOP_P, device=dev)
    shape, dt, nbytes = f"B={B} V={V}", _timing.dtype_name(logits.dtype), B * V * 4
    rlk_temperature = lambda: rlk.sample(logits, seeds, offsets, temperature=t)
    rlk_top_k_top_p = lambda: rlk.sample(logits, seeds, offsets, temperature=t, top_k=k, top_p=p)
    for op, rlk_fn, torch_fn, args in (
        ("sample.temperature", rlk_temperature, _torch_temperature, (logits, t)),
        ("sample.top_k_top_p", rlk_top_k_top_p, _torch_top_k_top_p, (logits, t, k, p)),
    ):
        measure(emit, op, shape, dt, "rlk", rlk_fn, nbytes=nbytes)
        measure(emit, op, shape, dt, "torch", functools.partial(torch_fn, *args), nbytes=nbytes)
        fn = functools.partial(compiled(torch_fn), *args)
        measure(emit, op, shape, dt, "compile", fn, nbytes=nbytes)


def run(quick: bool, emit: Callable[[dict], None]) -> None:
    """Emit the rows of every shape (only the first when ``quick``)."""
    for B, V in SHAPES[: 1 if quick else None]:
        _sample(emit, B, V)
