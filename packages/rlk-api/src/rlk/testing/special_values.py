"""Special-value cases of the conformance kit: NaN, +/-inf and overflow inputs.

The float64 reference is the oracle where IEEE semantics define the answer: a backend must give
NaN exactly where the reference does, the same infinities (with their sign), and finite values
within the accuracy tolerances. Overflow cases are finite inputs whose fp32 intermediates would
overflow (squares of 1e30, sums of 1e38) while the answer is an ordinary number. Logits whose
``logit / temperature`` overflows fp32 (3e38 at temperature 1e-3) are outside the domain: NaN
log-probabilities for their rows, and no token. ``sample`` must draw the reference's token
(-1 for a row with a NaN logit or outside the domain). Run as part of the
``accuracy`` check (:func:`check`); cases with cotangents compare the gradients too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlk.ops import KWONLY
from rlk.testing.case_tools import FP32, Case, Gen, dtype_name
from rlk.testing.checks import TOLERANCES, Outcome, float64, run_case

NAN, INF = float("nan"), float("inf")


def _rms_norm(g: Gen) -> list[Case]:
    x = g.randn(6, 32)
    x[0] *= 1e30  # squares overflow fp32
    x[1] *= 3e37  # and their sum too
    x[2, 3] = INF
    x[3, 5] = NAN
    x[4] = 0.0
    x[5] *= 1e-30  # squares underflow: the row is scaled by 1/sqrt(eps)
    w = g.randn(32, scale=0.2, mean=1.0)
    args = {"x": x, "weight": w, "eps": 1e-6, "residual": None}
    return [Case("rms_norm", "fp32 overflow/inf/NaN/zero/underflow rows", FP32, args)]


def _silu(g: Gen) -> list[Case]:
    x = g.randn(2, 12)
    x[0, :6] = torch.tensor([NAN, INF, -INF, 1e30, -1e30, 0.0])
    x[1, 6:] = torch.tensor([NAN, INF, -INF, 1e30, -1e30, 0.0])
    return [Case("silu_and_mul", "fp32 NaN/inf/huge gates and ups", FP32, {"x": x})]


def _rotary(g: Gen) -> list[Case]:
    x = g.randn(3, 2, 8)
    x[0, 0, 1], x[1, 1, 6], x[2, 0, 0] = NAN, INF, -INF
    ang = g.randn(3, 8)
    args = {"x": x, "cos": ang.cos(), "sin": ang.sin()}
    return [Case("apply_rotary", "fp32 NaN/inf in x", FP32, args)]


def _attention(g: Gen) -> list[Case]:
    q, k, v = g.randn(9, 2, 16), g.randn(9, 1, 16), g.randn(9, 1, 16)
    q[2, 1, 3] = NAN  # that query row only
    k[6, 0, 0] = NAN  # every query of the second sequence from its position 1 on
    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device=g.device)
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu}
    args.update(causal=True, scale=0.25)
    return [Case("attention", "fp32 NaN in a query and in a key", FP32, args)]


def _logprobs(g: Gen) -> list[Case]:
    logits = g.randn(5, 40, scale=3.0)
    logits[0, 7] = INF  # another target: -inf; entropy NaN
    logits[1, 9] = INF  # the target itself: inf - inf = NaN
    logits[2, 3] = NAN
    logits[3, :20] = -INF  # masked logits: finite
    logits[4] *= 1e30  # huge but finite
    targets = torch.tensor([2, 9, 4, 25, 1], device=g.device)
    args = {"logits": logits, "targets": targets, "temperature": 1.0, "return_entropy": True}
    fused = {
        "hidden": g.randn(3, 16),
        "weight": g.randn(40, 16),
        "targets": targets[:3],
        "bias": None,
        "temperature": 1.0,
        "return_entropy": True,
        "logits_dtype": FP32,
    }
    fused["hidden"][1, 2] = NAN
    return [
        Case("logprobs", "fp32 +inf/NaN/-inf/huge logits", FP32, args),
        Case("linear_logprobs", "fp32 NaN hidden row", FP32, fused),
        _overflow_logprobs(g),
    ]


def overflowing_logits(g: Gen, rows: int = 6, vocab: int = 40) -> torch.Tensor:
    """fp32 logits ``[rows, vocab]`` for temperature 1e-3 (``rows >= 5``): in rows 1 to 4 a
    finite ``logit / temperature`` overflows fp32, which puts the row outside the domain (NaN
    log-probabilities, no token drawn): rows 1 and 4 hold ten equal maxima near bf16's largest
    value (3e38: +inf), row 2 one logit of -3e38 (-inf), row 3 both. The other rows are
    ordinary."""
    x = g.randn(rows, vocab, scale=3.0)
    x[1, :10] = x[4, :10] = 3e38
    x[2, 5] = -3e38
    x[3, 0], x[3, 1] = 3e38, -3e38
    return x


def _overflow_logprobs(g: Gen) -> Case:
    logits = overflowing_logits(g)
    # Row 1's target is one of the maxima, row 4's is not: both NaN, as is every entropy there.
    targets = torch.tensor([2, 3, 4, 25, 20, 1], device=g.device)
    args = {"logits": logits, "targets": targets, "temperature": 1e-3, "return_entropy": True}
    return Case("logprobs", "fp32 logits whose logit / temperature overflows", FP32, args)


def _policy(g: Gen) -> list[Case]:
    lp, old = g.randn(3, 6, scale=0.1, mean=-2.0), g.randn(3, 6, scale=0.1, mean=-2.0)
    mask = torch.ones(3, 6, dtype=torch.bool, device=g.device)
    mask[2, 4:] = False
    lp[0, 2] = NAN  # a kept token: the loss is NaN
    lp[2, 5] = NAN  # padding: ignored
    base = {"logprobs": lp, "old_logprobs": old, "advantages": g.randn(3, 6), "mask": mask}
    base.update(dict.fromkeys(KWONLY["policy_loss"]), clip_low=0.2, clip_high=0.2, clip_c=3.0)
    base.update(agg="token-mean", ratio_level="token", is_level="token", is_mode="truncate")
    base.update(loss_mode="vanilla", mode_params=())
    base["is_normalize"] = False
    pad = dict(base, logprobs=torch.where(mask, lp.nan_to_num(-2.0), NAN))
    roll = old.clone()
    roll[1, 1] = NAN  # a NaN importance weight: truncated NaN, masked out in mask mode
    is_mask = dict(pad, rollout_logprobs=roll, is_mode="mask", is_min=0.5, is_max=2.0)
    is_trunc = dict(pad, rollout_logprobs=roll, is_max=2.0)
    cot = (g.randn(),)
    return [
        Case("policy_loss", "fp32 NaN log-prob on a kept token", FP32, base, cot),
        Case("policy_loss", "fp32 NaN log-probs on padding only", FP32, pad, cot),
        Case("policy_loss", "fp32 NaN rollout log-prob, IS mask", FP32, is_mask, cot),
        Case("policy_loss", "fp32 NaN rollout log-prob, IS truncate", FP32, is_trunc, cot),
    ]


def _kl(g: Gen) -> list[Case]:
    lp = g.randn(2, 6, scale=0.5, mean=-2.0)
    ref = lp + g.randn(2, 6, scale=0.3)
    lp[0, :3] = torch.tensor([NAN, INF, -INF])
    ref[1, :2] = torch.tensor([NAN, -INF])
    # The straight-through kinds (value of k3, gradient of k2) only with NaN: the reference's
    # k2 - k2.detach() is not defined at an infinite d.
    finite_inf = (lp.nan_to_num(nan=NAN, posinf=-1.0, neginf=-3.0), ref.nan_to_num(NAN, -1.0, -3.0))
    out = []
    for kind, clamp in (("k3", 10.0), ("k3", None), ("k1", 10.0), ("k2", 10.0), ("k3+", 10.0)):
        lp, ref = finite_inf if kind.endswith("+") else (lp, ref)
        args = {"logprobs": lp, "ref_logprobs": ref, "kind": kind, "clamp": clamp}
        args["old_logprobs"] = None
        # Gradients only where they are finite in value: d/dd of inf is not IEEE-defined.
        cot = (g.randn(2, 6),) if kind != "k2" else ()
        out.append(Case("kl_penalty", f"fp32 NaN/inf {kind} clamp={clamp}", FP32, args, cot))
    return out


def _grpo(g: Gen) -> list[Case]:
    r = g.randn(4, 4)
    r[0] *= 1e30  # squares overflow fp32
    r[1] *= 3e37  # the sum too
    r[2, 1] = NAN
    r[3, 2] = INF
    out = []
    for est, norm in (("grpo", "group"), ("grpo", "none"), ("rloo", "group")):
        args = {"rewards": r.reshape(-1), "group_size": 4, "norm_std": norm, "eps": 1e-6}
        args.update(group_ids=None, estimator=est, mask=None)
        label = f"fp32 overflow/NaN/inf groups {est} norm_std={norm}"
        out.append(Case("grpo_advantages", label, FP32, args))
    return out


def _sample(g: Gen) -> list[Case]:
    logits = g.randn(6, 50, scale=3.0)
    logits[0, 11] = NAN  # no token: -1
    logits[1, 30] = NAN
    logits[2, 17] = INF  # greedy: that token
    logits[3, :40] = -INF  # only the last 10 can be drawn
    temps = torch.tensor([0.7, 0.0, 0.0, 1.0, 0.0, 1.0], device=g.device)
    args = {
        "logits": logits,
        "seeds": torch.arange(6, device=g.device),
        "offsets": torch.zeros(6, dtype=torch.int64, device=g.device),
        "temperature": temps,
        "top_k": torch.zeros(6, dtype=torch.int64, device=g.device),
        "top_p": torch.ones(6, device=g.device),
    }
    # Rows 1 to 4 outside the domain at temperature 1e-3 (overflowing_logits): -1, with the
    # filters off and on; row 0 is greedy (no division: the first maximum), row 5 ordinary.
    x = overflowing_logits(g, vocab=50)
    x[0, 1:3] = 3e38
    over = dict(args, logits=x, temperature=torch.full((6,), 1e-3, device=g.device))
    over["temperature"][0] = 0.0
    filters = dict(over, top_k=torch.full_like(over["top_k"], 5))
    filters["top_p"] = torch.full_like(over["top_p"], 0.9)
    # +inf logits with the filters on: the +inf tokens hold all the mass, so top-k and top-p
    # keep them and the draw is the first of them (row 1: two; row 2: with -inf beside).
    top = g.randn(4, 50, scale=3.0)
    top[0, 21] = INF
    top[1, [8, 33]] = INF
    top[2, 5], top[2, :4] = INF, -INF
    inf_filters = {
        "logits": top,
        "seeds": torch.arange(4, device=g.device),
        "offsets": torch.zeros(4, dtype=torch.int64, device=g.device),
        "temperature": torch.ones(4, device=g.device),
        "top_k": torch.tensor([0, 5, 0, 3], device=g.device),
        "top_p": torch.tensor([0.9, 0.5, 0.95, 0.8], device=g.device),
    }
    return [
        Case("sample", "fp32 NaN/+inf/-inf logits", FP32, args),
        Case("sample", "fp32 logits whose logit / temperature overflows", FP32, over),
        Case("sample", "fp32 overflowing logit / temperature, top-k and top-p", FP32, filters),
        Case("sample", "fp32 +inf logits with top-k and top-p", FP32, inf_filters),
    ]


BUILDERS: dict[str, Callable[[Gen], list[Case]]] = {
    "rms_norm": _rms_norm,
    "silu_and_mul": _silu,
    "apply_rotary": _rotary,
    "attention": _attention,
    "logprobs": _logprobs,
    "linear_logprobs": lambda g: _logprobs(g)[1:],
    "policy_loss": _policy,
    "kl_penalty": _kl,
    "grpo_advantages": _grpo,
    "sample": _sample,
}


def cases(op: str, device: torch.device) -> list[Case]:
    """The special-value cases of ``op`` (none for ops without one), seeded by the op's name."""
    build = BUILDERS.get(op)
    if build is None:
        return []
    found = build(Gen(f"{op}/special", device))
    return [c for c in found if c.op == op]


