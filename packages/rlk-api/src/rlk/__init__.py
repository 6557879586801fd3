"""rlk: deterministic, batch-invariant operators for RL post-training of LLMs.

The rollout engine and the trainer call the same ops, so every sampled token gets bitwise the
same log-probability on both sides. Ops dispatch to a backend chosen per device (``RLK_BACKEND``
or :func:`use_backend`; see ``rlk info``).
"""

from rlk._ops import (
    apply_rotary,
    attention,
    grpo_advantages,
    kl_penalty,
    linear,
    linear_logprobs,
    logprobs,
    paged_attention,
    policy_loss,
    rms_norm,
    sample,
    silu_and_mul,
)
from rlk._plugins import (
    GUARANTEES,
    OPS,
    BackendError,
    BackendImpl,
    BackendSpec,
    current_backend,
    hookimpl,
    use_backend,
)
from rlk.batch_invariant import batch_invariant

__version__ = "0.1.0"

__all__ = [
    "GUARANTEES",
    "OPS",
    "BackendError",
    "BackendImpl",
    "BackendSpec",
    "apply_rotary",
    "attention",
    "batch_invariant",
    "current_backend",
    "grpo_advantages",
    "hookimpl",
    "kl_penalty",
    "linear",
    "linear_logprobs",
    "logprobs",
    "paged_attention",
    "policy_loss",
    "rms_norm",
    "sample",
    "silu_and_mul",
    "use_backend",
]
