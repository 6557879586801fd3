"""tree_gemm: the fused tree kernels have the bits of the unfused reference (per-leaf GEMMs).

The unfused path (``tree_matmul_unfused`` / ``tree_linear_forward_unfused``: one fp32
``gemm._matmul`` per leaf, torch adds by the tree, bias, one rounding) is the reference; both
fused kernels (``_tree_kernel``, and ``_tree_flat_kernel`` with its pending sums in registers
or parked in scratch) must equal it bitwise for every launch config (every config of every
installed tuning table, and the fused kernels' own ``TREE_CONFIGS``), every leaf count, dtype
and shape (M = 1, odd N, a leaf's K-range not a multiple of BLOCK_K), and be batch-invariant.
CPU tests run the interpreter on tiny shapes; ``gpu`` tests repeat the check at real sizes and
read the PTX (wgmma for every config on sm_90).
"""

from __future__ import annotations

import pytest
import torch

from rlk_triton import aot_record, gemm, tree_gemm, tuning
from rlk_triton.backend import default_table, known_tables

DTYPES = (torch.bfloat16, torch.float32)
LEAVES = (1, 2, 4, 8, 16)


def _small(bm, bn, group_m=1):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group_m, "num_warps": 4, "num_stages": 2}


def _small_flat(bm, bn, reg_slots, halves=False, group_m=1):
    return {**_small(bm, bn, group_m), "VARIANT": "flat", "REG_SLOTS": reg_slots, "HALVES": halves}


# Small tiles so tiny CPU shapes span several tiles (the interpreter ignores the MMA-kind rule).
SMALL = (_small(16, 16), _small(32, 16, 2))
# The flat kernel: every pending sum parked, slot 0 in registers, the chain on column halves.
SMALL_FLAT = (
    _small_flat(16, 16, 0),
    _small_flat(32, 16, 1, group_m=2),
    _small_flat(16, 32, 0, True),
)


