"""``rlk consistency``, added to the ``rlk`` command through the entry-point group
``rlk.commands`` (see ``rlk_cli.Command``).

A module beside the package, as ``rlk_cli`` is beside ``rlk``: importing it imports neither torch
nor transformers nor rlk, so ``rlk --help`` reads the arguments declared here at once; of
``rlk_integrations`` it imports the engine registry only
(:data:`rlk_integrations.engine.registry.ROLLOUT_ENGINES`, torch-free: the choices of
``--rollout-mode``); :func:`_run` imports :mod:`rlk_integrations.tools.consistency` when the
command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rlk_cli import Command
from rlk_integrations.engine.registry import ROLLOUT_ENGINES

#: ``--rollout-mode`` values naming several engines: ``all`` runs every engine that can run
#: here (the report names the others and why); ``both`` is padded and paged.
ROLLOUT_GROUPS: dict[str, tuple[str, ...] | None] = {"all": None, "both": ("padded", "paged")}

#: The built-in models ``--help`` names: those of :mod:`rlk_integrations.tools.zoo`, written out
#: because importing the zoo imports torch (a test holds the two lists equal).
BUILTIN_MODELS = (
    "tiny", "tiny-llama", "tiny-qwen3", "tiny-mha", "tiny-mha8", "tiny-qwen3-moe",
    "tiny-qwen2-moe", "tiny-deepseek-v3", "qwen2-0.5b", "qwen3-0.6b", "llama3-8b-4layers",
    "qwen3-4b-4layers", "qwen3-30b-a3b-4layers", "deepseek-v3-4layers", "llama3.2-1b-4layers",
    "qwen2.5-1.5b-4layers",
)  # fmt: skip


def _add_arguments(pk: argparse.ArgumentParser) -> None:
    pk.add_argument(
        "--model",
        default="tiny",
        help=f"built-in config ({', '.join(BUILTIN_MODELS)}; random weights) or a local "
        "checkpoint directory (default: tiny)",
    )
    pk.add_argument("--backend", default=None, help="rlk backend (default: the selected one)")
    pk.add_argument("--prompts", type=int, default=8, help="number of prompts (default: 8)")
    pk.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per prompt (16)")
    pk.add_argument("--prompt-len", default="4:12", help="prompt lengths MIN:MAX (default 4:12)")
    pk.add_argument("--micro-batch", type=int, default=3, help="sequences per training micro-batch")
    pk.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed")
    pk.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    pk.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    engines = "; ".join(f"{name}: {what}" for name, (_, what) in ROLLOUT_ENGINES.items())
    pk.add_argument(
        "--rollout-mode",
        "--rollout-engine",
        default="all",
        choices=(*ROLLOUT_ENGINES, *ROLLOUT_GROUPS),
        help=f"rlk rollout engine ({engines}), both (padded and paged) or all (a row for each "
        "engine that can run here; the report says why the others cannot) (default: all; the "
        "stock side is padded, plus stock vLLM with vllm)",
    )
    pk.add_argument("--page-size", type=int, default=16, help="paged mode: tokens per KV page")
    pk.add_argument(
        "--max-batch", type=int, default=None, help="paged mode: running requests (default: all)"
    )
    pk.add_argument(
        "--train-engine",
        default="transformers",
        choices=("transformers", "megatron", "transformers-graphs"),
        help="training recompute of the rlk rows: the transformers integration, Megatron-core's "
        "GPTModel with rlk's layer spec, or the transformers integration through "
        "training.GraphedLogprobs (CUDA graphs on a GPU) (default: transformers; the stock row "
        "is always stock transformers)",
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
    pk.add_argument(
        "--ep",
        type=int,
        default=None,
        help="rlk side, a mixture-of-experts model: expert-parallel size of the padded rollout "
        "and the training recompute (transformers or megatron); spawns that many processes "
        "(gloo on CPU, NCCL on GPUs; 1 runs the expert-parallel code path on one), each holding "
        "1/N of the experts and running its share of the prompts, which N must divide, as it "
        "must the experts (default: no expert parallelism)",
    )
    pk.add_argument(
        "--steps",
        type=int,
        default=None,
        help="with --rollout-engine vllm: run N GRPO steps (vLLM samples 4 completions per "
        "prompt, the trainer of --train-engine recomputes and updates, the weights go back "
        "into vLLM) and print a row per side and step (default: one rollout, no update)",
    )
    pk.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    pk.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    pk.add_argument("--quiet", action="store_true", help="no progress lines")


def _run(args: argparse.Namespace) -> int:
    from rlk_integrations.tools import consistency

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
        print("rlk: an rlk row is not exactly zero", file=sys.stderr)
    return 0 if ok else 1


def _run_consistency(args: argparse.Namespace, prompt_len: tuple[int, int]) -> dict[str, Any]:
    import torch

    from rlk_integrations.tools import consistency

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
        rollout_modes=ROLLOUT_GROUPS.get(args.rollout_mode, (args.rollout_mode,)),
        page_size=args.page_size,
        max_batch=args.max_batch,
        train_engine=args.train_engine,
        leaves=args.leaves,
        train_tp=args.train_tp,
        rollout_tp=args.rollout_tp,
        ep=args.ep,
        steps=args.steps,
        progress=None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True)),
    )


CONSISTENCY = Command(
    help="rollout vs training log-prob mismatch, stock transformers vs rlk",
    add_arguments=_add_arguments,
    run=_run,
)
