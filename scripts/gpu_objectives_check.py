"""Every ``grpo_advantages`` estimator compiled and run on a GPU (or ``--cpu``: the Triton
interpreter) against the float64 reference backend: a quick compile-and-agree check after
kernel edits, printing each estimator's max |difference|.

    python scripts/gpu_objectives_check.py [--cpu]
"""

import sys

import torch

import rlk

dev = "cpu" if "--cpu" in sys.argv else "cuda"
g = torch.Generator(device=dev).manual_seed(0)
rewards = torch.rand(64, device=dev, generator=g)
mask = torch.arange(9, device=dev)[None] < torch.randint(1, 10, (64, 1), device=dev, generator=g)
for est in ("grpo", "rloo", "reinforce++-baseline", "reinforce++", "rloo_vectorized", "opo",
            "grpo_passk"):  # fmt: skip
    kw = {"mask": mask} if est in ("opo", "reinforce++", "reinforce++-baseline") else {}
    group = None if est == "reinforce++" else 8
    try:
        a = rlk.grpo_advantages(rewards, group, estimator=est, **kw)
        with rlk.use_backend("reference"):
            b = rlk.grpo_advantages(rewards, group, estimator=est, **kw)
        print(f"{est:<24} {(a.double() - b.double()).abs().max().item():.1e}")
    except Exception as e:  # report every estimator
        print(f"{est:<24} {type(e).__name__}: {str(e)[:100]}")
