"""rlk.parallel: tree-ordered linear and TP-invariant row/column-parallel linears.

One-device tests check the tree's accuracy, order, batch invariance and errors. Distributed
tests spawn 2 (and 4) CPU processes with gloo: every rank's row-parallel / column-parallel
result, forward and backward, must equal the one-device tree ops bitwise. Shapes are tiny: the
kernels run under Triton's interpreter here.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from parallel_workers import _inputs, _worker

import rlk
import rlk.parallel as P

DTYPES = (torch.bfloat16, torch.float32)
# Max error vs float64 relative to the output's RMS (rounding of the output dominates).
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-5}


def _rel_err(y, ref):
    return ((y.double() - ref).abs().max() / ref.pow(2).mean().sqrt()).item()


# --------------------------------------------------------------------------------------------
# One device
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_linear_accuracy(dtype):
    x, w, b = _inputs(5, 96, 40, dtype, lead=(2,))
    y = P.tree_linear(x, w, b, leaves=4)
    assert y.shape == (2, 5, 40) and y.dtype == dtype
    ref = x.double() @ w.double().T + b.double()
    assert _rel_err(y, ref) < TOL[dtype]


def test_tree_linear_is_the_documented_tree():
    # The leaf partials (fp32, the backend's GEMM) added as ((p0+p1)+(p2+p3)), bias, round once.
    from rlk_triton import gemm
    from rlk_triton.backend import default_table

    x, w, b = _inputs(3, 64, 24, torch.bfloat16)
    table = default_table()
    p = [
        gemm._matmul(x[:, i * 16 : (i + 1) * 16], w[:, i * 16 : (i + 1) * 16].t(), None,
                     torch.float32, table, "linear.fwd")
        for i in range(4)
    ]  # fmt: skip
    expected = (((p[0] + p[1]) + (p[2] + p[3])) + b.float()).to(torch.bfloat16)
    assert torch.equal(P.tree_linear(x, w, b, leaves=4), expected)
    # One leaf is the plain batch-invariant linear.
    assert torch.equal(P.tree_linear(x, w, b, leaves=1), rlk.linear(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_linear_batch_invariance(dtype):
    x, w, b = _inputs(7, 64, 24, dtype, seed=1)
    full = P.tree_linear(x, w, b, leaves=8)
    for rows in ([3], [0, 6], [1, 2, 4, 5]):
        assert torch.equal(P.tree_linear(x[rows], w, b, leaves=8), full[rows])


def test_tree_linear_backward_is_linear_backward():
    x, w, b = _inputs(4, 64, 24, torch.bfloat16, seed=2)
    g = torch.randn(4, 24).to(torch.bfloat16)
    grads = []
    for fn in (P.tree_linear, rlk.linear):
        xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
        kw = {"leaves": 4} if fn is P.tree_linear else {}
        (fn(xs, ws, bs, **kw).float() * g.float()).sum().backward()
        grads.append((xs.grad, ws.grad, bs.grad))
    for a, c in zip(*grads):
        assert torch.equal(a, c)


def test_column_tree_linear():
    x, w, b = _inputs(4, 32, 64, torch.float32, seed=3)
    g = torch.randn(4, 64)
    xs = x.clone().requires_grad_(True)
    y = P.column_tree_linear(xs, w, b, leaves=4)
    assert torch.equal(y.detach(), rlk.linear(x, w, b))
    (y * g).sum().backward()
    ref = g.double() @ w.double()
    assert _rel_err(xs.grad, ref) < TOL[torch.float32]
    # dX reduces N by the 4-leaf tree of fp32 partials.
    from rlk_triton import gemm
    from rlk_triton.backend import default_table

    p = [
        gemm._matmul(g[:, i * 16 : (i + 1) * 16], w[i * 16 : (i + 1) * 16], None,
                     torch.float32, default_table(), "linear.bwd_dx")
        for i in range(4)
    ]  # fmt: skip
    assert torch.equal(xs.grad, (p[0] + p[1]) + (p[2] + p[3]))


def test_errors():
    x, w, b = _inputs(2, 48, 16, torch.float32)
    with pytest.raises(ValueError, match="leaves = 32 must divide K = x.shape"):
        P.tree_linear(x, w, b, leaves=32)
    with pytest.raises(ValueError, match="leaves must be a power of two"):
        P.tree_linear(x, w, b, leaves=3)
    with pytest.raises(TypeError, match="leaves must be an int"):
        P.tree_linear(x, w, b, leaves=True)
    with pytest.raises(ValueError, match="weight must be"):
        P.tree_linear(x, w[:, :32], b, leaves=4)
    with pytest.raises(ValueError, match="leaves = 32 must divide N"):
        P.column_tree_linear(x, w, b, leaves=32)
    with pytest.raises(ValueError, match="group was given"):
        P.row_parallel_linear(x, w, b, leaves=4, group=object())
    with pytest.raises(TypeError, match="gather_output"):
        P.column_parallel_linear(x, w, b, gather_output=1)
    with pytest.raises(ValueError, match="world_size = 3 must divide"):
        P.shard(w, 0, rank=0, world_size=3)
    # The leaves rule as other distributions ask it: leaves per rank, or an error naming leaves.
    assert P.check_leaves(8) == 8 and P.check_leaves(8, world=2) == 4
    with pytest.raises(ValueError, match="leaves must be a power of two"):
        P.check_leaves(6)
    with pytest.raises(TypeError, match="leaves must be an int"):
        P.check_leaves(True)
    with pytest.raises(ValueError, match="leaves = 8 must be a multiple of .* size 3"):
        P.check_leaves(8, world=3)
    with pytest.raises(ValueError, match="group was given"):
        P.group_info(object())


class _PlainPlugin:
    """Backend "plain": the reference's required ops only (no optional tree-linear ops)."""

    @rlk.hookimpl
    def rlk_backends(self):
        import rlk_reference

        ops = {op: getattr(rlk_reference, op) for op in rlk.OPS}
        impl = rlk.BackendImpl(ops=ops, claims=frozenset({"accuracy"}))
        spec = rlk.BackendSpec("plain", 1, ("cpu",), lambda: (True, ""), lambda: impl)
        return [spec]


