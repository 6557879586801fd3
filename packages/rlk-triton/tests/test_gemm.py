"""linear (batch-invariant GEMM): accuracy, batch invariance, determinism, tuning invariance.

CPU tests run the kernels under Triton's interpreter on small shapes; a test table with small
tiles makes them span several tiles in M, N and K. GPU tests (``gpu``) check the same
properties at real sizes, and that every config runs the same MMA instruction kind.
"""

from __future__ import annotations

import pytest
import torch

from rlk_triton import gemm, tuning

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Max error vs float64 relative to the output's RMS: rounding of the output dominates.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}


def _small(bm, bn, group_m=1):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group_m, "num_warps": 4, "num_stages": 2}


# Small tiles so tiny CPU shapes span several tiles (the interpreter ignores the MMA-kind
# constraint the real configs obey). Chooser 0: the first, smallest.
SMALL = (_small(16, 16), _small(32, 16, 2), _small(16, 32, 3))
SMALL_TABLE = {k: tuning.Rule(configs=SMALL) for k in gemm.TUNING}
# Every candidate: the small ones and the real table's, for tuning invariance.
ALL_TABLE = {k: tuning.Rule(configs=SMALL + tuple(r.configs)) for k, r in gemm.TUNING.items()}


def _inputs(M, K, N, dtype, bias=True, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    if requires_grad:
        x.requires_grad_(True)
        w.requires_grad_(True)
        if b is not None:
            b.requires_grad_(True)
    return x, w, b


def _close(got, ref, dtype, what):
    err = (got.double() - ref).abs().max().item()
    scale = ref.pow(2).mean().sqrt().item() + 1e-12
    assert err <= TOL[dtype] * max(scale, 1.0), f"{what}: max err {err:.3g}, rms {scale:.3g}"


def _grads(x, w, b, dy, table):
    y = gemm.linear(x, w, b, table=table)
    y.backward(dy)
    out = [y.detach(), x.grad, w.grad] + ([b.grad] if b is not None else [])
    x.grad = w.grad = None
    if b is not None:
        b.grad = None
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 40, 16), (3, 96, 48), (17, 70, 33)])
def test_accuracy_forward_backward(dtype, M, K, N):
    x, w, b = _inputs(M, K, N, dtype, requires_grad=True)
    dy = torch.randn(M, N).to(dtype)
    y, dx, dw, db = _grads(x, w, b, dy, SMALL_TABLE)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == dtype
    xd, wd, bd = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    yd = xd @ wd.T + bd
    yd.backward(dy.double())
    _close(y, yd.detach(), dtype, "y")
    _close(dx, xd.grad, dtype, "dx")
    _close(dw, wd.grad, dtype, "dw")
    _close(db, bd.grad, dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_bias_and_strided_weight(dtype):
    x, w, _ = _inputs(5, 72, 24, dtype, bias=False)
    y = gemm.linear(x, w, None, table=SMALL_TABLE)
    _close(y, x.double() @ w.double().T, dtype, "y")
    # A transposed view of W (what torch.mm(x, W.t()) hands over) gives the same bits.
    wt = w.t().contiguous().t()
    assert torch.equal(gemm.linear(x, wt, None, table=SMALL_TABLE), y)


@pytest.mark.parametrize("table", [SMALL_TABLE, gemm.TUNING], ids=["small", "default"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance_forward(dtype, table):
    M, K, N = 37, 96, 40
    x, w, b = _inputs(M, K, N, dtype, seed=1)
    full = gemm.linear(x, w, b, table=table)
    g = torch.Generator().manual_seed(2)
    for i in (0, 17, M - 1):
        assert torch.equal(gemm.linear(x[i : i + 1], w, b, table=table), full[i : i + 1]), i
    for size in (2, 5, 16, 20):
        idx = torch.randperm(M, generator=g)[:size]
        assert torch.equal(gemm.linear(x[idx], w, b, table=table), full[idx]), size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariance_dx_and_determinism(dtype):
    M, K, N = 21, 40, 36
    x, w, b = _inputs(M, K, N, dtype, seed=3, requires_grad=True)
    dy = torch.randn(M, N).to(dtype)
    _, dx, dw, db = _grads(x, w, b, dy, SMALL_TABLE)
    for rows in ([4], [0, 7, 20], list(range(3, 19))):
        xs = x.detach()[rows].requires_grad_(True)
        _, dxs, _, _ = _grads(xs, w, b, dy[rows], SMALL_TABLE)
        assert torch.equal(dxs, dx[rows]), rows
    # dW and db sum over rows: not batch-invariant, but identical run to run.
    _, dx2, dw2, db2 = _grads(x, w, b, dy, SMALL_TABLE)
    assert torch.equal(dx2, dx) and torch.equal(dw2, dw) and torch.equal(db2, db)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tuning_invariance(dtype):
    M, K, N = 19, 80, 40
    x, w, b = _inputs(M, K, N, dtype, seed=4, requires_grad=True)
    dy = torch.randn(M, N).to(dtype)
    sets = tuning.op_configs(ALL_TABLE, "linear")
    assert len(sets) == len(SMALL) + len(gemm._CONFIGS)
    assert {k for s in sets for k in s} == {"linear.fwd", "linear.bwd_dx", "linear.bwd_dw"}
    base = None
    for cfgs in sets:
        with tuning.force("linear", cfgs):
            out = _grads(x, w, b, dy, ALL_TABLE)
        if base is None:
            base = out
        for name, got, ref in zip(("y", "dx", "dw", "db"), out, base, strict=True):
            assert torch.equal(got, ref), (name, cfgs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unrolled_k_loop_keeps_the_chain(dtype):
    # UNROLL tiles per iteration and the leftover tiles one at a time are the same chain of
    # dots: every unroll, through pointers and descriptors, gives the bits of UNROLL 1. K spans
    # whole groups, leftover whole tiles and a partial tile.
    bk = gemm.BLOCK_K[dtype]
    M, K, N = 5, 7 * bk + 9, 40
    x, w, b = _inputs(M, K, N, dtype, seed=6, requires_grad=True)
    dy = torch.randn(M, N).to(dtype)
    table = {k: tuning.Rule(configs=(_small(16, 16),)) for k in gemm.TUNING}
    base = _grads(x, w, b, dy, table)
    for unroll in (2, 3, 8):
        for tma in (False, True):
            cfg = {**gemm.gemm_config(64, 16, 4, 3, tma=tma, unroll=unroll)}
            with tuning.force("linear", {k: cfg for k in gemm.TUNING}):
                out = _grads(x, w, b, dy, table)
            for name, got, ref in zip(("y", "dx", "dw", "db"), out, base, strict=True):
                assert torch.equal(got, ref), (name, unroll, tma)


def test_default_configs_keep_one_mma_kind():
    # Hopper uses wgmma only for BLOCK_M % 64 == 0 and num_warps % 4 == 0 (else mma.sync):
    # every config must qualify so that every shape runs the same instructions.
    for key, rule in gemm.TUNING.items():
        for cfg in rule.configs:
            assert cfg["BLOCK_M"] % 64 == 0 and cfg["num_warps"] in (4, 8), (key, cfg)
            assert cfg["BLOCK_N"] % 16 == 0, (key, cfg)
        for M in (1, 16, 64, 65, 256, 512, 4096, 16384):
            for N, K in ((4096, 4096), (151936, 3584), (14336, 4096), (16, 4096)):
                for nbytes in (2, 4):
                    i = rule.choose(M=M, N=N, K=K, dtype_bytes=nbytes)
                    assert 0 <= i < len(rule.configs)


def test_eager_small_products_launch_pointers(monkeypatch):
    # A chosen descriptor config runs the pointer kernel (same tiles, same bits) for an eager
    # product under tuning.HOST_BOUND_FLOPS; a larger product, or a forced config, gets descriptors.
    seen = []
    monkeypatch.setattr(gemm, "_launch_tma", lambda *args: seen.append("tma"))
    x, w, _ = _inputs(300, 64, 48, torch.bfloat16)
    cfg = tuning.config(gemm.TUNING, "linear.fwd", M=300, N=48, K=64, dtype_bytes=2)
    assert cfg["TMA"]
    ref = gemm.linear(x, w, None, table=SMALL_TABLE)
    assert torch.equal(gemm.linear(x, w, None, table=gemm.TUNING), ref) and seen == []
    with tuning.force("linear", {"linear.fwd": cfg}):
        gemm.linear(x, w, None, table=gemm.TUNING)
    assert seen == ["tma"]
    monkeypatch.setattr(tuning, "HOST_BOUND_FLOPS", 0)
    gemm.linear(x, w, None, table=gemm.TUNING)
    assert seen == ["tma", "tma"]


def test_edge_shapes():
    x, w, b = _inputs(0, 40, 8, torch.bfloat16)
    assert gemm.linear(x, w, b, table=SMALL_TABLE).shape == (0, 8)
    x, w, b = _inputs(3, 40, 8, torch.bfloat16, requires_grad=True)
    dy = torch.randn(3, 8).to(torch.bfloat16)
    y, dx, dw, db = _grads(x, w, b, dy, SMALL_TABLE)
    # No rows: dW and db are zero sums.
    xe = torch.zeros(0, 40, dtype=torch.bfloat16, requires_grad=True)
    we = w.detach().clone().requires_grad_(True)
    be = b.detach().clone().requires_grad_(True)
    gemm.linear(xe, we, be, table=SMALL_TABLE).sum().backward()
    assert torch.equal(we.grad, torch.zeros_like(we)) and torch.equal(be.grad, torch.zeros_like(be))


def test_bias_grad_strided():
    # fused_logprobs calls _bias_grad directly; a transposed dY must give the same bits.
    dy = torch.randn(70, 150).to(torch.bfloat16)
    db = gemm._bias_grad(dy, torch.bfloat16)
    assert torch.equal(gemm._bias_grad(dy.t().contiguous().t(), torch.bfloat16), db)
    _close(db, dy.double().sum(0), torch.bfloat16, "db")


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_continues_the_k_chain(dtype):
    """A product split over K at multiples of BLOCK_K and accumulated into fp32 has the bits of
    the one product, at every config (the logits backward's dh runs so over vocabulary slices)."""
    torch.manual_seed(7)
    bk = gemm.BLOCK_K[dtype]
    a = torch.randn(37, 3 * bk + 19).to(dtype)
    b = torch.randn(3 * bk + 19, 45).to(dtype)
    for cfg in [*SMALL, *gemm._CONFIGS]:
        with tuning.force("linear", {"linear.bwd_dx": cfg}):
            whole = gemm._matmul(a, b, None, torch.float32, ALL_TABLE, "linear.bwd_dx")
            part = gemm._matmul(a[:, :bk], b[:bk], None, torch.float32, ALL_TABLE, "linear.bwd_dx")
            for k0, k1 in ((bk, 3 * bk), (3 * bk, 3 * bk + 19)):
                gemm._matmul(a[:, k0:k1], b[k0:k1], None, torch.float32, ALL_TABLE,
                             "linear.bwd_dx", out=part, accumulate=True)  # fmt: skip
        assert torch.equal(part, whole), cfg
    # Split elsewhere, the chain differs: the test can tell.
    odd = gemm._matmul(a[:, :7], b[:7], None, torch.float32, ALL_TABLE, "linear.bwd_dx")
    gemm._matmul(a[:, 7:], b[7:], None, torch.float32, ALL_TABLE, "linear.bwd_dx", out=odd,
                 accumulate=True)  # fmt: skip
    assert not torch.equal(odd, whole)


def test_bias_grad_sums_every_row_once():
    # Integer values make every partial exact, so a row counted twice or lost at a K-tile edge
    # (37 rows past two full tiles), or a column block skipped, changes the result.
    m = 2 * gemm.BLOCK_K[torch.bfloat16] + 37
    dy = torch.randint(-4, 5, (m, 150)).to(torch.bfloat16)
    assert torch.equal(gemm._bias_grad(dy, torch.float32), dy.double().sum(0).float())
    assert torch.equal(gemm._bias_grad(dy[:0], torch.float32), torch.zeros(150))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_grad_from_the_dw_launch(dtype):
    """dW's launch computes dbias in extra programs: the bits of the standalone launch, at every
    config, and dW's bits unchanged by the extra programs."""
    torch.manual_seed(6)
    dy = torch.randn(83, 150).to(dtype)
    x = torch.randn(83, 40).to(dtype)
    alone = gemm._bias_grad(dy, dtype)
    for cfg in [*SMALL, *gemm._CONFIGS]:
        cfgs = {"linear.bwd_dw": cfg}
        with tuning.force("linear", cfgs):
            dw = gemm._matmul(dy.t(), x, None, dtype, ALL_TABLE, "linear.bwd_dw")
            db = torch.full((150,), float("nan"), dtype=dtype)
            dw2 = gemm._matmul(dy.t(), x, None, dtype, ALL_TABLE, "linear.bwd_dw", rows=db)
        assert torch.equal(db, alone), cfg
        assert torch.equal(dw2, dw), cfg


# --------------------------------------------------------------------------------------------
# GPU (H200): run on the GPU machine with `pytest -m gpu`.
# --------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_inputs(M, K, N, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    return x, w, b


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("K,N", [(4096, 4096), (896, 151936)])
def test_gpu_batch_invariance(K, N):
    big = 4096
    x, w, b = _gpu_inputs(big + 64, K, N)
    full = gemm.linear(x[:big], w, b, table=gemm.TUNING)
    ref = x[:256].double() @ w.double().T + b.double()
    _close(full[:256], ref, torch.bfloat16, "y")
    # Rows preceded by other rows in a bigger launch (4096 + 64 rows, grid changes too).
    more = gemm.linear(x, w, b, table=gemm.TUNING)
    assert torch.equal(more[:big], full)
    for M in (1, 7, 64, 300, 4096):
        for off in {0, 1, big - M}:
            y = gemm.linear(x[off : off + M], w, b, table=gemm.TUNING)
            assert torch.equal(y, more[off : off + M]), (M, off)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_tuning_invariance_and_mma_kind(dtype):
    M, K, N = 300, 1024, 1536
    x, w, b = _gpu_inputs(M, K, N, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    dy = torch.randn(M, N, device="cuda").to(dtype)
    base = None
    for cfgs in tuning.op_configs(gemm.TUNING, "linear"):
        with tuning.force("linear", cfgs):
            out = _grads(x, w, b, dy, gemm.TUNING)
            out2 = _grads(x, w, b, dy, gemm.TUNING)
        for got, again in zip(out, out2, strict=True):
            assert torch.equal(got, again), ("run to run", cfgs)
        if base is None:
            base = out
        for name, got, ref in zip(("y", "dx", "dw", "db"), out, base, strict=True):
            assert torch.equal(got, ref), (name, cfgs)
    major, _ = torch.cuda.get_device_capability()
    if major == 9 and dtype != torch.float32:
        # Every config must compile to wgmma, or small-M tiles would round differently.
        for cfg in gemm._CONFIGS:
            c = torch.empty(M, N, device="cuda", dtype=dtype)
            kernel = gemm._launch(x.detach(), w.detach().t(), b.detach(), c, cfg)
            assert "wgmma" in kernel.asm["ptx"], cfg


@pytest.mark.gpu
@gpu
def test_gpu_dx_batch_invariance():
    M, K, N = 512, 4096, 4096
    x, w, _ = _gpu_inputs(M, K, N)
    dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    gemm.linear(xg, w, None, table=gemm.TUNING).backward(dy)
    for rows in (slice(0, 1), slice(5, 12), slice(100, 164)):
        xs = x[rows].clone().requires_grad_(True)
        gemm.linear(xs, w, None, table=gemm.TUNING).backward(dy[rows])
        assert torch.equal(xs.grad, xg.grad[rows]), rows
