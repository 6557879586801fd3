"""Triton launches of one rlk training step, per kernel, per decoder layer and for the head.

    python scripts/count_launches.py [--models qwen2-0.5b,llama3-8b-4layers] [--seqs 8] [--len 512]

The step is the e2e benchmark's (``rlk_integrations.e2e_bench``): a packed row of random
sequences through the patched model, ``rlk.linear_logprobs``, their sum, backward. It runs on
CPU with every Triton launch counted and skipped (no kernel computes, so the numbers flowing
through are garbage; only the launches are real), once with one decoder layer and once with
two: the difference is one layer's launches, the rest is the embedding, the final norm and the
head. A launch costs the host tens of microseconds on a GPU machine whatever the kernel does,
so in a host-bound step (a small model) these counts bound the step time from below.
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launch path below

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from rlk_integrations import e2e_bench, models  # noqa: E402
from rlk_integrations.transformers import patch_model  # noqa: E402

LAUNCHES: collections.Counter[str] = collections.Counter()


def _count(self, *args, **kwargs) -> None:
    LAUNCHES[self.fn.__name__] += 1


def step_launches(name: str, layers: int, seqs: int, length: int) -> collections.Counter[str]:
    """Launches per kernel of one training step of ``name`` cut to ``layers`` decoder layers."""
    cls, config = models.CONFIGS[name]
    key = f"{name}-{layers}-layers"
    models.CONFIGS[key] = (cls, dict(config, num_hidden_layers=layers))
    try:
        model = models.load_model(key, dtype=torch.bfloat16, device="cpu", seed=0)
    finally:
        del models.CONFIGS[key]
    patch_model(model)
    samples = e2e_bench._train_samples(model.config.vocab_size, seqs, length)
    e2e_bench._rlk_step(model, samples)  # first call: lazily built tables stay out
    model.zero_grad(set_to_none=True)
    LAUNCHES.clear()
    e2e_bench._rlk_step(model, samples)
    return collections.Counter(LAUNCHES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2-0.5b,qwen3-0.6b,llama3-8b-4layers")
    ap.add_argument("--seqs", type=int, default=e2e_bench.TRAIN_SEQS)
    ap.add_argument("--len", type=int, default=e2e_bench.TRAIN_LEN)
    a = ap.parse_args()
    interpreter.InterpretedFunction.run = _count
    os.environ.setdefault("RLK_VALIDATE", "0")  # value checks read results: none exist here
    table = []
    for name in a.models.split(","):
        one = step_launches(name, 1, a.seqs, a.len)
        two = step_launches(name, 2, a.seqs, a.len)
        layer = two - one
        head = one - layer
        print(f"{name}: per layer {sum(layer.values())}, outside the layers {sum(head.values())}")
        for kernel in sorted(set(two), key=lambda k: -two[k]):
            print(f"  {kernel:32s} layer {layer[kernel]:3d}  outside {head[kernel]:3d}")
        n = models.CONFIGS[name][1]["num_hidden_layers"]
        total = n * sum(layer.values()) + sum(head.values())
        table.append((name, sum(layer.values()), sum(head.values()), n, total))
    print(f"\n{'model':20s} {'per layer':>9s} {'outside':>8s} {'layers':>6s} {'per step':>8s}")
    for name, per_layer, outside, n, total in table:
        print(f"{name:20s} {per_layer:9d} {outside:8d} {n:6d} {total:8d}")


if __name__ == "__main__":
    main()
