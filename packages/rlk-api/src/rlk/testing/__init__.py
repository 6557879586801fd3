"""The conformance kit: checks a backend against the numerics contract (``rlk conformance``).

For each op it runs five checks, one per guarantee of ``rlk.GUARANTEES``:

1. ``accuracy``: outputs and gradients vs ``rlk_reference`` on float64 copies of the inputs,
   within :data:`TOLERANCES` (relative RMS error and max error, both reported); ``sample``
   must draw the reference's token in >= 99% of rows and in every greedy row.
2. ``batch_invariance``: a row / sequence / GRPO group gives the same bits (outputs and its
   input gradients) alone, in the full batch, reordered, and mixed with other random units.
3. ``determinism``: the same call twice gives the same bits, forward and backward (weight
   gradients included).
4. ``tuning_invariance``: every config of ``impl.tuning_configs(op)``, forced with
   ``impl.use_config``, gives the bits of the default choice.
5. ``path_invariance``: attention training == prefill == chunked prefill == decode ==
   paged_attention (page sizes 16..128, shuffled pages); ``linear_logprobs`` == ``logprobs`` of
   ``linear``; ``rms_norm`` with a residual == the unfused add and norm; ``silu_and_mul`` of
   gate and up == of their concatenation; ``apply_rotary`` of q and k == two calls, and of q
   and k as token-strided column views of one tensor (a fused q/k/v product) == of their
   contiguous copies.

A check of a guarantee the backend does not claim (``impl.claims``) is a skip, never a pass. An op
the backend does not implement is a FAIL row, and so is an exception inside a check (the run goes
on). Inputs are seeded, so two runs test the same values. ``quick`` shapes are tiny (CPU, Triton
interpreter); ``quick=False`` uses real shapes, for a GPU.

Backend packages can use :func:`assert_conformance` in their own tests::

    def test_conformance():
        rlk.testing.assert_conformance("mybackend", ops=["rms_norm"])
"""

from __future__ import annotations

import math
import random
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlk import selection
from rlk.ops import OPS, OPTIONAL_OPS
from rlk.plugins import GUARANTEES, BackendImpl
from rlk.testing import cases as _cases
from rlk.testing import checks as _checks
from rlk.testing import moe_cases as _moe_cases
from rlk.testing import special_values as _special
from rlk.testing.checks import SAMPLE_AGREEMENT, TOLERANCES

CHECKS = GUARANTEES

#: Why a check does not apply to an op.
NOT_APPLICABLE = {
    ("policy_loss", "batch_invariance"): "the loss aggregates over the whole batch",
    ("value_loss", "batch_invariance"): "the loss aggregates over the whole batch",
    ("logprobs", "path_invariance"): "fused == unfused is checked under linear_logprobs",
}
NO_SECOND_PATH = "no second path for this op"


@dataclass
class Row:
    """One (op, check) result. ``max_err``: worst max abs error (accuracy) or max abs
    difference between results that should be bitwise equal; ``rel_rms``: relative RMS error."""

    op: str
    check: str
    status: str  # "pass" | "fail" | "skip"
    max_err: float | None = None
    rel_rms: float | None = None
    detail: str = ""
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # the first few mismatches
    n_failures: int = 0


@dataclass
class Report:
    backend: str
    device: str
    quick: bool
    claims: list[str]
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "fail"]

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.rows) for s in ("pass", "fail", "skip")}

    def row(self, op: str, check: str) -> Row:
        for r in self.rows:
            if r.op == op and r.check == check:
                return r
        raise KeyError((op, check))

    def to_dict(self) -> dict[str, Any]:
        def num(x: float | None) -> float | str | None:
            return x if x is None or math.isfinite(x) else str(x)

        rows = []
        for r in self.rows:
            d = asdict(r)
            d["max_err"], d["rel_rms"] = num(r.max_err), num(r.rel_rms)
            rows.append(d)
        return {
            "backend": self.backend,
            "device": self.device,
            "mode": "quick" if self.quick else "full",
            "claims": self.claims,
            "ok": self.ok,
            "summary": self.counts(),
            "seconds": round(self.seconds, 2),
            "seed": _cases.SEED,
            "tolerances": TOLERANCES,
            "sample_agreement": SAMPLE_AGREEMENT,
            "rows": rows,
        }


#: The ops the kit checks: every required op, then the optional ops it has cases for (a
#: backend without one is skipped there, not failed).
KIT_OPS: tuple[str, ...] = (*OPS, *_moe_cases.BUILDERS)


