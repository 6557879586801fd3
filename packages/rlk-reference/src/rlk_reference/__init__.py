"""rlk_reference: the float64, unfused, obviously-correct oracle of every rlk op.

Each op takes the normalised arguments that ``rlk`` passes to a backend (row ops get 2-D
``[T, H]`` tensors, ``sample`` gets per-row parameter tensors), computes in float64 and returns
results in the input dtype (log-probabilities, entropies, losses, KL and advantages in float32;
float64 inputs give float64 results). The backward is torch autograd through the float64
computation. Every op accepts an ignored ``table=None`` keyword, like the rlk_triton ops.

It also implements the optional ops of ``rlk.parallel`` (:func:`tree_linear`,
:func:`column_tree_linear`, :func:`vocab_parallel_linear_logprobs`), whose ranks exchange
float64 partial values through the ``exchange`` that ``rlk.parallel`` passes.

The random numbers of :func:`sample` are specified bit-exactly in :mod:`rlk_reference.philox`.
"""

from rlk_reference._attention import attention, paged_attention
from rlk_reference._dense import apply_rotary, linear, rms_norm, silu_and_mul
from rlk_reference._logprobs import linear_logprobs, logprobs
from rlk_reference._losses import grpo_advantages, kl_penalty, policy_loss
from rlk_reference._moe import moe_experts, moe_route
from rlk_reference._parallel import (
    column_tree_linear,
    tree_linear,
    vocab_parallel_linear_logprobs,
)
from rlk_reference._ppo import gae_advantages, value_loss
from rlk_reference._sampling import sample

__all__ = [
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
    "tree_linear",
    "column_tree_linear",
    "vocab_parallel_linear_logprobs",
    "moe_route",
    "moe_experts",
]
