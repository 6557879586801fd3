"""rlk._library: every public op as a ``torch.library`` custom operator.

``opcheck`` of each operator (schema, fake, autograd registration, AOT dispatch), each op under
``torch.compile(fullgraph=True)`` against its eager bits (outputs and gradients), the backend
picked when the compiled graph runs, the recomputing backward of a backend without
``OpAutograd``, and ``rlk.batch_invariant()`` under ``torch.compile``. Small shapes: the
Triton interpreter is slow.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import rlk
from rlk import _library, selection

BF = torch.bfloat16


def _t(*shape, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    t = torch.randn(*shape, generator=g).to(dtype)
    return t.requires_grad_() if grad else t


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _policy():
    lp, old, roll = (_t(2, 5, grad=i == 0, seed=i) for i in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    kw = dict(
        clip_c=3.0,
        rollout_logprobs=roll,
        is_normalize=torch.tensor(1.5),
        reject={"token_k1": (0.2, 5.0), "seq_mean_k3": 4.0},
        num_tokens=torch.tensor(8.0),
    )
    return (lp, old, _t(2, seed=4), mask), kw


_HOLEY = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)


def _value():
    v, old, ret = (_t(2, 5, grad=i == 0, seed=i) for i in range(3))
    kw = dict(clip=0.2, agg="seq-mean-token-sum-norm", num_seqs=torch.tensor(3.0))
    return (v, old, ret, _HOLEY), kw


def _paged():
    q, kc, vc = _t(2, 2, 8), _t(3, 4, 1, 8), _t(3, 4, 1, 8)
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    return (q, kc, vc, table, torch.tensor([6, 3], dtype=torch.int32), _cu(1, 1)), {}


def _paged_stores():
    # The last token of each sequence stored by the call: seq 0's token 5 (page 0, offset 1:
    # slot 1), seq 1's token 2 (page 1, offset 2: slot 6).
    args, _ = _paged()
    kw = {"k_new": _t(2, 1, 8, seed=5), "v_new": _t(2, 1, 8, seed=6)}
    return args, {**kw, "slots": torch.tensor([1, 6])}


def _rms_heads():
    # Qwen3's q norm on a fused q/k/v product: [T, heads, D] column views, read in place.
    qkv = _t(4, 5 * 8, dtype=BF)
    return (qkv[:, : 3 * 8].view(4, 3, 8), _t(8, dtype=BF), 1e-6), {}


#: op -> (a label, a function making the public call's (args, kwargs)).
CASES = {
    "linear": lambda: ((_t(4, 8, grad=True), _t(6, 8, grad=True), _t(6, grad=True)), {}),
    "rms_norm": lambda: ((_t(4, 8, dtype=BF, grad=True), _t(8, dtype=BF, grad=True), 1e-6), {}),
    "rms_norm/residual": lambda: (
        (_t(4, 8, dtype=BF, grad=True), _t(8, dtype=BF, grad=True), 1e-6),
        {"residual": _t(4, 8, dtype=BF, grad=True, seed=1)},
    ),
    "silu_and_mul": lambda: ((_t(2, 3, 8, dtype=BF, grad=True),), {}),
    "silu_and_mul/up": lambda: ((_t(4, 4, grad=True), _t(4, 4, grad=True, seed=1)), {}),
    "apply_rotary": lambda: ((_t(4, 2, 8, grad=True), _t(4, 8), _t(4, 8, seed=1)), {}),
    "apply_rotary/k": lambda: (
        (_t(4, 2, 8, dtype=BF, grad=True), _t(4, 8), _t(4, 8, seed=1)),
        {"k": _t(4, 1, 8, dtype=BF, grad=True)},
    ),
    "attention": lambda: (
        (_t(6, 2, 8, grad=True), _t(6, 1, 8, grad=True), _t(6, 1, 8, grad=True, seed=1)),
        {"cu_seqlens_q": _cu(2, 4), "cu_seqlens_k": _cu(2, 4)},
    ),
    "attention/bounds": lambda: (
        (_t(3, 2, 8, grad=True), _t(6, 1, 8, grad=True), _t(6, 1, 8, grad=True, seed=1)),
        {
            "cu_seqlens_q": _cu(1, 2),
            "cu_seqlens_k": _cu(2, 4),
            "max_seqlen_q": 2,
            "max_seqlen_k": 4,
        },
    ),  # fmt: skip
    "paged_attention": _paged,
    "paged_attention/stores": _paged_stores,
    "rms_norm/heads": _rms_heads,
    "logprobs": lambda: (
        (_t(4, 16, dtype=BF, grad=True), torch.tensor([0, 3, 15, 7])),
        {"temperature": 0.7, "return_entropy": True},
    ),
    "linear_logprobs": lambda: (
        (_t(4, 8, grad=True), _t(16, 8, grad=True), torch.tensor([0, 3, 15, 7])),
        {"logits_dtype": BF},
    ),
    "policy_loss": _policy,
    "kl_penalty": lambda: (
        (_t(2, 5, grad=True), _t(2, 5, seed=1)),
        {"kind": "k3", "old_logprobs": _t(2, 5, seed=2)},
    ),
    "grpo_advantages": lambda: ((_t(6),), {"group_size": 3, "norm_std": "batch"}),
    "gae_advantages": lambda: (
        (_t(2, 5, dtype=BF), _t(2, 5, seed=1), _HOLEY),
        {"gamma": 0.99, "lam": 0.95},
    ),
    "value_loss": _value,
    "moe_route": lambda: ((_t(5, 8, dtype=BF, grad=True), 3), {"normalize": True}),
    "moe_route_grouped": lambda: (
        (_t(5, 8, grad=True), _t(8, seed=1), 3),
        {"n_group": 4, "topk_group": 2, "normalize": True, "scale": 2.5},
    ),
    "moe_experts": lambda: (
        (
            _t(5, 8, dtype=BF, grad=True),
            torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2]]),
            _t(5, 2, grad=True, seed=1),
            _t(4, 8, 8, dtype=BF, grad=True, seed=2),
            _t(4, 8, 4, dtype=BF, grad=True, seed=3),
        ),
        {},
    ),
    "sample": lambda: (
        (_t(3, 16), torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])),
        {"temperature": 0.8, "top_k": torch.tensor([0, 4, 8]), "top_p": 0.9},
    ),
}


def _public(label):
    return getattr(rlk, label.split("/")[0])


def _operator_calls(label):
    """The operator calls ``(op, operator arguments)`` that the public call makes under
    ``torch.compile`` (the compiling path entered by hand; the value checks run, eagerly)."""
    args, kwargs = CASES[label]()
    seen = []

    def record(op, a, k):
        seen.append((op, _library.operator_args(op, a, k)))
        return real(op, a, k)

    real = _library.call
    with (
        mock.patch.object(selection, "_compiling", return_value=True),
        mock.patch.object(_library, "call", side_effect=record),
    ):
        _public(label)(*args, **kwargs)
    return seen


@pytest.mark.parametrize("label", list(CASES))
def test_opcheck(label):
    ((op, values),) = _operator_calls(label)
    torch.library.opcheck(getattr(torch.ops.rlk, op).default, tuple(values))


def _outputs(out):
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return [out[0], *out[1].values()]  # a loss and its metrics
    return list(out) if isinstance(out, tuple) else [out]


def _run(fn, label):
    args, kwargs = CASES[label]()
    outs = _outputs(fn(*args, **kwargs))
    given = (*args, *kwargs.values())
    leaves = [a for a in given if isinstance(a, torch.Tensor) and a.requires_grad]
    diff = [o for o in outs if o.requires_grad]
    grads = []
    if diff:
        cots = [torch.linspace(-1, 1, o.numel()).reshape(o.shape).to(o.dtype) for o in diff]
        grads = torch.autograd.grad(diff, leaves, cots, allow_unused=True)
    return [o.detach() for o in outs], grads


#: Differentiable ops whose Triton backend has no OpAutograd: their compiled backward runs the
#: op again under autograd (``_library._recompute_grads``) and differentiates it. None now.
RECOMPUTED: set[str] = set()


@pytest.mark.parametrize("label", list(CASES))
def test_compiled_op_gives_the_eager_bits(label):
    """Outputs and gradients, bit for bit. The compiled backward of a differentiable op runs
    the backend's backward kernels on what its forward saved (never the op again, but for
    :data:`RECOMPUTED`), so the gradients compared are those kernels' bits against the eager
    ``autograd.Function``'s: a backward that changed them fails here."""
    torch._dynamo.reset()
    fn = _public(label)
    want_out, want_grads = _run(fn, label)
    recompute = mock.patch.object(_library, "_recompute_grads", wraps=_library._recompute_grads)
    with recompute as recomputed:
        got_out, got_grads = _run(torch.compile(fn, fullgraph=True), label)
    op = label.split("/")[0]
    assert recomputed.called == (op in RECOMPUTED and any(g is not None for g in got_grads))
    assert len(want_out) == len(got_out)
    for a, b in zip(want_out, got_out):
        assert torch.equal(a, b)
    for a, b in zip(want_grads, got_grads, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_eager_calls_do_not_go_through_the_operators():
    with mock.patch.object(_library, "call", side_effect=AssertionError("operator called")):
        rlk.linear(_t(4, 8), _t(6, 8))


def test_the_backend_is_picked_when_the_compiled_graph_runs():
    """The graph holds the operator, not a backend: a backend chosen after compiling serves
    the next call, forward and backward (here the float64 reference, whose backward without
    OpAutograd runs its own op again under autograd)."""
    torch._dynamo.reset()
    compiled = torch.compile(rlk.rms_norm, fullgraph=True)
    want = {}
    for name in ("auto", "reference"):
        with rlk.use_backend(name):
            want[name] = _run(rlk.rms_norm, "rms_norm/residual")
    for name in ("auto", "reference", "auto"):
        with rlk.use_backend(name):
            got = _run(compiled, "rms_norm/residual")
        for a, b in zip(want[name][0] + list(want[name][1]), got[0] + list(got[1])):
            assert torch.equal(a, b), name
    diff = [not torch.equal(a, b) for a, b in zip(want["auto"][1], want["reference"][1])]
    assert any(diff), "the two backends agree bitwise here: the test cannot tell them apart"


def test_a_backend_without_op_autograd_poisons_the_extras():
    """Its forward does not compute the extras another backend's backward would read."""
    args, kwargs = CASES["rms_norm"]()
    with rlk.use_backend("reference"):
        outs = torch.ops.rlk.rms_norm(*_library.operator_args("rms_norm", args, {"residual": None}))
    assert torch.isnan(outs[-1]).all()


def test_batch_invariant_under_compile():
    """``batch_invariant()`` serves the aten kernels a compiled graph calls (``aot_eager``),
    not the code Inductor generates or the extern GEMMs it calls; rlk's own ops stay rlk's in
    either graph."""
    x, w = _t(5, 64), _t(16, 64)
    rlk_rows = rlk.linear(x, w)
    stock = x @ w.t()
    torch._dynamo.reset()
    with rlk.batch_invariant():
        eager_graph = torch.compile(lambda a, b: a @ b.t(), backend="aot_eager", fullgraph=True)
        assert torch.equal(eager_graph(x, w), rlk_rows)
        inductor = torch.compile(lambda a, b: (a @ b.t(), rlk.linear(a, b)), fullgraph=True)
        got_stock, got_rlk = inductor(x, w)
    assert torch.equal(got_stock, stock)
    assert torch.equal(got_rlk, rlk_rows)
    assert not torch.equal(stock, rlk_rows), "stock and rlk agree here: nothing is shown"
