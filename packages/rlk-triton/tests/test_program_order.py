"""No result depends on the order in which a kernel's programs run.

A GPU schedules a grid's programs in any order, and that order changes from run to run and
with the load on the device. rlk's kernels use no atomics; every value a program adds across
programs (attention's dQ over key/value tiles, the experts' weight gradients over tokens, a
tree GEMM's leaves) is added in an order the code fixes. Under Triton's interpreter the
programs run one after another in grid order, so running them in the reversed order instead
shows any sum that depends on the schedule: every op of the conformance kit, forward and
backward, on its invariance cases, must give the same bits both ways. The negative control is
a kernel that adds across programs in arrival order, which the reversal must catch.
"""

from __future__ import annotations

import pytest
import torch

from rlk import selection, testing
from rlk.testing import checks
from rlk_triton._triton import INTERPRET, tl, triton  # rlk first: it sets up the interpreter

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton interpreter only (CPU)")

#: Ops whose kit cases fit one program under every config of their tables (elementwise or
#: per-row kernels: no value crosses programs), where a reversed order runs the same program.
ONE_PROGRAM = ("silu_and_mul", "kl_penalty", "moe_route", "moe_route_grouped")


def _reverse_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every interpreted grid's programs last to first (on each axis)."""
    from triton.runtime import interpreter as itp

    original = itp.InterpreterBuilder.set_grid_idx

    def set_grid_idx(self, x, y, z):
        nx, ny, nz = self.grid_dim
        original(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(itp.InterpreterBuilder, "set_grid_idx", set_grid_idx)


def _run_every_config(impl, op: str) -> list[dict[str, torch.Tensor]]:
    """The op on its invariance cases (each unit pool as one batch), forward and backward,
    under its default choice and then each config of its tuning tables, forced."""
    fn = impl.ops[op]
    pools = testing.build_cases(op, True, torch.device("cpu")).invariance
    cases = [checks.batch_of(c) for c in pools]
    out = [checks.run_case(fn, c) for c in cases]
    for cfg in impl.tuning_configs(op) if impl.tuning_configs is not None else []:
        with impl.use_config(op, cfg):
            out += [checks.run_case(fn, c) for c in cases]
    return out


def _differ(want: list[dict], got: list[dict]) -> list[str]:
    return [
        f"run {i} {k}"
        for i, (w, g) in enumerate(zip(want, got, strict=True))
        for k in w
        if not checks.bits_equal(w[k], g[k])
    ]


def _count_grids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the number of programs of every interpreted launch."""
    from triton.runtime import interpreter as itp

    sizes: list[int] = []
    original = itp.InterpreterBuilder.set_grid_dim

    def set_grid_dim(self, nx, ny, nz):
        sizes.append(nx * ny * nz)
        return original(self, nx, ny, nz)

    monkeypatch.setattr(itp.InterpreterBuilder, "set_grid_dim", set_grid_dim)
    return sizes


@pytest.mark.parametrize("op", [op for op in testing.KIT_OPS if op not in ONE_PROGRAM])
def test_reversed_program_order_changes_no_bit(op, monkeypatch):
    impl = selection.registry().load("triton", complete=False)
    sizes = _count_grids(monkeypatch)
    want = _run_every_config(impl, op)
    # A grid of one program runs the same way in either order: the test must reach some grid
    # of several, or it could not fail.
    assert max(sizes) > 1, f"{op}: every launch had one program"
    _reverse_programs(monkeypatch)
    got = _run_every_config(impl, op)
    assert not _differ(want, got), f"{op}: the programs' order changed {_differ(want, got)}"


@triton.jit
def _add_in_arrival_order(x_ptr, out_ptr):
    # Each program adds its value to one total in the order the programs run: the schedule
    # decides the rounding (what a float atomic add does on a GPU).
    pid = tl.program_id(0)
    tl.store(out_ptr, tl.load(out_ptr) + tl.load(x_ptr + pid))


def test_a_sum_in_arrival_order_is_caught(monkeypatch):
    x = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0, -7.5, 1e-3, 2.0], dtype=torch.float32)

    def total():
        out = torch.zeros(1, dtype=torch.float32)
        _add_in_arrival_order[(x.numel(),)](x, out)
        return {"out": out}

    want = [total()]
    _reverse_programs(monkeypatch)
    got = [total()]
    assert _differ(want, got) == ["run 0 out"]
