"""The checks of the conformance kit, one function per guarantee.

Each check takes the backend op, the op's cases and a seeded ``random.Random`` and returns a
:class:`Outcome`; it raises only on a bug of the backend (the runner turns that into a FAIL row).
Invariance checks compare bits (``view`` as integers), so ``-0.0 != 0.0`` and NaN == NaN only
with the same payload.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlk.ops import GRAD_ARGS, OUT_DTYPE, UNIT_GRADS
from rlk.testing.case_tools import (
    Case,
    Gen,
    Seq,
    batch_of,
    call,
    dtype_name,
    pack,
    paged_args,
    paged_cache,
    select,
)
from rlk.testing.cases import AttnPath

#: Accuracy tolerances against the float64 reference, by the dtype of the op's inputs.
#: ``rel_rms`` bounds ``||out - ref||_2 / ||ref||_2`` and ``rel_max`` bounds
#: ``max|out - ref| / max|ref|`` (the largest error measured against the tensor's scale, so
#: near-zero elements of a gradient do not need an absolute tolerance of their own). Both are
#: checked on every output and every gradient. bf16/fp16: a few units of the last place of the
#: format (ops that round intermediates in backward, like attention, need the margin); fp32:
#: fp32 accumulation without TF32.
TOLERANCES: dict[str, dict[str, float]] = {
    "bf16": {"rel_rms": 2e-2, "rel_max": 5e-2},
    "fp16": {"rel_rms": 4e-3, "rel_max": 1e-2},
    "fp32": {"rel_rms": 1e-5, "rel_max": 1e-4},
}

#: ``sample`` against the reference: the fraction of rows that must draw the same token (greedy
#: rows must all agree). Near-ties of ``logit / temperature + gumbel`` may legitimately resolve
#: differently in fp32 and float64.
SAMPLE_AGREEMENT = 0.99

#: Failure messages kept per check (the count is in the detail).
MAX_FAILURES = 20


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "skip"
    detail: str = ""
    max_err: float | None = None
    rel_rms: float | None = None
    failures: list[str] = field(default_factory=list)  # the first MAX_FAILURES
    n_failures: int = 0


def _finish(failures: list[str], ok_detail: str, **numbers: Any) -> Outcome:
    if failures:
        more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
        detail = "; ".join(failures[:3]) + more
        return Outcome(
            "fail", detail, failures=failures[:MAX_FAILURES], n_failures=len(failures), **numbers
        )
    return Outcome("pass", ok_detail, **numbers)


# --------------------------------------------------------------------------------------------
# Running a case: outputs and gradients by name
# --------------------------------------------------------------------------------------------


def flatten(out: Any) -> dict[str, torch.Tensor]:
    """Name the results of an op: ``out`` / ``out0, out1`` and ``metric.<name>``."""
    if isinstance(out, torch.Tensor):
        return {"out": out}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return {"out": out[0], **{f"metric.{k}": v for k, v in sorted(out[1].items())}}
    if isinstance(out, tuple):
        return {f"out{i}": t for i, t in enumerate(out)}
    raise TypeError(f"op returned {type(out).__name__}, expected tensors")


def run_case(fn: Callable[..., Any], case: Case, backward: bool = True) -> dict[str, torch.Tensor]:
    """Run ``case`` forward (and backward with its cotangents): ``{name: tensor}`` detached."""
    args = dict(case.args)
    leaves: dict[str, torch.Tensor] = {}
    if backward and case.cot:
        for name in GRAD_ARGS.get(case.op, ()):
            if args.get(name) is not None:
                args[name] = leaves[name] = args[name].detach().clone().requires_grad_(True)
    flat = flatten(call(fn, case.op, args))
    res = {k: v.detach() for k, v in flat.items()}
    if leaves:
        # Integer outputs (moe_route's expert indices) get no cotangent.
        outs = [(k, v) for k, v in flat.items() if k.startswith("out") and v.is_floating_point()]
        if len(outs) != len(case.cot):
            raise RuntimeError(f"expected {len(case.cot)} differentiable outputs, got {len(outs)}")
        for k, v in outs:
            if not v.requires_grad:
                raise RuntimeError(f"output {k} does not require grad: no backward")
        grads = torch.autograd.grad(
            [v for _, v in outs],
            list(leaves.values()),
            [c.to(v.dtype) for c, (_, v) in zip(case.cot, outs, strict=True)],
            allow_unused=True,
        )
        for name, g in zip(leaves, grads, strict=True):
            if g is None:
                raise RuntimeError(f"backward gives no gradient for {name}")
            res[f"grad.{name}"] = g
    return res


def float64(case: Case) -> Case:
    """The case with every floating-point tensor copied to float64 (the reference's inputs)."""

    def up(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.double()
        return v

    return Case(
        case.op,
        case.label,
        torch.float64,
        {k: up(v) for k, v in case.args.items()},
        tuple(up(c) for c in case.cot),
    )


def _expected_dtype(case: Case, key: str) -> torch.dtype | None:
    if key.startswith("grad."):
        return case.args[key[5:]].dtype
    if key.startswith("metric."):
        return torch.float32
    want = OUT_DTYPE[case.op].split(",")  # one dtype, or one per output ("float32,int64")
    want = want[int(key[3:] or 0)] if len(want) > 1 else want[0]
    return case.dtype if want == "input" else getattr(torch, want)


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """``(max abs error, relative RMS error, max error relative to max |want|)``."""
    if got.numel() == 0:
        return 0.0, 0.0, 0.0
    g, w = got.double(), want.double()
    d = (g - w).abs()
    max_abs = float(d.max())
    if math.isnan(max_abs) or not bool(torch.isfinite(g).all()):
        return math.nan, math.nan, math.nan

    def rel(num: float, den: float) -> float:
        return 0.0 if num == 0 else (num / den if den > 0 else math.inf)

    return max_abs, rel(float(d.norm()), float(w.norm())), rel(max_abs, float(w.abs().max()))


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        size = a.element_size()
        a, b = a.contiguous().view(_INT_VIEW[size]), b.contiguous().view(_INT_VIEW[size])
    return torch.equal(a, b)


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> tuple[str, float]:
    """How two tensors that should be bitwise equal differ: message and max abs difference."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}", math.inf
    if not a.is_floating_point():
        n = int((a != b).sum())
        return f"{n}/{a.numel()} differ", float("nan")
    d = (a.double() - b.double()).abs().nan_to_num(math.inf)
    n = int(
        (
            a.contiguous().view(_INT_VIEW[a.element_size()])
            != b.contiguous().view(_INT_VIEW[a.element_size()])
        ).sum()
    )
    return f"{n}/{a.numel()} elements differ, max |diff| {float(d.max()):.2e}", float(d.max())


class _Diffs:
    """Collects bitwise mismatches: failure messages and the largest difference seen."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.max_diff = 0.0
        self.compared = 0

    def compare(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.compared += 1
        if bits_equal(got, want):
            return
        msg, diff = _mismatch(got, want)
        self.failures.append(f"{what}: {msg}")
        if not math.isnan(diff):
            self.max_diff = max(self.max_diff, diff)

    def compare_all(self, what: str, got: dict, want: dict) -> None:
        for key, w in want.items():
            if key not in got:
                self.failures.append(f"{what}: {key} missing")
            else:
                self.compare(f"{what}: {key}", got[key], w)

    def outcome(self, ok_detail: str) -> Outcome:
        return _finish(self.failures, ok_detail, max_err=self.max_diff if self.failures else 0.0)


# --------------------------------------------------------------------------------------------
# 1. Accuracy
# --------------------------------------------------------------------------------------------


def accuracy(fn: Callable, ref: Callable, cases: list[Case], rnd: random.Random) -> Outcome:
    """Every output and gradient vs the reference run on float64 copies of the inputs."""
    if cases and cases[0].op == "sample":
        return _sample_accuracy(fn, ref, cases)
    failures: list[str] = []
    worst = (-1.0, 0.0, 0.0, "")  # (error / tolerance, max abs, rel rms, where)
    n = 0
    for case in cases:
        got = run_case(fn, case)
        want = run_case(ref, float64(case))
        tol = TOLERANCES[dtype_name(case.dtype)]
        for key, w in want.items():
            g = got.get(key)
            where = f"{case.label}: {key}"
            if g is None:
                failures.append(f"{where} missing")
                continue
            dt = _expected_dtype(case, key)
            if g.shape != w.shape or g.dtype != dt:
                failures.append(
                    f"{where} is {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)} {dt}"
                )
                continue
            n += 1
            if not g.is_floating_point():  # indices (moe_route's experts): exactly the oracle's
                if not torch.equal(g, w.to(g.device)):
                    failures.append(f"{where}: {int((g != w.to(g.device)).sum())} differ")
                continue
            max_abs, rel_rms, rel_max = errors(g, w)
            # A result cannot beat its own dtype: where the exact values, merely rounded to the
            # output dtype, already miss the tolerance (tiny gradients in fp16 subnormals), twice
            # that rounding error is the bound instead.
            _, repr_rms, repr_max = errors(w.to(g.dtype), w)
            ratio = max(
                rel_rms / max(tol["rel_rms"], 2 * repr_rms),
                rel_max / max(tol["rel_max"], 2 * repr_max),
            )
            if not ratio <= 1.0:  # NaN fails too
                failures.append(
                    f"{where} rel RMS {rel_rms:.2e} (tol {tol['rel_rms']:.0e}), max err "
                    f"{max_abs:.2e} = {rel_max:.2e} of max|ref| (tol {tol['rel_max']:.0e})"
                )
            if math.isnan(ratio) or ratio > worst[0]:
                worst = (math.inf if math.isnan(ratio) else ratio, max_abs, rel_rms, where)
    ok = f"{n} tensors in {len(cases)} cases; worst {worst[3]} ({worst[0]:.2f} of tolerance)"
    return _finish(failures, ok, max_err=worst[1], rel_rms=worst[2])


def _sample_accuracy(fn: Callable, ref: Callable, cases: list[Case]) -> Outcome:
    failures, rows, agree = [], 0, 0
    for case in cases:
        got = run_case(fn, case)["out"]
        want = run_case(ref, float64(case))["out"]
        if got.shape != want.shape or got.dtype != torch.int64:
            failures.append(f"{case.label}: got {tuple(got.shape)} {got.dtype}, want int64")
            continue
        same = got == want.to(got.device)
        greedy = case.args["temperature"] == 0
        rows += same.numel()
        agree += int(same.sum())
        if not bool(same[greedy].all()):
            bad = (~same & greedy).nonzero()[:, 0].tolist()
            failures.append(f"{case.label}: greedy rows {bad[:5]} differ from the reference")
        frac = float(same.float().mean())
        if frac < SAMPLE_AGREEMENT:
            failures.append(
                f"{case.label}: {int(same.sum())}/{same.numel()} rows agree with the reference "
                f"(need {SAMPLE_AGREEMENT:.0%})"
            )
    return _finish(failures, f"{agree}/{rows} rows draw the reference's token")


# --------------------------------------------------------------------------------------------
# 2. Batch invariance
# --------------------------------------------------------------------------------------------


def _trials(case: Case, rnd: random.Random) -> list[tuple[str, list[int]]]:
    """Batches to compare with the full batch: units alone, reordered, mixed with others."""
    n, pool = case.batch, case.units
    others = list(range(n, pool))
    alone = sorted({0, n - 1, rnd.randrange(n)})
    trials = [(f"unit {u} alone", [u]) for u in alone]
    trials.append(("batch reversed", list(reversed(range(n)))))
    k = rnd.randint(1, max(1, n - 1))
    mixed = rnd.sample(range(n), k) + rnd.sample(others, rnd.randint(1, len(others)))
    rnd.shuffle(mixed)
    trials.append((f"{k} units among {len(mixed) - k} others", mixed))
    everything = list(range(pool))
    rnd.shuffle(everything)
    trials.append(("batch shuffled into all others", everything))
    return trials


def _unit_keys(case: Case, res: dict) -> list[tuple[str, str]]:
    """(result key, span kind) of the results that belong to one unit."""
    keys = [(k, "q") for k in res if k.startswith("out")]
    for name in UNIT_GRADS.get(case.op, ()):
        if f"grad.{name}" in res:
            keys.append((f"grad.{name}", "k" if name in ("k", "v") else "q"))
    return keys


def batch_invariance(fn: Callable, cases: list[Case], rnd: random.Random) -> Outcome:
    """A unit's outputs (and input gradients) computed in the batch == alone == elsewhere."""
    diffs = _Diffs()
    for case in cases:
        if not case.batch:  # no units (a batch statistic: whitened GAE): not this check's
            continue
        full_case, full_spans = select(case, range(case.batch))
        full = run_case(fn, full_case)
        keys = _unit_keys(case, full)
        for what, units in _trials(case, rnd):
            sub, spans = select(case, units)
            got = run_case(fn, sub)
            for pos, u in enumerate(units):
                if u >= case.batch:
                    continue
                for key, kind in keys:
                    a, b = spans[kind][pos], full_spans[kind][u]
                    diffs.compare(
                        f"{case.label}, {what}: {key} of unit {u}",
                        got[key][a[0] : a[1]],
                        full[key][b[0] : b[1]],
                    )
    return diffs.outcome(f"{diffs.compared} unit results bitwise equal across batches")


# --------------------------------------------------------------------------------------------
# 3. Determinism and 4. tuning invariance
# --------------------------------------------------------------------------------------------


def determinism(fn: Callable, cases: list[Case], rnd: random.Random, runs: int = 2) -> Outcome:
    """The same call twice: bitwise equal outputs and gradients (weight gradients included)."""
    diffs = _Diffs()
    for case in cases:
        batch = batch_of(case)
        first = run_case(fn, batch)
        for i in range(1, runs):
            diffs.compare_all(f"{case.label}, run {i + 1}", run_case(fn, batch), first)
    return diffs.outcome(f"{diffs.compared} results bitwise equal over {runs} runs")


def tuning_invariance(
    fn: Callable, op: str, configs: list, use_config: Callable, cases: list[Case]
) -> Outcome:
    """Every tuning config the backend may pick gives the bits of its default choice."""
    diffs = _Diffs()
    for case in cases:
        batch = batch_of(case)
        default = run_case(fn, batch)
        for i, cfg in enumerate(configs):
            with use_config(op, cfg):
                got = run_case(fn, batch)
            diffs.compare_all(f"{case.label}, config {i} {_short(cfg)}", got, default)
    return diffs.outcome(f"{len(configs)} configs bitwise equal to the default")


def _short(cfg: Any) -> str:
    text = repr(dict(cfg)) if isinstance(cfg, Mapping) else repr(cfg)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------------
# 5. Path invariance
# --------------------------------------------------------------------------------------------


def _attention_train(fn: Callable, p: AttnPath) -> tuple[list[torch.Tensor], Callable]:
    """Outputs of the training call (all sequences packed, nq == nk), and a packed runner."""

    def run(parts: list[Seq]) -> list[torch.Tensor]:
        args, _, spans = pack(parts, True, p.scale)
        out = call(fn, "attention", args)
        return [out[a:b] for a, b in spans["q"]]

    return run(p.seqs), run


def attention_paths(fn: Callable, paths: list[AttnPath], rnd: random.Random) -> Outcome:
    """Training == prefill == chunked prefill == token-by-token decode, per sequence; and the
    training call with length bounds (``max_seqlen_q/k``, exact and loose) == without."""
    diffs = _Diffs()
    for p in paths:
        train, run = _attention_train(fn, p)
        lengths = [s.q.shape[0] for s in p.seqs]
        args, _, spans = pack(p.seqs, True, p.scale)
        longest = max(1, *lengths)
        for bq, bk in ((longest, longest), (longest + 37, 2 * longest + 5)):
            out = call(fn, "attention", {**args, "max_seqlen_q": bq, "max_seqlen_k": bk})
            for i, (a, b) in enumerate(spans["q"]):
                diffs.compare(f"{p.label}: seq {i}, bounds {bq}/{bk}", out[a:b], train[i])
        # Prefill of the prompt, then decode one token at a time (continuous batching).
        prompt = [max(0, n - p.decode) for n in lengths]
        pre = [i for i, n in enumerate(prompt) if n > 0]
        outs = run([Seq(p.seqs[i].q[: prompt[i]], *_kv(p.seqs[i], prompt[i])) for i in pre])
        for i, o in zip(pre, outs, strict=True):
            diffs.compare(f"{p.label}: prefill of seq {i}", o, train[i][: prompt[i]])
        for step in range(p.decode):
            live = [i for i, n in enumerate(lengths) if prompt[i] + step < n]
            pos = {i: prompt[i] + step for i in live}
            outs = run(
                [Seq(p.seqs[i].q[pos[i] : pos[i] + 1], *_kv(p.seqs[i], pos[i] + 1)) for i in live]
            )
            for i, o in zip(live, outs, strict=True):
                diffs.compare(
                    f"{p.label}: decode of seq {i} at {pos[i]}", o, train[i][pos[i] : pos[i] + 1]
                )
        # Chunked prefill: chunk j of every sequence still running, against its keys so far.
        for c in p.chunks:
            for j in range(math.ceil(max(lengths) / c)):
                live = [i for i, n in enumerate(lengths) if j * c < n]
                ends = {i: min((j + 1) * c, lengths[i]) for i in live}
                outs = run(
                    [Seq(p.seqs[i].q[j * c : ends[i]], *_kv(p.seqs[i], ends[i])) for i in live]
                )
                for i, o in zip(live, outs, strict=True):
                    diffs.compare(
                        f"{p.label}: chunk {j} (size {c}) of seq {i}", o, train[i][j * c : ends[i]]
                    )
    return diffs.outcome(f"{diffs.compared} prefill/decode/chunk outputs bitwise equal to training")


def _kv(s: Seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return s.k[:n], s.v[:n]


def paged_paths(fn: Callable, attention_fn: Callable, paths: list[AttnPath], gen: Gen) -> Outcome:
    """paged_attention == attention (training call), for every page size, pages shuffled."""
    diffs = _Diffs()
    for p in paths:
        train, _ = _attention_train(attention_fn, p)
        for ps in p.page_sizes:
            # Decode (1 query), a chunk (5 queries) and a whole prefill, in turn.
            nqs = [(1, min(5, s.q.shape[0]), s.q.shape[0])[i % 3] for i, s in enumerate(p.seqs)]
            seqs = [Seq(s.q[len(s.q) - nq :], s.k, s.v) for s, nq in zip(p.seqs, nqs, strict=True)]
            cache = paged_cache(seqs, ps, gen)
            args, spans = paged_args(seqs, cache, range(len(seqs)), p.scale)
            out = call(fn, "paged_attention", args)
            for i, ((a, b), nq) in enumerate(zip(spans, nqs, strict=True)):
                n = p.seqs[i].q.shape[0]
                diffs.compare(
                    f"{p.label}: page size {ps}, seq {i} ({nq} queries)",
                    out[a:b],
                    train[i][n - nq :],
                )
            if ps == p.page_sizes[0]:
                # The caches as strided views: keys and values side by side in each token's
                # row, as a serving engine's blocks hold them (vLLM's [.., 2 * D]).
                d = args["k_cache"].shape[-1]
                kv = torch.cat([args["k_cache"], args["v_cache"]], dim=-1)
                views = {**args, "k_cache": kv[..., :d], "v_cache": kv[..., d:]}
                diffs.compare(
                    f"{p.label}: page size {ps}, strided caches",
                    call(fn, "paged_attention", views),
                    out,
                )
                # The new tokens' keys and values stored by the call itself (k_new, v_new,
                # slots) into caches whose slots hold garbage, the values as token-strided
                # views: the same output, and the caches as they were.
                stored = _stored_by_the_call(args, seqs, nqs, ps)
                diffs.compare(
                    f"{p.label}: page size {ps}, new K/V stored by the call",
                    call(fn, "paged_attention", stored),
                    out,
                )
                for name in ("k_cache", "v_cache"):
                    diffs.compare(
                        f"{p.label}: page size {ps}, {name} after the stores",
                        stored[name],
                        args[name],
                    )
    return diffs.outcome(f"{diffs.compared} paged outputs bitwise equal to attention")


def _stored_by_the_call(args: dict, seqs: list[Seq], nqs: list[int], ps: int) -> dict:
    """``args`` of :func:`paged_paths` with each sequence's query tokens' keys and values taken
    out of copies of the caches (their slots filled with garbage) and passed as ``k_new``,
    ``v_new`` and ``slots``; ``v_new`` a token-strided view (beside ``k_new`` in one tensor)."""
    kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
    slots = []
    for i, (s, nq) in enumerate(zip(seqs, nqs, strict=True)):
        pos = torch.arange(s.k.shape[0] - nq, s.k.shape[0], device=kc.device)
        pages = args["block_table"][i].long()[pos // ps]
        slots.append(pages * ps + pos % ps)
    slots = torch.cat(slots)
    k_new, v_new = kc[slots // ps, slots % ps], vc[slots // ps, slots % ps]
    kv = torch.cat([k_new, v_new], dim=1)  # [Tn, 2 Hk, D]: v_new a token-strided view
    hk = k_new.shape[1]
    kc[slots // ps, slots % ps] = kc[slots // ps, slots % ps].flip(0) * 3 + 1  # garbage
    vc[slots // ps, slots % ps] = vc[slots // ps, slots % ps].flip(0) * 3 + 1
    return {**args, "k_cache": kc, "v_cache": vc, "k_new": kv[:, :hk], "v_new": kv[:, hk:],
            "slots": slots}  # fmt: skip


def logprobs_paths(
    fused: Callable, linear: Callable, logprobs: Callable, cases: list[Case]
) -> Outcome:
    """linear_logprobs(h, W, t) == logprobs(linear(h, W), t): log-probs and entropy."""
    diffs = _Diffs()
    for case in cases:
        a = case.args
        got = flatten(call(fused, "linear_logprobs", a))
        logits = call(
            linear, "linear", {"x": a["hidden"], "weight": a["weight"], "bias": a["bias"]}
        )
        lp_args = {
            "logits": logits.to(a["logits_dtype"]),
            "targets": a["targets"],
            "temperature": a["temperature"],
            "return_entropy": a["return_entropy"],
        }
        diffs.compare_all(
            f"{case.label}: fused vs unfused", got, flatten(call(logprobs, "logprobs", lp_args))
        )
    return diffs.outcome(f"{diffs.compared} fused results bitwise equal to linear + logprobs")


def _heads_strided(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` as a heads view ``[T, heads, H / heads]`` (4 heads where H allows, else 1)
    of a wider ``[T, H + H / heads]`` tensor: the layout of q in a fused q/k/v product, the
    same values as ``x.view(T * heads, H / heads)``, a token stride of its own."""
    T, H = x.shape
    heads = 4 if H % 4 == 0 else 1
    d = H // heads
    wide = torch.cat([x, torch.full_like(x[:, :d], 7.0)], 1)
    return wide[:, :H].view(T, heads, d)


def rms_norm_paths(fn: Callable, cases: list[Case]) -> Outcome:
    """rms_norm(x, w, eps, residual) == (rms_norm(x + residual, w, eps), x + residual); and a
    heads view of a wider tensor (q in a fused q/k/v product) gives the result of its rows'
    contiguous copy."""
    diffs = _Diffs()
    for case in cases:
        a = case.args
        y, s = call(fn, "rms_norm", a)
        s_ref = a["x"] + a["residual"]
        y_ref = call(fn, "rms_norm", {**a, "x": s_ref, "residual": None})
        diffs.compare(f"{case.label}: sum", s, s_ref)
        diffs.compare(f"{case.label}: normed", y, y_ref)
        x3 = _heads_strided(a["x"])
        heads = {**a, "x": x3, "weight": a["weight"][: x3.shape[2]], "residual": None}
        got = call(fn, "rms_norm", heads)
        rows = {**heads, "x": x3.reshape(-1, x3.shape[2])}
        diffs.compare(f"{case.label}: heads view", got, call(fn, "rms_norm", rows).view(x3.shape))
    return diffs.outcome(
        f"{diffs.compared} fused-residual and heads-view results bitwise equal to unfused, "
        "contiguous calls"
    )


def silu_and_mul_paths(fn: Callable, cases: list[Case]) -> Outcome:
    """silu_and_mul(gate, up) == silu_and_mul(cat(gate, up)): the output and both gradients."""
    diffs = _Diffs()
    for case in cases:
        gate, up = case.args["x"], case.args["up"]
        pair = run_case(fn, case)
        joined = Case(case.op, case.label, case.dtype,
                      {"x": torch.cat([gate, up], dim=-1)}, case.cot)  # fmt: skip
        one = run_case(fn, joined)
        i = gate.shape[-1]
        diffs.compare(f"{case.label}: out", pair["out"], one["out"])
        diffs.compare(f"{case.label}: grad gate", pair["grad.x"], one["grad.x"][..., :i])
        diffs.compare(f"{case.label}: grad up", pair["grad.up"], one["grad.x"][..., i:])
    return diffs.outcome(f"{diffs.compared} two-tensor results bitwise equal to one tensor's")


def moe_combine_order(fn: Callable, cases: list[Case]) -> Outcome:
    """moe_experts (fp32 cases) == ``sum_r w[:, r] * moe_experts(x, indices[:, r], 1)`` added in
    ascending rank r in fp32: a one-expert call with weight 1 returns that expert's fp32 output
    exactly, so the k-expert result must be its rank-order sum, bit for bit."""
    diffs = _Diffs()
    for case in cases:
        a = case.args
        out = call(fn, case.op, a)
        want = torch.zeros_like(out)
        ones = torch.ones_like(a["weights"][:, :1])
        for r in range(a["indices"].shape[1]):
            one = {**a, "indices": a["indices"][:, r : r + 1].contiguous(), "weights": ones}
            want = want + a["weights"][:, r : r + 1] * call(fn, case.op, one)
        diffs.compare(f"{case.label}: combine", out, want)
    return diffs.outcome(f"{diffs.compared} results bitwise equal to the rank-order sum")


def _without_k(args: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    return {**{k: v for k, v in args.items() if k != "k"}, "x": x}


def _token_strided(x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` and ``k [T, Hk, D]`` as column views of one ``[T, (H + Hk + 1) D]``
    tensor (the layout of a fused q/k/v product): the same values, a token stride of their
    own."""
    T, H, D = x.shape
    wide = torch.cat([x.reshape(T, -1), k.reshape(T, -1), torch.full_like(x[:, 0], 7.0)], 1)
    return wide[:, : H * D].view(T, H, D), wide[:, H * D : -D].view(T, -1, D)


def rotary_paths(fn: Callable, cases: list[Case]) -> Outcome:
    """apply_rotary(x, cos, sin, k) == (apply_rotary(x, cos, sin), apply_rotary(k, cos, sin)):
    the outputs and the gradients of x and k; and x and k as token-strided column views of
    one tensor (a fused q/k/v product) give the outputs of their contiguous copies."""
    diffs = _Diffs()
    for case in cases:
        a = case.args
        pair = run_case(fn, case)
        alone = [
            run_case(fn, Case(case.op, case.label, case.dtype, _without_k(a, t), (c,)))
            for t, c in ((a["x"], case.cot[0]), (a["k"], case.cot[1]))
        ]
        for name, i in (("x", 0), ("k", 1)):
            diffs.compare(f"{case.label}: {name}", pair[f"out{i}"], alone[i]["out"])
            diffs.compare(f"{case.label}: grad {name}", pair[f"grad.{name}"], alone[i]["grad.x"])
        x, k = _token_strided(a["x"], a["k"])
        strided = run_case(fn, Case(case.op, case.label, case.dtype, {**a, "x": x, "k": k}, ()))
        for i in (0, 1):
            diffs.compare(f"{case.label}: strided out{i}", strided[f"out{i}"], pair[f"out{i}"])
    return diffs.outcome(
        f"{diffs.compared} pair and token-strided results bitwise equal to separate, "
        "contiguous calls"
    )


__all__ = [
    "SAMPLE_AGREEMENT",
    "TOLERANCES",
    "Outcome",
    "accuracy",
    "attention_paths",
    "batch_invariance",
    "bits_equal",
    "determinism",
    "errors",
    "logprobs_paths",
    "paged_paths",
    "rms_norm_paths",
    "rotary_paths",
    "run_case",
    "silu_and_mul_paths",
    "tuning_invariance",
]
