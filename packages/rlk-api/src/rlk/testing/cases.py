"""Inputs of the conformance kit: one builder per op, in two sizes.

``quick`` shapes are tiny, because on a CPU the Triton kernels run under a slow interpreter; the
``full`` shapes are the real ones (hidden 896..8192, vocabularies of 32000 and 151936, rows up to
32768, head dims 64/128 with GQA, sequences of thousands of tokens), sampled rather than crossed.

Every tensor comes from a generator seeded by the op's name, so a run is reproducible. Backends
receive the arguments exactly as ``rlk.ops`` passes them (validated and normalised: row ops get
2-D ``[T, H]`` tensors, ``scale``/``logits_dtype`` resolved, sampling parameters per row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlk.ops import AGG_MODES, KL_KINDS, OPS
from rlk.ops.losses import _mode_params

# KWONLY, SEED, Case, Gen, OpCases, call, select and batch_of are also read through this module
# (rlk.testing, the tests).
from rlk.testing.case_tools import (  # noqa: F401
    BF16,
    FP16,
    FP32,
    KWONLY,
    SEED,
    Case,
    Gen,
    OpCases,
    Seq,
    batch_of,
    call,
    dtype_name,
    pack,
    paged_args,
    paged_cache,
    select,
)

# PPO's critic side, built in their own module; listed in BUILDERS below with the others.
from rlk.testing.ppo_cases import gae_advantages, value_loss  # noqa: F401

# --------------------------------------------------------------------------------------------
# Builders, one per op. Each returns OpCases(accuracy, invariance, path).
# --------------------------------------------------------------------------------------------


def _linear(gen: Gen, dt, t: int, k: int, n: int, bias: bool, batch: int = 0) -> Case:
    args = {
        "x": gen.randn(t, k, dtype=dt),
        "weight": gen.randn(n, k, dtype=dt, scale=k**-0.5),
        "bias": gen.randn(n, dtype=dt) if bias else None,
    }
    label = f"{dtype_name(dt)} T={t} K={k} N={n}" + (" bias" if bias else "")
    return Case("linear", label, dt, args, (gen.randn(t, n, dtype=dt),), ("x",), 1, batch)


def linear(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_linear(gen, dt, 13, 48, 40, True) for dt in (BF16, FP16, FP32)]
        acc += [_linear(gen, BF16, 5, 64, 17, False)]
        inv = [_linear(gen, BF16, 18, 48, 40, True, batch=12)]
    else:
        acc = [
            _linear(gen, BF16, 257, 4096, 4096, False),
            _linear(gen, BF16, 1, 8192, 1024, True),
            _linear(gen, FP16, 100, 896, 4864, True),
            _linear(gen, FP32, 64, 2048, 2048, False),
        ]
        inv = [
            _linear(gen, BF16, 32768 + 512, 2048, 2048, False, batch=32768),
            _linear(gen, BF16, 4096 + 256, 4096, 4096, True, batch=4096),
            _linear(gen, FP16, 1024 + 128, 896, 4864, True, batch=1024),
            _linear(gen, FP32, 512 + 64, 896, 896, True, batch=512),
        ]
    return OpCases(acc, inv)


def _rms(gen: Gen, dt, t: int, h: int, residual: bool, batch: int = 0) -> Case:
    args = {
        "x": gen.randn(t, h, dtype=dt),
        "weight": gen.randn(h, dtype=dt, scale=0.2, mean=1.0),
        "eps": 1e-6,
        "residual": gen.randn(t, h, dtype=dt) if residual else None,
    }
    cot = tuple(gen.randn(t, h, dtype=dt) for _ in range(2 if residual else 1))
    label = f"{dtype_name(dt)} T={t} H={h}" + (" residual" if residual else "")
    rows = ("x", "residual") if residual else ("x",)
    return Case("rms_norm", label, dt, args, cot, rows, 1, batch)


def rms_norm(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_rms(gen, dt, 11, 64, True) for dt in (BF16, FP16, FP32)]
        acc += [_rms(gen, BF16, 6, 40, False)]
        inv = [_rms(gen, BF16, 18, 64, True, batch=12)]
        path = [_rms(gen, dt, 9, 64, True) for dt in (BF16, FP16, FP32)]
    else:
        acc = [
            _rms(gen, BF16, 257, 4096, True),
            _rms(gen, BF16, 33, 8192, False),
            _rms(gen, FP16, 64, 896, True),
            _rms(gen, FP32, 64, 2048, False),
        ]
        inv = [
            _rms(gen, BF16, 32768 + 512, 4096, True, batch=32768),
            _rms(gen, BF16, 2048 + 256, 896, False, batch=2048),
            _rms(gen, FP32, 1024 + 128, 8192, True, batch=1024),
        ]
        path = [_rms(gen, dt, 4096, 4096, True) for dt in (BF16, FP16, FP32)]
    return OpCases(acc, inv, path)


def _silu(gen: Gen, dt, t: int, i: int, batch: int = 0, pair: bool = False) -> Case:
    """A silu_and_mul case: ``x [t, 2i]``, or (``pair``) the gate ``x`` and ``up``, ``[t, i]``."""
    if pair:
        args = {"x": gen.randn(t, i, dtype=dt, scale=2.0), "up": gen.randn(t, i, dtype=dt)}
        rows: tuple[str, ...] = ("x", "up")
    else:
        args = {"x": gen.randn(t, 2 * i, dtype=dt, scale=2.0)}  # no up, as rlk.ops calls it
        rows = ("x",)
    label = f"{dtype_name(dt)} T={t} I={i}" + (" gate, up" if pair else "")
    return Case("silu_and_mul", label, dt, args, (gen.randn(t, i, dtype=dt),), rows, 1, batch)


def silu_and_mul(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_silu(gen, dt, 9, 48) for dt in (BF16, FP16, FP32)] + [_silu(gen, BF16, 4, 20)]
        acc += [_silu(gen, FP16, 5, 24, pair=True)]
        inv = [_silu(gen, BF16, 18, 48, batch=12), _silu(gen, BF16, 18, 20, batch=12, pair=True)]
        path = [_silu(gen, dt, 7, 40, pair=True) for dt in (BF16, FP32)]
    else:
        acc = [_silu(gen, BF16, 257, 4864), _silu(gen, FP16, 100, 11008), _silu(gen, FP32, 64, 896)]
        acc += [_silu(gen, BF16, 257, 4864, pair=True)]
        inv = [
            _silu(gen, BF16, 16384 + 256, 4864, batch=16384),
            _silu(gen, FP32, 1024 + 64, 2048, batch=1024),
            _silu(gen, BF16, 4096 + 256, 14336, batch=4096, pair=True),
        ]
        path = [_silu(gen, dt, 4096, 4864, pair=True) for dt in (BF16, FP16, FP32)]
    return OpCases(acc, inv, path)


def _rotary(
    gen: Gen, dt, t: int, h: int, d: int, cos_dt, batch: int = 0, hk: int | None = None
) -> Case:
    """A rotary case; ``hk``: with keys of ``hk`` heads (the pair form)."""
    pos = gen.randint(0, 4096, t).to(FP32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=gen.device, dtype=FP32) / d))
    ang = pos[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    args = {
        "x": gen.randn(t, h, d, dtype=dt),
        "cos": ang.cos().to(cos_dt),
        "sin": ang.sin().to(cos_dt),
    }
    if hk is not None:  # the pair form; a one-tensor call passes no k, as rlk.ops does
        args["k"] = gen.randn(t, hk, d, dtype=dt)
    label = f"{dtype_name(dt)} T={t} H={h} D={d} cos {dtype_name(cos_dt)}"
    cot = (gen.randn(t, h, d, dtype=dt),)
    rows: tuple[str, ...] = ("x", "cos", "sin")
    if hk is not None:
        label += f" k Hk={hk}"
        cot += (gen.randn(t, hk, d, dtype=dt),)
        rows += ("k",)
    return Case("apply_rotary", label, dt, args, cot, rows, 1, batch)


def apply_rotary(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_rotary(gen, dt, 10, 3, 32, FP32) for dt in (BF16, FP16, FP32)]
        acc += [_rotary(gen, BF16, 7, 2, 64, BF16), _rotary(gen, BF16, 7, 6, 32, FP32, hk=2)]
        inv = [
            _rotary(gen, BF16, 18, 3, 32, FP32, batch=12),
            _rotary(gen, BF16, 18, 4, 32, FP32, batch=12, hk=1),
        ]
        path = [_rotary(gen, dt, 9, 6, 32, FP32, hk=2) for dt in (BF16, FP32)]
    else:
        acc = [
            _rotary(gen, BF16, 4096, 32, 128, FP32),
            _rotary(gen, FP16, 1000, 14, 64, FP16),
            _rotary(gen, FP32, 512, 8, 128, FP32),
            _rotary(gen, BF16, 4096, 32, 128, FP32, hk=8),
            _rotary(gen, BF16, 1000, 14, 64, FP32, hk=2),
        ]
        inv = [
            _rotary(gen, BF16, 16384 + 256, 16, 128, FP32, batch=16384),
            _rotary(gen, BF16, 4096 + 256, 14, 64, FP32, batch=4096, hk=2),
        ]
        path = [
            _rotary(gen, BF16, 4096, 32, 128, FP32, hk=8),
            _rotary(gen, FP16, 4096, 14, 64, FP16, hk=2),
        ]
    return OpCases(acc, inv, path)


def _logits(gen: Gen, t: int, v: int, dt) -> torch.Tensor:
    return gen.randn(t, v, dtype=dt, scale=3.0)


def _logprobs(gen: Gen, dt, t: int, v: int, temp: float, entropy: bool, batch: int = 0) -> Case:
    args = {
        "logits": _logits(gen, t, v, dt),
        "targets": gen.randint(0, v, t),
        "temperature": temp,
        "return_entropy": entropy,
    }
    cot = tuple(gen.randn(t) for _ in range(2 if entropy else 1))
    label = f"{dtype_name(dt)} T={t} V={v} temp={temp}" + (" entropy" if entropy else "")
    return Case("logprobs", label, dt, args, cot, ("logits", "targets"), 1, batch)


def logprobs(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_logprobs(gen, dt, 12, 300, 1.0, True) for dt in (BF16, FP16, FP32)]
        acc += [_logprobs(gen, BF16, 7, 257, 0.7, False)]
        inv = [_logprobs(gen, BF16, 18, 300, 1.0, True, batch=12)]
    else:
        acc = [
            _logprobs(gen, BF16, 64, 151936, 1.0, True),
            _logprobs(gen, FP16, 256, 32000, 0.8, False),
            _logprobs(gen, FP32, 32, 151936, 1.0, True),
        ]
        inv = [
            _logprobs(gen, BF16, 1024 + 64, 151936, 1.0, True, batch=1024),
            _logprobs(gen, FP32, 8192 + 256, 32000, 0.7, False, batch=8192),
        ]
    return OpCases(acc, inv)


def _fused(
    gen: Gen,
    dt,
    t: int,
    h: int,
    v: int,
    bias: bool,
    temp: float,
    entropy: bool,
    logits_dtype=None,
    batch: int = 0,
) -> Case:
    logits_dtype = logits_dtype or dt
    args = {
        "hidden": gen.randn(t, h, dtype=dt),
        "weight": gen.randn(v, h, dtype=dt, scale=3.0 * h**-0.5),
        "targets": gen.randint(0, v, t),
        "bias": gen.randn(v, dtype=dt) if bias else None,
        "temperature": temp,
        "return_entropy": entropy,
        "logits_dtype": logits_dtype,
    }
    cot = tuple(gen.randn(t) for _ in range(2 if entropy else 1))
    label = (
        f"{dtype_name(dt)} T={t} H={h} V={v} temp={temp} logits {dtype_name(logits_dtype)}"
        + (" bias" if bias else "")
        + (" entropy" if entropy else "")
    )
    return Case("linear_logprobs", label, dt, args, cot, ("hidden", "targets"), 1, batch)


def linear_logprobs(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_fused(gen, dt, 10, 64, 300, False, 1.0, True) for dt in (BF16, FP16, FP32)]
        acc += [_fused(gen, BF16, 5, 48, 257, True, 0.7, False, logits_dtype=FP32)]
        inv = [_fused(gen, BF16, 15, 64, 300, True, 1.0, True, batch=10)]
        path = [_fused(gen, dt, 9, 64, 300, True, 0.7, True) for dt in (BF16, FP16, FP32)]
        path += [_fused(gen, BF16, 6, 48, 257, False, 1.0, True)]
    else:
        acc = [
            _fused(gen, BF16, 256, 896, 151936, False, 1.0, True),
            _fused(gen, FP16, 128, 4096, 32000, True, 0.8, False),
            _fused(gen, BF16, 64, 2048, 151936, False, 1.0, False, logits_dtype=FP32),
            _fused(gen, FP32, 64, 2048, 32000, False, 1.0, True),
        ]
        inv = [
            _fused(gen, BF16, 4096 + 128, 2048, 32000, False, 1.0, True, batch=4096),
            _fused(gen, BF16, 512 + 32, 896, 151936, True, 0.7, False, batch=512),
        ]
        path = [
            _fused(gen, BF16, 1024, 896, 151936, False, 1.0, True),
            _fused(gen, FP16, 512, 4096, 32000, True, 0.7, True),
            _fused(gen, FP32, 256, 2048, 32000, False, 1.0, True),
        ]
    return OpCases(acc, inv, path)


def _response_mask(gen: Gen, b: int, length: int, empty_row: bool) -> torch.Tensor:
    start = gen.randint(0, max(1, length // 2), b)
    end = start + gen.randint(1, length + 1, b)
    pos = torch.arange(length, device=gen.device)
    mask = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    if empty_row:
        mask[0] = False  # a sequence without response tokens must not count
    return mask


#: policy_loss variants of the conformance cases: the keyword arguments each one adds.
POLICY_VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "dual clip": {"clip_c": 1.8},
    "tis": {"is_max": 2.0},
    "adv[B]": {"clip_c": 1.8},
    "empty row": {},
    "float mask": {},
    "gspo, sequence mask IS": {
        "clip_c": 1.4,
        "ratio_level": "sequence",
        "is_level": "sequence",
        "is_mode": "mask",
        "is_min": 0.5,
        "is_max": 2.0,
    },
    "rejection": {"is_level": None, "reject": {"token_k1": (0.9, 1.12), "seq_mean_k2": 0.005}},
    "token mask IS, normalised, rejection": {
        "is_mode": "mask",
        "is_min": 0.85,
        "is_max": 1.2,
        "is_normalize": True,
        "reject": {"seq_max_k3": 0.03},
    },
    "sequence IS, global counts": {"is_level": "sequence", "is_min": 0.7, "is_normalize": 1.3},
}


#: policy_loss's other objectives (``loss_mode``): the aggregation its peer uses and the keyword
#: arguments of each case (``mode_params`` as the public dict; a backend gets the floats).
#: Thresholds sit where the cases' divergences spread.
MODE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "cispo": ("token-mean", {"loss_mode": "cispo"}),
    "cispo, upper cap only": (
        "token-mean",
        {"loss_mode": "cispo", "clip_low": 1.0, "clip_high": 0.1},
    ),
    "dppo_tv": (
        "token-mean",
        {"loss_mode": "dppo_tv", "clip_low": 0.02, "clip_high": 0.03, "clip_c": 1.15},
    ),
    "dppo_kl": (
        "seq-mean-token-mean",
        {"loss_mode": "dppo_kl", "clip_low": 0.001, "clip_high": 0.0015},
    ),
    "sapo": ("seq-mean-token-mean", {"loss_mode": "sapo"}),
    "sapo, gspo ratio": (
        "row-mean-token-mean",
        {"loss_mode": "sapo", "ratio_level": "sequence", "mode_params": {"tau_neg": 2.0}},
    ),
    "dro": ("token-mean", {"loss_mode": "dro", "mode_params": {"beta": 0.5}}),
    "gpg": ("seq-mean-token-sum", {"loss_mode": "gpg"}),
    "geo_mean": ("row-mean-token-mean", {"loss_mode": "geo_mean", "clip_low": 0.1}),
    "vespo": ("token-mean", {"loss_mode": "vespo"}),
}


def _grid(t: torch.Tensor) -> torch.Tensor:
    """Log-probs on a grid of 2^-12: their fp32 differences are exact, so a backend's clip, mask
    and rejection decisions at a token are the float64 reference's (the bounds are off the
    grid), and a case of a million tokens cannot flip one by rounding."""
    return torch.round(t * 4096) / 4096


def _off_the_bounds(new, old, mask, mode: str, clip_low: float, clip_high: float):
    """``mask`` without the tokens whose DPPO divergence lies within 0.1% of a bound.

    The divergence is a function of the probabilities (``exp`` and ``log`` of the log-probs):
    unlike a log-ratio it is not exact in fp32, so at a million tokens a few land within its
    rounding of a bound, and their keep-or-drop decision may legitimately differ from the
    float64 reference's. Those tokens are masked out; every other decision has a margin far
    above fp32's error."""
    lp, lo = new.double(), old.double()
    p, po = lp.exp(), lo.exp()
    if mode == "dppo_tv":
        d, bounds = p - po, (-clip_low, clip_high)
    else:
        d = po * (lo - lp) + (1 - po) * torch.log((1 - po + 1e-8) / (1 - p + 1e-8))
        bounds = (clip_low, clip_high)
    near = torch.zeros_like(mask, dtype=torch.bool)
    for bound in bounds:
        near |= (d - bound).abs() <= 1e-3 * abs(bound)
    return mask & ~near


