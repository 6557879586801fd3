"""Ops called from many threads at once give the single-thread bits, with no error.

Data loaders and asynchronous rollout workers call rlk from threads. On CPU the kernels run
under Triton's interpreter, which patches module-level state for each launch; rlk serialises
those launches (``rlk_triton._interpreter._LAUNCH_LOCK``). Without the lock most ops fail here
with interpreter errors. On a GPU the same test runs the compiled kernels (``-m gpu``).
"""

from __future__ import annotations

import threading

import pytest
import torch

import rlk
from rlk.ops import losses
from rlk.testing import cases

THREADS, CALLS = 8, 50


def _small(op: str, device: str) -> cases.Case:
    """One unit (a row, a group, a sequence) of the op's smallest invariance case, as keyword
    arguments of the public function: the interpreter's time grows with the tensors."""
    oc = cases.BUILDERS[op](cases.Gen(op, torch.device(device)), True)
    size = lambda c: sum(v.numel() for v in c.args.values() if isinstance(v, torch.Tensor))  # noqa: E731
    case = cases.select(min(oc.invariance, key=size), [0])[0]
    case.args = {k: v for k, v in case.args.items() if v is not None}
    return case


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors(x)]
    return []


def _public(op: str, args: dict) -> dict:
    """A case's arguments as the public function takes them: a case holds the backend's form,
    where policy_loss's ``mode_params`` are floats in ``MODE_PARAMS`` order."""
    if op == "policy_loss" and isinstance(args.get("mode_params"), tuple):
        names = [k for k, _ in losses.MODE_PARAMS.get(args["loss_mode"], ())]
        args = dict(args, mode_params=dict(zip(names, args["mode_params"])))
    return args


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", rlk.OPS)
def test_concurrent_calls_give_the_single_thread_bits(op, device):
    case = _small(op, device)
    fn = getattr(rlk, op)
    with rlk.use_backend("triton"):
        want = _tensors(cases.call(fn, op, _public(op, case.args)))
    assert want
    problems: list[str] = []
    start = threading.Barrier(THREADS)

    def work():
        start.wait()  # every thread calls at once
        with rlk.use_backend("triton"):  # the selection is per thread
            for _ in range(CALLS):
                try:
                    got = _tensors(cases.call(fn, op, _public(op, case.args)))
                except Exception as e:  # reported below, with the others
                    problems.append(f"{type(e).__name__}: {e}")
                    return
                if len(got) != len(want) or not all(map(_same_bits, got, want)):
                    problems.append("different bits")

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not problems, f"{len(problems)} of {THREADS * CALLS} calls: {problems[0]}"