def _table_configs():
    """Every distinct launch config of the GEMM rules the tree paths use, in every installed
    table, and the fused kernel's own candidates."""
    seen, out = set(), []
    cands = [c for t in known_tables().values() for k in ("linear.fwd", "linear.bwd_dx")
             for c in t[k].configs]  # fmt: skip
    for c in cands + list(tree_gemm.TREE_CONFIGS):
        key = repr(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _inputs(M, K, N, dtype, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    w = (torch.randn(N, K, generator=g, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g, device=device).to(dtype)
    return x, w, b


def _fused(x, w, b, leaves, cfg, out_dtype=None):
    return tree_gemm._fused(x, w.t(), b, leaves, out_dtype or x.dtype, None, "", cfg)


def _bits_equal(a, b):
    # Bitwise, -0.0 vs +0.0 included.
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leaves", LEAVES)
def test_fused_equals_unfused(dtype, leaves):
    table = default_table()
    block_k = gemm.BLOCK_K[dtype]
    # Leaf widths: below BLOCK_K, a multiple of it, and one tile plus a remainder.
    for M, width, N in ((1, 24, 17), (7, block_k, 9), (5, block_k + 8, 16)):
        x, w, b = _inputs(M, leaves * width, N, dtype, seed=leaves)
        ref = tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table)
        # The fp32 subtree value (what a TP rank computes), no bias: it shows a change of the
        # tree's association that a bf16 output can hide.
        ref32 = tree_gemm.tree_matmul_unfused(x, w.t(), leaves, table=table)
        for cfg in SMALL + SMALL_FLAT:
            assert _bits_equal(_fused(x, w, b, leaves, cfg), ref), (M, width, N, cfg)
            assert _bits_equal(_fused(x, w, None, leaves, cfg, torch.float32), ref32), cfg
        assert _bits_equal(tree_gemm.tree_linear_forward(x, w, b, leaves, table), ref)
        assert _bits_equal(tree_gemm.subtree_sum(x, w, leaves, table=table), ref32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_unfused_every_table_config(dtype):
    table = default_table()
    cfgs = _table_configs()
    assert len(cfgs) >= len(gemm._CONFIGS)
    for leaves, (M, K, N) in ((4, (3, 4 * 40, 20)), (8, (2, 8 * 24, 9))):
        x, w, b = _inputs(M, K, N, dtype, seed=leaves)
        ref = tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table)
        for cfg in cfgs:
            # The unfused reference under the same config too (gemm's own tuning invariance).
            with tuning.force("linear", {"linear.fwd": cfg}):
                assert _bits_equal(tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table),
                                   ref), cfg  # fmt: skip
            assert _bits_equal(_fused(x, w, b, leaves, cfg), ref), (leaves, cfg)
        with tuning.force("tree_linear", {"tree_linear.fwd": tree_gemm.TREE_CONFIGS[-1]}):
            assert _bits_equal(tree_gemm.tree_linear_forward(x, w, b, leaves, table), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_batch_invariance(dtype):
    table = default_table()
    M, K, N, leaves = 21, 8 * 40, 24, 8
    x, w, b = _inputs(M, K, N, dtype, seed=3)
    for cfg in (SMALL[1], *SMALL_FLAT, None):
        run = (lambda xs, cfg=cfg: _fused(xs, w, b, leaves, cfg)) if cfg else (
            lambda xs: tree_gemm.tree_linear_forward(xs, w, b, leaves, table))  # fmt: skip
        full = run(x)
        for rows in ([0], [20], [3, 4, 5], [1, 11, 19, 2]):
            assert _bits_equal(run(x[rows]), full[rows]), (rows, cfg)


def test_subtrees_combine_to_the_fused_root():
    # A TP rank's subtree (fused, its K-shard, leaves / t) topped by the tree == the full root.
    table = default_table()
    x, w, b = _inputs(6, 8 * 24, 20, torch.bfloat16, seed=5)
    root = tree_gemm.subtree_sum(x, w, 8, table=table)
    for t in (2, 4, 8):
        k = x.shape[1] // t
        parts = [tree_gemm.subtree_sum(x[:, r * k : (r + 1) * k].contiguous(),
                                       w[:, r * k : (r + 1) * k].contiguous(), 8 // t,
                                       table=table) for r in range(t)]  # fmt: skip
        assert _bits_equal(tree_gemm.tree_combine(parts), root), t
    y = tree_gemm.finish(root.clone(), b, x.dtype)
    assert _bits_equal(tree_gemm.tree_linear_forward(x, w, b, 8, table), y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_tree_dx_equals_unfused(dtype):
    # column_tree_linear's dX = dY @ W reduced over N by the leaf tree, rounded once.
    table = default_table()
    M, K, N, leaves = 5, 24, 4 * 40, 4
    x, w, b = _inputs(M, K, N, dtype, seed=6)
    x.requires_grad_(True)
    dy = torch.randn(M, N).to(dtype)
    tree_gemm.column_tree_linear(x, w, b, leaves=leaves, table=table).backward(dy)
    ref = tree_gemm.tree_matmul_unfused(dy, w, leaves, table=table, key="linear.bwd_dx")
    assert _bits_equal(x.grad, ref.to(dtype))
    assert _bits_equal(tree_gemm.tree_matmul(dy, w, leaves, table=table, key="linear.bwd_dx"), ref)


def test_flat_empty_leaves():
    # K = 0: the flat loop has no tile to end a leaf on; the launch takes _tree_kernel (bias).
    table = default_table()
    x, w, b = _inputs(3, 0, 5, torch.bfloat16)
    ref = tree_gemm.tree_linear_forward_unfused(x, w, b, 4, table)
    for cfg in SMALL_FLAT:
        assert _bits_equal(_fused(x, w, b, 4, cfg), ref), cfg


def test_many_leaves_fall_back_to_unfused(monkeypatch):
    table = default_table()
    x, w, b = _inputs(3, 4 * 24, 10, torch.bfloat16, seed=7)
    fused = tree_gemm.tree_linear_forward(x, w, b, 4, table)
    monkeypatch.setattr(tree_gemm, "MAX_FUSED_LEAVES", 2)
    assert _bits_equal(tree_gemm.tree_linear_forward(x, w, b, 4, table), fused)


def test_use_fused_rule():
    assert tree_gemm.use_fused(2) and tree_gemm.use_fused(8) and tree_gemm.use_fused(64)
    assert not tree_gemm.use_fused(128)  # more leaves than the kernel unrolls


def test_tree_configs_keep_one_mma_kind_and_chooser_in_range():
    for cfg in tree_gemm.TREE_CONFIGS:
        assert cfg["BLOCK_M"] % 64 == 0 and cfg["num_warps"] in (4, 8), cfg
        assert cfg["BLOCK_N"] % 16 == 0, cfg
    for M in (1, 64, 512, 4096):
        for N, K in ((896, 896), (896, 4864), (4096, 14336)):
            for leaves in (1, 2, 4, 8, 16, 32, 64):
                for nbytes in (2, 4):
                    i = tree_gemm._choose_tree(M=M, N=N, K=K, leaves=leaves, dtype_bytes=nbytes)
                    assert 0 <= i < len(tree_gemm.TREE_CONFIGS)
                    assert tree_gemm._fits_tree(tree_gemm.TREE_CONFIGS[i], leaves), (M, N, i)
    # The flat kernel: 128x256 where that grid fills the GPU, else 128x128 where it nearly does.
    wide = tree_gemm.TREE_CONFIGS[tree_gemm._choose_tree(4096, 4096, 14336, leaves=8)]
    assert wide["VARIANT"] == "flat" and wide["BLOCK_N"] == 256, wide
    narrow = tree_gemm.TREE_CONFIGS[tree_gemm._choose_tree(2048, 896, 4864, leaves=8)]
    assert narrow["VARIANT"] == "flat" and narrow["BLOCK_N"] == 128, narrow
    assert "VARIANT" not in tree_gemm.TREE_CONFIGS[tree_gemm._choose_tree(1, 4096, 14336, 8)]


def test_a_forced_config_that_does_not_fit_is_not_launched():
    # 128x128 / 8 warps holds 64 fp32 registers a thread per live tile: it fits 2 leaves (2
    # tiles), not 4 (3 tiles: ptxas cannot allocate them on sm_100), where the choice runs.
    big = tree_gemm.TREE_CONFIGS[4]
    table = default_table()
    x, w, b = _inputs(3, 4 * 24, 10, torch.bfloat16)
    launched = []

    def sink(kernel, args, kwargs):
        launched.append((kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_warps"]))
        return True  # recorded, not run

    for leaves, fits in ((2, True), (4, False)):
        assert tree_gemm._fits_tree(big, leaves) is fits
        chosen = tree_gemm.TREE_CONFIGS[tree_gemm._choose_tree(3, 10, 96, leaves)]
        want = big if fits else chosen
        launched.clear()
        with aot_record.recording(sink), tuning.force("tree_linear", {"tree_linear.fwd": big}):
            tree_gemm.tree_linear_forward(x, w, b, leaves, table)
        assert launched == [(want["BLOCK_M"], want["BLOCK_N"], want["num_warps"])], leaves


# --------------------------------------------------------------------------------------------
# GPU (H200): run on the GPU machine with `pytest -m gpu`.
# --------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_fused_equals_unfused_every_config(dtype):
    # Every config the fused kernel can run (TREE_CONFIGS that fit 8 leaves: no installed
    # table has tree_linear rules; the CPU test also runs the GEMM tables' configs through it)
    # at 8 leaves, and the fp32 subtree output; every leaf count at the chosen config. K-leaf
    # widths 112 (Qwen2 o_proj / 8: not a multiple of BLOCK_K) and 512. (With every table's
    # GEMM configs too this did not finish in 110 s on the H200.)
    table = default_table()
    major, _ = torch.cuda.get_device_capability()
    for M, K, N in ((300, 896, 896), (129, 4096, 640)):
        x, w, b = _inputs(M, K, N, dtype, device="cuda")
        leaves = 8
        ref = tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table)
        ref32 = tree_gemm.tree_matmul_unfused(x, w.t(), leaves, table=table)
        for cfg in tree_gemm.TREE_CONFIGS:
            if not tree_gemm._fits_tree(cfg, leaves):
                continue  # never launched at 8 leaves (its live tiles exceed the registers)
            c = torch.empty(M, N, device="cuda", dtype=dtype)
            kernel = tree_gemm._tree_launch(x, w.t(), b, c, leaves, cfg)
            assert _bits_equal(c, ref), (M, K, N, leaves, cfg)
            if dtype != torch.float32:
                got32 = _fused(x, w, None, leaves, cfg, torch.float32)
                assert _bits_equal(got32, ref32), (M, K, N, leaves, cfg, "fp32 subtree")
                if major == 9:
                    assert "wgmma" in kernel.asm["ptx"], cfg
        for leaves in LEAVES:
            ref = tree_gemm.tree_linear_forward_unfused(x, w, b, leaves, table)
            got = tree_gemm.tree_linear_forward(x, w, b, leaves, table)
            assert _bits_equal(got, ref), (M, K, N, leaves)


@pytest.mark.gpu
@gpu
def test_gpu_fused_batch_invariance():
    table = default_table()
    x, w, b = _inputs(4096 + 64, 4864, 896, torch.bfloat16, device="cuda")
    more = tree_gemm.tree_linear_forward(x, w, b, 8, table)
    for M in (1, 7, 64, 300, 4096):
        for off in {0, 1, 4096 - M}:
            y = tree_gemm.tree_linear_forward(x[off : off + M], w, b, 8, table)
            assert _bits_equal(y, more[off : off + M]), (M, off)
