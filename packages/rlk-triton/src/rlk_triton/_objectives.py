"""What the RL objectives' kernels share (:mod:`rlk_triton.policy_loss`, :mod:`rlk_triton.kl`,
:mod:`rlk_triton.advantages`): the batch-sum block and NaN-propagating fp32 helpers.

Every floating-point sum of those kernels has one order, fixed by module constants: a
sequence's tokens are accumulated lane-wise in blocks of ``policy_loss.BLOCK_L`` (lane ``i``
adds tokens ``i, i + BLOCK_L, ...`` in ascending order), then the lanes are added by the fixed
binary tree of :func:`rlk_triton.logprobs.tree_sum`; the sequences are combined the same way
in blocks of :data:`BLOCK_B` by a single program, and so are a GRPO group's members (in their
order in the batch) in blocks of ``advantages.BLOCK_G``. Counts are integer sums (exact). So
the results do not depend on tuning, and no step syncs with the host.
"""

from __future__ import annotations

from rlk_triton._triton import jit, tl

#: Sequences per block of the batch sums.
BLOCK_B = 256


def _log2(n: int) -> int:
    return n.bit_length() - 1


# NaN and infinities follow IEEE semantics as in the float64 reference (torch's max, min and
# clamp propagate NaN): every max/min/clamp on values here propagates NaN, where Triton's
# defaults (tl.maximum, tl.minimum, tl.max) would return the other operand and hide a NaN
# log-prob behind a finite loss. On numbers they give the same results as the defaults.


@jit
def _max2(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _min2(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def _safe_div(num, den):
    return tl.where(den > 0, tl.math.div_rn(num, tl.maximum(den, 1e-30)), 0.0)
