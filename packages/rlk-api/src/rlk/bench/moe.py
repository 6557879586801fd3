"""``rlk bench`` family ``moe``: a mixture-of-experts layer (router, top-k, experts, combine)
against stock transformers' own, bf16: Qwen3-30B-A3B's ``Qwen3MoeSparseMoeBlock`` and
DeepSeek-V3's ``DeepseekV3MoE``.

The layers (:data:`LAYERS`), on the same random inputs and the same weights in every impl:

- ``qwen3-30b-a3b``: hidden 2048, 128 experts of 768 intermediate units, 8 per token, the top-k
  weights renormalised. rlk: ``rlk.linear`` (router logits), ``rlk.moe_route``,
  ``rlk.moe_experts``.
- ``deepseek-v3``: DeepSeek-V3's dimensions (hidden 7168, experts of 2048, 8 per token from the
  best 4 of 8 groups, sigmoid scores with a selection bias, renormalised, times
  ``routed_scaling_factor`` 2.5, one shared expert of 2048) with 128 of its 256 experts (16
  per group). Why 128: the stock peer's fwd+bwd. Its experts loop takes each expert's weights
  by indexing, whose backward allocates a zero gradient of the whole ``[E, 2I, H]`` and ``[E,
  H, I]`` tensors per expert hit; on a CPU (E = 32, H = 1024, I = 512, 256 tokens) a step
  peaked 2.4x the expert weights above what the weights hold. On a GPU that is, estimated,
  3.4x the weights plus about 6 GB of saved activations at 16384 tokens: some 45 GB at 128
  experts (11.3 GB of weights), over 80 GB at 256 (22.5 GB). rlk: ``rlk.linear`` of the fp32
  upcasts (the router's logits in fp32, as transformers computes them),
  ``rlk.moe_route_grouped``, ``rlk.moe_experts``, plus the shared expert
  ``down(silu_and_mul(gate(x), up(x)))`` on ``rlk.linear`` and ``rlk.silu_and_mul``: the
  patched model's layer (``rlk_integrations.models.moe.moe_forward``). The selection bias is
  random at a trained model's scale (0.01), float32 as checkpoints store it, so that the choice
  differs from the scores' order.

Impls of each layer:

- ``rlk``: rlk's ops, as above;
- ``stock``: transformers' block with its eager experts (a loop over the experts hit, which
  reads the device: it cannot be captured in a CUDA graph, so its rows are timed eagerly);
- ``stock-grouped_mm``: the same block with transformers' ``grouped_mm`` experts, which run
  ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where the installed torch has them
  (a peer that fails, such a torch missing, is left out with its error).

Rows: ``moe_layer.fwd`` on inputs that do not require grad, ``moe_layer.fwd+bwd`` the forward
then ``torch.autograd.grad`` to the input and every weight (router, experts, shared expert).
Token counts: decode (1, 64, 256 tokens) and training (4096, 16384). TFLOP/s counts the routed
work: ``2 T H E`` for the router, ``6 T k H I`` for the experts, ``6 T H I`` for a shared
expert (the forward; three times that for fwd+bwd). transformers is imported only here; without
it the stock rows are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

import rlk
from rlk.bench import timing as _timing
from rlk.bench._peers import Case, time_op


class Layer(NamedTuple):
    """A benchmarked MoE layer: ``groups`` ``(n_group, topk_group)`` makes it DeepSeek-V3's
    (grouped sigmoid router, selection bias, :data:`SCALE`, one shared expert of ``inter``
    units); None, Qwen3-MoE's (softmax top-k, renormalised)."""

    name: str
    hidden: int
    experts: int
    k: int
    inter: int
    groups: tuple[int, int] | None = None


LAYERS = [
    Layer("qwen3-30b-a3b", 2048, 128, 8, 768),
    Layer("deepseek-v3", 7168, 128, 8, 2048, (8, 4)),
]
TOKENS = [1, 64, 256, 4096, 16384]
QUICK_TOKENS = [64, 4096]
DTYPE = torch.bfloat16
#: DeepSeek-V3's ``routed_scaling_factor``.
SCALE = 2.5


def make_params(layer: Layer) -> dict[str, torch.Tensor]:
    """The layer's random weights (bf16 Parameters not requiring grad, each ``~ N(0, 1/fan_in)``;
    DeepSeek-V3's float32 selection ``bias`` a plain tensor): ``router [E, H]``, ``gate_up [E,
    2I, H]``, ``down [E, H, I]``, and for DeepSeek-V3 ``shared_gate``/``shared_up [I, H]``,
    ``shared_down [H, I]``, ``bias [E]``."""

    def param(*shape: int) -> torch.nn.Parameter:
        w = _timing.randn(*shape, dtype=DTYPE) * shape[-1] ** -0.5
        return torch.nn.Parameter(w, requires_grad=False)

    H, E, I = layer.hidden, layer.experts, layer.inter
    p = {"router": param(E, H), "gate_up": param(E, 2 * I, H), "down": param(E, H, I)}
    if layer.groups is not None:
        p.update(shared_gate=param(I, H), shared_up=param(I, H), shared_down=param(H, I))
        p["bias"] = _timing.randn(E, dtype=torch.float32) * 0.01
    return p


