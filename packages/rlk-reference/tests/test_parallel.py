"""The float64 tree-ordered and tensor-parallel ops: ranks simulated by threads.

Each rank runs in a thread with its shard; :class:`ThreadExchange` gives them the ``gather`` and
``reduce`` that ``rlk.parallel`` builds from a process group. Every rank's outputs and gradients
must match the one-device float64 oracle (the float64 sums of the ranks' partials differ from
it by rounding only).
"""

from __future__ import annotations

import threading

import pytest
import torch

import rlk_reference as ref


class ThreadExchange:
    """``world`` ranks as threads: gather through a shared list and a barrier."""

    def __init__(self, world: int):
        self.world = world
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world)

    def rank_view(self, rank: int) -> _Rank:
        return _Rank(self, rank)


class _Rank:
    def __init__(self, shared: ThreadExchange, rank: int):
        self.shared, self.rank, self.world = shared, rank, shared.world

    def gather(self, t):
        self.shared.barrier.wait()  # the previous exchange has been read by every rank
        self.shared.slots[self.rank] = t.clone()
        self.shared.barrier.wait()
        return list(self.shared.slots)

    def reduce(self, partial, bias, dtype):
        acc = torch.stack(self.gather(partial)).sum(0)
        if bias is not None:
            acc = acc + bias
        return acc.to(dtype)


def _run_ranks(world, fn):
    """``fn(rank, exchange)`` in ``world`` threads; their results in rank order."""
    shared, out, errors = ThreadExchange(world), [None] * world, []

    def target(r):
        try:
            out[r] = fn(r, shared.rank_view(r))
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _grads(fn, tensors):
    ts = [t.clone().requires_grad_(True) for t in tensors]
    y = fn(*ts)
    outs = y if isinstance(y, tuple) else (y,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return [o.detach() for o in outs], [t.grad for t in ts]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _data(seed=0, M=3, K=16, N=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(M, K, generator=g),
        torch.randn(N, K, generator=g),
        torch.randn(N, generator=g),
    )


def _shard(t, dim, rank, world):
    return t.chunk(world, dim)[rank].contiguous()


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_equals_one_device(world):
    x, w, b = _data()
    (y1,), (dx1, dw1, db1) = _grads(lambda x, w, b: ref.tree_linear(x, w, b, 8), (x, w, b))

    def rank(r, ex):
        args = (_shard(x, 1, r, world), _shard(w, 1, r, world), b)
        return _grads(lambda x, w, b: ref.tree_linear(x, w, b, 8 // world, exchange=ex), args)

    for r, ((y,), (dx, dw, db)) in enumerate(_run_ranks(world, rank)):
        _close(y, y1)
        _close(dx, _shard(dx1, 1, r, world))
        _close(dw, _shard(dw1, 1, r, world))
        _close(db, db1)


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_equals_one_device(world):
    x, w, b = _data(1)
    (y1,), (dx1, dw1, db1) = _grads(lambda x, w, b: ref.column_tree_linear(x, w, b, 8), (x, w, b))

    def rank(r, ex):
        args = (x, _shard(w, 0, r, world), _shard(b, 0, r, world))
        fn = lambda x, w, b: ref.column_tree_linear(x, w, b, 8 // world, exchange=ex)  # noqa: E731
        return _grads(fn, args)

    for r, ((y,), (dx, dw, db)) in enumerate(_run_ranks(world, rank)):
        _close(y, _shard(y1, 1, r, world))
        _close(dx, dx1)
        _close(dw, _shard(dw1, 0, r, world))
        _close(db, _shard(db1, 0, r, world))


@pytest.mark.parametrize("entropy", [False, True])
def test_vocab_parallel_equals_linear_logprobs(entropy):
    world, T, H, V = 4, 5, 8, 32
    g = torch.Generator().manual_seed(2)
    h, w, b = (
        torch.randn(T, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randn(V, generator=g),
    )
    tgt = torch.randint(0, V, (T,), generator=g)

    def one(h, w, b):
        return ref.linear_logprobs(h, w, tgt, b, 0.7, entropy, None)

    outs1, grads1 = _grads(one, (h, w, b))

    def rank(r, ex):
        def fn(h, w, b):
            return ref.vocab_parallel_linear_logprobs(h, w, tgt, b, 0.7, entropy, None, exchange=ex)

        return _grads(fn, (h, _shard(w, 0, r, world), _shard(b, 0, r, world)))

    for r, (outs, (dh, dw, db)) in enumerate(_run_ranks(world, rank)):
        for a, e in zip(outs, outs1, strict=True):
            _close(a, e)
        _close(dh, grads1[0])
        _close(dw, _shard(grads1[1], 0, r, world))
        _close(db, _shard(grads1[2], 0, r, world))


def test_the_check_can_fail():
    # A rank that drops its partial (an exchange that does not sum) is caught.
    x, w, b = _data(3)
    y1 = ref.tree_linear(x, w, b, 8)

    def rank(r, ex):
        ex.reduce = lambda p, bias, dtype: p.to(dtype)
        return ref.tree_linear(_shard(x, 1, r, 2), _shard(w, 1, r, 2), b, 4, exchange=ex)

    with pytest.raises(AssertionError):
        _close(_run_ranks(2, rank)[0], y1)
