"""training.ppo_step and examples/ppo_toy.py: PPO with a value head, rollout and training on rlk.

The toy loop runs on CPU under the Triton interpreter (marked slow): its reward rises, and at
every step the training pass recomputes the rollout's log-probabilities and values bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rlk_integrations.engine import critic, training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.models.transformers import patch_model  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ppo_toy.py"


def _example():
    spec = importlib.util.spec_from_file_location("ppo_toy", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ppo_step_refuses_samples_without_values_and_bad_arguments():
    model = patch_model(zoo.load_model("tiny", device="cpu"))
    critic.add_value_head(model)
    opt = torch.optim.Adam(model.parameters())
    bare = [Sample([1, 2], [3, 4], torch.zeros(2))]
    with pytest.raises(ValueError, match="rollout values"):
        training.ppo_step(model, opt, bare, torch.ones(1), 1)
    ok = [Sample([1, 2], [3, 4], torch.zeros(2), values=torch.zeros(2))]
    with pytest.raises(ValueError, match="rewards must be"):
        training.ppo_step(model, opt, ok, torch.ones(2), 1)
    with pytest.raises(ValueError, match="epochs"):
        training.ppo_step(model, opt, ok, torch.ones(1), 1, epochs=0)


@pytest.mark.slow
def test_ppo_toy_trains_with_exact_logprobs_and_values():
    records = _example().train(steps=8, prompts=8, new_tokens=4, micro_batch=4, log=lambda s: None)
    for step, r in enumerate(records):
        assert r["max_abs_dlogp"] == 0, step
        assert r["max_abs_dvalue"] == 0, step
        assert r["value_loss"] > 0, step  # the critic is trained
    # One response per prompt, 4 tokens: a step's mean reward is noisy; compare 3-step means
    # (on the CPU, 0.51 over the first three steps and 0.65 over the last three).
    rewards = [r["reward"] for r in records]
    assert sum(rewards[-3:]) > sum(rewards[:3]) + 0.15, rewards
