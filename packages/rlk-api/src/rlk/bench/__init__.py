"""``rlk bench``: every op family against the strongest implementation the machine has.

Each family module (``gemm``, ``attention``, ``norm``, ``logprobs``, ``sampling``, ``moe`` here; in
rlk-integrations, found through the entry-point group ``rlk.bench``, ``e2e``, the rollout and
training engines, ``e2e-long``, their rollouts at long prompts and outputs, and
``e2e-heldout``, the training rows on held-out model shapes, and ``e2e-train-long``, the
training rows at 16384-token context) has
``run(quick, emit)``, which times rlk's public op and its peers on the same random inputs, in
this process, and passes each result row to ``emit`` as soon as it is measured.
A row is ``{op, shape, dtype, impl, ms, timing, [GB/s], [TFLOP/s], [extra_GiB],
[hbm_roofline]}`` (``extra_GiB``: the peak memory one call allocates, its outputs included,
where a family measures it; ``hbm_roofline``: the share of the HBM roofline, where a family
gives it, e.g. the paged rollout's);
``impl`` is ``rlk`` or
the peer's name (``cublas``, ``sdpa``, ``sdpa-flash``, ``liger``, ``compile``, ``torch``,
``hf-generate``, ``hf-generate-static``, ``stock``, ``stock+liger``).

The report (``--json``) holds ``meta`` (commit, GPU, versions, the copy-bandwidth and cuBLAS
ceilings measured in the same run), ``rows``, ``failed`` (families that raised) and
``left_out`` (peers that raised, so have no row: ``{family, op, shape, dtype, impl,
left_out}``, the last the error's type and first line);
:func:`render_markdown` turns it into the table document.

Each GPU kind has its own record, ``docs/benchmarks/<kind>.json`` and ``.md``
(:func:`gpu_kind`: ``h100.json`` on an H100, ``h200.json`` on an H200): ``--json`` and
``--markdown`` without a file write the kind's files of the GPU measured, merging the run into
the record already there (the families measured again replace theirs). Ratios are measured
in one process on one GPU; :func:`merge` refuses parts of different kinds, so a figure is only
ever set beside figures of its own kind.

Example::

    rlk bench --quick --only gemm,norm
    rlk bench --only attention,gemm --json --markdown   # docs/benchmarks/<kind>.json and .md
    rlk bench --render docs/benchmarks/h200.json     # the Markdown of an earlier run
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlk._versions import versions
from rlk.bench.timing import ceilings

#: Every family, in the order ``rlk bench`` runs them.
FAMILIES = (
    "gemm", "attention", "norm", "logprobs", "sampling", "moe", "e2e", "e2e-long", "e2e-heldout",
    "e2e-train-long",
)  # fmt: skip

#: The families of other distributions (entry-point group ``rlk.bench``, each naming the family's
#: module) and the install that brings them: without it, asking for one is an error.
PLUGIN_FAMILIES = {
    "e2e": 'rlk-integrations (pip install "rlk[transformers]")',
    "e2e-long": 'rlk-integrations (pip install "rlk[transformers]")',
    "e2e-heldout": 'rlk-integrations (pip install "rlk[transformers]")',
    "e2e-train-long": 'rlk-integrations (pip install "rlk[transformers]")',
}
BENCH_GROUP = "rlk.bench"

#: Where each GPU kind's record lives (``<kind>.json`` and ``<kind>.md``), from the directory
#: ``rlk bench`` runs in (the repository's root).
RESULTS_DIR = Path("docs/benchmarks")

#: impl names that are rlk itself; every other impl of a row's (op, shape, dtype) is a peer.
#: ``rlk graphed``: the e2e training pass replayed as CUDA graphs.
RLK_IMPLS = ("rlk", "rlk graphed")


def gpu_kind(name: str) -> str:
    """The kind of the GPU named ``name`` (``torch.cuda.get_device_name``), which names its
    result files: the first word that is a model number, lowercased (``"NVIDIA H100 80GB
    HBM3"`` -> ``"h100"``, ``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA A100-SXM4-80GB"`` ->
    ``"a100"``, ``"AMD Instinct MI300X"`` -> ``"mi300x"``), else the whole name's words
    joined by ``-``."""
    for word in re.split(r"[\s_/-]+", name):
        if re.fullmatch(r"[A-Za-z]{1,3}\d{2,4}[A-Za-z]?", word):
            return word.lower()
    return "-".join(re.findall(r"[a-z0-9]+", name.lower())) or "unknown"


def kind_paths(kind: str) -> tuple[Path, Path]:
    """``(json, markdown)`` paths of kind ``kind``'s record under :data:`RESULTS_DIR`."""
    return RESULTS_DIR / f"{kind}.json", RESULTS_DIR / f"{kind}.md"


