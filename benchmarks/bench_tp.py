"""Tensor-parallel training step: rlk's tree-ordered TP vs the same model with stock all-reduce.

    python benchmarks/bench_tp.py [--model qwen2-0.5b] [--tp 2] [--samples 32] [--len 512]
        [--leaves 8] [--exchange gather|halving]

Both rows run the transformers integration on rlk kernels at the same TP degree, spawned over
``--tp`` GPUs with NCCL (:mod:`rlk_integrations.engine.tp_workers`): ``tree`` is the TP-invariant layout
(row-parallel outputs and column-parallel input gradients gathered in fp32 and summed by the
leaf tree, vocabulary-parallel ``linear_logprobs``), ``stock`` the usual one (``rlk.linear`` on
each rank's slice and an NCCL all-reduce; the same vocabulary-parallel log-probs). One step is
the forward + backward of every packed micro-batch (the ``rlk consistency`` training recompute),
timed after one warm-up micro-batch; the median of ``--repeat`` runs. The target: tree
within 10% of stock. The TP=1 row is the same model on one GPU with the tree-ordered linears.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch


def _samples(n, length, vocab, seed=0):
    from rlk_integrations.engine.engines import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        toks = torch.randint(0, vocab, (length,), generator=g).tolist()
        half = length // 2
        out.append(Sample(prompt=toks[:half], response=toks[half:], logprobs=torch.zeros(1)))
    return out


def main() -> int:
    from rlk_integrations.engine import tp_workers, training
    from rlk_integrations.tools import zoo

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--exchange", default="gather", choices=("gather", "halving"),
                   help="how tree ranks combine their fp32 values (RLK_TP_EXCHANGE)")  # fmt: skip
    args = p.parse_args()
    os.environ["RLK_TP_EXCHANGE"] = args.exchange  # inherited by the spawned ranks

    model = zoo.load_model(args.model, dtype=torch.bfloat16, device=args.device)
    samples = _samples(args.samples, args.len, model.config.vocab_size)
    groups = training.micro_batches(len(samples), args.micro_batch)
    tokens = sum(len(s.tokens) for s in samples)
    bf16 = torch.bfloat16
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "w.pt")
        tp_workers.save_weights(model, weights)
        cfg = model.config
        del model
        for name, world, stock in (("tp1-tree", 1, False), ("tree", args.tp, False),
                                   ("stock", args.tp, True)):  # fmt: skip
            secs = []
            for _ in range(args.repeat):
                _, s = tp_workers.spawn(tp_workers.train_worker, world, args.device, cfg,
                                        weights, bf16, args.leaves, samples, groups, 1.0, bf16,
                                        True, stock)  # fmt: skip
                secs.append(s)
            results[name] = statistics.median(secs)
            print(f"{name:>9}: TP={world} step {results[name] * 1e3:9.1f} ms, "
                  f"{tokens / results[name]:10.0f} tokens/s", flush=True)  # fmt: skip
    ratio = results["stock"] / results["tree"]
    print("| model | TP | leaves | exchange | tokens/step | tree ms | stock all-reduce ms | "
          "tree/stock throughput |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.model} | {args.tp} | {args.leaves} | {args.exchange} | {tokens} | "
          f"{results['tree'] * 1e3:.1f} | {results['stock'] * 1e3:.1f} | {ratio:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