def _policy(gen: Gen, dt, b: int, length: int, agg: str, variant: str) -> Case:
    old = _grid(gen.randn(b, length, scale=0.5, mean=-2.0))
    # A shift per sequence spreads the sequence ratios (GSPO) over and beyond the clip range.
    shift = torch.linspace(-0.4, 0.5, b, device=gen.device)[:, None]
    # Wider ratios where the dual clip (bound 1.8) should bite.
    noise = 0.5 if variant in ("dual clip", "adv[B]") else 0.15
    new = _grid(old + gen.randn(b, length, scale=noise) + (shift if "gspo" in variant else 0.0))
    # Rollout noise differs per sequence, so that sequence statistics separate the sequences.
    roll_scale = torch.linspace(0.05, 0.15, b, device=gen.device)[:, None]
    # Advantages with a positive mean keep the loss away from 0, so relative errors mean something.
    adv = (
        gen.randn(b, dtype=dt, mean=0.5)
        if variant in ("adv[B]", "gspo, sequence mask IS")
        else gen.randn(b, length, dtype=dt, mean=0.5)
    )
    mask = _response_mask(gen, b, length, empty_row=variant not in ("plain", "float mask"))
    if variant == "float mask":
        mask = mask.to(dt)
    if variant in POLICY_VARIANTS:
        extra = dict(POLICY_VARIANTS[variant])
    else:
        extra = dict(MODE_VARIANTS[variant][1])
        extra["mode_params"] = _mode_params(extra["loss_mode"], extra.get("mode_params"))
    roll = variant in POLICY_VARIANTS and variant not in (
        "plain",
        "dual clip",
        "adv[B]",
        "empty row",
        "float mask",
    )
    if "counts" in variant:
        if agg == "token-mean":
            extra["num_tokens"] = torch.tensor(3.0 * b * length, device=gen.device)
        elif agg != "token-sum":
            extra["num_seqs"] = torch.tensor(2.0 * b, device=gen.device)
    if agg.endswith("-norm"):
        extra["norm_length"] = float(2 * length) if "counts" in variant else None
    args = {
        "logprobs": new.to(dt),
        "old_logprobs": old.to(dt),
        "advantages": adv,
        "mask": mask,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_c": None,
        "agg": agg,
        "ratio_level": "token",
        "rollout_logprobs": _grid(old + roll_scale * gen.randn(b, length)).to(dt) if roll else None,
        "is_level": "token",
        "is_mode": "truncate",
        "is_min": None,
        "is_max": None,
        "is_normalize": False,
        "reject": None,
        "num_tokens": None,
        "num_seqs": None,
        "norm_length": None,
        "loss_mode": "vanilla",
        "mode_params": (),
    }
    args.update(extra)
    if args["loss_mode"] in ("dppo_tv", "dppo_kl"):
        args["mask"] = _off_the_bounds(
            args["logprobs"], args["old_logprobs"], args["mask"], args["loss_mode"],
            args["clip_low"], args["clip_high"],
        )  # fmt: skip
    label = f"{dtype_name(dt)} B={b} L={length} {agg} {variant}"
    return Case("policy_loss", label, dt, args, (gen.randn(),))


