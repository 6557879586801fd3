"""Megatron-core training step: stock local spec vs the rlk spec, tokens per second.

    python benchmarks/bench_megatron.py [--model qwen2-0.5b|llama3-8b-4layers] [--tp 2]
        [--micro-batches 4] [--seqs 8] [--seq-len 512] [--warmup 2] [--steps 5] [--json FILE]
    python benchmarks/bench_megatron.py --device cpu --model tiny --micro-batches 2 --seqs 2 \\
        --seq-len 8 --warmup 0 --steps 1          # smoke test (Triton's CPU interpreter)

Both models are Megatron-core ``GPTModel`` s with the same weights (a seeded random
transformers model of the config from :mod:`rlk_integrations.tools.zoo`, converted by
:func:`rlk_integrations.adapters.megatron.load_hf_weights`), in bf16 on the device:

- **stock**: Megatron's local layer spec (no TransformerEngine, no Apex), Megatron's
  column/row-parallel linears and all-reduce, its RoPE and ``DotProductAttention``; log-probs as
  ``log_softmax(logits).gather`` (TP = 1) or Megatron's ``vocab_parallel_cross_entropy``
  (TP > 1). The local ``DotProductAttention`` rejects ``PackedSeqParams``, so each packed
  micro-batch is one row with a block-diagonal causal mask (the same tokens and sequence
  boundaries; its RoPE positions run on across the row, which costs the same).
- **rlk**: :func:`rlk_integrations.adapters.megatron.build_gpt_model` (rlk spec) and
  :func:`rlk_integrations.adapters.megatron.packed_logprobs` (``thd`` ``PackedSeqParams`` with
  cu_seqlens, ``rlk.linear_logprobs``); ``--leaves`` tree-ordered linears (8 by default at
  TP > 1, as ``rlk consistency --train-tp``).

A training step is forward + log-probs + backward of ``--micro-batches`` packed micro-batches
of ``--seqs`` random-token sequences (lengths around ``--seq-len``), gradients accumulated; the
time is the median over ``--steps`` steps after ``--warmup`` (``torch.cuda.synchronize`` then
``perf_counter``). ``--tp N`` spawns N ranks (NCCL, rank r on ``cuda:r``; gloo on CPU).
Rank 0 prints tokens/s of both engines and rlk / stock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import rlk  # noqa: F401  (first: picks Triton's CPU interpreter before Megatron imports it)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_micro_batches(args, vocab: int) -> list[list]:
    """``micro_batches`` lists of ``seqs`` samples (one prompt token, the rest response, so
    every token but each sequence's first gets a log-prob); lengths vary around ``seq_len``."""
    from rlk_integrations.engine.engines import Sample

    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.micro_batches):
        batch = []
        for _ in range(args.seqs):
            lo, hi = max(2, args.seq_len // 2), args.seq_len * 3 // 2 + 1
            n = int(torch.randint(lo, hi, (1,), generator=g))
            toks = torch.randint(0, vocab, (n,), generator=g).tolist()
            batch.append(Sample(prompt=toks[:1], response=toks[1:], logprobs=torch.empty(0)))
        out.append(batch)
    return out


def block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Megatron's boolean mask (True = masked) ``[1, 1, T, T]``: causal within each sequence."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    t = seq.numel()
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return ~(causal & (seq[:, None] == seq[None, :]))[None, None]


def stock_logprobs(model, batch: list, world: int) -> torch.Tensor:
    """Stock Megatron: the packed row through ``GPTModel.forward`` (logits), then the
    log-probs of the response tokens."""
    from megatron.core import tensor_parallel

    from rlk_integrations.engine.training import pack_samples

    device = next(model.parameters()).device
    ids, pos, rows, targets = pack_samples(batch, device)
    mask = block_causal_mask([len(s.tokens) for s in batch], device)
    logits = model(ids, pos, mask)[0].index_select(0, rows).float()  # [R, V / world]
    if world == 1:
        return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    return -tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], targets[:, None])[:, 0]


