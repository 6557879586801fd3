"""Worker of the gloo tests in test_parallel.py.

Spawned processes import their target by module name, so it lives in a module of its own on the
test path (``pythonpath = ["tests"]``), not in the test file that pytest imports by path.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import rlk
import rlk.parallel as P


def _inputs(M, K, N, dtype, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    return x, w, b


def _grads(fn, tensors, g):
    ts = [t.clone().requires_grad_(True) for t in tensors]
    y = fn(*ts)
    (y.float() * g.float()).sum().backward()
    return y.detach(), [t.grad for t in ts]


def _worker(rank, world, init_file, dtypes, backward, device="cpu", sizes=(3, 64, 32, 5, 16),
            exchange="gather"):  # fmt: skip
    """``device="cuda"``: NCCL, rank r on cuda:r. ``sizes``: M, K, N of the linears and T, H of
    the vocabulary-parallel log-probs (whose V is 2 * VOCAB_LEAVES * ... see below).
    ``exchange``: how the ranks' fp32 subtree values are combined (``RLK_TP_EXCHANGE``)."""
    os.environ["RLK_TP_EXCHANGE"] = exchange
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        os.environ.setdefault("RLK_BACKEND", "cuda")
    os.environ.setdefault("RLK_BACKEND", "triton")
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    M, K, N, T, H = sizes
    try:
        sh = lambda t, d: P.shard(t, d, rank=rank, world_size=world)  # noqa: E731
        for dtype in dtypes:
            x, w, b = (t.to(dev) for t in _inputs(M, K, N, dtype, seed=7, lead=(1,)))
            g = torch.randn(1, M, N, generator=torch.Generator().manual_seed(8)).to(dev)
            tag = f"rank {rank}/{world} {dtype}"

            # Row-parallel == tree_linear (8 leaves), forward and backward.
            def one_row(x, w, b):
                return P.tree_linear(x, w, b, leaves=8)

            def tp_row(xs, ws, b):
                return P.row_parallel_linear(xs, ws, b, leaves=8)

            row_in = (sh(x, -1), sh(w, 1), b)
            if backward:
                y1, (dx1, dw1, db1) = _grads(one_row, (x, w, b), g)
                yt, (dxt, dwt, dbt) = _grads(tp_row, row_in, g)
                assert torch.equal(dxt, sh(dx1, -1)), f"{tag}: row-parallel dX"
                assert torch.equal(dwt, sh(dw1, 1)), f"{tag}: row-parallel dW"
                assert torch.equal(dbt, db1), f"{tag}: row-parallel dbias"
            else:
                y1, yt = one_row(x, w, b), tp_row(*row_in)
            assert torch.equal(yt, y1), f"{tag}: row-parallel forward"
            # bf16 outputs rarely show a last-bit change of the fp32 sum (at these sizes never),
            # so compare the fp32 root too: the rank's subtree, gathered and topped by the tree.
            from rlk_triton import tree_gemm
            from rlk_triton.backend import default_table

            xr, xs = x.reshape(-1, K), sh(x, -1).reshape(-1, K // world)
            root1 = tree_gemm.subtree_sum(xr, w, 8, table=default_table())
            local = tree_gemm.subtree_sum(xs, sh(w, 1), 8 // world, table=default_table())
            parts = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(parts, local)
            assert torch.equal(tree_gemm.tree_combine(parts), root1), f"{tag}: fp32 root"
            # Each exchange gives the fp32 root itself, with M = 3 rows (padded to the ranks)
            # and 4 rows (no padding: halving sums into the given tensor).
            four = (torch.cat([local, local[:1]]), torch.cat([root1, root1[:1]]))
            for name in P.EXCHANGES:
                os.environ["RLK_TP_EXCHANGE"] = name
                for part, want in ((local, root1), four):
                    got = P._tree_reduce(part.clone(), world, None, None, torch.float32)
                    assert torch.equal(got, want), f"{tag}: fp32 root by {name}, M={len(want)}"
            os.environ["RLK_TP_EXCHANGE"] = exchange
            if dtype == torch.float32:
                # Negative control: a stock all-reduce of the ranks' plain linears differs, so
                # the equalities above are not vacuous at this size.
                stock = rlk.linear(*row_in[:2])
                dist.all_reduce(stock)
                assert not torch.equal(stock + b, y1), f"{tag}: stock all-reduce agreed"

            # Column-parallel == column_tree_linear / rlk.linear, forward and backward.
            def one_col(x, w, b):
                return P.column_tree_linear(x, w, b, leaves=8)

            def tp_col(x, ws, bs):
                return P.column_parallel_linear(x, ws, bs, leaves=8, gather_output=True)

            col_in = (x, sh(w, 0), sh(b, 0))
            if backward:
                y1, (dx1, dw1, db1) = _grads(one_col, (x, w, b), g)
                yt, (dxt, dwt, dbt) = _grads(tp_col, col_in, g)
                assert torch.equal(dxt, dx1), f"{tag}: column-parallel dX"
                assert torch.equal(dwt, sh(dw1, 0)), f"{tag}: column-parallel dW"
                assert torch.equal(dbt, sh(db1, 0)), f"{tag}: column-parallel dbias"
            else:
                y1, yt = one_col(x, w, b), tp_col(*col_in)
            assert torch.equal(yt, y1), f"{tag}: column-parallel forward"
            local = P.column_parallel_linear(x, sh(w, 0), sh(b, 0), leaves=8)
            assert torch.equal(local, sh(rlk.linear(x, w, b), -1)), f"{tag}: column slice"
            # gather_columns: the ranks' blocks in rank order; the gradient keeps the rank's block.
            mine = local.detach().requires_grad_(True)
            whole = P.gather_columns(mine)
            assert torch.equal(whole, rlk.linear(x, w, b)), f"{tag}: gather_columns"
            whole.backward(g.to(dtype))
            assert torch.equal(mine.grad, sh(g.to(dtype), -1)), f"{tag}: gather_columns gradient"
            _vocab_parallel(T, H, dtype, dev, sh, tag)
    finally:
        dist.destroy_process_group()


def _vocab_parallel(T, H, dtype, dev, sh, tag):
    """Vocabulary-parallel log-probs (and entropy) == rlk.linear_logprobs of the full lm_head,
    forward and backward (dHidden replicated, dW / dbias the rank's rows)."""
    from rlk_triton.logprobs import VOCAB_LEAVES

    g = torch.Generator().manual_seed(11)
    V = 2 * VOCAB_LEAVES if dev.type == "cpu" else 151936
    h = torch.randn(T, H, generator=g).to(dtype).to(dev)
    w = (torch.randn(V, H, generator=g) * H**-0.5 * 4).to(dtype).to(dev)
    b = torch.randn(V, generator=g).to(dtype).to(dev)
    tgt = torch.randint(0, V, (T,), generator=g).to(dev)
    g1, g2 = (torch.randn(T, generator=g).to(dev) for _ in range(2))

    def run(fn, h, w, b):
        h, w, b = (t.clone().requires_grad_(True) for t in (h, w, b))
        lp, ent = fn(h, w, tgt, b, 0.9, True)
        ((lp * g1).sum() + (ent * g2).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad, b.grad

    one = run(rlk.linear_logprobs, h, w, b)
    tp = run(P.vocab_parallel_linear_logprobs, h, sh(w, 0), sh(b, 0))
    for name, a, e in zip(("logprobs", "entropy", "dhidden"), tp, one):
        assert torch.equal(a, e), f"{tag}: vocab-parallel {name}"
    assert torch.equal(tp[3], sh(one[3], 0)), f"{tag}: vocab-parallel dW"
    assert torch.equal(tp[4], sh(one[4], 0)), f"{tag}: vocab-parallel dbias"