def policy_loss(gen: Gen, quick: bool) -> OpCases:
    b, length = (4, 12) if quick else (256, 4096)
    variants = list(POLICY_VARIANTS)
    # Every aggregation with every variant, in fp32; the low-precision dtypes on a few.
    acc = [_policy(gen, FP32, b, length, agg, v) for agg in AGG_MODES for v in variants]
    acc += [_policy(gen, BF16, b, length, "token-mean", v) for v in ("empty row", "float mask")]
    acc += [_policy(gen, BF16, b, length, "row-mean-token-mean", "gspo, sequence mask IS")]
    acc += [_policy(gen, FP16, b, length, "seq-mean-token-mean", "dual clip")]
    acc += [_policy(gen, FP16, b, length, "seq-mean-token-sum-norm", "rejection")]
    acc += [_policy(gen, FP32, b, length, agg, v) for v, (agg, _) in MODE_VARIANTS.items()]
    acc += [_policy(gen, BF16, b, length, "token-mean", v) for v in ("cispo", "geo_mean")]
    if not quick:  # real shapes: a sample of the (aggregation, variant) pairs
        acc = acc[:: len(AGG_MODES)] + acc[len(AGG_MODES) * len(variants) :]
    inv = [
        _policy(gen, BF16, b, length, "seq-mean-token-mean", "tis"),
        _policy(gen, FP32, b, length, "row-mean-token-sum-norm", "gspo, sequence mask IS"),
        _policy(gen, BF16, b, length, "token-mean", "token mask IS, normalised, rejection"),
        *(_policy(gen, FP32, b, length, agg, v) for v, (agg, _) in MODE_VARIANTS.items()),
    ]
    return OpCases(acc, inv)


