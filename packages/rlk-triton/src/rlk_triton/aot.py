"""Every rlk Triton kernel compiled ahead of time for AMD CDNA and NVIDIA GPUs, on the CPU, and
the numerics contract checked in the generated code (``rlk aot``).

Triton compiles for a GPU it does not have: ``triton.compile(ASTSource(kernel, signature,
constexprs), target=GPUTarget("hip", "gfx942", 64))`` gives AMD's ``amdgcn`` assembly and an
``hsaco``; ``GPUTarget("cuda", 90, 32)`` gives PTX and a ``cubin`` (Triton's wheel brings
``ptxas`` and AMD's linker). ``rlk aot``

1. **records** the launches rlk makes (:mod:`rlk_triton.aot_record`): every op is called on
   CPU tensors, forward and backward, once per config set of every installed tuning table
   (portable, cuda, rocm) and as on an NVIDIA and an AMD GPU; :func:`rlk_triton._triton.jit`
   reports each launch with its options (``enable_fp_fusion=False``, ``num_warps``, ...) and
   skips it (no launcher reads a kernel's output, so this takes seconds);
2. **compiles** each distinct launch for :data:`~rlk_triton.aot_compile.TARGETS` in
   subprocesses with the interpreter off, through Triton's own binder, with the recorded
   options (:mod:`rlk_triton.aot_compile`, which caches the results by key);
3. **reads** the generated code (:func:`rlk_triton.aot_compile.analyse`): floating-point
   atomics and matrix instructions (``v_mfma_*``, ``mma.sync.*``, ``wgmma.mma_async.*``,
   ``tcgen05.mma.*``);
4. **checks** the contract on that report (this module, :func:`violations`): every launch
   compiles for every target its table's backend claims (:data:`CLAIMED`); no floating-point
   atomic outside :data:`ORDERED_ACCUMULATIONS`; one set of matrix-instruction kinds per
   kernel, target and call across all configs (a different MFMA shape sums K in another
   order).

What this does not show: that the code runs, or its speed, on that hardware.

Example::

    report = run(ops=["rms_norm"], targets=["gfx942", "sm_90"])
    assert not violations(report), violations(report)

This module imports neither torch nor triton at import time (``rlk --help`` loads it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from rlk_cli import Command
from rlk_triton.aot_compile import TARGETS, compile_launches, read_cache, write_cache
from rlk_triton.aot_record import PLATFORMS, Launch, record

#: The targets each backend's tuning table must compile for (the portable table runs on any
#: of them). A table not named here must compile for every target.
CLAIMED: dict[str, tuple[str, ...]] = {
    "triton": tuple(TARGETS),
    "cuda": ("sm_80", "sm_90", "sm_100"),
    "rocm": ("gfx90a", "gfx942", "gfx950"),
}

#: Kernels allowed floating-point atomics, with the fixed order that serialises them (the
#: contract allows an accumulation serialised in a fixed order, and only one that is named).
#: ``"module:kernel": "how the order is fixed"``. None today.
ORDERED_ACCUMULATIONS: dict[str, str] = {}


def run(
    ops: Sequence[str] | None = None,
    targets: Sequence[str] = tuple(TARGETS),
    quick: bool = False,
    jobs: int = 1,
    cache: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Record, compile and analyse (see the module's docstring). The report::

        {"triton": version, "targets": [...], "configs": [{"op", "configs", "tables"}],
         "rows": [{"kernel", "call", "config", "target", "ok", "error", "artifacts",
                   "float_atomics", "matrix"}],
         "seconds": {"record", "compile"}, "compiled", "cached", "cpu_seconds"}

    one row per distinct (kernel, call, config, target). ``cache``: a JSON file of earlier
    results by key (see :func:`rlk_triton.aot_compile._worker`): its entries are used, and it is rewritten with this
    run's (a run of every op and target drops the others), so that only kernels whose source
    (or Triton) changed compile again.
    """
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"targets: unknown {unknown}; known: {', '.join(TARGETS)}")
    t0 = time.perf_counter()
    launches, configs = record(ops, quick=quick, progress=progress)
    t1 = time.perf_counter()
    known = read_cache(cache) if cache and os.path.exists(cache) else {}
    report, entries = compile_report(launches, configs, targets, jobs=jobs, cache=known,
                                     progress=progress)  # fmt: skip
    report["seconds"]["record"] = round(t1 - t0, 1)
    if cache:
        # A run of every op and target keeps only what it used (stale keys go); a partial run
        # adds to the file.
        whole = ops is None and set(targets) == set(TARGETS)
        write_cache(cache, entries if whole else {**known, **entries})
    return report


