"""Every public op rejects bad input with a TypeError/ValueError naming the argument, before any
backend code runs (a spy backend whose ops all fail proves nothing was launched)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

import rlk
import rlk.parallel
from rlk import _validate as chk
from rlk import selection
from rlk.plugins import BackendImpl, BackendSpec

bf16 = torch.bfloat16
i32 = torch.int32


class _Tripwire:
    @rlk.hookimpl
    def rlk_backends(self):
        def reached(*a, **k):
            raise AssertionError("validation let bad input reach the backend")

        impl = BackendImpl(ops={op: reached for op in rlk.OPS}, claims=frozenset())
        return [
            BackendSpec(
                name="tripwire",
                priority=10**6,
                device_types=("*",),
                is_available=lambda: (True, ""),
                load=lambda: impl,
            )
        ]


@pytest.fixture(autouse=True)
def tripwire(monkeypatch):
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    selection.reset_registry(extra_plugins=[_Tripwire()])
    with rlk.use_backend("tripwire"):
        yield
    selection.reset_registry()


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def cu(*offsets):
    return torch.tensor(offsets, dtype=i32)


def _attn(**over):
    a = dict(
        q=r(5, 4, 16),
        k=r(7, 2, 16),
        v=r(7, 2, 16),
        cu_seqlens_q=cu(0, 2, 5),
        cu_seqlens_k=cu(0, 3, 7),
    )
    a.update(over)
    return lambda: rlk.attention(
        a["q"],
        a["k"],
        a["v"],
        a["cu_seqlens_q"],
        a["cu_seqlens_k"],
        **{
            k: v
            for k, v in over.items()
            if k in ("causal", "scale", "max_seqlen_q", "max_seqlen_k")
        },
    )


def _paged(**over):
    a = dict(
        q=r(3, 4, 16),
        k_cache=r(6, 16, 2, 16),
        v_cache=r(6, 16, 2, 16),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=i32),
        seq_lens=cu(20, 17),
        cu_seqlens_q=cu(0, 1, 3),
    )
    new = {k: v for k, v in over.items() if k in ("k_new", "v_new", "slots")}
    a.update({k: v for k, v in over.items() if k not in new})
    return lambda: rlk.paged_attention(
        a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"], a["cu_seqlens_q"],
        **new,
    )  # fmt: skip


def _pl(**over):
    b, l = 2, 5
    a = dict(
        logprobs=r(b, l),
        old_logprobs=r(b, l),
        advantages=r(b, l),
        mask=torch.ones(b, l, dtype=torch.bool),
    )
    kw = {k: v for k, v in over.items() if k not in a}
    a.update({k: v for k, v in over.items() if k in a})
    return lambda: rlk.policy_loss(
        a["logprobs"], a["old_logprobs"], a["advantages"], a["mask"], **kw
    )


def _gae(**over):
    a = dict(rewards=r(2, 5), values=r(2, 5), mask=torch.ones(2, 5, dtype=torch.bool))
    kw = {k: v for k, v in over.items() if k not in a}
    a.update({k: v for k, v in over.items() if k in a})
    return lambda: rlk.gae_advantages(a["rewards"], a["values"], a["mask"], **kw)


def _vl(**over):
    a = dict(values=r(2, 5), old_values=r(2, 5), returns=r(2, 5), mask=torch.ones(2, 5))
    kw = {k: v for k, v in over.items() if k not in a}
    a.update({k: v for k, v in over.items() if k in a})
    return lambda: rlk.value_loss(a["values"], a["old_values"], a["returns"], a["mask"], **kw)


def _sample(**over):
    a = dict(logits=r(3, 10), seeds=torch.arange(3), offsets=torch.zeros(3, dtype=torch.int64))
    kw = {k: v for k, v in over.items() if k not in a}
    a.update({k: v for k, v in over.items() if k in a})
    return lambda: rlk.sample(a["logits"], a["seeds"], a["offsets"], **kw)


T = torch.arange(4)

CASES = {
    # linear
    "linear x not a tensor": (lambda: rlk.linear([1.0], r(3, 1)), TypeError, "x"),
    "linear int x": (
        lambda: rlk.linear(torch.ones(2, 3, dtype=torch.int64), r(4, 3)),
        TypeError,
        "x",
    ),
    "linear weight 1-D": (lambda: rlk.linear(r(2, 3), r(3)), ValueError, "weight"),
    "linear K mismatch": (lambda: rlk.linear(r(2, 3), r(4, 5)), ValueError, "weight"),
    "linear bias shape": (lambda: rlk.linear(r(2, 3), r(4, 3), r(5)), ValueError, "bias"),
    "linear dtype mismatch": (
        lambda: rlk.linear(r(2, 3), r(4, 3, dtype=bf16)),
        TypeError,
        "weight",
    ),
    "linear non-contiguous": (lambda: rlk.linear(r(3, 2).t(), r(4, 3)), ValueError, "x"),
    "linear device mismatch": (
        lambda: rlk.linear(r(2, 3), r(4, 3).to("meta")),
        ValueError,
        "weight",
    ),
    # rms_norm
    "rms_norm weight shape": (lambda: rlk.rms_norm(r(2, 8), r(7)), ValueError, "weight"),
    "rms_norm eps": (lambda: rlk.rms_norm(r(2, 8), r(8), -1.0), ValueError, "eps"),
    "rms_norm residual shape": (
        lambda: rlk.rms_norm(r(2, 8), r(8), 1e-6, r(3, 8)),
        ValueError,
        "residual",
    ),
    "rms_norm residual dtype": (
        lambda: rlk.rms_norm(r(2, 8), r(8), 1e-6, r(2, 8, dtype=bf16)),
        TypeError,
        "residual",
    ),
    "rms_norm empty hidden": (lambda: rlk.rms_norm(r(2, 0), r(0)), ValueError, "x"),
    "rms_norm eps nan": (lambda: rlk.rms_norm(r(2, 8), r(8), float("nan")), ValueError, "eps"),
    "rms_norm eps inf": (lambda: rlk.rms_norm(r(2, 8), r(8), float("inf")), ValueError, "eps"),
    "rms_norm eps zero": (lambda: rlk.rms_norm(r(2, 8), r(8), 0.0), ValueError, "eps"),
    "rms_norm eps str": (lambda: rlk.rms_norm(r(2, 8), r(8), "1e-6"), TypeError, "eps"),
    "rms_norm x non-contiguous": (lambda: rlk.rms_norm(r(8, 2).t(), r(8)), ValueError, "x"),
    "rms_norm int x": (
        lambda: rlk.rms_norm(torch.ones(2, 8, dtype=torch.int64), r(8)),
        TypeError,
        "x",
    ),
    "rms_norm weight 2-D": (lambda: rlk.rms_norm(r(2, 8), r(1, 8)), ValueError, "weight"),
    "rms_norm residual non-contiguous": (
        lambda: rlk.rms_norm(r(2, 8), r(8), 1e-6, r(8, 2).t()),
        ValueError,
        "residual",
    ),
    "rms_norm device mismatch": (
        lambda: rlk.rms_norm(r(2, 8), r(8).to("meta")),
        ValueError,
        "weight",
    ),
    # silu_and_mul
    "silu odd": (lambda: rlk.silu_and_mul(r(2, 7)), ValueError, "x"),
    "silu up shape": (lambda: rlk.silu_and_mul(r(2, 7), r(2, 6)), ValueError, "up"),
    "silu up dtype": (lambda: rlk.silu_and_mul(r(2, 4), r(2, 4, dtype=bf16)), TypeError, "up"),
    "silu up not a tensor": (lambda: rlk.silu_and_mul(r(2, 4), 1.0), TypeError, "up"),
    # rotary
    "rotary 2-D x": (lambda: rlk.apply_rotary(r(4, 8), r(4, 8), r(4, 8)), ValueError, "x"),
    "rotary cos shape": (lambda: rlk.apply_rotary(r(4, 2, 8), r(3, 8), r(3, 8)), ValueError, "cos"),
    "rotary cos dtype": (
        lambda: rlk.apply_rotary(
            r(4, 2, 8, dtype=bf16), r(4, 8, dtype=torch.float16), r(4, 8, dtype=torch.float16)
        ),
        TypeError,
        "cos",
    ),
    "rotary odd dim": (
        lambda: rlk.apply_rotary(r(4, 2, 7), r(4, 7), r(4, 7)),
        ValueError,
        "head dim",
    ),
    "rotary k 2-D": (
        lambda: rlk.apply_rotary(r(4, 2, 8), r(4, 8), r(4, 8), r(4, 8)),
        ValueError,
        "k",
    ),
    "rotary k tokens": (
        lambda: rlk.apply_rotary(r(4, 2, 8), r(4, 8), r(4, 8), r(3, 1, 8)),
        ValueError,
        "k",
    ),
    "rotary k head dim": (
        lambda: rlk.apply_rotary(r(4, 2, 8), r(4, 8), r(4, 8), r(4, 1, 6)),
        ValueError,
        "k",
    ),
    "rotary k dtype": (
        lambda: rlk.apply_rotary(r(4, 2, 8), r(4, 8), r(4, 8), r(4, 1, 8, dtype=bf16)),
        TypeError,
        "k",
    ),
    "rotary k not a tensor": (
        lambda: rlk.apply_rotary(r(4, 2, 8), r(4, 8), r(4, 8), [1.0]),
        TypeError,
        "k",
    ),
    # attention
    "attn q 2-D": (_attn(q=r(5, 64)), ValueError, "q"),
    "attn v shape": (_attn(v=r(7, 2, 8)), ValueError, "v"),
    "attn heads": (_attn(q=r(5, 3, 16)), ValueError, "heads"),
    "attn head dim": (_attn(q=r(5, 4, 8)), ValueError, "head dim"),
    "attn cu dtype": (_attn(cu_seqlens_q=torch.tensor([0, 2, 5])), TypeError, "cu_seqlens_q"),
    "attn cu first": (_attn(cu_seqlens_q=cu(1, 2, 5)), ValueError, "cu_seqlens_q"),
    "attn cu monotone": (_attn(cu_seqlens_k=cu(0, 8, 7)), ValueError, "cu_seqlens_k"),
    "attn cu total": (_attn(cu_seqlens_k=cu(0, 3, 6)), ValueError, "cu_seqlens_k"),
    "attn cu count": (_attn(cu_seqlens_k=cu(0, 7)), ValueError, "cu_seqlens_k"),
    "attn more q than k": (_attn(cu_seqlens_q=cu(0, 4, 5)), ValueError, "queries"),
    "attn causal type": (_attn(causal="yes"), TypeError, "causal"),
    "attn causal int": (_attn(causal=1), TypeError, "causal"),
    "attn head dim zero": (_attn(q=r(5, 4, 0), k=r(7, 2, 0), v=r(7, 2, 0)), ValueError, "head dim"),
    "attn scale": (_attn(scale=-1.0), ValueError, "scale"),
    "attn no sequence": (_attn(cu_seqlens_q=cu(0), cu_seqlens_k=cu(0)), ValueError, "no sequence"),
    "attn one bound": (_attn(max_seqlen_q=3), ValueError, "max_seqlen_k"),
    "attn bound type": (_attn(max_seqlen_q=3.0, max_seqlen_k=4), TypeError, "max_seqlen_q"),
    "attn bound bool": (_attn(max_seqlen_q=3, max_seqlen_k=True), TypeError, "max_seqlen_k"),
    "attn bound zero": (_attn(max_seqlen_q=0, max_seqlen_k=4), ValueError, "max_seqlen_q"),
    "attn bound short": (_attn(max_seqlen_q=3, max_seqlen_k=3), ValueError, "max_seqlen_k"),
    # paged attention
    "paged page out of range": (
        _paged(block_table=torch.tensor([[0, 9], [2, 3]], dtype=i32)),
        ValueError,
        "block_table",
    ),
    "paged too long": (_paged(seq_lens=cu(40, 17)), ValueError, "seq_lens"),
    "paged k_new alone": (_paged(k_new=r(3, 2, 16)), ValueError, "together"),
    "paged slots dtype": (
        _paged(k_new=r(3, 2, 16), v_new=r(3, 2, 16), slots=cu(19, 35, 36)),
        TypeError,
        "slots",
    ),
    "paged v_new shape": (
        _paged(k_new=r(3, 2, 16), v_new=r(2, 2, 16), slots=torch.tensor([19, 35, 36])),
        ValueError,
        "v_new",
    ),
    "paged slot out of range": (
        _paged(k_new=r(3, 2, 16), v_new=r(3, 2, 16), slots=torch.tensor([19, 35, 96])),
        ValueError,
        "slots",
    ),
    "paged slots repeated": (
        _paged(k_new=r(3, 2, 16), v_new=r(3, 2, 16), slots=torch.tensor([19, 35, 35])),
        ValueError,
        "distinct",
    ),
    "paged too short": (_paged(seq_lens=cu(20, 1)), ValueError, "seq_lens"),
    "paged seq_lens shape": (_paged(seq_lens=cu(20)), ValueError, "seq_lens"),
    "paged cu length": (_paged(cu_seqlens_q=cu(0, 3)), ValueError, "cu_seqlens_q"),
    "paged head dim zero": (
        _paged(q=r(3, 4, 0), k_cache=r(6, 16, 2, 0), v_cache=r(6, 16, 2, 0)),
        ValueError,
        "head dim",
    ),
    "paged block_table dtype": (
        _paged(block_table=torch.tensor([[0, 1], [2, 3]])),
        TypeError,
        "block_table",
    ),
    # logprobs
    "logprobs target high": (
        lambda: rlk.logprobs(r(4, 10), torch.tensor([0, 1, 2, 10])),
        ValueError,
        "targets",
    ),
    "logprobs target negative": (
        lambda: rlk.logprobs(r(4, 10), torch.tensor([0, -1, 2, 3])),
        ValueError,
        "targets",
    ),
    "logprobs target dtype": (lambda: rlk.logprobs(r(4, 10), T.to(i32)), TypeError, "targets"),
    "logprobs target length": (lambda: rlk.logprobs(r(5, 10), T), ValueError, "targets"),
    "logprobs temperature": (lambda: rlk.logprobs(r(4, 10), T, 0.0), ValueError, "temperature"),
    "logprobs 3-D": (lambda: rlk.logprobs(r(1, 4, 10), T), ValueError, "logits"),
    "logprobs entropy str": (
        lambda: rlk.logprobs(r(4, 10), T, return_entropy="False"),
        TypeError,
        "return_entropy",
    ),
    "logprobs entropy int": (
        lambda: rlk.logprobs(r(4, 10), T, return_entropy=0),
        TypeError,
        "return_entropy",
    ),
    # linear_logprobs
    "llp hidden mismatch": (
        lambda: rlk.linear_logprobs(r(4, 8), r(10, 9), T),
        ValueError,
        "weight",
    ),
    "llp target high": (
        lambda: rlk.linear_logprobs(r(4, 8), r(10, 8), T + 7),
        ValueError,
        "targets",
    ),
    "llp logits_dtype": (
        lambda: rlk.linear_logprobs(r(4, 8), r(10, 8), T, logits_dtype=torch.int8),
        TypeError,
        "logits_dtype",
    ),
    "llp bias": (lambda: rlk.linear_logprobs(r(4, 8), r(10, 8), T, r(9)), ValueError, "bias"),
    "llp entropy str": (
        lambda: rlk.linear_logprobs(r(4, 8), r(10, 8), T, return_entropy="no"),
        TypeError,
        "return_entropy",
    ),
    "vocab-parallel llp entropy str": (
        lambda: rlk.parallel.vocab_parallel_linear_logprobs(
            r(4, 8), r(10, 8), T, return_entropy="False"
        ),
        TypeError,
        "return_entropy",
    ),
    # policy_loss
    "pl agg": (_pl(agg="mean"), ValueError, "agg"),
    "pl old shape": (_pl(old_logprobs=r(2, 4)), ValueError, "old_logprobs"),
    "pl adv shape": (_pl(advantages=r(3)), ValueError, "advantages"),
    "pl mask values": (_pl(mask=torch.full((2, 5), 2.0)), ValueError, "mask"),
    "pl clip_c": (_pl(clip_c=0.5), ValueError, "clip_c"),
    "pl clip_low": (_pl(clip_low=1.5), ValueError, "clip_low"),
    "pl tis alone": (_pl(tis_cap=2.0), ValueError, "rollout_logprobs"),
    "pl rollout shape": (
        _pl(rollout_logprobs=r(2, 4), tis_cap=2.0),
        ValueError,
        "rollout_logprobs",
    ),
    # kl / grpo
    "kl kind": (lambda: rlk.kl_penalty(r(2, 3), r(2, 3), "k4"), ValueError, "kind"),
    "kl shape": (lambda: rlk.kl_penalty(r(2, 3), r(2, 4), "k1"), ValueError, "ref_logprobs"),
    # gae_advantages / value_loss
    "gae 1-D rewards": (_gae(rewards=r(10)), ValueError, "rewards"),
    "gae int rewards": (_gae(rewards=torch.ones(2, 5, dtype=i32)), TypeError, "rewards"),
    "gae values shape": (_gae(values=r(2, 4)), ValueError, "values"),
    "gae mask shape": (_gae(mask=torch.ones(3, 5, dtype=torch.bool)), ValueError, "mask"),
    "gae mask values": (_gae(mask=torch.full((2, 5), 0.5)), ValueError, "mask"),
    "gae gamma > 1": (_gae(gamma=1.5), ValueError, "gamma"),
    "gae lam negative": (_gae(lam=-0.1), ValueError, "lam"),
    "gae lam nan": (_gae(lam=float("nan")), ValueError, "lam"),
    "gae whiten str": (_gae(whiten="False"), TypeError, "whiten"),
    "value old_values shape": (_vl(old_values=r(2, 6)), ValueError, "old_values"),
    "value returns dtype": (_vl(returns=torch.ones(2, 5, dtype=i32)), TypeError, "returns"),
    "value mask shape": (_vl(mask=torch.ones(2, 4)), ValueError, "mask"),
    "value clip zero": (_vl(clip=0.0), ValueError, "clip"),
    "value agg": (_vl(agg="seq-mean"), ValueError, "agg"),
    "value num_seqs with token-mean": (_vl(num_seqs=3.0), ValueError, "num_seqs"),
    "value num_tokens negative": (_vl(num_tokens=-1.0), ValueError, "num_tokens"),
    "value norm_length with token-sum": (
        _vl(agg="token-sum", norm_length=4.0),
        ValueError,
        "norm_length",
    ),  # fmt: skip
    "grpo divisibility": (lambda: rlk.grpo_advantages(r(10), 4), ValueError, "group_size"),
    "grpo size one": (lambda: rlk.grpo_advantages(r(10), 1), ValueError, "group_size"),
    "grpo float size": (lambda: rlk.grpo_advantages(r(10), 2.0), TypeError, "group_size"),
    "grpo 2-D": (lambda: rlk.grpo_advantages(r(2, 5), 5), ValueError, "rewards"),
    "grpo eps zero": (lambda: rlk.grpo_advantages(r(10), 5, eps=0.0), ValueError, "eps"),
    "grpo eps negative": (lambda: rlk.grpo_advantages(r(10), 5, eps=-1e-6), ValueError, "eps"),
    "grpo norm_std str": (
        lambda: rlk.grpo_advantages(r(10), 5, norm_std="False"),
        TypeError,
        "norm_std",
    ),
    # sample
    "sample seeds length": (_sample(seeds=torch.arange(2)), ValueError, "seeds"),
    "sample seeds dtype": (_sample(seeds=torch.zeros(3)), TypeError, "seeds"),
    "sample top_p zero": (_sample(top_p=0.0), ValueError, "top_p"),
    "sample top_p high": (_sample(top_p=1.5), ValueError, "top_p"),
    "sample top_k": (_sample(top_k=-1), ValueError, "top_k"),
    "sample top_k float": (_sample(top_k=2.5), TypeError, "top_k"),
    "sample temperature": (_sample(temperature=-0.5), ValueError, "temperature"),
    "sample offsets": (_sample(offsets=torch.full((3,), -1)), ValueError, "offsets"),
    "sample offsets int": (_sample(offsets=-1), ValueError, "offsets"),
    "sample seeds overflow": (_sample(seeds=2**64), ValueError, "seeds"),
    "sample top_p nan": (_sample(top_p=float("nan")), ValueError, "top_p"),
    "sample top_p nan tensor": (_sample(top_p=torch.full((3,), float("nan"))), ValueError, "top_p"),
    "sample temperature nan": (_sample(temperature=float("nan")), ValueError, "temperature"),
    "sample temperature inf": (_sample(temperature=float("inf")), ValueError, "temperature"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_rejected_naming_the_argument(case):
    fn, exc, name = CASES[case]
    with pytest.raises(exc, match=name):
        fn()


def test_good_input_reaches_the_backend():
    with pytest.raises(AssertionError, match="reach the backend"):
        rlk.linear(r(2, 3), r(4, 3))


def _meta_sample(**params):
    logits = torch.empty(3, 10, device="meta")
    seeds = torch.empty(3, dtype=torch.int64, device="meta")
    return rlk.sample(logits, seeds, 0, **params)


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": float("nan")},
        {"top_p": 1.5},
        {"top_p": 0.0},
        {"top_k": -1},
        {"temperature": -1.0},
        {"temperature": float("nan")},
    ],
    ids=str,
)
def test_sample_checks_python_numbers_on_the_host_on_any_device(monkeypatch, params):
    # Off CPU, with RLK_VALIDATE off, tensors' values go unchecked; numbers never do.
    monkeypatch.setenv("RLK_VALIDATE", "0")
    with pytest.raises(ValueError, match=next(iter(params))):
        _meta_sample(**params)


def test_sample_number_checks_read_no_device(monkeypatch):
    # A meta tensor has no values: any device read would raise before the backend is reached.
    # (Under RLK_VALIDATE the logits themselves are read, for NaN: that check is left out.)
    monkeypatch.setenv("RLK_VALIDATE", "1")
    checks = chk.value_checks_enabled
    monkeypatch.setattr(chk, "value_checks_enabled", lambda t: t.dim() != 2 and checks(t))
    with pytest.raises(AssertionError, match="reach the backend"):
        _meta_sample(temperature=0.7, top_k=5, top_p=0.9)


def test_sample_rejects_nan_logits_where_values_are_checked():
    logits = torch.zeros(2, 5)
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="logits has NaN"):
        rlk.sample(logits, torch.zeros(2, dtype=torch.int64), 0)


@pytest.mark.parametrize(
    "raw, on",
    [
        ("1", True),
        (" 1", True),
        ("TRUE", True),
        ("Yes\n", True),
        ("on", True),
        ("0", False),
        ("false", False),
        (" No ", False),
        ("OFF", False),
        ("", False),
    ],
)
def test_rlk_validate_parsing(monkeypatch, raw, on):
    monkeypatch.setenv("RLK_VALIDATE", raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chk.value_checks_enabled(torch.empty(1, device="meta")) is on


def test_rlk_validate_unset_is_off(monkeypatch):
    monkeypatch.delenv("RLK_VALIDATE")
    assert chk.value_checks_enabled(torch.empty(1, device="meta")) is False
    assert chk.value_checks_enabled(torch.empty(1)) is True  # CPU: always (no device to sync)


def test_rlk_validate_unknown_value_warns_once_and_checks(monkeypatch):
    monkeypatch.setattr(chk, "_warned", set())
    monkeypatch.setenv("RLK_VALIDATE", "enable")
    meta = torch.empty(1, device="meta")
    with pytest.warns(RuntimeWarning, match="RLK_VALIDATE='enable'"):
        assert chk.value_checks_enabled(meta) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chk.value_checks_enabled(meta) is True


def test_rlk_loads_files_with_weights_only():
    """Every torch.load in rlk's sources passes weights_only=True: a pickle can run code."""
    root = Path(__file__).resolve().parents[1] / "packages"
    calls = []
    for path in root.glob("*/src/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                safe = (
                    isinstance(kw.get("weights_only"), ast.Constant)
                    and kw["weights_only"].value is True
                )
                calls.append((f"{path.relative_to(root)}:{node.lineno}", safe))
    assert calls, "no torch.load found: the search is broken"
    assert [where for where, safe in calls if not safe] == []