def _kl(
    gen: Gen,
    dt,
    b: int,
    length: int,
    kind: str,
    batch: int = 0,
    clamp: float | None = 10.0,
    bias: bool = False,
) -> Case:
    ref = gen.randn(b, length, scale=0.5, mean=-2.0)
    lp = ref + gen.randn(b, length, scale=0.7)
    lp[0, :2] = ref[0, :2] + torch.tensor([-3.0, 3.0], device=gen.device)  # k3 > 10 at -3
    args = {
        "logprobs": lp.to(dt),
        "ref_logprobs": ref.to(dt),
        "kind": kind,
        "clamp": clamp,
        "old_logprobs": (lp + gen.randn(b, length, scale=0.2)).to(dt) if bias else None,
    }
    label = f"{dtype_name(dt)} B={b} L={length} {kind} clamp={clamp}" + (
        " bias-corrected" if bias else ""
    )
    rows = ("logprobs", "ref_logprobs", "old_logprobs") if bias else ("logprobs", "ref_logprobs")
    return Case("kl_penalty", label, dt, args, (gen.randn(b, length),), rows, 1, batch)


def kl_penalty(gen: Gen, quick: bool) -> OpCases:
    b, length = (4, 12) if quick else (256, 4096)
    acc = [_kl(gen, FP32, b, length, kind) for kind in KL_KINDS]
    acc += [_kl(gen, dt, b, length, "k3") for dt in (BF16, FP16)]
    acc += [_kl(gen, FP32, b, length, "k3", clamp=None, bias=True)]  # TRL
    acc += [_kl(gen, BF16, b, length, "k3+", clamp=5.0, bias=True)]
    if quick:
        inv = [_kl(gen, BF16, 9, 12, "k3", batch=6), _kl(gen, FP32, 9, 12, "k3+", 6, None, True)]
    else:
        inv = [
            _kl(gen, BF16, 264, 4096, "k3", 256),
            _kl(gen, FP32, 264, 4096, "abs+", 256, 10, True),
        ]
    return OpCases(acc, inv)


