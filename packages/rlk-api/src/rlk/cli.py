"""The ``rlk`` command: ``rlk info``, ``rlk conformance`` and ``rlk bench``, and the commands of
other distributions (``rlk_commands.Command``: ``rlk consistency`` comes with rlk-integrations).

The arguments are parsed by :mod:`rlk_commands`, without torch; :func:`run` runs the command.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

import torch

from rlk import bench, selection
from rlk._versions import versions
from rlk.ops import CATALOG, OPTIONAL_OPS
from rlk.plugins import BackendError
from rlk_commands import parse


def _device() -> dict[str, Any]:
    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return {
            "type": "cuda",
            "vendor": kind,
            "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
        }
    return {"type": "cpu", "name": platform.processor() or platform.machine()}


#: Entry-point group of the checks other distributions add to ``rlk info``: each entry point is a
#: function returning ``{"name", "tested", "installed", "ok", "note"}`` about an outside framework
#: it integrates (rlk-integrations' verl engine, e.g.), imported only when ``rlk info`` runs.
INFO_GROUP = "rlk.info"


def _integrations() -> list[dict[str, Any]]:
    """The checks of :data:`INFO_GROUP`, by name; one whose import or call fails is listed with
    ``ok: False`` and the error, not raised (``rlk info`` reports, it does not stop)."""
    import importlib.metadata as md

    out = []
    for ep in sorted(md.entry_points(group=INFO_GROUP), key=lambda e: e.name):
        try:
            entry = dict(ep.load()())
        except Exception as e:  # noqa: BLE001 - any failure is shown with its name
            entry = {"ok": False, "note": f"broken: {type(e).__name__}: {e}"}
        entry.setdefault("name", ep.name)
        out.append(entry)
    return out


def info_dict() -> dict[str, Any]:
    """What ``rlk info`` shows. ``selected`` is None when the requested backend (auto or a name)
    cannot serve this machine's device; ``error`` then says why, and the table is still there."""
    reg = selection.registry()
    device = _device()
    selected, error = None, None
    try:
        selected = selection.current_backend(device["type"])
    except BackendError as e:
        error = str(e)
    backends = []
    for name, spec in reg.specs.items():
        entry: dict[str, Any] = {
            "name": name,
            "available": False,
            "broken": False,
            "priority": spec.priority,
            "device_types": list(spec.device_types),
            "distribution": spec.distribution,
            "description": spec.description,
        }
        try:
            entry["available"], entry["reason"] = reg.status(name)
        except BackendError as e:
            entry["broken"], entry["reason"] = True, str(e)
        if entry["available"]:
            try:
                impl = reg.load(name, complete=False)
                entry["missing_ops"] = impl.missing()
                # Every op of the catalog it serves, and the optional ones it leaves out.
                entry["ops"] = [s.name for s in CATALOG if s.name in impl.ops]
                entry["missing_optional_ops"] = [op for op in OPTIONAL_OPS if op not in impl.ops]
                entry["delegated"] = dict(impl.delegated)
                entry["claims"] = sorted(impl.claims)
            except BackendError as e:  # available, yet its loader failed
                entry["available"], entry["broken"], entry["reason"] = False, True, str(e)
        backends.append(entry)
    for b in reg.broken:  # plugins that declared nothing usable, and ambiguous names
        backends.append(
            {
                "name": b.name,
                "available": False,
                "broken": True,
                "reason": b.reason,
                "priority": b.priority,
                "device_types": list(b.device_types),
                "distribution": b.distribution,
                "description": "",
            }
        )
    return {
        "selected": selected,
        "error": error,
        "requested": selection.requested(),
        "device": device,
        "versions": versions(),
        "backends": backends,
        "integrations": _integrations(),
    }


