"""Conformance inputs of PPO's critic side (``gae_advantages``, ``value_loss``), quick and full,
in the form of :mod:`rlk.testing.cases` (which lists these builders with the others).

Response masks have holes (a tool's output inside a multi-turn response) and an empty row;
padding holds infinities and NaN, which no result may see. ``gae_advantages``' pools are of
rows without whitening (a row's results are its own); its whitened cases, a statistic of the
batch, have no units (``batch=0``): they are checked for accuracy, determinism and tuning
invariance. ``value_loss`` aggregates over the batch: its cases have no units either.
"""

from __future__ import annotations

import torch

from rlk.ops import AGG_MODES
from rlk.testing.case_tools import BF16, FP16, FP32, Case, Gen, OpCases, dtype_name


def _holey_mask(gen: Gen, b: int, length: int) -> torch.Tensor:
    """A response per row (random start and end), a hole inside most, row 1 empty."""
    pos = torch.arange(length, device=gen.device)[None, :]
    start = gen.randint(0, max(1, length // 4), b)[:, None]
    end = start + gen.randint(length // 2, length + 1, b)[:, None]
    hole = start + gen.randint(1, max(2, length // 3), b)[:, None]
    hole_len = gen.randint(0, max(1, length // 4), b)[:, None]
    mask = (pos >= start) & (pos < end) & ~((pos >= hole) & (pos < hole + hole_len))
    if b > 1:
        mask[1] = False
    return mask


def _pad(t: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(mask, t, torch.full_like(t, fill))


def _gae(gen: Gen, dt, b: int, length: int, gamma: float, lam: float, whiten: bool,
         batch: int = 0, float_mask: bool = False) -> Case:  # fmt: skip
    mask = _holey_mask(gen, b, length)
    # Sparse outcome-like rewards plus a small dense part, values of the scale of returns.
    rewards = gen.randn(b, length, scale=0.1) + (gen.rand(b, length) < 0.1) * gen.randn(b, length)
    values = gen.randn(b, length, scale=0.5)
    args = {
        "rewards": _pad(rewards, mask, float("inf")).to(dt),
        "values": _pad(values, mask, float("nan")).to(dt),
        "mask": mask.to(dt) if float_mask else mask,
        "gamma": gamma,
        "lam": lam,
        "whiten": whiten,
    }
    label = f"{dtype_name(dt)} B={b} L={length} gamma={gamma} lam={lam}" + (
        " whiten" if whiten else ""
    )
    if float_mask:
        label += " float mask"
    rows = () if whiten else ("rewards", "values", "mask")
    return Case("gae_advantages", label, dt, args, (), rows, 1, batch)


def gae_advantages(gen: Gen, quick: bool) -> OpCases:
    b, length = (4, 12) if quick else (256, 4096)
    acc = [
        _gae(gen, FP32, b, length, g, lam, w)
        for g, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.0))
        for w in (False, True)
    ]
    acc += [
        _gae(gen, BF16, b, length, 1.0, 0.95, True),
        _gae(gen, FP16, b, length, 0.99, 1.0, False),
    ]
    acc += [_gae(gen, FP32, b, length, 0.99, 0.95, True, float_mask=True)]
    pool, batch = (9, 6) if quick else (264, 256)
    inv = [
        _gae(gen, FP32, pool, length, 0.99, 0.95, False, batch=batch),
        _gae(gen, BF16, pool, length, 1.0, 1.0, False, batch=batch),
        _gae(gen, FP32, b, length, 1.0, 0.95, True),  # no units: determinism and tuning
    ]
    return OpCases(acc, inv)


def _value(gen: Gen, dt, b: int, length: int, agg: str, clip: float | None,
           counts: bool = False) -> Case:  # fmt: skip
    mask = _holey_mask(gen, b, length)
    old = gen.randn(b, length)
    returns = old + gen.randn(b, length, scale=0.7)
    # Some values inside the clip range of their old value, some beyond it on either side.
    values = old + gen.randn(b, length, scale=0.6)
    args = {
        "values": _pad(values, mask, float("inf")).to(dt),
        "old_values": _pad(old, mask, float("nan")).to(dt),
        "returns": _pad(returns, mask, float("-inf")).to(dt),
        "mask": mask,
        "clip": clip,
        "agg": agg,
        "num_tokens": None,
        "num_seqs": None,
        "norm_length": float(length) if agg.endswith("-norm") else None,
    }
    if counts:
        if agg == "token-mean":
            args["num_tokens"] = torch.tensor(3.0 * b * length, device=gen.device)
        elif agg != "token-sum":
            args["num_seqs"] = 2.0 * b
        if agg.endswith("-norm"):
            args["norm_length"] = float(2 * length)
    label = f"{dtype_name(dt)} B={b} L={length} {agg} clip={clip}" + (" counts" if counts else "")
    return Case("value_loss", label, dt, args, (gen.randn(),))


def value_loss(gen: Gen, quick: bool) -> OpCases:
    b, length = (4, 12) if quick else (256, 4096)
    acc = [_value(gen, FP32, b, length, agg, clip) for agg in AGG_MODES for clip in (0.5, None)]
    acc += [_value(gen, FP32, b, length, agg, 0.2, counts=True) for agg in AGG_MODES]
    acc += [_value(gen, BF16, b, length, "token-mean", 0.5), _value(gen, FP16, b, length,
            "seq-mean-token-mean", 0.5)]  # fmt: skip
    if not quick:  # real shapes: a sample of the (aggregation, clip) pairs
        acc = acc[::3]
    inv = [
        _value(gen, FP32, b, length, "seq-mean-token-mean", 0.5),
        _value(gen, BF16, b, length, "token-mean", 0.2, counts=True),
    ]
    return OpCases(acc, inv)


#: The builders, by op (rlk.testing.cases lists them with the others).
BUILDERS = {"gae_advantages": gae_advantages, "value_loss": value_loss}