def _commit() -> str:
    """The commit measured: ``RLK_COMMIT`` when set (a script running on a copy of the tree,
    whose .git may be missing or stale, passes the commit it copied), else git's HEAD, marked
    ``+uncommitted`` when tracked files differ from it."""
    if os.environ.get("RLK_COMMIT"):
        return os.environ["RLK_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout; set RLK_COMMIT)"
    return sha + ("+uncommitted" if dirty else "")


def meta(argv: list[str]) -> dict[str, Any]:
    m = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(0),
        "versions": versions("transformers", "liger-kernel"),
        "command": "rlk bench " + " ".join(argv),
    }
    m.update(ceilings())
    return m


def family_module(name: str) -> Any:
    """The module of family ``name``: ``rlk.bench.<name>``, or what the entry point ``name`` of
    the group ``rlk.bench`` names (a module, or an object, with ``run(quick, emit)``). Raises
    ``ValueError`` naming what to install when no installed distribution has it."""
    if name not in PLUGIN_FAMILIES:
        return importlib.import_module(f"rlk.bench.{name}")
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group=BENCH_GROUP) if ep.name == name]
    if len(eps) != 1:
        raise ValueError(
            f"the {name} family comes with {PLUGIN_FAMILIES[name]}"
            if not eps
            else f"more than one installed distribution declares the {name} family"
        )
    return eps[0].load()


def available() -> list[str]:
    """The families whose module is installed (:data:`FAMILIES` order)."""
    from importlib.metadata import entry_points

    found = {ep.name for ep in entry_points(group=BENCH_GROUP)}
    return [f for f in FAMILIES if f not in PLUGIN_FAMILIES or f in found]


def run(
    families: list[str],
    quick: bool,
    progress: Callable[[str], None] | None = None,
    on_row: Callable[[list[dict], list[str]], None] | None = None,
    left_out: list[dict] | None = None,
) -> tuple[list[dict], list[str]]:
    """Run ``families``; returns ``(rows, failed families)``. A family that raises is reported
    (traceback to stderr) and the others still run. ``on_row(rows, failed)`` is called after
    every row and every failure. A family emits a peer that raised as a record with a
    ``left_out`` key (its error) instead of ``ms``: it goes to ``left_out`` when given, never
    to the rows."""
    rows: list[dict] = []
    failed: list[str] = []

    def emit(r: dict) -> None:
        r = {"family": fam, **r}
        if "left_out" in r:
            if left_out is not None:
                left_out.append(r)
            if on_row is not None:
                on_row(rows, failed)
            if progress is not None:
                progress(f"  {r['op']} {r['shape']} {r['impl']} left out: {r['left_out']}")
            return
        rows.append(r)
        if on_row is not None:
            on_row(rows, failed)
        if progress is not None:
            extra = "".join(
                f"  {k} {r[k]:g}"
                for k in ("GB/s", "TFLOP/s", "extra_GiB", "hbm_roofline")
                if k in r
            )
            progress(
                f"  {r['op']:<24} {r['shape']:<34} {r['dtype']:<5} {r['impl']:<12} "
                f"{r['ms']:9.4f} ms{extra}  ({r['timing']})"
            )

    for fam in families:
        if progress is not None:
            progress(f"[{fam}]")
        try:
            family_module(fam).run(quick=quick, emit=emit)
        except Exception:
            traceback.print_exc()
            failed.append(fam)
            if on_row is not None:
                on_row(rows, failed)
    return rows, failed


