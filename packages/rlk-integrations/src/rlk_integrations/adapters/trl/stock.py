"""The stock baseline: :class:`StockGRPOTrainer`, TRL's GRPO trainer unchanged plus the
sampling log-probabilities of transformers' ``generate``, compared with TRL's own as the rlk
trainer does (logged, never raised)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from trl import GRPOTrainer

from rlk_integrations.adapters.trl.check import _LogprobCheck
from rlk_integrations.adapters.trl.release import _check_trl_version


class StockGRPOTrainer(_LogprobCheck, GRPOTrainer):
    """``trl.GRPOTrainer`` unchanged, plus the sampling log-probabilities of its own rollout.

    Generation is TRL's (transformers' ``generate``); each sampled token's log-probability is
    ``log_softmax(logits / temperature)`` in float32 of the raw logits ``generate`` returns
    (``output_logits=True``), which TRL then carries as ``sampling_per_token_logps`` (it changes
    TRL's training only through ``off_policy_mask_threshold``, which reads them). The
    comparison with TRL's log-probabilities is logged under the same names as
    :class:`RLKGRPOTrainer`'s, never raised: the baseline of ``examples/trl_grpo.py`` and the
    tests.

    Example::

        StockGRPOTrainer(model, reward_funcs=reward, args=config, train_dataset=ds).train()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_trl_version()
        super().__init__(*args, **kwargs)
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError(
                "StockGRPOTrainer records transformers' generate: use_vllm and "
                "use_transformers_continuous_batching must be False"
            )
        self._init_check()

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        model = self.accelerator.unwrap_model(self.model_wrapped)
        steps: list[torch.Tensor] = []
        generate: Callable[..., Any] = model.generate

        def recording_generate(*args: Any, generation_config: Any, **kwargs: Any) -> torch.Tensor:
            config = copy.deepcopy(generation_config)
            config.output_logits = config.return_dict_in_generate = True
            out = generate(*args, generation_config=config, **kwargs)
            steps.extend(out.logits)  # one [B, V] tensor per new token
            return out.sequences

        model.generate = recording_generate
        try:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            del model.generate
        if not steps:
            return completion_ids, [[] for _ in completion_ids]
        # Gathered on the device, one copy to the host: [B, steps] of the sampled tokens.
        width = len(steps)
        ids = torch.tensor(
            [c[:width] + [0] * (width - len(c[:width])) for c in completion_ids],
            device=steps[0].device,
        )
        picked = torch.stack(
            [
                torch.log_softmax(logits.float() / self.temperature, dim=-1)
                .gather(1, ids[:, t : t + 1])
                .squeeze(1)
                for t, logits in enumerate(steps)
            ],
            dim=1,
        ).cpu()
        return completion_ids, [picked[i, : len(c)].tolist() for i, c in enumerate(completion_ids)]