def time_steps(model, step_logprobs, micro_batches, args, device) -> list[float]:
    """Seconds of each timed training step (forward + log-probs + backward of every
    micro-batch, gradients accumulated)."""
    import torch.distributed as dist

    total = sum(len(s.response) for mb in micro_batches for s in mb)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    times = []
    for i in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        for mb in micro_batches:
            (-step_logprobs(model, mb).sum() / total).backward()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def worker(rank: int, args, init_file: str) -> None:
    from rlk_integrations.adapters import megatron
    from rlk_integrations.tools import zoo

    world = args.tp
    device, teardown = megatron.init_distributed(rank, world, init_file, args.device)
    cpu_patch = None
    if device.type == "cpu":
        # mcore API: stock RoPE puts its table on torch.cuda.current_device() (CPU smoke test).
        cpu_patch, torch.cuda.current_device = torch.cuda.current_device, lambda: "cpu"
    try:
        dtype = DTYPES[args.dtype]
        hf = zoo.load_model(args.model, dtype=dtype, seed=args.seed)
        cfg, state = hf.config, hf.state_dict()
        micro_batches = make_micro_batches(args, cfg.vocab_size)
        tokens = sum(len(s.tokens) for mb in micro_batches for s in mb)
        leaves = args.leaves if args.leaves else (8 if world > 1 else None)
        results = {}
        for engine in ("stock", "rlk"):
            model = megatron.build_gpt_model(
                cfg, dtype=dtype, use_rlk=engine == "rlk", leaves=leaves,
                perform_initialization=False,
            )  # fmt: skip
            megatron.load_hf_weights(model, state, cfg, rank=rank, world_size=world)
            model.to(device).train()
            if engine == "rlk":
                step = lambda m, mb: torch.cat(megatron.packed_logprobs(m, mb))  # noqa: E731
            else:
                step = lambda m, mb: stock_logprobs(m, mb, world)  # noqa: E731
            with torch.enable_grad():
                times = time_steps(model, step, micro_batches, args, device)
            med = statistics.median(times)
            results[engine] = {"median_s": med, "tokens_per_s": tokens / med, "times_s": times}
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            report(args, cfg, tokens, leaves, results)
    finally:
        if cpu_patch is not None:
            torch.cuda.current_device = cpu_patch
        teardown()


def report(args, cfg, tokens: int, leaves, results: dict) -> None:
    from megatron.core import __version__ as mcore

    ratio = results["rlk"]["tokens_per_s"] / results["stock"]["tokens_per_s"]
    print(
        f"{args.model} ({cfg.model_type}), {args.dtype}, TP={args.tp}, leaves={leaves}, "
        f"megatron-core {mcore}, torch {torch.__version__}, device {args.device}"
    )
    print(
        f"step: {args.micro_batches} micro-batches x {args.seqs} sequences, {tokens} tokens; "
        f"median of {args.steps} after {args.warmup} warm-up"
    )
    for engine, r in results.items():
        print(f"  {engine:<6} {r['median_s'] * 1e3:10.1f} ms/step {r['tokens_per_s']:12.0f} tok/s")
    print(f"  rlk / stock: {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "tokens": tokens, "ratio": ratio, **results}, f, indent=1
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2-0.5b", help="a config of rlk_integrations.tools.zoo")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism (spawned ranks)")
    p.add_argument("--leaves", type=int, default=0, help="tree leaves (0: 8 at TP > 1, else none)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seqs", type=int, default=8, help="sequences per packed micro-batch")
    p.add_argument("--seq-len", type=int, default=512, help="mean sequence length")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU (use --device cpu --model tiny to smoke-test)")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs")
    with tempfile.TemporaryDirectory(prefix="rlk-bench-mg-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        if args.tp == 1:
            worker(0, args, init_file)
        else:
            import torch.multiprocessing as mp

            mp.spawn(worker, args=(args, init_file), nprocs=args.tp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