def _print_info(d: dict[str, Any]) -> None:
    dev = d["device"]
    print(f"device:   {dev['type']} ({dev['name']})")
    print(f"selected: {d['selected'] or 'none'} (RLK_BACKEND={d['requested']})")
    if d["error"]:
        print(f"          {d['error']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in d["versions"].items()))
    print("backends:")
    for b in d["backends"]:
        mark = "*" if b["name"] == d["selected"] else " "
        if b["broken"]:
            state = f"broken: {b['reason']}"
        else:
            state = "available" if b["available"] else f"unavailable: {b['reason']}"
        devices = ",".join(b["device_types"])
        prio = "?" if b["priority"] is None else b["priority"]
        print(
            f" {mark} {b['name']:<10} prio {prio:>3}  devices {devices:<10} "
            f"[{b['distribution']}] {state}"
        )
        if "ops" in b:
            required = sum(op not in OPTIONAL_OPS for op in b["ops"])
            optional = [op for op in b["ops"] if op in OPTIONAL_OPS]
            print(
                f"      ops: {required} of the {len(CATALOG) - len(OPTIONAL_OPS)} required; "
                f"optional: {', '.join(optional) or 'none'}"
            )
        if b.get("missing_ops"):
            print(f"      not implemented (cannot be selected): {', '.join(b['missing_ops'])}")
        if b.get("missing_optional_ops"):
            print(f"      optional ops it lacks: {', '.join(b['missing_optional_ops'])}")
        for op, how in (b.get("delegated") or {}).items():
            print(f"      delegates {op}: {how}")
    if d.get("integrations"):
        print("integrations:")
    for i in d.get("integrations", []):
        state = "ok" if i.get("ok") else "not usable"
        tested = (
            f"tested {i['tested']}, installed {i.get('installed') or 'none'}: "
            if "tested" in i
            else ""
        )
        print(f"   {i['name']:<10} {tested}{state}" + (f" ({i['note']})" if i.get("note") else ""))


def _cmd_info(args: argparse.Namespace) -> int:
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_info(d)
    if d["error"]:  # the table is printed either way; the exit status says rlk cannot run here
        print(f"rlk: error: {d['error']}", file=sys.stderr)
        return 2
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from rlk import testing  # (0.3 s to import: loaded for this command only, not for rlk info)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    try:
        report = testing.run_conformance(
            backend=args.backend,
            ops=ops,
            device=args.device,
            quick=not args.full,
            progress=None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True)),
        )
    except ValueError as e:  # an unknown op name
        print(f"rlk: error: {e}", file=sys.stderr)
        return 2
    print(testing.format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.render:
        parts = []
        for path in args.render:
            with open(path) as f:
                parts.append(json.load(f))
        report = bench.merge(parts, mixed_commits=args.mixed_commits)
        # Without a file: the record of the kind the parts ran on.
        kind_json, kind_md = bench.kind_paths(bench.gpu_kind(report["meta"]["gpu"]))
        args.json = str(kind_json) if args.json == "" else args.json
        args.markdown = str(kind_md) if args.markdown == "" else args.markdown
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
        text = bench.render_markdown(report)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        else:
            print(text, end="")
        return 0
    return bench.main(args.only, args.quick, args.json, args.markdown, args.argv)


#: The command each of rlk's own subcommands runs (the parser lives in the torch-free module
#: ``rlk_commands``; a command of another distribution brings its own ``run``).
COMMANDS = {
    "info": _cmd_info,
    "conformance": _cmd_conformance,
    "bench": _cmd_bench,
}


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run the parsed command; a BackendError is a one-line error and exit status 2."""
    if args.cmd == "bench":
        args.argv = list(argv if argv is not None else sys.argv[1:])[1:]
    command = COMMANDS.get(args.cmd) or args.command.run
    try:
        return command(args)
    except BackendError as e:
        print(f"rlk: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Run ``rlk`` with ``argv`` (default: ``sys.argv[1:]``), as the command ``rlk_cli.main``
    does; returns the exit status."""
    args = parse(argv)
    return args if isinstance(args, int) else run(args, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
