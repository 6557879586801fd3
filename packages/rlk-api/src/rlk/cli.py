"""The ``rlk`` command: ``rlk info``, ``rlk conformance`` and ``rlk consistency``."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from typing import Any

from rlk import _plugins


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in (
        "torch",
        "triton",
        "pluggy",
        "rlk",
        "rlk-reference",
        "rlk-triton",
        "rlk-cuda",
        "rlk-rocm",
        "rlk-ascend",
    ):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def _device() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return {
            "type": "cuda",
            "vendor": kind,
            "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
        }
    return {"type": "cpu", "name": platform.processor() or platform.machine()}


def info_dict() -> dict[str, Any]:
    """What ``rlk info`` shows. ``selected`` is None when the requested backend (auto or a name)
    cannot serve this machine's device; ``error`` then says why, and the table is still there."""
    reg = _plugins.registry()
    device = _device()
    selected, error = None, None
    try:
        selected = _plugins.current_backend(device["type"])
    except _plugins.BackendError as e:
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
        except _plugins.BackendError as e:
            entry["broken"], entry["reason"] = True, str(e)
        if entry["available"]:
            try:
                impl = reg.load(name, complete=False)
                entry["missing_ops"] = impl.missing()
                entry["delegated"] = dict(impl.delegated)
                entry["claims"] = sorted(impl.claims)
            except _plugins.BackendError as e:  # available, yet its loader failed
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
        "requested": _plugins._requested(),
        "device": device,
        "versions": _versions(),
        "backends": backends,
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
        if b.get("missing_ops"):
            print(f"      not implemented (cannot be selected): {', '.join(b['missing_ops'])}")
        for op, how in (b.get("delegated") or {}).items():
            print(f"      delegates {op}: {how}")


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
    from rlk import testing

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


def _cmd_consistency(args: argparse.Namespace) -> int:

    from rlk import consistency

    lo, _, hi = args.prompt_len.partition(":")
    try:
        prompt_len = (int(lo), int(hi or lo))
    except ValueError:
        print(f"rlk: error: --prompt-len must be MIN:MAX, got {args.prompt_len!r}", file=sys.stderr)
        return 2
    try:
        report = _run_consistency(args, prompt_len)
    except consistency.UsageError as e:
        print(f"rlk: error: {e}", file=sys.stderr)
        return 2
    print(consistency.format_table(report))
    if args.json:
        consistency.write_json(report, args.json)
    ok = consistency.ok(report)
    if not ok:
        print("rlk: the rlk row is not exactly zero", file=sys.stderr)
    return 0 if ok else 1


