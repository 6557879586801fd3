"""The public RL objectives' arguments: bad input names the argument before a backend runs;
verl's names arrive at the backend as rlk's; defaults are resolved (a spy backend records what
it receives)."""

from __future__ import annotations

import re

import pytest
import torch

import rlk
from rlk import selection
from rlk.plugins import BackendImpl, BackendSpec

CALLS: list[tuple[str, tuple, dict]] = []


class _Spy:
    @rlk.hookimpl
    def rlk_backends(self):
        def op(name):
            def record(*args, **kwargs):
                CALLS.append((name, args, kwargs))
                return torch.zeros(())  # a result the API accepts; CALLS has the call

            return record

        impl = BackendImpl(ops={name: op(name) for name in rlk.OPS}, claims=frozenset())
        return [
            BackendSpec(
                name="spy",
                priority=10**6,
                device_types=("*",),
                is_available=lambda: (True, ""),
                load=lambda: impl,
            )
        ]


@pytest.fixture(autouse=True)
def spy(monkeypatch):
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    selection.reset_registry(extra_plugins=[_Spy()])
    CALLS.clear()
    with rlk.use_backend("spy"):
        yield
    selection.reset_registry()


def r(*shape):
    return torch.randn(*shape)


M = torch.ones(2, 5, dtype=torch.bool)


def _pl(**kw):
    return rlk.policy_loss(r(2, 5), r(2, 5), r(2), M, **kw)


def _received():
    return CALLS[-1][2]


BAD = {
    "agg": (dict(agg="dr_grpo"), ValueError),
    "ratio_level": (dict(ratio_level="seq"), ValueError),
    "is_level": (dict(rollout_logprobs=r(2, 5), is_level="tok"), ValueError),
    "is_mode": (dict(rollout_logprobs=r(2, 5), is_mode="clip"), ValueError),
    "is_min": (dict(rollout_logprobs=r(2, 5), is_min=-1.0), ValueError),
    "is_max": (dict(rollout_logprobs=r(2, 5), is_max="2"), TypeError),
    "is_min <= is_max": (dict(rollout_logprobs=r(2, 5), is_min=3.0, is_max=2.0), ValueError),
    "tis_cap and is_max": (dict(rollout_logprobs=r(2, 5), tis_cap=2.0, is_max=2.0), ValueError),
    "rollout_logprobs": (dict(is_max=2.0), ValueError),
    "rollout_logprobs type": (dict(rollout_logprobs=[0.0] * 5), TypeError),
    "rollout_logprobs shape": (dict(rollout_logprobs=r(2, 4), is_max=2.0), ValueError),
    "reject needs rollout_logprobs": (dict(reject={"token_k1": 2.0}), ValueError),
    "is_normalize needs weights": (
        dict(rollout_logprobs=r(2, 5), is_level=None, is_normalize=True),
        ValueError,
    ),
    "is_normalize": (dict(rollout_logprobs=r(2, 5), is_normalize=-1.0), ValueError),
    "reject option": (dict(rollout_logprobs=r(2, 5), reject={"token_k4": 1.0}), ValueError),
    "reject type": (dict(rollout_logprobs=r(2, 5), reject=["token_k1"]), TypeError),
    "reject bounds": (
        dict(rollout_logprobs=r(2, 5), reject={"seq_sum_k1": (2.0, 1.0)}),
        ValueError,
    ),
    "reject threshold": (dict(rollout_logprobs=r(2, 5), reject={"seq_max_k2": 0.0}), ValueError),
    "num_tokens mode": (dict(agg="seq-mean-token-mean", num_tokens=10), ValueError),
    "num_tokens": (dict(num_tokens=0), ValueError),
    "num_tokens tensor": (dict(num_tokens=torch.tensor(-3.0)), ValueError),
    "num_tokens shape": (dict(num_tokens=torch.ones(2)), TypeError),
    "num_seqs mode": (dict(agg="token-mean", num_seqs=3), ValueError),
    "norm_length mode": (dict(agg="seq-mean-token-mean", norm_length=64), ValueError),
    "norm_length": (dict(agg="row-mean-token-sum-norm", norm_length=float("inf")), ValueError),
    "loss_mode": (dict(loss_mode="ppo"), ValueError),
    "loss_mode clip_cov": (dict(loss_mode="clip_cov"), ValueError),
    "loss_mode kl_cov": (dict(loss_mode="kl_cov"), ValueError),
    "loss_mode gspo": (dict(loss_mode="gspo"), ValueError),
    "loss_mode bypass_mode": (dict(loss_mode="bypass_mode"), ValueError),
    "mode_params of another mode": (dict(loss_mode="sapo", mode_params={"beta": 1}), ValueError),
    "mode_params needed": (dict(loss_mode="dro"), ValueError),
    "mode_params type": (dict(loss_mode="dro", mode_params=[1.0]), TypeError),
    "mode_params value": (dict(loss_mode="sapo", mode_params={"tau_pos": 0.0}), ValueError),
    "clip_c for cispo": (dict(loss_mode="cispo", clip_c=3.0), ValueError),
    "clip_low for cispo": (dict(loss_mode="cispo", clip_low=1.5), ValueError),
    "ratio_level for gpg": (dict(loss_mode="gpg", ratio_level="sequence"), ValueError),
    "is_level for geo_mean": (dict(loss_mode="geo_mean", rollout_logprobs=r(2, 5)), ValueError),
    "is_level for vespo": (dict(loss_mode="vespo", rollout_logprobs=r(2, 5)), ValueError),
}