@pytest.fixture
def plain_backend(monkeypatch):
    from rlk import selection

    monkeypatch.delenv("RLK_BACKEND", raising=False)
    selection.reset_registry(extra_plugins=[_PlainPlugin()])
    yield "plain"
    selection.reset_registry()


def test_backend_without_the_optional_op_names_the_ones_with_it(plain_backend):
    x, w, b = _inputs(2, 32, 16, torch.float32)
    assert rlk.linear(x, w, b) is not None  # "plain" is complete: it can be selected
    calls = (
        (P.tree_linear, "tree_linear"),
        (P.row_parallel_linear, "tree_linear"),
        (P.column_tree_linear, "column_tree_linear"),
        (P.column_parallel_linear, "column_tree_linear"),
    )
    with rlk.use_backend(plain_backend):
        for fn, op in calls:
            with pytest.raises(rlk.BackendError) as e:
                fn(x, w, b, leaves=4)
            msg = str(e.value)
            assert f"rlk.parallel.{fn.__name__}" in msg and "'plain'" in msg, msg
            assert f"optional op {op!r}" in msg and "RLK_BACKEND" in msg, msg
            # The backends here that have it are named (the float64 one and rlk-triton's).
            assert "reference" in msg and "triton" in msg, msg
    assert "plain" not in P.tree_backends("cpu")
    assert {"reference", "triton"} <= set(P.TREE_BACKENDS)


@pytest.mark.parametrize("fn", [P.tree_linear, P.column_tree_linear])
def test_reference_backend_serves_the_tree_linears(fn):
    # The float64 oracle claims the optional ops: accurate, and differentiable.
    x, w, b = _inputs(5, 64, 24, torch.float32, seed=4)
    xs = x.clone().requires_grad_(True)
    with rlk.use_backend("reference"):
        y = fn(xs, w, b, leaves=4)
    y.sum().backward()
    ref = x.double() @ w.double().T + b.double()
    assert _rel_err(y.detach(), ref) < TOL[torch.float32]
    assert _rel_err(xs.grad, w.double().sum(0).expand(5, 64)) < TOL[torch.float32]