def ratios(rows: list[dict]) -> list[dict]:
    """Per (op, shape, dtype) and rlk impl (``rlk_impl``) with a row: rlk's ms, the best peer,
    and ``peer_ms / rlk_ms`` (above 1: rlk is faster)."""
    groups: dict[tuple, dict[str, float]] = {}
    order: list[tuple] = []
    for r in rows:
        key = (r.get("family", ""), r["op"], r["shape"], r["dtype"])
        if key not in groups:
            groups[key] = {}
            order.append(key)
        groups[key][r["impl"]] = r["ms"]
    out = []
    for key in order:
        impls = groups[key]
        peers = {i: ms for i, ms in impls.items() if i not in RLK_IMPLS}
        if not peers:
            continue
        best = min(peers, key=peers.get)
        for impl in (i for i in RLK_IMPLS if i in impls):
            out.append(
                {
                    "family": key[0],
                    "op": key[1],
                    "shape": key[2],
                    "dtype": key[3],
                    "rlk_impl": impl,
                    "rlk_ms": impls[impl],
                    "peer": best,
                    "peer_ms": peers[best],
                    "peer_over_rlk": peers[best] / impls[impl],
                }
            )
    return out


def _table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(header, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in body]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def format_family(rows: list[dict], family: str) -> str:
    """The rows of one family, then its ``peer_ms / rlk_ms`` table."""
    fam_rows = [r for r in rows if r.get("family") == family]
    cols = ["op", "shape", "dtype", "impl", "ms", "GB/s", "TFLOP/s", "timing"]
    cols += [c for c in ("extra_GiB", "hbm_roofline") if any(c in r for r in fam_rows)]
    body = [[_fmt(r.get(c, "")) for c in cols] for r in fam_rows]
    text = _table(cols, body)
    rat = ratios(fam_rows)
    if rat:
        cols2 = ["op", "shape", "dtype", "rlk", "rlk ms", "best peer", "peer ms"]
        cols2.append("peer_ms / rlk_ms")
        body2 = [
            [x["op"], x["shape"], x["dtype"], x["rlk_impl"], _fmt(x["rlk_ms"]), x["peer"]]
            + [_fmt(x["peer_ms"]), f"{x['peer_over_rlk']:.2f}"]
            for x in rat
        ]
        text += "\n\n" + _table(cols2, body2)
    return text


_KEEP = ("command", "gpu", "copy_GBps", "cublas_bf16_TFLOPs", "commit", "date")


def _families(command: str) -> set[str]:
    """The families named by a ``rlk bench --only a,b`` command (empty: all of them)."""
    words = command.split()
    return set(words[words.index("--only") + 1].split(",")) if "--only" in words[:-1] else set()


def _leaves(report: dict) -> list[tuple[dict, list[dict]]]:
    """``report`` as (part meta, its rows) pairs. A merged report (``meta["parts"]``) gives one
    pair per part, each row going to the part whose ``--only`` named its family."""
    m = report["meta"]
    if "parts" not in m:
        return [({k: m[k] for k in _KEEP}, list(report["rows"]))]
    leaves = [(dict(p), []) for p in m["parts"]]
    for r in report["rows"]:
        mine = [lv for lv in leaves if r["family"] in _families(lv[0]["command"])] or leaves
        owner = next((lv for lv in mine if lv[0]["commit"] == r.get("commit")), mine[0])
        owner[1].append(r)
    return leaves