def _reference_op(op: str) -> Callable:
    import rlk_reference

    return getattr(rlk_reference, op)


def _tuning(impl: BackendImpl, op: str) -> list:
    return list(impl.tuning_configs(op)) if impl.tuning_configs is not None else []


def _run_check(
    impl: BackendImpl, op: str, check: str, oc: _cases.OpCases, device: torch.device
) -> _checks.Outcome:
    fn = impl.ops[op]
    rnd = random.Random(_cases.SEED ^ zlib.crc32(f"{op}/{check}".encode()))
    if check == "accuracy":
        out = _checks.accuracy(fn, _reference_op(op), oc.accuracy, rnd)
        return _special.with_accuracy(out, fn, _reference_op(op), op, device)
    if check == "batch_invariance":
        return _checks.batch_invariance(fn, oc.invariance, rnd)
    if check == "determinism":
        return _checks.determinism(fn, oc.invariance, rnd, runs=2 if device.type == "cpu" else 3)
    if check == "tuning_invariance":
        configs = _tuning(impl, op)
        if not configs:
            return _checks.Outcome("skip", "no tunable kernels")
        if impl.use_config is None:
            return _checks.Outcome("fail", "tuning_configs given but no use_config to force one")
        return _checks.tuning_invariance(fn, op, configs, impl.use_config, oc.invariance)
    if check == "path_invariance":
        return _path(impl, op, oc, device, rnd)
    raise ValueError(check)


def _needs(impl: BackendImpl, *ops: str) -> None:
    missing = [o for o in ops if o not in impl.ops]
    if missing:
        raise RuntimeError(f"this check also needs {', '.join(missing)}, which is not implemented")


def _path(impl, op, oc, device, rnd) -> _checks.Outcome:
    if op == "attention":
        return _checks.attention_paths(impl.ops[op], oc.path, rnd)
    if op == "paged_attention":
        _needs(impl, "attention")
        gen = _cases.Gen("paged_attention/path", device)
        return _checks.paged_paths(impl.ops[op], impl.ops["attention"], oc.path, gen)
    if op == "linear_logprobs":
        _needs(impl, "linear", "logprobs")
        return _checks.logprobs_paths(
            impl.ops[op], impl.ops["linear"], impl.ops["logprobs"], oc.path
        )
    if op == "rms_norm":
        return _checks.rms_norm_paths(impl.ops[op], oc.path)
    if op == "silu_and_mul":
        return _checks.silu_and_mul_paths(impl.ops[op], oc.path)
    if op == "apply_rotary":
        return _checks.rotary_paths(impl.ops[op], oc.path)
    if op == "moe_experts":
        return _checks.moe_combine_order(impl.ops[op], oc.path)
    return _checks.Outcome("skip", NO_SECOND_PATH)


def build_cases(op: str, quick: bool, device: torch.device) -> _cases.OpCases:
    """The kit's seeded cases of ``op`` (a name of :data:`KIT_OPS`) on ``device``: ``accuracy``
    cases, ``invariance`` unit pools (what batch invariance, determinism and tuning invariance
    run) and ``path`` cases; ``quick``: the tiny CPU shapes. The same values on every call, so
    a backend's own tests can run its kernels on exactly what ``rlk conformance`` checks::

        pools = rlk.testing.build_cases("rms_norm", True, torch.device("cpu")).invariance
    """
    if op in _moe_cases.BUILDERS:
        return _moe_cases.BUILDERS[op](_cases.Gen(op, device), quick)
    return _cases.build(op, quick, device)


def _op_rows(impl: BackendImpl, op: str, device: torch.device, quick: bool) -> list[Row]:
    if op not in impl.ops:
        if op in OPTIONAL_OPS:
            return [Row(op, "implemented", "skip", detail="optional op, not implemented")]
        return [Row(op, "implemented", "fail", detail="not implemented")]
    rows: list[Row] = []
    oc: _cases.OpCases | None = None
    for check in CHECKS:
        t0 = time.perf_counter()
        if check not in impl.claims:
            out = _checks.Outcome("skip", "not claimed by backend")
        elif (op, check) in NOT_APPLICABLE:
            out = _checks.Outcome("skip", NOT_APPLICABLE[(op, check)])
        else:
            try:
                if oc is None:
                    oc = build_cases(op, quick, device)
                out = _run_check(impl, op, check, oc, device)
            except Exception as e:  # a crash is a failure of this check, and the run goes on
                where = traceback.extract_tb(e.__traceback__)[-1]
                out = _checks.Outcome(
                    "fail", f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})"
                )
        rows.append(
            Row(
                op,
                check,
                out.status,
                out.max_err,
                out.rel_rms,
                out.detail,
                round(time.perf_counter() - t0, 3),
                out.failures,
                out.n_failures or int(out.status == "fail"),
            )
        )
    return rows


