"""Host time per call of rlk's op wrappers on a CPU, every Triton kernel launch stubbed out.

    python3 scripts/wrapper_host_time.py

What an eager training step or padded rollout pays per op on the host, apart from the kernel
launch: argument checks, backend dispatch, the ``autograd.Function``, output allocation and,
for the backward, autograd's engine. Tiny tensors keep the CPU's own tensor work (allocations,
fills) out of the figures. The stubbed kernels write nothing, so the outputs are garbage; only
the time means anything. The checks that read values, which a CPU tensor always gets and a GPU
one only under ``RLK_VALIDATE=1``, are turned off, as on a GPU by default. Two commits compare
by running this once per checkout (put the other checkout's ``packages/*/src`` first on
``PYTHONPATH``), best of five rounds each.

On a GPU, ``scripts/host_overhead.py`` times the same calls with their real launches.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import time

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors, before rlk imports Triton

import torch  # noqa: E402
from host_overhead import _fwd_bwd  # noqa: E402  (the forward, then a backward of ones)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import rlk  # noqa: E402
import rlk_triton  # noqa: E402
from rlk import _validate  # noqa: E402


def _stub_launches() -> int:
    """Replace every rlk_triton kernel's ``run`` with a no-op; returns how many."""
    n = 0
    for info in pkgutil.iter_modules(rlk_triton.__path__):
        module = importlib.import_module(f"rlk_triton.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, InterpretedFunction):
                obj.run = lambda *args, **kwargs: None
                n += 1
    return n


def _best_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return min(rounds)


def main() -> None:
    print(f"rlk from {os.path.dirname(rlk.__file__)}; {_stub_launches()} kernels stubbed")
    _validate.value_checks_enabled = lambda t: False
    torch.manual_seed(0)
    bf = torch.bfloat16
    t, h, hq, hk, d, inter = 8, 64, 14, 2, 16, 128

    def leaf(*shape):
        return torch.randn(*shape, dtype=bf, requires_grad=True)

    x, r, w, wn, g = leaf(t, h), leaf(t, h), leaf(h, h), leaf(h), leaf(t, 2 * inter)
    q, k, v = leaf(t, hq, d), leaf(t, hk, d), leaf(t, hk, d)
    cu = torch.tensor([0, t], dtype=torch.int32)
    cases = {
        "linear": lambda: rlk.linear(x, w),
        "rms_norm": lambda: rlk.rms_norm(x, wn, 1e-6),
        "rms_norm, residual": lambda: rlk.rms_norm(x, wn, 1e-6, residual=r),
        "silu_and_mul": lambda: rlk.silu_and_mul(g),
        "attention": lambda: rlk.attention(q, k, v, cu, cu, causal=True),
    }
    print(f"{'op':20} {'forward us':>11} {'fwd+bwd us':>11}")
    for name, fn in cases.items():
        with torch.no_grad():
            fwd = _best_us(fn, 300)
        both = _best_us(_fwd_bwd(fn), 100)
        print(f"{name:20} {fwd:11.1f} {both:11.1f}", flush=True)


if __name__ == "__main__":
    main()
