"""The ``rlk`` command's entry point.

It builds the argument parser without importing torch (or rlk, which imports torch), so
``rlk --help``, ``rlk <command> --help``, ``rlk --version`` and argparse's usage errors answer at
once; the commands themselves run in :mod:`rlk.cli`, imported after the arguments parsed.
"""

from __future__ import annotations

import argparse


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlk")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlk", description="Deterministic, batch-invariant ops for RL."
    )
    p.add_argument("--version", action="version", version=f"rlk {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="installed backends, availability, selection, versions")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pc = sub.add_parser("conformance", help="check a backend against the numerics contract")
    pc.add_argument("--backend", default=None, help="backend name (default: the selected one)")
    pc.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    pc.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    pc.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    pc.add_argument("--full", action="store_true", help="real shapes (GPU) instead of quick ones")
    pc.add_argument("--quiet", action="store_true", help="no progress lines")
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from rlk import cli

    return cli.run(args, argv)
