"""NVIDIA tuning overrides on top of rlk_triton's portable table (launch parameters only)."""

from __future__ import annotations

from rlk_triton.tuning import Rule

#: kernel key -> Rule. Empty keys fall back to the kernel's own portable rule.
NVIDIA: dict[str, Rule] = {}
