"""Triton launches and torch kernels of one rlk training step, per decoder layer and for the head.

    python scripts/count_launches.py [--models qwen2-0.5b,llama3-8b-4layers] [--seqs 8] [--len 512]
    python scripts/count_launches.py --decode [--seqs 64]

``--decode``: the paged rollout's decode step instead (``rlk_integrations.engine.paged_step``: the
step that the engine replays as a CUDA graph, here run eagerly, ``--seqs`` requests of one new
token each). Inside a graph a launch costs no host time, but each kernel boundary still leaves
the GPU idle for the next kernel's start and its last wave's tail, so the count bounds that
idle time.

The step is the e2e benchmark's (``rlk_integrations.tools.e2e_bench``): a packed row of random
sequences through the patched model, ``rlk.linear_logprobs``, their sum, backward. It runs on
CPU with every Triton launch counted and skipped (no kernel computes, so the numbers flowing
through are garbage; only the launches are real), once with one decoder layer and once with
two: the difference is one layer's launches, the rest is the embedding, the final norm and the
head. A launch costs the host tens of microseconds on a GPU machine whatever the kernel does,
so in a host-bound step (a small model) these counts bound the step time from below.

The torch column counts the aten ops of the step that run a kernel on a GPU (every op but views
and allocations; counted by a ``TorchDispatchMode``), and ``syncs`` the reads of a device value
by the host (``aten::_local_scalar_dense``: ``.item()``, ``int(t)``). Two CPU paths are counted as
a GPU runs them: value checks are off (as without ``RLK_VALIDATE``), and the kernels' index-check
flag is one tensor, reported by a queued ``_assert_async`` (a CPU call would make a new flag
and read it; ``rlk_triton._bounds``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launch path below

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from rlk import _validate  # noqa: E402
from rlk_integrations.models.transformers import patch_model  # noqa: E402
from rlk_integrations.tools import e2e_bench, zoo  # noqa: E402
from rlk_triton import _bounds  # noqa: E402

LAUNCHES: collections.Counter[str] = collections.Counter()

#: aten ops that allocate only (no kernel).
_ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class _TorchKernels(TorchDispatchMode):
    """Counts into LAUNCHES, as ``torch:<op>``, the aten ops that run a kernel, and host syncs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            LAUNCHES["sync:item"] += 1
        elif not func.is_view and name not in _ALLOCATIONS:
            LAUNCHES[f"torch:{name}"] += 1
        return func(*args, **(kwargs or {}))


def _count(self, *args, **kwargs) -> None:
    LAUNCHES[self.fn.__name__] += 1


def _model(name: str, layers: int) -> torch.nn.Module:
    """``name`` cut to ``layers`` decoder layers, bf16 on the CPU, patched."""
    cls, config = zoo.CONFIGS[name]
    key = f"{name}-{layers}-layers"
    zoo.CONFIGS[key] = (cls, dict(config, num_hidden_layers=layers))
    try:
        model = zoo.load_model(key, dtype=torch.bfloat16, device="cpu", seed=0)
    finally:
        del zoo.CONFIGS[key]
    patch_model(model)
    return model


def step_launches(name: str, layers: int, seqs: int, length: int) -> collections.Counter[str]:
    """Launches per kernel of one training step of ``name`` cut to ``layers`` decoder layers."""
    model = _model(name, layers)
    samples = e2e_bench._train_samples(model.config.vocab_size, seqs, length)
    e2e_bench._rlk_step(model, samples)  # first call: lazily built tables stay out
    model.zero_grad(set_to_none=True)
    LAUNCHES.clear()
    with _TorchKernels():
        e2e_bench._rlk_step(model, samples)
    return collections.Counter(LAUNCHES)


def decode_launches(name: str, layers: int, seqs: int) -> collections.Counter[str]:
    """Launches per kernel of one decode step of ``seqs`` requests (the graphed step, eager)."""
    from rlk_integrations.engine import paged

    model = _model(name, layers)
    padded, paged._EAGER_PADDED_DECODE = paged._EAGER_PADDED_DECODE, True
    try:
        engine = paged.PagedEngine(model, max_len=64, max_batch=seqs, cuda_graphs=False)
    finally:
        paged._EAGER_PADDED_DECODE = padded
    graphs = engine.graphs
    graphs._fill([], seqs, {})  # every row padding: one cached token each
    with torch.no_grad():  # as PagedEngine.generate runs it
        graphs._step(seqs)  # first call: lazily built tables stay out
        LAUNCHES.clear()
        with _TorchKernels():
            graphs._step(seqs)
    return collections.Counter(LAUNCHES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2-0.5b,qwen3-0.6b,llama3-8b-4layers")
    ap.add_argument("--seqs", type=int, default=None, help=f"default {e2e_bench.TRAIN_SEQS}, "
                    f"with --decode {e2e_bench.BATCHES[-1]}")  # fmt: skip
    ap.add_argument("--len", type=int, default=e2e_bench.TRAIN_LEN)
    ap.add_argument("--decode", action="store_true", help="the paged rollout's decode step")
    a = ap.parse_args()
    interpreter.InterpretedFunction.run = _count
    _validate.value_checks_enabled = lambda t: False  # as on a GPU; they read garbage here
    ok = torch.ones(1, dtype=torch.int32)
    _bounds.flag = lambda device: ok
    _bounds.report = lambda flag, message: LAUNCHES.update(["torch:_assert_async"])
    table = []
    if a.decode:
        seqs = a.seqs or e2e_bench.BATCHES[-1]
        count = functools.partial(decode_launches, seqs=seqs)
    else:
        seqs = a.seqs or e2e_bench.TRAIN_SEQS
        count = functools.partial(step_launches, seqs=seqs, length=a.len)
    for name in a.models.split(","):
        one, two = count(name, 1), count(name, 2)
        layer = two - one
        head = one - layer
        print(f"{name}: per layer {_kinds(layer)}, outside the layers {_kinds(head)}")
        for kernel in sorted(set(two), key=lambda k: -two[k]):
            print(f"  {kernel:32s} layer {layer[kernel]:3d}  outside {head[kernel]:3d}")
        n = zoo.CONFIGS[name][1]["num_hidden_layers"]
        step = collections.Counter({k: n * v for k, v in layer.items()}) + head
        table.append((name, _kinds(layer), _kinds(head), n, _kinds(step)))
    print(f"\n{'model':20s} {'layers':>6s}  per layer / outside / per step: Triton, torch, syncs")
    for name, per_layer, outside, n, step in table:
        print(f"{name:20s} {n:6d}  {per_layer} / {outside} / {step}")


def _kinds(counts: collections.Counter[str]) -> str:
    """``Triton, torch, syncs`` counts of ``counts`` as text."""
    torch_ops = sum(v for k, v in counts.items() if k.startswith("torch:"))
    syncs = sum(v for k, v in counts.items() if k.startswith("sync:"))
    return f"{sum(counts.values()) - torch_ops - syncs}, {torch_ops}, {syncs}"


if __name__ == "__main__":
    main()
