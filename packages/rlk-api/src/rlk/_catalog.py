"""The op catalog: one :class:`OpSpec` per op, the single list every other op table comes from.

Derived here: :data:`OPS` (the ops every backend must serve), :data:`OPTIONAL_OPS` (ops a
backend may claim), and the conformance kit's metadata (:data:`KWONLY`, :data:`GRAD_ARGS`,
:data:`UNIT_GRADS`, :data:`OUT_DTYPE`). Derived elsewhere from :data:`CATALOG`: the public
exports of ``rlk`` (``rlk/__init__.py``), the float64 backend's ops (``rlk/_builtin.py``) and
the ops of rlk-triton's backends (``rlk_triton/backend.py``). A test checks that the public
functions of the ``rlk.ops`` family modules and the reference's functions match the catalog.

Adding an op (``docs/architecture.md``, "Adding an op"): one :class:`OpSpec` here, its public
function in its family's module of ``rlk/ops/`` (or, for an optional op, the function that
dispatches to it), its float64 oracle in ``rlk_reference``, its kernels in the file of
rlk-triton named by ``family``, and its case builder in ``rlk/testing/cases.py`` (named after
the op).

This module imports nothing heavy (no torch): ``rlk_cli`` and the plugin registry read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    """One op, as backends receive it (validated, normalised arguments; see ``rlk.ops``).

    ``family``: the op family, which is also the module of rlk-triton holding its kernels,
    launchers, ``autograd.Function`` and the function a backend binds to a tuning table.
    ``kwonly``: arguments a backend receives by keyword (the others come by position, in the
    order of the public signature). ``grad_args``: inputs that get a gradient. ``unit_grads``:
    those of ``grad_args`` that belong to one row / sequence, so must not depend on the batch
    (weight gradients sum over rows and only have to be deterministic). ``out_dtype``: the dtype
    of the outputs, ``"input"`` for the dtype of the first tensor argument, else a torch dtype's
    name. ``optional``: a backend may leave the op out and still be selected; rlk then raises
    :class:`rlk.BackendError` where the op is asked for.
    """

    name: str
    family: str
    kwonly: tuple[str, ...] = ()
    grad_args: tuple[str, ...] = ()
    unit_grads: tuple[str, ...] = ()
    out_dtype: str = "input"
    optional: bool = False


_POLICY_KWONLY = (
    "clip_low",
    "clip_high",
    "clip_c",
    "agg",
    "ratio_level",
    "rollout_logprobs",
    "is_level",
    "is_mode",
    "is_min",
    "is_max",
    "is_normalize",
    "reject",
    "num_tokens",
    "num_seqs",
    "norm_length",
)

_TREE_LINEAR = dict(
    kwonly=("exchange",), grad_args=("x", "weight", "bias"), unit_grads=("x",), optional=True
)

#: Every op, required ones in the order of ``rlk.OPS``, then the optional ones.
CATALOG: tuple[OpSpec, ...] = (
    OpSpec("linear", "gemm", grad_args=("x", "weight", "bias"), unit_grads=("x",)),
    OpSpec("rms_norm", "norm", grad_args=("x", "weight", "residual"), unit_grads=("x", "residual")),
    OpSpec("silu_and_mul", "activation", grad_args=("x", "up"), unit_grads=("x", "up")),
    OpSpec("apply_rotary", "rotary", grad_args=("x", "k"), unit_grads=("x", "k")),
    OpSpec(
        "attention",
        "attention",
        kwonly=("max_seqlen_q", "max_seqlen_k"),
        grad_args=("q", "k", "v"),
        unit_grads=("q", "k", "v"),
    ),
    OpSpec("paged_attention", "paged_attention"),
    OpSpec(
        "logprobs", "logprobs", grad_args=("logits",), unit_grads=("logits",), out_dtype="float32"
    ),
    OpSpec(
        "linear_logprobs",
        "fused_logprobs",
        grad_args=("hidden", "weight", "bias"),
        unit_grads=("hidden",),
        out_dtype="float32",
    ),
    # policy_loss aggregates over the batch: its gradient is checked for determinism only.
    OpSpec(
        "policy_loss",
        "policy_loss",
        kwonly=_POLICY_KWONLY,
        grad_args=("logprobs",),
        out_dtype="float32",
    ),
    OpSpec(
        "kl_penalty",
        "kl",
        kwonly=("clamp", "old_logprobs"),
        grad_args=("logprobs",),
        unit_grads=("logprobs",),
        out_dtype="float32",
    ),
    OpSpec(
        "grpo_advantages",
        "advantages",
        kwonly=("norm_std", "eps", "group_ids", "estimator", "mask"),
        out_dtype="float32",
    ),
    # PPO's critic side: GAE (not differentiable) and the clipped value loss, which aggregates
    # over the batch (its gradient is checked for determinism only).
    OpSpec("gae_advantages", "ppo", kwonly=("gamma", "lam", "whiten"), out_dtype="float32"),
    OpSpec(
        "value_loss",
        "ppo",
        kwonly=("clip", "agg", "num_tokens", "num_seqs", "norm_length"),
        grad_args=("values",),
        out_dtype="float32",
    ),
    OpSpec("sample", "sampling", kwonly=("temperature", "top_k", "top_p"), out_dtype="int64"),
    # Tree-ordered linears (rlk.parallel): K (tree_linear) or dX's N (column_tree_linear)
    # reduced by a fixed tree of leaves; ``exchange`` tops the tree over tensor-parallel ranks.
    OpSpec("tree_linear", "tree_gemm", **_TREE_LINEAR),
    OpSpec("column_tree_linear", "tree_gemm", **_TREE_LINEAR),
    # Mixture of experts (rlk.ops.moe): the router's top-k and the experts, combined.
    OpSpec(
        "moe_route",
        "moe",
        grad_args=("logits",),
        unit_grads=("logits",),
        out_dtype="float32,int64",
        optional=True,
    ),
    OpSpec(
        "moe_experts",
        "moe",
        grad_args=("x", "weights", "gate_up", "down"),
        unit_grads=("x", "weights"),
        optional=True,
    ),
    # linear_logprobs with the lm_head split over the ranks of ``exchange`` (rlk.parallel).
    OpSpec(
        "vocab_parallel_linear_logprobs",
        "vocab_parallel",
        kwonly=("exchange",),
        grad_args=("hidden", "weight", "bias"),
        out_dtype="float32",
        optional=True,
    ),
)

SPECS: dict[str, OpSpec] = {s.name: s for s in CATALOG}

#: Every op a backend must serve. A backend missing one cannot be selected.
OPS: tuple[str, ...] = tuple(s.name for s in CATALOG if not s.optional)

#: Ops a backend may claim (``rlk.parallel`` dispatches to them).
OPTIONAL_OPS: tuple[str, ...] = tuple(s.name for s in CATALOG if s.optional)

KWONLY: dict[str, tuple[str, ...]] = {s.name: s.kwonly for s in CATALOG if s.kwonly}
GRAD_ARGS: dict[str, tuple[str, ...]] = {s.name: s.grad_args for s in CATALOG if s.grad_args}
UNIT_GRADS: dict[str, tuple[str, ...]] = {s.name: s.unit_grads for s in CATALOG if s.unit_grads}
OUT_DTYPE: dict[str, str] = {s.name: s.out_dtype for s in CATALOG}
