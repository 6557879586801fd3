"""PPO on the toy verifiable task of ``grpo_toy.py``, rollout, critic and training all on rlk.

Task: the reward of a response is the fraction of its tokens that are even ids. The critic is
a value head on the policy model (``critic.add_value_head``). Each step: sample one response
per prompt with ``rlk.sample`` (a left-padded batch with a KV cache) recording the critic's
values, score them, then ``training.ppo_step``: GAE (``rlk.gae_advantages``) from the outcome
rewards and the rollout's values, log-probabilities and values recomputed in packed
micro-batches of another composition, ``rlk.policy_loss`` + ``rlk.value_loss``, backward, Adam
step.

The log shows the reward going up and, between rollout and training, max |dlogp| and
max |dvalue| staying exactly 0: the first ratio of each update is exactly 1 and the critic's
old values are its values.

    python examples/ppo_toy.py --steps 6             # CPU: tiny model, Triton interpreter
    python examples/ppo_toy.py --model qwen2-0.5b --prompts 32 --new-tokens 64  # GPU
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlk_integrations.engine import critic, rollout, training  # rlk_triton before transformers
from rlk_integrations.models.transformers import patch_model
from rlk_integrations.tools import zoo


def reward(response: list[int]) -> float:
    return sum(t % 2 == 0 for t in response) / max(len(response), 1)


def train(
    model_name: str = "tiny",
    steps: int = 6,
    prompts: int = 8,
    new_tokens: int = 6,
    micro_batch: int = 3,
    lr: float = 5e-2,
    epochs: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    log=print,
) -> list[dict[str, float]]:
    """Run the loop; one record per step: ``reward`` (the batch mean) and ``ppo_step``'s."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    model = zoo.load_model(model_name, dtype=dtype, device=device)
    patch_model(model)
    head = critic.add_value_head(model)  # starts at 0: the first advantages are the returns
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    log(f"{model_name} on {device}: {prompts} prompts x {new_tokens} tokens per step")
    log(f"{'step':>4} {'reward':>7} {'loss':>9} {'v_loss':>8} {'max|dlogp|':>10} "
        f"{'max|dvalue|':>11} {'step s':>7}")  # fmt: skip
    records = []
    for step in range(steps):
        start = time.perf_counter()
        batch = [[rng.randrange(vocab) for _ in range(rng.randint(3, 8))] for _ in range(prompts)]
        seeds = [rng.randrange(2**62) for _ in batch]
        ro = rollout.generate(model, batch, new_tokens, seeds=seeds, value_head=head)
        rewards = torch.tensor([reward(s.response) for s in ro.samples])
        order = list(range(len(batch)))
        rng.shuffle(order)  # training sees other micro-batches than the rollout batch
        out = training.ppo_step(model, opt, ro.samples, rewards, micro_batch, epochs=epochs,
                                order=order, logits_dtype=ro.logits_dtype)  # fmt: skip
        out["reward"] = rewards.mean().item()
        records.append(out)
        log(
            f"{step:>4} {out['reward']:>7.3f} {out['loss']:>9.4f} {out['value_loss']:>8.4f} "
            f"{out['max_abs_dlogp']:>10.3g} {out['max_abs_dvalue']:>11.3g} "
            f"{time.perf_counter() - start:>7.1f}"
        )
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8, help="prompts (one response each) per step")
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=3, help="sequences per training micro-batch")
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--epochs", type=int, default=1, help="PPO epochs over each rollout")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    train(a.model, a.steps, a.prompts, a.new_tokens, a.micro_batch, a.lr, a.epochs,
          getattr(torch, a.dtype), a.seed)  # fmt: skip


if __name__ == "__main__":
    main()