def _compare(where: str, got: torch.Tensor, want: torch.Tensor, tol: dict) -> str | None:
    """Why ``got`` does not match the reference's ``want`` on special values, or None."""
    if got.shape != want.shape:
        return f"{where}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    g, w = got.double().cpu(), want.double().cpu()
    if not got.is_floating_point():
        bad = (g != w).nonzero()[:, 0].tolist()
        return f"{where}: differs at {bad[:5]} ({g.tolist()} vs {w.tolist()})" if bad else None
    nan_g, nan_w = g.isnan(), w.isnan()
    if not torch.equal(nan_g, nan_w):
        extra, missing = (nan_g & ~nan_w).sum().item(), (nan_w & ~nan_g).sum().item()
        return f"{where}: {extra} NaN where the reference has none, {missing} missing"
    inf_g, inf_w = g.isinf(), w.isinf()
    if not torch.equal(inf_g, inf_w) or not torch.equal(g[inf_g], w[inf_w]):
        return f"{where}: infinities differ from the reference's"
    fin = ~(nan_w | inf_w)
    if not bool(fin.any()):
        return None
    err = (g[fin] - w[fin]).abs().max().item()
    scale = w[fin].abs().max().item()
    # Where the exact values rounded to the output dtype already miss the tolerance, twice
    # that rounding is the bound (as in the accuracy check).
    rounding = (w[fin].to(got.dtype).double() - w[fin]).abs().max().item()
    bound = max(tol["rel_max"] * max(scale, 1e-30), 2 * rounding)
    return None if err <= bound else f"{where}: max err {err:.2e} > {bound:.2e} on finite values"


