"""rlk: deterministic, batch-invariant operators for RL post-training of LLMs.

The rollout engine and the trainer call the same ops, so every sampled token gets bitwise the
same log-probability on both sides. Ops dispatch to a backend chosen per device (``RLK_BACKEND``
or :func:`use_backend`; see ``rlk info``).
"""

import os as _os
import sys as _sys


def _choose_triton_mode() -> None:
    # Triton picks compiled or interpreted execution when it is first imported. On a machine
    # without a GPU rlk's kernels need the interpreter, so choose it now, before any other
    # library (transformers, ...) imports triton.
    if "TRITON_INTERPRET" in _os.environ or "triton" in _sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"


_choose_triton_mode()

# The ops (from their family modules in rlk.ops) are imported by name and listed in __all__
# (spelled out for static tools: type checkers, IDEs, the API docs); a test checks both against
# the catalog.
from rlk import _library  # noqa: E402, F401  (defines the torch.ops.rlk operators)
from rlk._plugins import (  # noqa: E402
    GUARANTEES,
    OPS,
    BackendError,
    BackendImpl,
    BackendSpec,
    current_backend,
    hookimpl,
    use_backend,
)
from rlk.batch_invariant import batch_invariant  # noqa: E402
from rlk.ops.attention import attention, paged_attention  # noqa: E402
from rlk.ops.dense import apply_rotary, linear, rms_norm, silu_and_mul  # noqa: E402
from rlk.ops.logprobs import linear_logprobs, logprobs  # noqa: E402
from rlk.ops.losses import grpo_advantages, kl_penalty, policy_loss  # noqa: E402
from rlk.ops.moe import moe_experts, moe_route  # noqa: E402
from rlk.ops.ppo import gae_advantages, value_loss  # noqa: E402
from rlk.ops.sampling import sample  # noqa: E402

__version__ = "0.1.0"

#: The public names: the API, then every required op of the catalog (``rlk/_catalog.py``).
__all__ = [
    "GUARANTEES",
    "OPS",
    "BackendError",
    "BackendImpl",
    "BackendSpec",
    "batch_invariant",
    "current_backend",
    "hookimpl",
    "use_backend",
    # the ops, in the catalog's order (written out: documentation tools read __all__ statically)
    "linear",
    "rms_norm",
    "silu_and_mul",
    "apply_rotary",
    "attention",
    "paged_attention",
    "logprobs",
    "linear_logprobs",
    "policy_loss",
    "kl_penalty",
    "grpo_advantages",
    "gae_advantages",
    "value_loss",
    "sample",
]
