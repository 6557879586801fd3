"""Mixture of experts: the routers' top-k (:func:`moe_route`; DeepSeek-V3's group-limited sigmoid
router, :func:`moe_route_grouped`) and the experts (:func:`moe_experts`).

A mixture-of-experts layer is ``rlk.linear`` (the router's logits), then :func:`moe_route` (or
:func:`moe_route_grouped`), then :func:`moe_experts`. All are optional ops (``rlk._catalog``): a
backend without them raises :class:`rlk.BackendError` naming those that have them; rlk never
runs another backend's kernel in their place. Each is also a ``torch.library`` operator
(``torch.ops.rlk.moe_route``, ``moe_experts``), opaque to ``torch.compile`` as the required ops
are: its backward runs the backend's backward kernels on what the forward kept (rlk-triton's
``OpAutograd``), or, for a backend without that pair, the op again under autograd. Contract
(docs/guide.md, "Mixture of experts"): a token's experts, weights and output depend only on its
own row, its experts' weights and nothing of the batch; ties go to the lower expert index; the k
expert outputs are added in rank order.
"""

from __future__ import annotations

import torch

from rlk import _validate as chk
from rlk import selection
from rlk._catalog import Operator, no_extras, op

#: The ops declared here (``rlk`` exports them).
__all__ = ["moe_route", "moe_route_grouped", "moe_experts"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _routed(a: dict) -> list[torch.Tensor]:
    t, k = a["logits"].shape[0], a["top_k"]
    dev = a["logits"].device
    return [torch.empty((t, k), dtype=dtype, device=dev) for dtype in (torch.float32, torch.int64)]


@op(
    "moe",
    grad_args=("logits",),
    unit_grads=("logits",),
    out_dtype="float32,int64",
    optional=True,
    operator=Operator(
        "Tensor logits, int top_k, bool normalize",
        outputs=_routed,
        extras=no_extras,
        saved_outputs=lambda a: (0, 1),
    ),
)
def moe_route(
    logits: torch.Tensor, top_k: int, normalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and routing weights from the router's logits.

    Shapes: ``logits [T, E]`` (bf16/fp16/fp32, e.g. ``rlk.linear(x, router_weight)``) ->
    ``(weights, indices)``, float32 and int64 ``[T, top_k]``, ranked by decreasing logit. The
    logits are compared exactly (``-0.0`` equals ``+0.0``, NaN ranks above every number), ties
    go to the lower expert index. ``weights`` are the softmax over all E experts at the chosen
    ones, or with ``normalize`` the softmax over the chosen k alone (Qwen-MoE's
    ``norm_topk_prob``: the top-k probabilities over their sum); a row holding a NaN or +inf
    logit gets NaN weights.

    Contract: a row's results depend on that row only, bitwise. Differentiable in ``logits``
    through ``weights``.

    Example::

        weights, indices = rlk.moe_route(rlk.linear(x, router_w), 8, normalize=True)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    chk.positive_int("top_k", top_k)
    if top_k > logits.shape[1]:
        raise ValueError(f"top_k = {top_k} is more than the {logits.shape[1]} experts")
    chk.flag("normalize", normalize)
    fn = selection.optional_op(logits.device, "moe_route", "rlk.moe_route")
    return fn(logits, top_k, normalize)


@op(
    "moe",
    grad_args=("logits",),
    unit_grads=("logits",),
    out_dtype="float32,int64",
    optional=True,
    operator=Operator(
        "Tensor logits, Tensor bias, int top_k, int n_group, int topk_group, bool normalize, "
        "float scale",
        outputs=_routed,
        extras=no_extras,
        saved_outputs=lambda a: (0, 1),
    ),
)
def moe_route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``): each token's ``top_k``
    experts by sigmoid score plus a selection bias, from its ``topk_group`` best groups.

    Shapes: ``logits [T, E]`` (bf16/fp16/fp32; DeepSeek-V3 computes them in fp32), ``bias
    [E]`` (float, the ``e_score_correction_bias``) -> ``(weights, indices)``, float32 and int64
    ``[T, top_k]``. In float32: ``s = sigmoid(logits)``, the selection score ``c = s + bias``.
    The experts are ``n_group`` groups of ``E / n_group`` consecutive ones; a group's score is
    the sum of its two largest ``c`` (the larger first); the ``topk_group`` groups of largest
    score are kept, then the ``top_k`` experts of largest ``c`` among them, ranked by
    decreasing ``c``. Scores are compared exactly (``-0.0`` equals ``+0.0``, NaN above every
    number); ties, of experts and of groups, go to the lower index (``torch.topk``, which
    transformers calls with ``sorted=False``, leaves the order of ties unspecified). ``weights``
    are ``s`` at the chosen experts (the bias selects, it never weighs), with ``normalize``
    divided by their sum (added in rank order) plus ``1e-20``, times ``scale`` (the
    ``routed_scaling_factor``).

    Contract: a row's results depend on that row (and ``bias``) only, bitwise.
    Differentiable in ``logits`` through ``weights`` (``bias`` gets no gradient).

    Example::

        w, idx = rlk.moe_route_grouped(logits, gate.e_score_correction_bias, 8, n_group=8,
                                       topk_group=4, normalize=True, scale=2.5)
    """
    chk.tensor("logits", logits, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    E = logits.shape[1]
    chk.tensor("bias", bias, dtypes=chk.FLOAT_DTYPES, ndim=1)
    chk.shape("bias", bias, (E,), "one per expert: logits.shape[1]")
    chk.same_device(logits=logits, bias=bias)
    chk.positive_int("top_k", top_k)
    chk.positive_int("n_group", n_group)
    chk.positive_int("topk_group", topk_group)
    chk.flag("normalize", normalize)
    scale = chk.positive_float("scale", scale)
    if E % n_group or E // n_group < 2:
        raise ValueError(f"n_group = {n_group} must divide the {E} experts in groups of >= 2")
    if topk_group > n_group:
        raise ValueError(f"topk_group = {topk_group} is more than n_group = {n_group}")
    if top_k > topk_group * (E // n_group):
        raise ValueError(
            f"top_k = {top_k} is more than the {topk_group * (E // n_group)} experts of "
            f"topk_group = {topk_group} groups"
        )
    fn = selection.optional_op(logits.device, "moe_route_grouped", "rlk.moe_route_grouped")
    return fn(logits, bias, top_k, n_group, topk_group, normalize, scale)


def _expert_rows(a: dict) -> list[torch.Tensor]:
    # The backward's extras: per (token, rank) slot, the gate/up outputs [T * k, 2I] and the
    # SwiGLU rows [T * k, I], in x's dtype.
    x, slots, i = a["x"], a["indices"].numel(), a["down"].shape[2]
    return [x.new_empty((slots, 2 * i)), x.new_empty((slots, i))]


@op(
    "moe",
    grad_args=("x", "weights", "gate_up", "down"),
    unit_grads=("x", "weights"),
    optional=True,
    operator=Operator(
        "Tensor x, Tensor indices, Tensor weights, Tensor gate_up, Tensor down",
        outputs=lambda a: [torch.empty_like(a["x"], memory_format=torch.contiguous_format)],
        extras=_expert_rows,
    ),
)
def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The chosen experts' SwiGLU MLPs, weighted and summed:
    ``out[t] = sum_r weights[t, r] * down[e] @ (silu(g) * u)``, ``e = indices[t, r]``,
    ``[g; u] = gate_up[e] @ x[t]``.

    Shapes: ``x [T, H]`` (bf16/fp16/fp32), ``indices [T, k]`` (int32/int64 in ``[0, E)``, e.g.
    from :func:`moe_route`), ``weights [T, k]`` (float), ``gate_up [E, 2I, H]`` (each expert's
    gate rows then up rows: transformers' ``gate_up_proj``) and ``down [E, H, I]`` in x's dtype
    (any strides) -> ``[T, H]`` in x's dtype. gate and up are rounded to x's dtype, ``silu(g) *
    u`` is computed in fp32 and rounded once, the down projection and the weighted sum stay in
    fp32, the k terms added in ascending rank ``r``, rounded once at the end.

    Contract: row t depends only on ``x[t]``, ``indices[t]``, ``weights[t]`` and its experts'
    weights, bitwise: not on the batch size, on how many tokens share an expert or on their
    order. Differentiable in ``x``, ``weights``, ``gate_up`` and ``down``; the backward is
    deterministic (no floating-point atomics). An index outside ``[0, E)`` is a ``ValueError``
    where value checks run (CPU, ``RLK_VALIDATE``); elsewhere its token's output is NaN and the
    kernel reports it (``rlk_triton._bounds``).

    Example::

        out = rlk.moe_experts(x, indices, weights, experts.gate_up_proj, experts.down_proj)
    """
    check_experts(x, indices, weights, gate_up, down)
    fn = selection.optional_op(x.device, "moe_experts", "rlk.moe_experts")
    return fn(x, indices.contiguous(), weights.contiguous(), gate_up, down)


def check_experts(x, indices, weights, gate_up, down, experts: int | None = None) -> None:
    """:func:`moe_experts`' argument checks, the indices in ``[0, experts)`` (default: the
    ``E`` experts of ``gate_up``; ``rlk.parallel.expert_parallel_moe_experts`` passes a shard
    of them and the count of all)."""
    chk.tensor("x", x, dtypes=chk.FLOAT_DTYPES, ndim=2, nonempty_last=True)
    chk.tensor("indices", indices, dtypes=_INDEX_DTYPES, ndim=2, contiguous=False)
    chk.tensor("weights", weights, dtypes=chk.FLOAT_DTYPES, ndim=2, contiguous=False)
    chk.tensor("gate_up", gate_up, dtypes=chk.FLOAT_DTYPES, ndim=3, contiguous=False)
    chk.tensor("down", down, dtypes=chk.FLOAT_DTYPES, ndim=3, contiguous=False)
    chk.same_dtype(x=x, gate_up=gate_up, down=down)
    chk.same_device(x=x, indices=indices, weights=weights, gate_up=gate_up, down=down)
    T, H = x.shape
    E, I2, _ = gate_up.shape
    if indices.shape[0] != T or indices.shape[1] < 1:
        raise ValueError(f"indices must have shape ({T}, k >= 1), got {tuple(indices.shape)}")
    chk.shape("weights", weights, indices.shape, "the shape of indices")
    if E < 1 or I2 < 2 or I2 % 2:
        raise ValueError(f"gate_up must be [E, 2I, H] with E, I >= 1, got {tuple(gate_up.shape)}")
    chk.shape("gate_up", gate_up, (E, I2, H), "[experts, 2 * intermediate, x.shape[1]]")
    chk.shape("down", down, (E, H, I2 // 2), "[experts, x.shape[1], intermediate]")
    experts = E if experts is None else experts
    chk.index_range("indices", indices, 0, experts, f"there are {experts} experts")