def test_no_process_group_is_one_rank():
    x, w, b = _inputs(3, 64, 16, torch.bfloat16)
    assert torch.equal(P.row_parallel_linear(x, w, b), P.tree_linear(x, w, b))
    assert torch.equal(P.column_parallel_linear(x, w, b, gather_output=True), rlk.linear(x, w, b))
    assert P.group_info() == (0, 1)
    y = torch.randn(2, 3, 5, requires_grad=True)
    assert torch.equal(P.gather_columns(y), y)


# --------------------------------------------------------------------------------------------
# gloo, several processes
# --------------------------------------------------------------------------------------------


def _spawn(tmp_path, world, dtypes, backward, *extra):
    init_file = tmp_path / f"pg_{world}"
    args = (world, str(init_file), dtypes, backward, *extra)
    mp.spawn(_worker, args=args, nprocs=world, join=True)


@pytest.mark.slow
def test_tp2_equals_one_device(tmp_path):
    _spawn(tmp_path, 2, DTYPES, backward=True)


@pytest.mark.slow
def test_tp4_equals_one_device(tmp_path):
    _spawn(tmp_path, 4, (torch.float32,), backward=False)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_halving_exchange_equals_one_device(tmp_path, world):
    # RLK_TP_EXCHANGE=halving in the row-parallel forward, the column-parallel dX and the
    # vocabulary-parallel dHidden: the one-device bits.
    _spawn(tmp_path, world, (torch.float32,), True, "cpu", (3, 64, 32, 5, 16), "halving")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_tp2_equals_one_device(tmp_path):
    # Qwen2-0.5B down_proj-like linears (K = 4864, N = 896) and its lm_head (V = 151936).
    _spawn(tmp_path, 2, DTYPES, True, "cuda", (256, 4864, 896, 256, 896))


# --------------------------------------------------------------------------------------------
# GPU (one device; the ranks simulated by contiguous shards)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("M", [1, 64, 512])
def test_gpu_shards_equal_one_device(M):
    # What TP relies on, at a real size (Qwen2-0.5B down_proj): a rank's contiguous K-shard
    # gives the same fp32 subtree bits as the strided leaves of the full input, and rows are
    # batch-invariant. The ranks are simulated on one GPU (no NCCL here).
    from rlk_triton import tree_gemm

    x, w, b = (t.cuda() for t in _inputs(512, 4864, 896, torch.bfloat16, seed=5))
    x = x[:M].contiguous()
    from rlk_triton.backend import default_table

    table = default_table()
    full = P.tree_linear(x, w, b, leaves=8)
    assert torch.equal(P.tree_linear(x[:1], w, b, leaves=8), full[:1])
    for t in (2, 4, 8):
        parts = [
            tree_gemm.subtree_sum(P.shard(x, 1, rank=r, world_size=t),
                                  P.shard(w, 1, rank=r, world_size=t), 8 // t, table=table)
            for r in range(t)
        ]  # fmt: skip
        y = tree_gemm.finish(tree_gemm.tree_combine(parts), b, x.dtype)
        assert torch.equal(y, full), f"TP={t} shards differ from one device"


def test_vocab_parallel_without_process_group_is_linear_logprobs():
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(4, 16, generator=g), torch.randn(64, 16, generator=g)
    tgt = torch.randint(0, 64, (4,), generator=g)
    assert torch.equal(P.vocab_parallel_linear_logprobs(h, w, tgt), rlk.linear_logprobs(h, w, tgt))
    with pytest.raises(TypeError, match="targets"):
        P.vocab_parallel_linear_logprobs(h, w, tgt.float())
    with pytest.raises(ValueError, match="targets"):
        P.vocab_parallel_linear_logprobs(h, w, tgt + 64)