def compile_report(
    launches: Sequence[Launch],
    configs: list[dict],
    targets: Sequence[str] = tuple(TARGETS),
    jobs: int = 1,
    cache: dict[str, dict] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, dict[str, dict]]:
    """The report of :func:`run` for recorded ``launches`` and their ``configs``, and the
    compile results by key that it used (``cache``'s and new ones)."""
    from rlk_triton._triton import triton

    t0 = time.perf_counter()
    if progress is not None:
        progress(f"compiling {len(launches)} launches for {', '.join(targets)} ({jobs} jobs)")
    # Each launch on the targets of its platform that a table holding its config claims.
    per = []
    for ln in launches:
        claimed = {t for name in configs[ln.config]["tables"] for t in CLAIMED.get(name, TARGETS)}
        vendor = PLATFORMS[ln.platform]
        per.append([t for t in targets if TARGETS[t][0] == vendor and t in claimed])
    results, new, stats = compile_launches(launches, per, jobs=jobs, cache=cache)
    rows, seen, used = [], set(), dict(new)
    for i, ln in enumerate(launches):
        for t in targets:
            if (i, t) not in results or (ln.kernel, ln.call, ln.config, t) in seen:
                continue
            seen.add((ln.kernel, ln.call, ln.config, t))
            key, res = results[(i, t)]
            if key:
                used[key] = res
            rows.append({"kernel": ln.kernel, "call": ln.call, "config": ln.config,
                         "target": t, **res})  # fmt: skip
    report = {
        "triton": triton.__version__,
        "targets": list(targets),
        "configs": configs,
        "rows": rows,
        "seconds": {"record": 0.0, "compile": round(time.perf_counter() - t0, 1)},
        "compiled": stats["compiled"],
        "cached": len(used) - stats["compiled"],
        "cpu_seconds": stats["cpu_seconds"],
    }
    return report, used


def violations(report: dict) -> list[str]:
    """The contract's breaches in ``report`` (empty when it holds):

    - a launch that does not compile for a target that a table holding its config claims;
    - a floating-point atomic in a kernel not in :data:`ORDERED_ACCUMULATIONS`;
    - two sets of matrix-instruction kinds for one kernel, target and call across configs.
    """
    out = []
    configs = report["configs"]
    kinds: dict[tuple[str, str, str], dict[tuple, list[int]]] = {}
    for r in report["rows"]:
        claimed = {t for name in configs[r["config"]]["tables"]
                   for t in CLAIMED.get(name, TARGETS)}  # fmt: skip
        where = f"{r['kernel']} [{r['call']}, config {r['config']}] on {r['target']}"
        if not r["ok"]:
            if r["target"] in claimed:
                out.append(f"does not compile: {where}: {r['error']}")
            continue
        if r["float_atomics"] and r["kernel"] not in ORDERED_ACCUMULATIONS:
            out.append(f"floating-point atomics {r['float_atomics']}: {where}")
        group = kinds.setdefault((r["kernel"], r["target"], r["call"]), {})
        group.setdefault(tuple(r["matrix"]), []).append(r["config"])
    for (kernel, target, call), sets in kinds.items():
        if len(sets) > 1:
            shown = "; ".join(f"{list(k) or 'none'} in configs {v}" for k, v in sets.items())
            out.append(f"matrix instructions differ across configs: {kernel} [{call}] on "
                       f"{target}: {shown}")  # fmt: skip
    return out


def summary(report: dict) -> str:
    """Per kernel and target: configs compiled (of those recorded), float atomics, matrix
    instruction kinds; then the contract's verdict."""
    per: dict[tuple[str, str], dict] = {}
    for r in report["rows"]:
        s = per.setdefault((r["kernel"], r["target"]), {"n": 0, "ok": 0, "atomics": set(),
                                                         "matrix": set(), "configs": set()})  # fmt: skip
        s["n"] += 1
        s["ok"] += r["ok"]
        s["configs"].add(r["config"])
        if r["ok"]:
            s["atomics"].update(r["float_atomics"])
            s["matrix"].update(r["matrix"])
    lines = [f"rlk aot: Triton {report['triton']}, targets {', '.join(report['targets'])}; "
             f"{len(report['rows'])} compilations of {len(report['configs'])} config sets"]  # fmt: skip
    lines.append(f"{'kernel':58} {'target':7} {'compiled':>10} {'configs':>7}  matrix; atomics")
    for (kernel, target), s in sorted(per.items()):
        atom = ", ".join(sorted(s["atomics"])) or "none"
        mat = ", ".join(sorted(s["matrix"])) or "none"
        lines.append(f"{kernel:58} {target:7} {s['ok']:>4}/{s['n']:<5} {len(s['configs']):>7}"
                     f"  {mat}; atomics: {atom}")  # fmt: skip
    bad = violations(report)
    lines += [f"VIOLATION {v}" for v in bad[:50]]
    if len(bad) > 50:
        lines.append(f"... {len(bad) - 50} more")
    secs = report["seconds"]
    lines.append(f"{'contract holds' if not bad else f'{len(bad)} violations'} "
                 f"(record {secs['record']}s, compile {secs['compile']}s: "
                 f"{report['compiled']} compiled in {report['cpu_seconds']} CPU-s, "
                 f"{report['cached']} from the cache)")  # fmt: skip
    return "\n".join(lines)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=None, help="comma-separated ops (default: the kit's)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    p.add_argument(
        "--quick", action="store_true",
        help="the kit's invariance cases only, not its accuracy cases (their other dtypes)",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="compile subprocesses (default 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--cache", default=None, metavar="FILE",
        help="results of earlier runs by kernel source, specialisation, options, target and "
        "Triton version: used, then rewritten with this run's",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _run_command(args: argparse.Namespace) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        report = run(ops, targets, quick=args.quick, jobs=args.jobs, cache=args.cache,
                     progress=progress)  # fmt: skip
    except (ValueError, KeyError) as e:
        print(f"rlk: error: {e}", file=sys.stderr)
        return 2
    print(summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "violations": violations(report)}, f, indent=1)
    return 1 if violations(report) else 0


#: ``rlk aot`` (entry-point group ``rlk.commands``).
COMMAND = Command(
    help="compile every rlk Triton kernel for gfx90a/gfx942/gfx950 and sm_80/90/100 on this "
    "machine and check the contract in the generated code",
    add_arguments=_add_arguments,
    run=_run_command,
)