@pytest.mark.parametrize("case", BAD, ids=str)
def test_policy_loss_bad_arguments_are_named(case):
    kw, exc = BAD[case]
    name = case.split()[0]
    with pytest.raises(exc, match=name):
        _pl(**kw)
    assert not CALLS


@pytest.mark.parametrize("arg", sorted(rlk.ops.UNOFFERED))
def test_unoffered_settings_name_themselves_and_say_why(arg):
    call = {
        "loss_mode": lambda v: _pl(loss_mode=v),
        "estimator": lambda v: rlk.grpo_advantages(r(4), 2, estimator=v),
        "kind": lambda v: rlk.kl_penalty(r(2, 3), r(2, 3), v),
    }[arg]
    for name, reason in rlk.ops.UNOFFERED[arg].items():
        with pytest.raises(ValueError, match=re.escape(f"{arg}={name!r} is not offered: ")) as err:
            call(name)
        assert reason in str(err.value)
    assert not CALLS


def test_policy_loss_mode_params_reach_the_backend_in_order():
    _pl(loss_mode="vespo", mode_params={"lambda_neg": 0.5, "k_pos": 1})
    assert _received()["loss_mode"] == "vespo"
    assert _received()["mode_params"] == (1.0, 3.0, 3.0, 0.5)
    _pl(loss_mode="sapo")
    assert _received()["mode_params"] == (1.0, 1.05)
    _pl()
    assert _received()["loss_mode"] == "vanilla" and _received()["mode_params"] == ()
    _pl(loss_mode="dppo_tv", clip_low=2.0, clip_c=0.5)  # divergence bounds, a cap below 1
    assert _received()["clip_c"] == 0.5


def test_policy_loss_normalises_what_the_backend_gets():
    _pl(agg="seq-mean-token-sum-norm")
    assert _received()["norm_length"] == 5.0  # the default: L
    _pl(rollout_logprobs=r(2, 5), tis_cap=2, reject={"token_k1": 4.0, "seq_max_k2": 1})
    got = _received()
    assert got["is_max"] == 2.0 and "tis_cap" not in got
    assert got["reject"] == {"token_k1": (0.25, 4.0), "seq_max_k2": (None, 1.0)}
    n = torch.tensor(40)
    _pl(num_tokens=n)
    assert _received()["num_tokens"] is n


KL_ALIASES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "low_var_kl+": "k3+",
    "k2+": "k2",
    "abs+": "abs+",
}


@pytest.mark.parametrize("name,canonical", KL_ALIASES.items())
def test_kl_penalty_accepts_verl_names(name, canonical):
    rlk.kl_penalty(r(2, 3), r(2, 3), name)
    assert CALLS[-1][1][2] == canonical


@pytest.mark.parametrize(
    "kw,exc,name",
    [
        (dict(kind="k4"), ValueError, "kind"),
        (dict(kind="k3", clamp=0.0), ValueError, "clamp"),
        (dict(kind="k3", old_logprobs=r(2, 4)), ValueError, "old_logprobs"),
    ],
)
def test_kl_penalty_bad_arguments_are_named(kw, exc, name):
    with pytest.raises(exc, match=name):
        rlk.kl_penalty(r(2, 3), r(2, 3), **kw)


def test_grpo_advantages_arguments():
    ids = torch.tensor([3, 1, 3, 7])
    rlk.grpo_advantages(r(4), group_ids=ids, estimator="rloo")
    assert _received()["estimator"] == "rloo" and _received()["norm_std"] == "group"
    rlk.grpo_advantages(r(4), 2, norm_std=False)
    assert _received()["norm_std"] == "none"
    rlk.grpo_advantages(r(4), estimator="reinforce_plus_plus", mask=torch.ones(4, 3))
    assert _received()["estimator"] == "reinforce++"
    bad = [
        (lambda: rlk.grpo_advantages(r(4), 2, group_ids=ids), ValueError, "group_ids"),
        (lambda: rlk.grpo_advantages(r(4)), ValueError, "group_size"),
        (lambda: rlk.grpo_advantages(r(4), group_ids=ids.float()), TypeError, "group_ids"),
        (lambda: rlk.grpo_advantages(r(4), group_ids=ids[:3]), ValueError, "group_ids"),
        (lambda: rlk.grpo_advantages(r(4), 2, estimator="ppo"), ValueError, "estimator"),
        (lambda: rlk.grpo_advantages(r(4), 2, norm_std="std"), TypeError, "norm_std"),
        (lambda: rlk.grpo_advantages(r(4), 2, mask=torch.ones(4, 3)), ValueError, "mask"),
        (
            lambda: rlk.grpo_advantages(r(4), 2, estimator="reinforce++-baseline"),
            ValueError,
            "mask",
        ),
        (
            lambda: rlk.grpo_advantages(r(4), estimator="reinforce++", mask=torch.ones(3, 3)),
            ValueError,
            "mask",
        ),
        (
            lambda: rlk.grpo_advantages(r(4), 2, estimator="reinforce++", mask=torch.ones(4, 3)),
            ValueError,
            "group",
        ),
    ]
    CALLS.clear()
    for fn, exc, name in bad:
        with pytest.raises(exc, match=name):
            fn()
    assert not CALLS
