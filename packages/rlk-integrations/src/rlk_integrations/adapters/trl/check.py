"""The comparison of TRL's log-probabilities with the sampling ones, where the weights are
those that sampled (:class:`_LogprobCheck`): logged under TRL's ``sampling/...`` names, raised
on a difference by the rlk trainer; mixed into both GRPO trainers."""

from __future__ import annotations

from typing import Any

import torch


class _LogprobCheck:
    """The comparison of TRL's log-probabilities with the sampling ones, where the weights are
    those that sampled; mixed into :class:`RLKGRPOTrainer` and :class:`StockGRPOTrainer`.

    ``_rlk_sampled_at[mode]`` is the ``global_step`` of the last generation of that mode: the
    weights change only when ``global_step`` does, so a batch's current log-probabilities are
    compared while it is unchanged (the first iteration over the batch)."""

    #: Raise on a difference (the rlk trainer), or only log it (the stock baseline).
    _raise_on_mismatch = False

    def _init_check(self) -> None:
        self._rlk_sampled_at: dict[str, int] = {}
        self._rlk_current: torch.Tensor | None = None

    def _compare(
        self, what: str, logps: torch.Tensor, inputs: dict[str, Any], log: bool = True
    ) -> None:
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is None:
            raise RuntimeError(
                "TRL did not pass the rollout's log-probabilities on (no "
                "sampling_per_token_logps): the generation override was not called"
            )
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"].bool()
        diff = (logps.detach() - sampling)[mask]
        ratio = torch.exp(diff)
        zero = torch.zeros((), device=sampling.device)
        d = diff.abs()
        stats = {
            "sampling/sampling_logp_difference/mean": d.mean() if d.numel() else zero,
            "sampling/sampling_logp_difference/max": d.max() if d.numel() else zero,
            "sampling/importance_sampling_ratio/min": ratio.min() if d.numel() else zero + 1,
            "sampling/importance_sampling_ratio/mean": ratio.mean() if d.numel() else zero + 1,
            "sampling/importance_sampling_ratio/max": ratio.max() if d.numel() else zero + 1,
        }
        for key, value in stats.items():
            if log:
                self._metrics[mode][key].append(float(value))
        worst = float(stats["sampling/sampling_logp_difference/max"])
        if self._raise_on_mismatch and worst != 0.0:
            raise RuntimeError(
                f"{what} differ from the sampling log-probabilities by up to {worst:.3e} under "
                "the weights that sampled: rlk's contract is equality. Was the model changed "
                "between the rollout and the recompute (dtype, patched modules, autocast)? "
                "check_logprobs=False logs the difference instead of raising"
            )

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        out = super()._generate_and_score_completions(inputs)
        self._rlk_sampled_at[mode] = self.state.global_step
        if out.get("old_per_token_logps") is not None:
            # With vLLM's importance-sampling correction TRL logs this comparison itself.
            logged = self.use_vllm and self.vllm_importance_sampling_correction
            self._compare("TRL's old_per_token_logps", out["old_per_token_logps"], out, not logged)
        return out

    def _compute_loss(self, model, inputs):
        self._rlk_current = None
        loss = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        if self._rlk_current is not None and self._rlk_sampled_at.get(mode) == (
            self.state.global_step
        ):
            self._compare("TRL's per_token_logps", self._rlk_current, inputs)
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, *args, **kwargs
        )
        self._rlk_current = logps.detach()  # read by _compute_loss (its one call is the policy)
        return logps, entropies, aux