def _run_consistency(args: argparse.Namespace, prompt_len: tuple[int, int]) -> dict[str, Any]:
    import torch

    from rlk import consistency

    return consistency.run(
        args.model,
        backend=args.backend,
        prompts=args.prompts,
        new_tokens=args.new_tokens,
        prompt_len=prompt_len,
        micro_batch=args.micro_batch,
        seed=args.seed,
        temperature=args.temperature,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        rollout_modes=consistency.ROLLOUT_MODES
        if args.rollout_mode == "both"
        else (args.rollout_mode,),
        page_size=args.page_size,
        max_batch=args.max_batch,
        train_engine=args.train_engine,
        leaves=args.leaves,
        train_tp=args.train_tp,
        rollout_tp=args.rollout_tp,
        progress=None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True)),
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from rlk import bench

    if args.render:
        parts = []
        for path in args.render:
            with open(path) as f:
                parts.append(json.load(f))
        report = bench.merge(parts)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rlk", description="Deterministic, batch-invariant ops for RL."
    )
    from rlk import __version__

    p.add_argument("--version", action="version", version=f"rlk {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="installed backends, availability, selection, versions")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pi.set_defaults(fn=_cmd_info)
    pc = sub.add_parser("conformance", help="check a backend against the numerics contract")
    pc.add_argument("--backend", default=None, help="backend name (default: the selected one)")
    pc.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    pc.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    pc.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    pc.add_argument("--full", action="store_true", help="real shapes (GPU) instead of quick ones")
    pc.add_argument("--quiet", action="store_true", help="no progress lines")
    pc.set_defaults(fn=_cmd_conformance)
    pk = sub.add_parser(
        "consistency", help="rollout vs training log-prob mismatch, stock transformers vs rlk"
    )
    pk.add_argument(
        "--model",
        default="tiny",
        help="built-in config (tiny, tiny-llama, tiny-qwen3, tiny-mha, tiny-mha8, qwen2-0.5b, "
        "qwen3-0.6b, llama3-8b-4layers; random weights) or a local checkpoint directory "
        "(default: tiny)",
    )
    pk.add_argument("--backend", default=None, help="rlk backend (default: the selected one)")
    pk.add_argument("--prompts", type=int, default=8, help="number of prompts (default: 8)")
    pk.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per prompt (16)")
    pk.add_argument("--prompt-len", default="4:12", help="prompt lengths MIN:MAX (default 4:12)")
    pk.add_argument("--micro-batch", type=int, default=3, help="sequences per training micro-batch")
    pk.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed")
    pk.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    pk.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    pk.add_argument(
        "--rollout-mode",
        default="both",
        choices=("padded", "paged", "both"),
        help="rlk rollout: left-padded batch, paged KV cache with continuous batching, or a row "
        "for each (default: both; the stock side is always padded)",
    )
    pk.add_argument("--page-size", type=int, default=16, help="paged mode: tokens per KV page")
    pk.add_argument(
        "--max-batch", type=int, default=None, help="paged mode: running requests (default: all)"
    )
    pk.add_argument(
        "--train-engine",
        default="transformers",
        choices=("transformers", "megatron"),
        help="training recompute of the rlk rows: the transformers integration or Megatron-core's "
        "GPTModel with rlk's layer spec (default: transformers; the stock row is always stock "
        "transformers)",
    )
    pk.add_argument(
        "--leaves",
        type=int,
        default=None,
        help="rlk side: o_proj/down_proj (and Megatron's parallel linears) on the tree-ordered "
        "linear with this many K-leaves, a power of two (default: plain rlk.linear)",
    )
    pk.add_argument(
        "--train-tp",
        type=int,
        default=1,
        help="rlk side: tensor-parallel size of the training recompute (either engine); > 1 "
        "spawns that many processes (gloo on CPU, NCCL on GPUs) and needs --leaves (default: 1)",
    )
    pk.add_argument(
        "--rollout-tp",
        type=int,
        default=1,
        help="rlk side: tensor-parallel size of the rollout; > 1 spawns that many processes "
        "(gloo on CPU, NCCL on GPUs) and needs --leaves (default: 1)",
    )
    pk.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    pk.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    pk.add_argument("--quiet", action="store_true", help="no progress lines")
    pk.set_defaults(fn=_cmd_consistency)
    pb = sub.add_parser("bench", help="time every op family against the strongest peer on this GPU")
    pb.add_argument(
        "--only", default=None, help="comma-separated families (default: all): gemm, attention, "
        "norm, logprobs, sampling, e2e",
    )  # fmt: skip
    pb.add_argument("--quick", action="store_true", help="one or two shapes per family")
    pb.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    pb.add_argument(
        "--markdown", default=None, metavar="FILE", help="also write the tables as Markdown"
    )
    pb.add_argument(
        "--render", default=None, nargs="+", metavar="JSON",
        help="measure nothing: turn earlier --json reports (several: parts of one run, e.g. one "
        "per GPU, merged) into Markdown (stdout or --markdown) and, with --json, one report",
    )  # fmt: skip
    pb.set_defaults(fn=_cmd_bench)
    args = p.parse_args(argv)
    if args.cmd == "bench":
        args.argv = list(argv if argv is not None else sys.argv[1:])[1:]
    try:
        return args.fn(args)
    except _plugins.BackendError as e:
        print(f"rlk: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
