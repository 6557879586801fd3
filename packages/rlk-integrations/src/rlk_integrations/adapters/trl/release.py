"""The TRL releases rlk's GRPO trainers are written against, and the check each trainer runs
when built: a release outside :data:`TESTED_TRL` is warned about once, one whose overridden
methods changed their parameters is refused (``RuntimeError``)."""

from __future__ import annotations

import inspect
import re
import warnings

import trl
from trl import GRPOTrainer

#: The oldest and newest TRL releases (major.minor) this integration is tested with; the extra
#: ``rlk[trl]`` declares the same range. The trainer overrides TRL methods that are not public
#: API, so another release is warned about, and one whose methods changed shape is refused.
TESTED_TRL = ((1, 16), (1, 16))

#: The TRL methods :class:`RLKGRPOTrainer` overrides, with the parameters it relies on.
_OVERRIDDEN = {
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations"),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),  # fmt: skip
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
}

_version_warned = False


def _check_trl_version() -> None:
    """Warn once outside :data:`TESTED_TRL`; raise if an overridden method changed its
    parameters (the override would then not be called the way it expects)."""
    global _version_warned
    (lo, hi), found = TESTED_TRL, trl.__version__
    m = re.match(r"(\d+)\.(\d+)", found)
    if m and not (lo <= (int(m[1]), int(m[2])) <= hi) and not _version_warned:
        _version_warned = True
        warnings.warn(
            f"rlk's TRL integration is tested with TRL {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, this "
            f"is {found}: check that sampling/sampling_logp_difference/max logs 0",
            RuntimeWarning,
            stacklevel=3,
        )
    problems = []
    for name, needs in _OVERRIDDEN.items():
        method = getattr(GRPOTrainer, name, None)
        if method is None:
            problems.append(f"GRPOTrainer has no {name}")
            continue
        params = inspect.signature(method).parameters
        missing = [p for p in needs if p not in params]
        if missing:
            problems.append(f"GRPOTrainer.{name} takes no {', '.join(missing)}")
    if problems:
        raise RuntimeError(
            f"TRL {found} changed the methods rlk's GRPOTrainer overrides (tested: "
            f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}): " + "; ".join(problems)
        )
