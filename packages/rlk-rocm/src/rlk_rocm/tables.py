"""AMD CDNA3 (MI300X) tuning overrides on top of rlk_triton's portable table.

Launch parameters only: 64-wide wavefronts favour num_warps in {4, 8} and smaller LDS use.
"""

from __future__ import annotations

from rlk_triton.tuning import Rule

#: kernel key -> Rule. Empty keys fall back to the kernel's own portable rule.
CDNA3: dict[str, Rule] = {}
