"""GRPO on a toy verifiable task, rollout and training both on rlk.

Task: the reward of a response is the fraction of its tokens that are even ids (checkable by a
program, like a math answer). Each step: sample ``--group`` responses per prompt with
``rlk.sample`` (a left-padded batch with a KV cache), score them, compute ``grpo_advantages``,
recompute the log-probabilities with ``linear_logprobs`` in packed micro-batches of another
composition, ``policy_loss`` against the rollout's log-probabilities, backward, Adam step.

The log shows the reward going up and the rollout-vs-training max |dlogp| staying exactly 0:
the importance ratio of the first update is exactly 1, no correction needed.

    python examples/grpo_toy.py --steps 6            # CPU: tiny model, Triton interpreter
    python examples/grpo_toy.py --model qwen2-0.5b --prompts 8 --group 8 --new-tokens 64  # GPU
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlk_integrations.engine import rollout, training  # imports rlk_triton before transformers
from rlk_integrations.models.transformers import patch_model
from rlk_integrations.tools import zoo


def reward(response: list[int]) -> float:
    return sum(t % 2 == 0 for t in response) / max(len(response), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group)")
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=3, help="sequences per training micro-batch")
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = zoo.load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    patch_model(model)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    print(
        f"{args.model} on {device}: {args.prompts} prompts x {args.group} responses x "
        f"{args.new_tokens} tokens per step"
    )
    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'max|dlogp|':>10} {'step s':>7}")
    for step in range(args.steps):
        start = time.perf_counter()
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(3, 8))] for _ in range(args.prompts)
        ]
        batch = [p for p in prompts for _ in range(args.group)]  # a group is contiguous
        seeds = [rng.randrange(2**62) for _ in batch]
        ro = rollout.generate(model, batch, args.new_tokens, seeds=seeds)
        rewards = torch.tensor([reward(s.response) for s in ro.samples])
        order = list(range(len(batch)))
        rng.shuffle(order)  # training sees other micro-batches than the rollout batch
        out = training.grpo_step(
            model,
            opt,
            ro.samples,
            rewards,
            args.group,
            args.micro_batch,
            order=order,
            logits_dtype=ro.logits_dtype,
        )
        secs = time.perf_counter() - start
        print(
            f"{step:>4} {rewards.mean().item():>7.3f} {out['loss']:>9.4f} "
            f"{out['max_abs_dlogp']:>10.3g} {secs:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