def merge(parts: list[dict], *, mixed_commits: bool = False) -> dict:
    """One report from the reports of parts of one run (families split over processes or GPUs
    of one machine): the rows and failures of all; ``meta`` of the first, with every part's
    command, GPU and ceilings under ``parts``. A single report comes back unchanged.

    Parts must have run on one GPU kind (:func:`gpu_kind`), and measured one commit, unless
    ``mixed_commits``: then each part keeps its own commit under ``parts`` and
    ``meta["commit_note"]`` names the parts measured at a commit other than the first part's.
    A part may itself be a merged report (the committed ``docs/benchmarks/<kind>.json``): its
    parts are kept (a row goes to the part of its ``commit`` and family), and a row measured
    again by a later part (same family, op, shape, dtype and impl) is replaced by it; a part
    whose rows were all replaced, or that has none and whose families a later part measured,
    leaves the list. A peer left out (``left_out``) is listed once, as its latest part
    recorded it, and not at all where a part has its row."""
    if len(parts) == 1:
        return parts[0]
    leaves = [lv for p in parts for lv in _leaves(p)]
    kinds = {gpu_kind(m["gpu"]) for m, _ in leaves}
    if len(kinds) != 1:
        raise ValueError(
            f"the parts ran on different GPU kinds ({', '.join(sorted(kinds))}): each kind "
            "has its own report, and its figures are compared with its own only"
        )
    commits = {m["commit"] for m, _ in leaves}
    if len(commits) != 1 and not mixed_commits:
        raise ValueError(
            f"the parts measured different commits: {sorted(commits)} (--mixed-commits to "
            "merge them anyway, each part keeping its commit)"
        )
    key = ("family", "op", "shape", "dtype", "impl")
    newest = {tuple(r.get(k) for k in key): i for i, (_, rows) in enumerate(leaves) for r in rows}
    kept = []
    for i, (m, rows) in enumerate(leaves):
        mine = [r for r in rows if newest[tuple(r.get(k) for k in key)] == i]
        fams = _families(m["command"])
        later = any(not fams or r["family"] in fams for _, rs in leaves[i + 1 :] for r in rs)
        if mine or not (rows or later):
            kept.append((m, mine))
    first = kept[0][0]
    meta = dict(parts[0]["meta"], parts=[m for m, _ in kept])
    meta.update(first)
    meta.pop("commit_note", None)
    others = [m for m, _ in kept if m["commit"] != first["commit"]]
    if others:
        meta["commit_note"] = "measured at other commits: " + "; ".join(
            f"`{m['command']}` at `{m['commit']}`" for m in others
        )
    # Each row names the commit it was measured at, so that a later merge keeps it with its part.
    rows = [dict(r, commit=m["commit"]) for m, rs in kept for r in rs]
    failed = [f for p in parts for f in p.get("failed", [])]
    latest = {tuple(r.get(k) for k in key): r for p in parts for r in p.get("left_out", [])}
    left_out = [r for k, r in latest.items() if k not in newest]
    return {"meta": meta, "rows": rows, "failed": failed, "left_out": left_out}


def render_markdown(report: dict) -> str:
    """The benchmark document for one result file (what docs/benchmarks/<gpu>.md holds)."""
    m = report["meta"]
    v = ", ".join(f"{k} {x}" for k, x in m["versions"].items())
    out = [
        f"# Benchmarks: {m['gpu']}",
        "",
        "Generated by `rlk bench --render` from the JSON file beside this one; do not edit.",
        "",
        f"- command: `{m['command']}`"
        if "parts" not in m
        else f"- commands (one process each{'' if m.get('commit_note') else ', same machine'}): "
        + "; ".join(f"`{p['command']}`" for p in m["parts"]),
        f"- commit measured: `{m['commit']}`, {m['date']}"
        + (f" ({m['commit_note']})" if m.get("commit_note") else ""),
        f"- versions: {v}",
        f"- ceilings measured in the same run: copy {m['copy_GBps']:.0f} GB/s (read + write), "
        f"cuBLAS bf16 {m['cublas_bf16_TFLOPs']:.0f} TFLOP/s",
        "- `peer_ms / rlk_ms` above 1: rlk is faster than the fastest peer row of that shape.",
        "- `timing`: `graph xN` is GPU time, the median of do_bench over replays of a CUDA "
        "graph of N calls; `events` the median over single eager calls (each >= 50 us) of an "
        "impl that cannot be captured; `launch-bound` such a call shorter than 50 us, so its "
        "time includes the launch; `wall` (rows `*.eager_call`) the wall time per call of "
        "back-to-back eager calls, host and launch included.",
    ]
    if report.get("failed"):
        out.append(f"- families that failed in this run: {', '.join(report['failed'])}")
    for r in report.get("left_out", []):
        out.append(f"- left out (the peer raised): `{r['impl']}` at {r['op']} {r['shape']}: "
                   f"{r['left_out']}")  # fmt: skip
    worst = {}
    for x in ratios(report["rows"]):
        if x["family"] not in worst or x["peer_over_rlk"] < worst[x["family"]]["peer_over_rlk"]:
            worst[x["family"]] = x
    if worst:
        out += ["", "## Worst ratio per family", ""]
        body = [
            [f, x["op"], x["shape"], x["rlk_impl"], x["peer"], f"{x['peer_over_rlk']:.2f}"]
            for f, x in worst.items()
        ]
        cols = ["family", "op", "shape", "rlk", "best peer", "peer_ms / rlk_ms"]
        out.append(_table(cols, body))
    fams = []
    for r in report["rows"]:
        if r.get("family") not in fams:
            fams.append(r.get("family"))
    for fam in fams:
        out += ["", f"## {fam}", "", format_family(report["rows"], fam)]
    return "\n".join(out) + "\n"