def check(fn: Callable, ref: Callable, op: str, device: torch.device) -> list[str]:
    """Failures of ``fn`` on the special-value cases of ``op`` (an empty list when it agrees)."""
    failures = []
    for case in cases(op, device):
        got = run_case(fn, case)
        want = run_case(ref, float64(case))
        tol = TOLERANCES[dtype_name(case.dtype)]
        for key, w in want.items():
            where = f"special values, {case.label}: {key}"
            if key not in got:
                failures.append(f"{where} missing")
                continue
            why = _compare(where, got[key], w, tol)
            if why:
                failures.append(why)
    return failures


def with_accuracy(outcome: Outcome, fn: Callable, ref: Callable, op: str, device) -> Outcome:
    """The accuracy check's ``outcome`` with the special-value cases of ``op`` added."""
    failures = check(fn, ref, op, torch.device(device))
    if not failures:
        n = len(cases(op, torch.device(device)))
        if n and outcome.status == "pass":
            outcome.detail += f"; {n} special-value cases agree with the reference"
        return outcome
    outcome.failures = (outcome.failures + failures)[:20]
    outcome.n_failures = max(outcome.n_failures, int(outcome.status == "fail")) + len(failures)
    outcome.detail = "; ".join(
        ([outcome.detail] if outcome.status == "fail" else []) + failures[:3]
    )
    outcome.status = "fail"
    return outcome