def rlk_route(
    layer: Layer, x: torch.Tensor, p: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's router on rlk's ops: ``x [T, H]`` -> float32 weights and int64 experts ``[T,
    k]`` (``p``: :func:`make_params`)."""
    if layer.groups is None:
        return rlk.moe_route(rlk.linear(x, p["router"]), layer.k, normalize=True)
    logits = rlk.linear(x.float(), p["router"].float())
    return rlk.moe_route_grouped(
        logits, p["bias"], layer.k, *layer.groups, normalize=True, scale=SCALE
    )


def rlk_layer(layer: Layer, x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer on rlk's ops: ``x [T, H]`` bf16 -> ``[T, H]`` bf16 (``p``: :func:`make_params`).

    Example::

        y = rlk_layer(LAYERS[1], x, make_params(LAYERS[1]))
    """
    w, idx = rlk_route(layer, x, p)
    out = rlk.moe_experts(x, idx, w, p["gate_up"], p["down"])
    if layer.groups is None:
        return out
    gate, up = rlk.linear(x, p["shared_gate"]), rlk.linear(x, p["shared_up"])
    return out + rlk.linear(rlk.silu_and_mul(gate, up), p["shared_down"])


def stock_blocks(layer: Layer, p: dict[str, torch.Tensor]) -> dict[str, torch.nn.Module] | str:
    """transformers' block per experts implementation (``stock``: eager, ``stock-grouped_mm``)
    on the weights ``p``, taking ``[1, T, H]``; a reason if transformers lacks it."""
    H, E, k, I = layer.hidden, layer.experts, layer.k, layer.inter
    try:
        if layer.groups is None:
            from transformers import Qwen3MoeConfig as Config
            from transformers.models.qwen3_moe.modeling_qwen3_moe import (
                Qwen3MoeSparseMoeBlock as Block,
            )

            kw: dict = dict(num_experts=E)
        else:
            from transformers import DeepseekV3Config as Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
                DeepseekV3MoE as Block,
            )

            n_group, topk_group = layer.groups
            kw = dict(n_routed_experts=E, n_group=n_group, topk_group=topk_group,
                      n_shared_experts=1, routed_scaling_factor=SCALE)  # fmt: skip
    except Exception as e:  # transformers not installed, or without this model
        return f"{type(e).__name__}: {e}"
    blocks = {}
    for impl, experts in (("stock", "eager"), ("stock-grouped_mm", "grouped_mm")):
        cfg = Config(hidden_size=H, num_experts_per_tok=k, moe_intermediate_size=I,
                     norm_topk_prob=True, **kw)  # fmt: skip
        cfg._experts_implementation = experts
        with torch.device("meta"):
            block = Block(cfg)
        block.gate.weight = p["router"]
        block.experts.gate_up_proj = p["gate_up"]
        block.experts.down_proj = p["down"]
        if layer.groups is not None:
            block.gate.e_score_correction_bias = p["bias"]
            for n in ("gate", "up", "down"):
                getattr(block.shared_experts, f"{n}_proj").weight = p[f"shared_{n}"]
        blocks[impl] = block
    return blocks


def _layer_rows(emit, layer: Layer, T: int) -> None:
    name, H, E, k, I = layer[:5]
    p = make_params(layer)
    x = _timing.randn(T, H, dtype=DTYPE)
    leaves = (x, *(w for n, w in p.items() if n != "bias"))
    cases: list[Case] = [("rlk", lambda: rlk_layer(layer, x, p), leaves)]
    shape = f"T={T} H={H} E={E} k={k} I={I} ({name})"
    blocks = stock_blocks(layer, p)
    if isinstance(blocks, str):
        for impl in ("stock", "stock-grouped_mm"):
            emit({"op": "moe_layer", "shape": shape, "dtype": "bf16", "impl": impl,
                  "left_out": blocks})  # fmt: skip
    else:
        for impl, block in blocks.items():
            # The [1, T, H] view is taken per call: x requires grad only from fwd+bwd on.
            cases.append((impl, lambda block=block: block(x.view(1, T, H)), leaves))
    flops = 2 * T * H * E + 6 * T * k * H * I + (6 * T * H * I if layer.groups else 0)
    time_op(emit, "moe_layer", shape, DTYPE, cases, {"flops": flops}, {"flops": 3 * flops})


def run(quick: bool, emit: Callable[[dict], None]) -> None:
    """Emit the rows of every layer and token count (the quick ones when ``quick``)."""
    for layer in LAYERS:
        for T in QUICK_TOKENS if quick else TOKENS:
            _layer_rows(emit, layer, T)
