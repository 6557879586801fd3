"""The public operators, one module per op family. Each validates its inputs, then calls the
selected backend; ``rlk`` exports every op (``rlk.linear``, ...).

Every op here has the same contract on every backend (docs/guide.md, "The numerics
contract"): an output element depends only on its own logical inputs, reductions have one fixed
order, tuning never changes bits, and backward is deterministic. Validation raises
``TypeError``/``ValueError`` naming the argument before any kernel is launched.

Backends receive normalised arguments: the leading dimensions of row-wise ops are flattened to
one (``[..., H] -> [T, H]``), defaults are resolved (``scale``, ``logits_dtype``,
``norm_length``), the sampling parameters of :func:`rlk.sample` are per-row tensors, and the RL
objectives get rlk's names for verl's (KL kinds, estimators), ``is_max`` for ``tis_cap``,
``norm_std`` as ``"group"``/``"batch"``/``"none"`` and ``reject`` as ``{option: (lower,
upper)}``.

The families (:data:`FAMILIES`): :mod:`rlk.ops.dense` (``linear``, ``rms_norm``,
``silu_and_mul``, ``apply_rotary``), :mod:`rlk.ops.attention` (``attention``,
``paged_attention``), :mod:`rlk.ops.logprobs` (``logprobs``, ``linear_logprobs``),
:mod:`rlk.ops.losses` (``policy_loss``, ``kl_penalty``, ``grpo_advantages``),
:mod:`rlk.ops.ppo` (``gae_advantages``, ``value_loss``), :mod:`rlk.ops.sampling` (``sample``),
:mod:`rlk.ops.moe` (the optional ``moe_route``, ``moe_experts``). The op functions are reached
through ``rlk`` or their family module (``rlk.ops.attention`` is the module, ``rlk.attention``
the op).

The op catalog is assembled here: each public function is declared an op by
``rlk._catalog.op`` (its :class:`OpSpec`) in its family module, and this package imports the
families and ``rlk.parallel`` (the tensor-parallel ops) and orders what they declared.

Public names for other distributions (backends, ``rlk.parallel``, the conformance kit):

- :data:`CATALOG` (one :class:`OpSpec` per op, required then optional), :data:`SPECS` (by
  name), :data:`OPS`, :data:`OPTIONAL_OPS` and the conformance kit's metadata
  (:data:`KWONLY`, :data:`GRAD_ARGS`, :data:`UNIT_GRADS`, :data:`OUT_DTYPE`), from which
  backends map their ops (rlk-triton's ``backend.OP_MODULES``);
- :func:`check_linear`, :func:`check_linear_logprobs`: the argument checks of ``linear`` and
  ``linear_logprobs``, for ops that take the same arguments (the tensor-parallel linears);
- the RL objectives' options: :data:`AGG_MODES`, :data:`RATIO_LEVELS`, :data:`IS_LEVELS`,
  :data:`IS_MODES`, :data:`REJECT_OPTIONS` (in the order of rlk-triton's bit flags),
  :data:`KL_KINDS`, :data:`KL_ALIASES`, :data:`ADV_ESTIMATORS`, :data:`ADV_ALIASES`,
  :data:`NORM_STD`, :data:`LOSS_MODES`, :data:`MODE_PARAMS`, and :data:`UNOFFERED` (the peers'
  settings rlk does not offer, each with the reason or the rlk call that gives it).
"""

from __future__ import annotations

import importlib

from rlk._catalog import FAMILIES, MODULES, OpSpec, declared
from rlk.ops.dense import check_linear
from rlk.ops.logprobs import check_linear_logprobs
from rlk.ops.losses import (
    ADV_ALIASES,
    ADV_ESTIMATORS,
    AGG_MODES,
    IS_LEVELS,
    IS_MODES,
    KL_ALIASES,
    KL_KINDS,
    LOSS_MODES,
    MODE_PARAMS,
    NORM_STD,
    RATIO_LEVELS,
    REJECT_OPTIONS,
    UNOFFERED,
)

for _module in MODULES:  # (the families and rlk.parallel: each declares its ops)
    importlib.import_module(_module)

#: Every op, required ones in the order of ``rlk.OPS``, then the optional ones (each group in
#: the order of :data:`FAMILIES`, then of the definitions in the module).
CATALOG: tuple[OpSpec, ...] = declared()
SPECS: dict[str, OpSpec] = {s.name: s for s in CATALOG}

#: Every op a backend must serve. A backend missing one cannot be selected.
OPS: tuple[str, ...] = tuple(s.name for s in CATALOG if not s.optional)

#: Ops a backend may claim and leave out (``rlk.parallel``'s and the mixture of experts').
OPTIONAL_OPS: tuple[str, ...] = tuple(s.name for s in CATALOG if s.optional)

#: The conformance kit's metadata, per op (see :class:`OpSpec`).
KWONLY: dict[str, tuple[str, ...]] = {s.name: s.kwonly for s in CATALOG if s.kwonly}
GRAD_ARGS: dict[str, tuple[str, ...]] = {s.name: s.grad_args for s in CATALOG if s.grad_args}
UNIT_GRADS: dict[str, tuple[str, ...]] = {s.name: s.unit_grads for s in CATALOG if s.unit_grads}
OUT_DTYPE: dict[str, str] = {s.name: s.out_dtype for s in CATALOG}

__all__ = [
    "CATALOG",
    "SPECS",
    "OPS",
    "OPTIONAL_OPS",
    "KWONLY",
    "GRAD_ARGS",
    "UNIT_GRADS",
    "OUT_DTYPE",
    "OpSpec",
    "ADV_ALIASES",
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "FAMILIES",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ALIASES",
    "KL_KINDS",
    "LOSS_MODES",
    "MODE_PARAMS",
    "NORM_STD",
    "RATIO_LEVELS",
    "REJECT_OPTIONS",
    "UNOFFERED",
    "check_linear",
    "check_linear_logprobs",
]
