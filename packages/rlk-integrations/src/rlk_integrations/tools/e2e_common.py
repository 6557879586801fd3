"""What the e2e families' modules share (:mod:`~rlk_integrations.tools.e2e_bench` and its
compiled rows, :mod:`~rlk_integrations.tools.e2e_compile`): the seed and dtype of the models,
the training rows' samples and timing, and the progress lines. Both import it; neither imports
the other back.

Example::

    samples = train_samples(vocab, 8, 512)
    seconds = train_seconds(model, step, samples, device)  # median of TRAIN_ITERS
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from rlk_integrations.engine.engines import Sample
from rlk_integrations.tools.recompute import sync

#: A training row: the median of ``TRAIN_ITERS`` timed iterations after ``TRAIN_WARMUP``
#: untimed ones.
TRAIN_WARMUP = 1
TRAIN_ITERS = 3
#: The models' weights (and the samples') seed, and their dtype.
SEED = 0
DTYPE = torch.bfloat16

_T0 = [time.perf_counter()]


def restart_clock() -> None:
    """Count :func:`say`'s seconds from now (a family's start)."""
    _T0[0] = time.perf_counter()


def say(msg: str) -> None:
    """A progress line on stderr."""
    # Seconds since the family started: what a run cut short by a time limit still tells.
    print(f"[{time.perf_counter() - _T0[0]:6.0f}s] {msg}", file=sys.stderr, flush=True)


def free(device: torch.device) -> None:
    """Release what the last model left (host garbage, the CUDA caching allocator's blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def wall(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), seconds)``, the device idle at both ends."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def train_samples(vocab: int, n: int, length: int) -> list[Sample]:
    """``n`` random sequences of ``length`` tokens. The "prompt" is the first token, so every
    later token is a target (``length - 1`` log-probs per sequence)."""
    g = torch.Generator().manual_seed(SEED + 1)
    rows = torch.randint(0, vocab, (n, length), generator=g).tolist()
    return [Sample(r[:1], r[1:], torch.zeros(0)) for r in rows]


def train_seconds(model, step, samples: list[Sample], device) -> float:
    """The median wall time of ``step(model, samples)`` (forward and backward) over
    :data:`TRAIN_ITERS` iterations after :data:`TRAIN_WARMUP`, gradients zeroed before each."""
    times = []
    for i in range(TRAIN_WARMUP + TRAIN_ITERS):
        model.zero_grad(set_to_none=True)
        _, seconds = wall(lambda: step(model, samples), device)
        if i >= TRAIN_WARMUP:
            times.append(seconds)
    model.zero_grad(set_to_none=True)  # the gradients are a model's worth of memory
    return statistics.median(times)
