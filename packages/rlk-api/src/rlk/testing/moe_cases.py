"""Conformance inputs of the mixture-of-experts ops (``moe_route``, ``moe_route_grouped``,
``moe_experts``), quick and full, in the form of :mod:`rlk.testing.cases`.

``moe_route``: router logits, some rows with tied maxima (the tie-break is part of the
contract), both routing forms. ``moe_route_grouped``: logits and a selection bias, every third
row with two experts tied at the top and every third with the first two groups tied at the top
(a router that breaks ties by arrival order rather than by the lower index fails).
``moe_experts``: a token's experts distinct and random, weights from a softmax, expert weights
at the scale of a real layer; the pool mixes tokens so that the batch changes how many tokens
each expert gets. ``path`` holds fp32 cases of :func:`rlk.testing.checks.moe_combine_order`.
"""

from __future__ import annotations

import torch

from rlk.testing.cases import BF16, FP16, FP32, Case, Gen, OpCases, dtype_name


def _route(gen: Gen, dt, t: int, e: int, k: int, normalize: bool, batch: int = 0) -> Case:
    logits = gen.randn(t, e, dtype=dt)
    logits[::3, 1] = logits[::3, 0] = logits[::3].max(dim=1).values + 1  # ties at the top
    args = {"logits": logits, "top_k": k, "normalize": normalize}
    label = f"{dtype_name(dt)} T={t} E={e} k={k}" + (" normalize" if normalize else "")
    return Case("moe_route", label, dt, args, (gen.randn(t, k),), ("logits",), 1, batch)


def moe_route(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_route(gen, dt, 9, 8, 2, n) for dt in (BF16, FP32) for n in (False, True)]
        acc += [_route(gen, FP16, 5, 6, 6, True)]
        inv = [_route(gen, BF16, 18, 8, 3, True, batch=12)]
    else:
        acc = [_route(gen, BF16, 257, 128, 8, True), _route(gen, FP32, 64, 64, 6, False)]
        inv = [_route(gen, BF16, 4096 + 256, 128, 8, True, batch=4096)]
    return OpCases(acc, inv)


def _grouped(gen: Gen, dt, t: int, e: int, k: int, groups: tuple[int, int], normalize: bool,
             batch: int = 0) -> Case:  # fmt: skip
    n_group, topk_group = groups
    size = e // n_group
    logits = gen.randn(t, e, dtype=dt)
    bias = gen.randn(e, scale=0.1)
    bias[1] = bias[0]
    bias[size : 2 * size] = bias[:size]
    # Experts 0 and 1 tied at the top; groups 0 and 1 equal and ahead of the others.
    logits[::3, 1] = logits[::3, 0] = logits[::3].max(dim=1).values + 1
    logits[1::3, size : 2 * size] = logits[1::3, :size]
    logits[1::3, : 2 * size] += 3
    args = {"logits": logits, "bias": bias, "top_k": k, "n_group": n_group,
            "topk_group": topk_group, "normalize": normalize, "scale": 2.5}  # fmt: skip
    label = f"{dtype_name(dt)} T={t} E={e} k={k} groups={n_group}/{topk_group}"
    label += " normalize" if normalize else ""
    return Case("moe_route_grouped", label, dt, args, (gen.randn(t, k),), ("logits",), 1, batch)


def moe_route_grouped(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_grouped(gen, dt, 9, 8, 2, (4, 2), n) for dt in (BF16, FP32) for n in (False, True)]
        acc += [
            _grouped(gen, FP32, 9, 16, 1, (4, 1), False),
            _grouped(gen, FP16, 6, 8, 3, (2, 2), True),
        ]
        inv = [_grouped(gen, BF16, 18, 16, 4, (4, 2), True, batch=12)]
    else:
        # DeepSeek-V3's router: 256 experts in 8 groups, 4 groups and 8 experts per token. The
        # indices must be the float64 oracle's exactly and a GPU's exp is not correctly rounded:
        # 64 tokens, so that no random near-tie (within a few ulps) decides a choice.
        acc = [
            _grouped(gen, FP32, 64, 256, 8, (8, 4), True),
            _grouped(gen, BF16, 64, 64, 6, (4, 2), False),
        ]
        inv = [_grouped(gen, FP32, 4096 + 256, 256, 8, (8, 4), True, batch=4096)]
    return OpCases(acc, inv)


def _experts(gen: Gen, dt, t: int, e: int, k: int, h: int, i: int, batch: int = 0) -> Case:
    order = torch.argsort(gen.rand(t, e), dim=1)[:, :k]  # k distinct experts per token
    args = {
        "x": gen.randn(t, h, dtype=dt),
        "indices": order.to(torch.int64),
        "weights": torch.softmax(gen.randn(t, k), dim=1),
        "gate_up": gen.randn(e, 2 * i, h, dtype=dt, scale=h**-0.5),
        "down": gen.randn(e, h, i, dtype=dt, scale=i**-0.5),
    }
    label = f"{dtype_name(dt)} T={t} E={e} k={k} H={h} I={i}"
    rows = ("x", "indices", "weights")
    return Case("moe_experts", label, dt, args, (gen.randn(t, h, dtype=dt),), rows, 1, batch)


def moe_experts(gen: Gen, quick: bool) -> OpCases:
    if quick:
        acc = [_experts(gen, dt, 10, 4, 2, 32, 48) for dt in (BF16, FP16, FP32)]
        inv = [_experts(gen, BF16, 18, 4, 2, 32, 32, batch=12)]
        path = [_experts(gen, FP32, 12, 4, 3, 32, 32)]
    else:
        acc = [_experts(gen, BF16, 64, 128, 8, 2048, 768), _experts(gen, FP32, 32, 16, 4, 512, 256)]
        inv = [_experts(gen, BF16, 4096 + 256, 128, 8, 2048, 768, batch=4096)]
        path = [_experts(gen, FP32, 64, 16, 4, 1024, 512)]
    return OpCases(acc, inv, path)


#: The builders, by op (joined to rlk.testing.cases' when the ops are in the catalog).
BUILDERS = {
    "moe_route": moe_route,
    "moe_route_grouped": moe_route_grouped,
    "moe_experts": moe_experts,
}
