"""GRPO with TRL's GRPOTrainer, rollout and training on rlk: sampling logp == training logp.

Task: ``a+b=`` prompts (a small built-in dataset), reward 1 when the completion starts with the
sum plus 0.1 per digit it holds (checkable by a program). The tokenizer is character-level and
built locally (``rlk_integrations.adapters.trl.char_tokenizer``); the model is one of the
random-weight configs of ``rlk_integrations.tools.zoo``: nothing is downloaded.

Each trainer runs ``--steps`` optimizer steps with TRL's GRPO loss; the table gives, per step,
the mean reward, the loss and ``max |sampling_logp - training_logp|``: TRL's log-probabilities
under the weights that sampled (the old ones, and the current ones in the first iteration over a
batch) against the rollout's (``-``: no such comparison that step, the weights had moved).

- ``rlk``: ``RLKGRPOTrainer`` (rlk's paged rollout with seeded ``rlk.sample``, log-probabilities
  from ``rlk.linear_logprobs``): the column is 0 at every step, or the run fails.
- ``stock``: TRL's ``GRPOTrainer`` (transformers' ``generate``, TRL's log-probabilities), with
  the sampling log-probabilities of ``generate``'s logits recorded (``StockGRPOTrainer``).

    python examples/trl_grpo.py                                   # CPU: tiny model, < 1 minute
    python examples/trl_grpo.py --device cuda --model qwen2-0.5b --prompts 8 --group 8 \\
        --new-tokens 128 --steps 10                               # GPU

The exit status is 1 if a comparison of the rlk trainer is not 0.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

# rlk_integrations.adapters imports rlk (and Triton's interpreter on CPU) first.
from rlk_integrations.adapters.trl import RLKGRPOTrainer, StockGRPOTrainer, char_tokenizer
from rlk_integrations.tools import zoo

MISMATCH = "sampling/sampling_logp_difference/max"


def dataset(n: int, seed: int):
    """``n`` addition problems: ``prompt`` ``"a+b="`` and ``answer`` the sum, as text."""
    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [(rng.randrange(50), rng.randrange(50)) for _ in range(n)]
    return Dataset.from_dict(
        {"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )


def reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 for a completion that starts with the answer, plus 0.1 per digit in it."""
    return [
        float(c.startswith(a)) + 0.1 * sum(ch.isdigit() for ch in c)
        for c, a in zip(completions, answer)
    ]


def run(name: str, args: argparse.Namespace, out_dir: str) -> tuple[list[dict], float]:
    """Train with one trainer; returns TRL's per-step logs and the run's seconds."""
    from transformers import PrinterCallback
    from trl import GRPOConfig

    model = zoo.load_model(
        args.model, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed
    )
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        num_iterations=args.num_iterations,
        temperature=args.temperature,
        max_steps=args.steps,
        learning_rate=args.lr,
        bf16=False,  # the weights are in --dtype already: no autocast
        use_cpu=args.device == "cpu",
        gradient_checkpointing=args.gradient_checkpointing,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
    )
    tokenizer = char_tokenizer(model.config.vocab_size)
    for cfg in (model.config, model.generation_config):  # the random model takes its ids
        cfg.bos_token_id = None
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    cls = RLKGRPOTrainer if name == "rlk" else StockGRPOTrainer
    trainer = cls(
        model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset(args.prompts * args.steps * 4, args.seed),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # the table below has what the run logs
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    return [h for h in trainer.state.log_history if "loss" in h and "step" in h], seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="a built-in config or a local checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trainer", default="both", choices=("rlk", "stock", "both"))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group)")
    p.add_argument("--new-tokens", type=int, default=8, help="max_completion_length")
    p.add_argument("--num-iterations", type=int, default=2, help="updates per generation")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    names = ["rlk", "stock"] if args.trainer == "both" else [args.trainer]
    print(
        f"{args.model} ({args.dtype}) on {args.device}: {args.prompts} prompts x {args.group} "
        f"completions x {args.new_tokens} tokens per step, num_iterations={args.num_iterations}"
    )
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for name in names:
            results[name] = run(name, args, out_dir)

    def cell(h: dict, key: str, fmt: str) -> str:
        if h.get(key) is None:
            return "-"
        return "0" if h[key] == 0 and key == MISMATCH else format(h[key], fmt)

    print(f"{'trainer':<7} {'step':>4} {'reward':>7} {'loss':>10} {'max|dlogp|':>10} {'step s':>7}")
    for name, (logs, _) in results.items():
        for h in logs:
            print(
                f"{name:<7} {h['step']:>4} {cell(h, 'reward', '.3f'):>7} {h['loss']:>10.3e} "
                f"{cell(h, MISMATCH, '.3e'):>10} {cell(h, 'step_time', '.2f'):>7}"
            )
    for name, (logs, seconds) in results.items():
        # After the first step: without the one-time costs (Triton compiles, CUDA graphs).
        later = [h["step_time"] for h in logs[1:] if h.get("step_time")]
        steady = f", after step 1: {len(later) / sum(later):.3f} steps/s" if later else ""
        rate = len(logs) / seconds
        print(f"{name}: {len(logs)} steps in {seconds:.1f} s, {rate:.3f} steps/s{steady}")
    rlk_logs = results.get("rlk", ([], 0))[0]
    bad = [h["step"] for h in rlk_logs if h.get(MISMATCH) not in (None, 0.0)]
    if bad:
        print(f"rlk: sampling and training log-probabilities differ at steps {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
