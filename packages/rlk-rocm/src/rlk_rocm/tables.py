"""AMD CDNA3 (MI300X) tuning overrides on top of rlk_triton's portable table.

Launch parameters only (the reduction order is fixed by the kernels' constants): CDNA3 runs
64-wide wavefronts, so ``num_warps=4`` is 256 threads, and its 64 KiB of LDS per CU favours two
pipeline stages over the deeper pipelines that Hopper's 228 KiB allow. These configs also keep
the portable constraints of the GEMM (BLOCK_M a multiple of 64, num_warps 4 or 8), so the same
table runs, with identical bits, on NVIDIA GPUs and under the CPU interpreter: the conformance
kit's tuning check runs every config of every installed table. None of this has been timed on
an MI300X (no AMD GPU was reachable); the choices follow AMD's published Triton tuning advice.
"""

from __future__ import annotations

from rlk_triton.gemm import gemm_config
from rlk_triton.tuning import Rule

_GEMM = (
    gemm_config(64, 64, 4, 2, group_m=8),  # 0: decode
    gemm_config(64, 128, 4, 2, group_m=8),  # 1: decode, wide N (lm_head)
    gemm_config(128, 128, 4, 2, group_m=8),  # 2: mid M
    gemm_config(256, 128, 8, 2, group_m=4),  # 3: large M
    gemm_config(64, 64, 4, 2, group_m=4),  # 4: fp32
)

_NUM_CUS = 304  # MI300X; shapes the choice only


def _choose(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    if dtype_bytes == 4:
        return 4
    if M <= 64:
        return 1 if (N // 128) >= 2 * _NUM_CUS else 0
    return 2 if M <= 512 else 3


def _choose_dw(M: int, N: int, K: int, dtype_bytes: int = 2) -> int:
    return 4 if dtype_bytes == 4 else 3


#: kernel key -> Rule. Keys left out fall back to the kernel's own portable rule.
CDNA3: dict[str, Rule] = {
    "linear.fwd": Rule(configs=_GEMM, choose=_choose),
    "linear.bwd_dx": Rule(configs=_GEMM, choose=_choose),
    "linear.bwd_dw": Rule(configs=_GEMM, choose=_choose_dw),
}