def run_conformance(
    backend: str | None = None,
    ops: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    quick: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Check ``backend`` (default: the one selected for ``device``) on ``ops`` (default: all).

    ``device`` defaults to cuda when present, else cpu. ``progress`` receives one line per op.
    Raises :class:`rlk.BackendError` when the backend cannot be found or loaded, and
    ``ValueError`` for an unknown op; everything else is reported in the rows.
    """
    device = torch.device(device if device is not None else selection.device_type())
    name = backend or selection.current_backend(device)
    impl = selection.registry().load(name, complete=False)
    ops = list(KIT_OPS if ops is None else [ops] if isinstance(ops, str) else ops)
    unknown = [o for o in ops if o not in KIT_OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; the ops are {', '.join(KIT_OPS)}")
    report = Report(name, str(device), quick, sorted(impl.claims))
    t0 = time.perf_counter()
    for op in ops:
        t_op = time.perf_counter()
        rows = _op_rows(impl, op, device, quick)
        report.rows.extend(rows)
        if progress is not None:
            states = ", ".join(f"{r.check} {r.status}" for r in rows)
            progress(f"{op}: {states} ({time.perf_counter() - t_op:.1f}s)")
    report.seconds = time.perf_counter() - t0
    return report


def _cell(r: Row | None) -> str:
    if r is None:
        return ""
    if r.status == "skip":
        return "skip"
    word = "pass" if r.status == "pass" else "FAIL"
    if r.max_err is None:
        return word
    return f"{word} {r.max_err:.1e}" if r.max_err else f"{word} 0"


def format_table(report: Report) -> str:
    """Op x check grid (status and max error), then failures, skip reasons, and a summary."""
    mode = "quick" if report.quick else "full"
    lines = [
        f"rlk conformance: backend {report.backend!r} on {report.device} ({mode} shapes); "
        f"claims: {', '.join(report.claims) or 'none'}"
    ]
    ops = list(dict.fromkeys(r.op for r in report.rows))
    by = {(r.op, r.check): r for r in report.rows}
    width = max([len(o) for o in ops] + [2]) + 2
    cols = [max(len(c) + 2, 15) for c in CHECKS]
    grid = list(zip(CHECKS, cols, strict=True))
    lines.append(("op".ljust(width) + "".join(c.ljust(w) for c, w in grid)).rstrip())
    for op in ops:
        if (op, "implemented") in by:
            lines.append(op.ljust(width) + "FAIL: not implemented")
            continue
        cells = "".join(_cell(by.get((op, c))).ljust(w) for c, w in grid)
        lines.append((op.ljust(width) + cells).rstrip())
    fails = report.failed
    if fails:
        lines.append("failures:")
        for r in fails:
            if r.n_failures <= 1:
                lines.append(f"  {r.op} / {r.check}: {r.detail}")
                continue
            lines.append(f"  {r.op} / {r.check}: {r.n_failures} failures, the first:")
            lines.extend(f"    {f}" for f in r.failures[:3])
    skips: dict[str, list[str]] = {}
    for r in report.rows:
        if r.status == "skip":
            skips.setdefault(r.detail, []).append(f"{r.op}/{r.check}")
    if skips:
        lines.append("skipped:")
        for reason, where in skips.items():
            shown = ", ".join(where) if len(where) <= 4 else f"{len(where)} checks"
            lines.append(f"  {reason}: {shown}")
    c = report.counts()
    lines.append(
        f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped ({report.seconds:.1f}s)"
    )
    return "\n".join(lines)


def assert_conformance(
    backend: str,
    ops: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    quick: bool = True,
) -> Report:
    """Run the kit and raise ``AssertionError`` with the table when a check fails (for tests)."""
    report = run_conformance(backend=backend, ops=ops, device=device, quick=quick)
    if not report.ok:
        raise AssertionError("conformance failed\n" + format_table(report))
    return report


__all__ = [
    "CHECKS",
    "SAMPLE_AGREEMENT",
    "TOLERANCES",
    "Report",
    "Row",
    "assert_conformance",
    "build_cases",
    "format_table",
    "run_conformance",
]
