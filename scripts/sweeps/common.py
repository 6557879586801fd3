"""Timing and config-sweep helpers shared by the parts of ``scripts/kernel_sweep.py``."""

from __future__ import annotations

import json

import torch

from rlk_triton import tuning
from rlk_triton._triton import triton


def graph_ms(fn, n_inner: int) -> float:
    """GPU time of one ``fn()`` from a CUDA graph of ``fn`` (which runs n_inner products).

    Not ``rlk.bench.timing.time_call``: that one falls back to eager timing when capture
    fails, and a sweep must see such a config fail (it is skipped) rather than time its host."""
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            fn()
    return do_bench(g.replay, warmup=20, rep=80, return_mode="median") / (4 * n_inner)


def products_ms(op, x, ws) -> float:
    """GPU time of one ``op(x, w)``, from a graph of the products over every weight in ws."""
    return graph_ms(lambda: [op(x, w_) for w_ in ws], len(ws))


# --------------------------------------------------------------------------------------------
# Memory-bound kernels: logprobs (the chunk-group constant and launch configs), silu_and_mul and
# rms_norm launch configs, each against Liger-Kernel, GPU time from CUDA graphs
# --------------------------------------------------------------------------------------------


def _liger_ms(name, make_call):
    from rlk.bench._peers import liger

    Fn = liger(name)
    if Fn is None:
        return float("nan")
    try:
        return products_ms(lambda x, w: make_call(Fn), None, [None])
    except Exception as e:  # a peer that cannot be captured in a graph
        print(name, type(e).__name__, str(e)[:200])
        return float("nan")


def _config_sweep(rows, part, shape, fn, key, configs, nbytes, peer_ms, ref=None):
    """Time ``fn`` under every config of kernel ``key``; bits compared with ``ref``."""
    op = key.split(".")[0]
    chosen = products_ms(lambda x, w: fn(), None, [None])
    ref = fn() if ref is None else ref
    for cf in configs:
        with tuning.force(op, {key: cf}):
            try:
                out = fn()
            except triton.runtime.errors.OutOfResources:
                print("skip", part, shape, cf, "out of resources", flush=True)
                continue
            equal = all(torch.equal(a, b) for a, b in zip(_tensors(out), _tensors(ref)))
            t = products_ms(lambda x, w: fn(), None, [None])
        r = {
            "part": part, "shape": shape, "key": key, "cfg": cf, "us": round(t * 1e3, 2),
            "chosen_us": round(chosen * 1e3, 2), "peer_us": round(peer_ms * 1e3, 2),
            "GBps": round(nbytes / t / 1e6), "bits_equal": bool(equal),
        }  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)


def _tensors(out):
    return out if isinstance(out, tuple) else (out,)