def _write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def main(
    only: str | None, quick: bool, json_path: str | None, md_path: str | None, argv: list[str]
) -> int:
    """The ``rlk bench`` command; returns the exit status."""
    families = [f.strip() for f in (only or ",".join(available())).split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"rlk: error: unknown families {unknown}; choose from {FAMILIES}", file=sys.stderr)
        return 2
    missing = [f for f in families if f not in available()]
    if missing:
        for f in missing:
            print(f"rlk: error: the {f} family comes with {PLUGIN_FAMILIES[f]}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("rlk: error: rlk bench needs a CUDA/ROCm GPU, and this torch sees none",
              file=sys.stderr)  # fmt: skip
        return 2

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if only is None:
        for f in FAMILIES:
            if f not in families:
                say(f"not measured: the {f} family comes with {PLUGIN_FAMILIES[f]}")

    report: dict[str, Any] = {"meta": meta(argv)}
    say(
        f"ceilings: copy {report['meta']['copy_GBps']:.0f} GB/s, "
        f"cuBLAS bf16 {report['meta']['cublas_bf16_TFLOPs']:.0f} TFLOP/s"
    )
    # No file named: the GPU kind's record, which this run is merged into.
    kind_json, kind_md = kind_paths(gpu_kind(report["meta"]["gpu"]))
    json_path = str(kind_json) if json_path == "" else json_path
    md_path = str(kind_md) if md_path == "" else md_path
    mine = json_path == str(kind_json) or md_path == str(kind_md)
    if mine and not RESULTS_DIR.is_dir():
        print(f"rlk: error: no {RESULTS_DIR}/ here for this GPU's record: run in the "
              "repository's root, or name the files", file=sys.stderr)  # fmt: skip
        return 2
    record = None
    if json_path == str(kind_json) and kind_json.exists():
        record = json.loads(kind_json.read_text())
        say(f"merging into {kind_json} (the rows measured again replace theirs)")

    left_out: list[dict] = []

    def full(rows: list[dict], failed: list[str]) -> dict:
        now = {**report, "rows": rows, "failed": failed, "left_out": left_out}
        return now if record is None else merge([record, now], mixed_commits=True)

    def save(rows: list[dict], failed: list[str]) -> None:
        # The report is rewritten after every row: a run cut short by a time limit keeps what
        # it measured.
        if json_path:
            _write_json(full(rows, failed), json_path)

    rows, failed = run(families, quick, say, save, left_out)
    report["rows"], report["failed"], report["left_out"] = rows, failed, left_out
    save(rows, failed)
    for fam in families:
        if any(r.get("family") == fam for r in rows):
            print(f"\n## {fam}\n\n{format_family(rows, fam)}", flush=True)
    if md_path:
        with open(md_path, "w") as f:
            f.write(render_markdown(full(rows, failed)))
    if failed:
        print(f"rlk: families that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
