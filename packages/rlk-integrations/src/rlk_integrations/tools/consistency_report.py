"""The report of ``rlk consistency``: a row's mismatch metrics (:func:`compare`, kept as a
:class:`SideResult`), the verdict (:func:`ok`), the table (:func:`format_table`) and the JSON file
(:func:`write_json`). Functions of the log-probabilities and of the report dict alone: nothing here
runs a model.

Example::

    m = compare([torch.zeros(3)], [torch.zeros(3)])   # {"tokens": 3, "max_abs_dlogp": 0.0, ...}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SideResult:
    side: str
    rollout_mode: str
    train_engine: str
    tokens: int
    max_abs_dlogp: float
    mean_abs_dlogp: float
    frac_differ: float
    k3_kl: float
    rollout_tok_s: float
    train_tok_s: float
    #: Mixture of experts: the share of tokens routed to other experts in training than in
    #: the rollout (rlk_integrations.models.moe.routing_differ); None where not measured.
    expert_differ: float | None = None
    #: The GRPO step of a loop run (``steps``); None in a one-shot run.
    step: int | None = None


def compare(rollout_lps: list[torch.Tensor], train_lps: list[torch.Tensor]) -> dict[str, float]:
    """Mismatch metrics over all tokens; k3 = mean(r - 1 - log r) with r = p_train / p_rollout."""
    a = torch.cat([x.detach().double().cpu() for x in rollout_lps])
    b = torch.cat([x.detach().double().cpu() for x in train_lps])
    if a.numel() == 0:
        return dict(tokens=0, max_abs_dlogp=0.0, mean_abs_dlogp=0.0, frac_differ=0.0, k3_kl=0.0)
    log_r = b - a
    return dict(
        tokens=a.numel(),
        max_abs_dlogp=float(log_r.abs().max()),
        mean_abs_dlogp=float(log_r.abs().mean()),
        frac_differ=float((log_r != 0).double().mean()),
        k3_kl=float((log_r.exp() - 1 - log_r).mean()),
    )


def ok(report: dict[str, Any]) -> bool:
    """True when the rlk row exists, compared tokens, and shows exactly zero mismatch."""
    rows = [r for r in report["rows"] if r["side"] == "rlk"]
    return bool(rows) and all(
        r["tokens"] > 0
        and r["max_abs_dlogp"] == 0.0
        and r["frac_differ"] == 0.0
        and not r.get("expert_differ")
        for r in rows
    )


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"model {report['model']} ({report['model_type']}, {report['dtype']}) on "
        f"{report['device']}, rlk backend {report['backend']}; {report['prompts']} prompts x "
        f"{report['new_tokens']} new tokens, training micro-batches of {report['micro_batch']}"
    )
    engine = report.get("train_engine", "transformers")
    leaves = report.get("leaves")
    notes = []
    tp, rtp = report.get("train_tp", 1), report.get("rollout_tp", 1)
    steps = report.get("steps")
    if steps:
        notes.append(
            f"{steps} GRPO steps: vLLM samples {report['group_size']} completions per prompt, "
            "the trainer recomputes and updates (SGD), the weights go back into vLLM; rlk rows: "
            f"rlk's vLLM models, training {engine} + rlk at TP={tp}; stock rows: stock vLLM, "
            "stock transformers, vLLM's reload_weights"
        )
    elif report.get("ep") is not None:
        core = "-core" if engine == "megatron" else ""
        notes.append(
            f"rlk rows: rollout transformers + rlk, training {engine}{core} + rlk, the experts "
            f"over EP={report['ep']} ranks (each samples, then recomputes another, share of the "
            "sequences); the stock row is stock transformers on one device"
        )
    elif engine != "transformers" or tp > 1 or rtp > 1:
        core = "-core" if engine == "megatron" else ""
        notes.append(
            f"rlk rows: rollout transformers + rlk at TP={rtp}, training {engine}{core} + rlk "
            f"at TP={tp}; the stock row is stock transformers on both sides at TP=1"
        )
    if leaves:
        notes.append(f"rlk o_proj/down_proj: tree-ordered linear, {leaves} leaves")
    if not steps and any(r.get("rollout_mode") == "vllm-stock" for r in report["rows"]):
        notes.append(
            "stock vllm-stock row: vLLM's own model classes and kernels sample, stock "
            "transformers recomputes"
        )
    for name, why in report.get("rollout_skipped", {}).items():
        notes.append(f"rollout engine {name} not run: {why}")
    # Mixture of experts: the share of tokens whose experts differ ("-": not measured).
    experts = any(r.get("expert_differ") is not None for r in report["rows"])
    stepped = any(r.get("step") is not None for r in report["rows"])
    cols = (
        ("step " if stepped else "") +
        f"{'side':<6} {'rollout':<10} {'train':<19} {'tokens':>7} {'max|dlogp|':>11} "
        f"{'mean|dlogp|':>12} "
        f"{'differ':>7} " + (f"{'experts':>8} " if experts else "") +
        f"{'k3 KL':>10} {'rollout tok/s':>14} {'train tok/s':>12}"
    )  # fmt: skip
    lines = [head, *notes, cols, "-" * len(cols)]
    for r in report["rows"]:
        lines.append(
            (f"{r['step']:>4} " if stepped else "")
            + f"{r['side']:<6} {r.get('rollout_mode', 'padded'):<10} "
            f"{r.get('train_engine', 'transformers'):<19} {r['tokens']:>7d} "
            f"{_num(r['max_abs_dlogp']):>11} "
            f"{_num(r['mean_abs_dlogp']):>12} {100 * r['frac_differ']:>6.1f}% "
            + (f"{_share(r.get('expert_differ')):>8} " if experts else "")
            + f"{_num(r['k3_kl']):>10} {r['rollout_tok_s']:>14.1f} {r['train_tok_s']:>12.1f}"
        )
    lines.append(
        "tok/s: this command's own loops (the paged rollout replays CUDA graphs of its decode "
        "steps on a GPU, the others run eagerly; the padded stock row is not transformers' "
        "generate). "
        "Engine speed: rlk bench --only e2e."
    )
    return "\n".join(lines)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3e}"


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
