"""Where a training step's time goes: wall time against GPU kernel time, per kernel and per
host function, for stock transformers, stock + Liger's fused linear cross-entropy, and rlk.

    python scripts/profile_training.py [--models qwen2-0.5b,qwen3-0.6b] [--seqs 8] [--len 512]

The step is the e2e benchmark's (``rlk_integrations.tools.e2e_bench``): a packed row of random
sequences, forward, log-probabilities, their sum, backward. For each model and impl:

- ``wall``: median of 3 synchronised steps;
- ``gpu``: the sum of kernel durations in one profiled step (torch.profiler), so ``wall - gpu``
  is time the GPU waited for the host (kernels do not overlap in one stream);
- ``host``: the time until the step returns, the device not waited for at its end;
- ``syncs``: synchronising CUDA calls in one step (torch's sync debug mode), by Python line;
- ``--triton-run``: rlk once more with its launch cache off, every kernel launched through
  Triton's own ``run``;
- ``--graphed``: rlk once more through ``GraphedLogprobs`` (the first step captures);
- the kernels that take the most GPU time, and (``--host``) the Python functions that take
  the most host time in one step (cProfile, by own time, then rlk's by cumulative time).

The table printed last has one line per model and impl.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict

import torch

from rlk_integrations.models.transformers import patch_model, unpatch_model
from rlk_integrations.tools import e2e_bench as e2e
from rlk_integrations.tools.zoo import load_model
from rlk_triton import _triton


def _wall(step, model, samples) -> float:
    times = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(model, samples)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def kernel_times(fn) -> tuple[float, dict[str, list[float]]]:
    """GPU kernel seconds of one call of ``fn`` (torch.profiler; kernels inside CUDA graph
    replays are recorded one by one) and ``{kernel name: [us, calls]}``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[ev.name[:60]][0] += us
            per[ev.name[:60]][1] += 1
            total += us
    return total / 1e6, per


def _kernels(step, model, samples) -> tuple[float, dict[str, list[float]]]:
    model.zero_grad(set_to_none=True)
    return kernel_times(lambda: step(model, samples))


def _host(step, model, samples, top: int) -> str:
    model.zero_grad(set_to_none=True)
    pr = cProfile.Profile()
    pr.enable()
    step(model, samples)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    stats = pstats.Stats(pr, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("rlk", top)
    return s.getvalue()


def _enqueue(step, model, samples) -> float:
    """Seconds until ``step`` returns, the device not waited for at its end: close to the wall
    time when the host is the limit (or the step synchronises), well below it when the GPU is."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    step(model, samples)
    seconds = time.perf_counter() - t
    torch.cuda.synchronize()
    return seconds


def _syncs(step, model, samples) -> dict[str, int]:
    """Synchronising CUDA calls in one step (torch's sync debug mode), by the Python line that
    made them."""
    import warnings

    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(model, samples)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    where: dict[str, int] = defaultdict(int)
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{w.filename}:{w.lineno}"] += 1
    return dict(where)


def _triton_run(step):
    """``step`` with rlk's launch cache off (:data:`rlk_triton._triton.FAST_LAUNCH`)."""

    def run(model, samples):
        _triton.FAST_LAUNCH = False
        try:
            return step(model, samples)
        finally:
            _triton.FAST_LAUNCH = True

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen2-0.5b,qwen3-0.6b")
    p.add_argument("--seqs", type=int, default=e2e.TRAIN_SEQS)
    p.add_argument("--len", type=int, default=e2e.TRAIN_LEN)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--host", action="store_true", help="also cProfile one step")
    p.add_argument(
        "--triton-run",
        action="store_true",
        help="also rlk with every kernel launched through Triton's own run (no launch cache)",
    )
    p.add_argument(
        "--graphed",
        action="store_true",
        help="also rlk with the pass and its backward replayed as CUDA graphs (GraphedLogprobs)",
    )
    a = p.parse_args()
    flce = e2e._liger()
    table = []
    for name in a.models.split(","):
        model = load_model(name, dtype=torch.bfloat16, device="cuda", seed=0)
        samples = e2e._train_samples(model.config.vocab_size, a.seqs, a.len)
        impls = [("stock", False, e2e._stock_step)]
        if flce is not None:
            impls.append(("stock+liger", False, lambda m, s: e2e._liger_step(flce, m, s)))
        impls.append(("rlk", True, e2e._rlk_step))
        if a.triton_run:
            impls.append(("rlk/triton-run", True, _triton_run(e2e._rlk_step)))
        if a.graphed:
            impls.append(("rlk graphed", True, e2e._graphed_step()))
        for impl, patched, step in impls:
            (patch_model if patched else unpatch_model)(model)
            wall = _wall(step, model, samples)
            gpu, per = _kernels(step, model, samples)
            enq = _enqueue(step, model, samples)
            syncs = _syncs(step, model, samples)
            print(
                f"\n== {name} {impl}: wall {wall * 1e3:.1f} ms, kernels {gpu * 1e3:.1f} ms "
                f"({sum(n for _, n in per.values())} launches), host enqueue {enq * 1e3:.1f} ms, "
                f"{sum(syncs.values())} synchronising calls"
            )
            for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:8]:
                print(f"  sync {n:4d}x  {where}")
            for k, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[: a.top]:
                print(f"  {us / 1e3:8.2f} ms {n:5d}x  {k}")
            if a.host and impl in ("rlk", "stock+liger"):
                print(_host(step, model, samples, 30))
            table.append((name, impl, wall, gpu, enq, sum(syncs.values()), a.seqs * a.len / wall))
        unpatch_model(model)
        del model
        torch.cuda.empty_cache()
    print(
        f"\n{'model':<20} {'impl':<15} {'wall ms':>8} {'gpu ms':>8} {'idle %':>7} "
        f"{'host ms':>8} {'syncs':>6} {'tok/s':>9}"
    )
    for name, impl, wall, gpu, enq, syncs, tok in table:
        idle = 100 * max(0.0, 1 - gpu / wall)
        print(
            f"{name:<20} {impl:<15} {wall * 1e3:8.1f} {gpu * 1e3:8.1f} {idle:7.1f} "
            f"{enq * 1e3:8.1f} {syncs:6d} {tok:9.0f}"
        )


if __name__ == "__main__":
    main()
