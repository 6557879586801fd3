"""``rlk bench`` family ``moe``: a mixture-of-experts layer (router, top-k, experts, combine)
against stock transformers' ``Qwen3MoeSparseMoeBlock``, bf16.

Impls, on the same random inputs and the same weights (Qwen3-30B-A3B's layer: hidden 2048,
128 experts of 768 intermediate units, 8 per token, the top-k weights renormalised):

- ``rlk``: ``rlk.linear`` (router logits), ``rlk.moe_route``, ``rlk.moe_experts``;
- ``stock``: transformers' block with its eager experts (a loop over the experts hit, which
  reads the device: it cannot be captured in a CUDA graph, so its rows are timed eagerly);
- ``stock-grouped_mm``: the same block with transformers' ``grouped_mm`` experts, which run
  ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where the installed torch has them
  (a peer that fails, such a torch missing, is left out with its error).

Rows: ``moe_layer.fwd`` on inputs that do not require grad, ``moe_layer.fwd+bwd`` the forward
then ``torch.autograd.grad`` to the input, the router weight and both expert weights. Token
counts: decode (1, 64, 256 tokens) and training (4096, 16384). TFLOP/s counts the routed
work: ``2 T H E`` for the router, ``6 T k H I`` for the experts (the forward; three times that
for fwd+bwd). transformers is imported only here; without it the stock rows are left out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import rlk
from rlk.bench import timing as _timing
from rlk.bench._peers import Case, time_op

#: (name, hidden, experts, per token, intermediate): Qwen3-30B-A3B's MoE layer.
LAYERS = [("qwen3-30b-a3b", 2048, 128, 8, 768)]
TOKENS = [1, 64, 256, 4096, 16384]
QUICK_TOKENS = [64, 4096]
DTYPE = torch.bfloat16


def _rlk_layer(x, router_w, gate_up, down, k: int) -> torch.Tensor:
    w, idx = rlk.moe_route(rlk.linear(x, router_w), k, normalize=True)
    return rlk.moe_experts(x, idx, w, gate_up, down)


def _stock_blocks(H: int, E: int, k: int, I: int, params: dict) -> dict[str, Callable] | str:
    """transformers' block per experts implementation, on ``params``; a reason if unavailable."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except Exception as e:  # transformers not installed, or without Qwen3-MoE
        return f"{type(e).__name__}: {e}"
    blocks = {}
    for impl, experts in (("stock", "eager"), ("stock-grouped_mm", "grouped_mm")):
        cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k,
                             moe_intermediate_size=I, norm_topk_prob=True)  # fmt: skip
        cfg._experts_implementation = experts
        with torch.device("meta"):
            block = Qwen3MoeSparseMoeBlock(cfg)
        block.gate.weight = params["router"]
        block.experts.gate_up_proj = params["gate_up"]
        block.experts.down_proj = params["down"]
        blocks[impl] = block
    return blocks


def _layer_rows(emit, name: str, T: int, H: int, E: int, k: int, I: int) -> None:
    def param(*shape: int) -> torch.nn.Parameter:
        w = _timing.randn(*shape, dtype=DTYPE) * shape[-1] ** -0.5
        return torch.nn.Parameter(w, requires_grad=False)

    params = {"router": param(E, H), "gate_up": param(E, 2 * I, H), "down": param(E, H, I)}
    x = _timing.randn(T, H, dtype=DTYPE)
    leaves = (x, params["router"], params["gate_up"], params["down"])
    cases: list[Case] = [
        ("rlk", lambda: _rlk_layer(x, params["router"], params["gate_up"], params["down"], k),
         leaves),
    ]  # fmt: skip
    shape = f"T={T} H={H} E={E} k={k} I={I} ({name})"
    blocks = _stock_blocks(H, E, k, I, params)
    if isinstance(blocks, str):
        for impl in ("stock", "stock-grouped_mm"):
            emit({"op": "moe_layer", "shape": shape, "dtype": "bf16", "impl": impl,
                  "left_out": blocks})  # fmt: skip
    else:
        for impl, block in blocks.items():
            # The [1, T, H] view is taken per call: x requires grad only from fwd+bwd on.
            cases.append((impl, lambda block=block: block(x.view(1, T, H)), leaves))
    flops = 2 * T * H * E + 6 * T * k * H * I
    time_op(emit, "moe_layer", shape, DTYPE, cases, {"flops": flops}, {"flops": 3 * flops})


def run(quick: bool, emit: Callable[[dict], None]) -> None:
    """Emit the rows of every layer and token count (the quick ones when ``quick``)."""
    for name, H, E, k, I in LAYERS:
        for T in QUICK_TOKENS if quick else TOKENS:
            _layer_rows(emit, name, T, H, E, k, I)