def _grpo(
    gen: Gen,
    dt,
    groups: int,
    size: int,
    norm_std: bool | str,
    batch: int = 0,
    estimator: str = "grpo",
) -> Case:
    r = gen.randn(groups, size)
    binary = (gen.rand(groups, size) < 0.5).float()
    r[1::3] = binary[1::3]  # 0/1 rewards, including groups with no spread
    r[2] = 1.0
    args = {
        "rewards": r.reshape(-1).to(dt),
        "group_size": size,
        "norm_std": norm_std,
        "eps": 1e-6,
        "group_ids": None,
        "estimator": estimator,
        "mask": None,
    }
    label = f"{dtype_name(dt)} groups={groups} size={size} {estimator} norm_std={norm_std}"
    return Case("grpo_advantages", label, dt, args, (), ("rewards",), size, batch)


def _grpo_ids(gen: Gen, dt, n: int, estimator: str, norm_std: str = "group", length: int = 0):
    """Groups by id: unequal sizes, interleaved, singletons; ``length`` > 0 adds a mask."""
    ids = (gen.randint(0, max(1, n // 3), n) * 5 + 2).to(torch.int64)
    r = gen.randn(n)
    r[ids == ids[0]] = 0.5  # a group with no spread
    args = {
        "rewards": r.to(dt),
        "group_size": None,
        "norm_std": norm_std,
        "eps": 1e-6,
        "group_ids": None if estimator == "reinforce++" else ids,
        "estimator": estimator,
        "mask": _response_mask(gen, n, length, empty_row=True) if length else None,
    }
    label = f"{dtype_name(dt)} N={n} group ids {estimator} norm_std={norm_std}"
    return Case("grpo_advantages", label, dt, args)


def grpo_advantages(gen: Gen, quick: bool) -> OpCases:
    g, s = (6, 4) if quick else (512, 16)
    n, length = (24, 12) if quick else (8192, 1024)
    acc = [
        _grpo(gen, FP32, g, s, True),
        _grpo(gen, FP32, g, s, False),
        _grpo(gen, BF16, g, s, True),
        _grpo(gen, FP32, g, s, "batch"),
        _grpo(gen, FP32, g, s, True, estimator="rloo"),
        _grpo_ids(gen, FP32, n, "grpo"),
        _grpo_ids(gen, BF16, n, "grpo", "none"),
        _grpo_ids(gen, FP32, n, "grpo", "batch"),
        _grpo_ids(gen, FP32, n, "rloo"),
        _grpo_ids(gen, FP32, n, "reinforce++-baseline", length=length),
        _grpo_ids(gen, BF16, n, "reinforce++", length=length),
        _grpo_ids(gen, FP32, n, "rloo_vectorized"),
        _grpo_ids(gen, FP32, n, "opo", "none", length=length),
        _grpo_ids(gen, FP32, n, "grpo_passk"),
        _grpo_ids(gen, BF16, n, "grpo_passk", "none"),
    ]
    inv = [
        _grpo(gen, FP32, g + 3, s, True, batch=g),
        _grpo(gen, BF16, g + 3, s, "none", batch=g, estimator="rloo"),
        _grpo(gen, FP32, g + 3, s, True, batch=g, estimator="grpo_passk"),
        _grpo(gen, FP32, g + 3, s, "none", batch=g, estimator="rloo_vectorized"),
    ]
    return OpCases(acc, inv)


def _sample(gen: Gen, dt, b: int, v: int, batch: int = 0, off: tuple[str, ...] = ()) -> Case:
    """A sample case; the filters named in ``off`` are None (off for every row), as
    ``rlk.sample`` passes a filter given as the number that turns it off."""
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3], device=gen.device)
    ks = torch.tensor([0, 0, 1, 5, 50], device=gen.device)
    ps = torch.tensor([1.0, 0.9, 0.5], device=gen.device)
    i = torch.arange(b, device=gen.device)
    args = {
        "logits": _logits(gen, b, v, dt),
        "seeds": gen.randint(-(2**62), 2**62, b),
        "offsets": gen.randint(0, 2**40, b),
        "temperature": temps[i % 4],
        "top_k": None if "top_k" in off else ks[i % 5],
        "top_p": None if "top_p" in off else ps[i % 3],
    }
    rows = tuple(k for k, a in args.items() if a is not None)
    label = f"{dtype_name(dt)} B={b} V={v}" + "".join(f" {name}=None" for name in off)
    return Case("sample", label, dt, args, (), rows, 1, batch)


def sample(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_sample(gen, dt, 32, 300) for dt in (BF16, FP16, FP32)]
        acc += [_sample(gen, BF16, 16, 300, off=("top_p",)), _sample(gen, FP32, 8, 300, off=OFF)]
        inv = [_sample(gen, BF16, 24, 300, batch=16), _sample(gen, BF16, 24, 300, 16, ("top_k",))]
    else:
        acc = [_sample(gen, BF16, 256, 151936), _sample(gen, FP32, 256, 32000)]
        acc += [_sample(gen, BF16, 64, 151936, off=("top_k",)), _sample(gen, BF16, 8, 151936)]
        inv = [
            _sample(gen, BF16, 64 + 16, 151936, batch=64),
            _sample(gen, BF16, 8 + 8, 151936, batch=8),
            _sample(gen, BF16, 8 + 8, 151936, batch=8, off=OFF),
        ]
    return OpCases(acc, inv)


#: Both filters None.
OFF = ("top_k", "top_p")


# Attention ----------------------------------------------------------------------------------


def _seq(gen: Gen, dt, nq: int, nk: int, hq: int, hk: int, d: int, grad: bool) -> Seq:
    return Seq(
        q=gen.randn(nq, hq, d, dtype=dt),
        k=gen.randn(nk, hk, d, dtype=dt),
        v=gen.randn(nk, hk, d, dtype=dt),
        do=gen.randn(nq, hq, d, dtype=dt) if grad else None,
    )


def _attn(gen, dt, shapes, hq, hk, d, causal=True, grad=True, batch=None, op="attention") -> Case:
    seqs = [_seq(gen, dt, nq, nk, hq, hk, d, grad) for nq, nk in shapes]
    scale = d**-0.5
    kind = "train" if all(nq == nk for nq, nk in shapes) else "prefill/decode"
    label = (
        f"{dtype_name(dt)} Hq={hq} Hk={hk} D={d} {kind} (nq,nk)="
        + ",".join(f"({nq},{nk})" if nq != nk else str(nk) for nq, nk in shapes)
        + ("" if causal else " non-causal")
    )
    n = len(seqs) if batch is None else batch
    args, cot, _ = pack(seqs[:n], causal, scale)
    return Case(op, label, dt, args, cot, (), 1, n if batch is not None else 0, seqs)


@dataclass
class AttnPath:
    """Path invariance of attention: full sequences, and the ways of splitting their calls."""

    label: str
    seqs: list[Seq]  # nq == nk
    decode: int  # tokens decoded one at a time at the end of each sequence
    chunks: tuple[int, ...]
    page_sizes: tuple[int, ...] = (16, 32, 64, 128)
    scale: float = 1.0


def _attn_path(gen, dt, lengths, hq, hk, d, decode, chunks) -> AttnPath:
    seqs = [_seq(gen, dt, n, n, hq, hk, d, False) for n in lengths]
    label = f"{dtype_name(dt)} Hq={hq} Hk={hk} D={d} lengths={','.join(map(str, lengths))}"
    return AttnPath(label, seqs, decode, chunks, scale=d**-0.5)


def attention(gen: Gen, quick: bool) -> OpCases:
    if quick:
        h = (4, 2, 32)
        acc = [_attn(gen, dt, [(1, 1), (45, 45), (133, 133)], *h) for dt in (BF16, FP16)]
        acc += [_attn(gen, BF16, [(1, 70), (5, 40), (20, 20)], *h, grad=False)]
        acc += [_attn(gen, FP16, [(17, 17), (30, 30)], 2, 2, 64, causal=False)]
        inv = [_attn(gen, BF16, [(45, 45), (133, 133), (1, 1), (20, 20), (70, 70)], *h, batch=3)]
        path = [
            _attn_path(gen, BF16, [1, 45, 133], *h, decode=6, chunks=(16, 64)),
            # Past 4096 keys (one KV head, small D: the interpreter's cost): the rows that
            # cross the KV split merge at the same positions on every path.
            _attn_path(gen, BF16, [4160], 2, 1, 16, decode=2, chunks=(4096,)),
        ]
    else:
        a, b = (32, 8, 128), (14, 2, 64)
        acc = [
            _attn(gen, BF16, [(1, 1), (300, 300), (2048, 2048)], *a),
            _attn(gen, FP16, [(513, 513), (1000, 1000)], *b),
            _attn(gen, BF16, [(1, 3000), (64, 1024), (1, 1), (200, 700)], *b, grad=False),
            _attn(gen, FP16, [(100, 100), (700, 700)], 16, 16, 128, causal=False),
        ]
        inv = [
            _attn(
                gen, BF16, [(100, 100), (2048, 2048), (1, 1), (513, 513), (3000, 3000)], *a, batch=3
            ),
            _attn(gen, FP16, [(700, 700), (1, 1), (1500, 1500), (64, 64)], *b, batch=2),
        ]
        path = [
            _attn_path(gen, BF16, [1, 129, 1500], *a, decode=128, chunks=(64, 257, 1024)),
            _attn_path(gen, FP16, [2000, 77], *b, decode=80, chunks=(128, 1000)),
            # Past 4096 keys: the rows that cross the KV split (rlk_triton.attention_fwd.KV_SPLIT)
            # merge at the same positions on every path.
            _attn_path(gen, BF16, [4500, 300], *b, decode=64, chunks=(1024, 3000)),
        ]
    return OpCases(acc, inv, path)


def _paged(gen, dt, shapes, hq, hk, d, page_size, batch=None) -> Case:
    case = _attn(gen, dt, shapes, hq, hk, d, grad=False, batch=batch, op="paged_attention")
    case.paged = paged_cache(case.seqs, page_size, gen)
    n = case.batch or len(case.seqs)
    case.args, _ = paged_args(case.seqs, case.paged, range(n), case.args["scale"])
    case.label += f" page_size={page_size}"
    return case


def paged_attention(gen: Gen, quick: bool) -> OpCases:
    if quick:
        h = (4, 2, 32)
        acc = [_paged(gen, dt, [(1, 70), (5, 40), (33, 33)], *h, 16) for dt in (BF16, FP16)]
        inv = [_paged(gen, BF16, [(1, 70), (5, 40), (33, 33), (1, 20), (3, 100)], *h, 16, batch=3)]
        path = [
            _attn_path(gen, BF16, [1, 45, 133, 20], *h, decode=0, chunks=()),
            # Decode past 4096 keys (the KV split), against the training call.
            _attn_path(gen, BF16, [4160, 45], 2, 1, 16, decode=0, chunks=()),
        ]
    else:
        a, b = (32, 8, 128), (14, 2, 64)
        acc = [
            _paged(gen, BF16, [(1, 3000), (16, 1024), (1, 1), (300, 300)], *a, 16),
            _paged(gen, FP16, [(1, 777), (1, 2048), (100, 500)], *b, 64),
            # A small batch past 4096 keys: a program per KV split, then the merge.
            _paged(gen, BF16, [(1, 8200), (1, 100)], *a, 16),
        ]
        inv = [
            _paged(gen, BF16, [(1, 3000), (1, 1), (64, 700), (1, 200), (1, 1500)], *a, 32, batch=3),
        ]
        path = [
            _attn_path(gen, BF16, [1, 129, 1500, 3000], *a, decode=0, chunks=()),
            _attn_path(gen, FP16, [2000, 77, 16], *b, decode=0, chunks=()),
            _attn_path(gen, BF16, [4500, 16], *b, decode=0, chunks=()),
        ]
    return OpCases(acc, inv, path)


#: op -> its case builder: the function of this module named after the op (every op of the
#: catalog must have one; a missing builder fails at import).
BUILDERS: dict[str, Callable[[Gen, bool], OpCases]] = {op: globals()[op] for op in OPS}


def build(op: str, quick: bool, device: torch.device) -> OpCases:
    """The inputs of every check of ``op`` (seeded by the op's name)."""
    return BUILDERS[op](Gen(op, device), quick)
