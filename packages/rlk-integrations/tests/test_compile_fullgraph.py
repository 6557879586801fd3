"""``torch.compile(model, fullgraph=True)(input_ids)`` of a patched model, as users write it: a
plain ``[B, S]`` batch, with and without an ``attention_mask`` (left padding), one graph, the
eager logits bit for bit, for every architecture (Qwen2, Llama, Qwen3, Qwen3-MoE, Qwen2-MoE,
DeepSeek-V3), and for the MoE models every gradient too: on the CPU (slow stage; the gradients of
Qwen3-MoE alone, the other two compiled backwards taking 15-40 s each under the interpreter) and
on a GPU (``gpu``: every MoE model's gradients).

What would stop the graph is a shape that depends on values: the real tokens of a padded batch
(eagerly gathered by ``nonzero``), the sequences of a packed row, transformers dropping a mask
without padding, the MoE dispatch. Under compile, attention takes every token, the pad tokens
as one sequence of their own whose rows are dropped, and the MoE ops are opaque operators.

The negative control: the graph Dynamo captures is checked to run rlk's operators and no stock
matmul, attention, softmax, top-k or activation; the same check on an unpatched model fails.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from rlk_integrations.models.transformers import patch_model  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

#: Stock compute that must not be in a patched model's graph (Dynamo's call targets).
STOCK = re.compile(
    r"\b(linear|matmul|mm|bmm|scaled_dot_product_attention|softmax|topk|silu|rms_norm)\b"
)


def _targets(graphs) -> set[str]:
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def stock_compute(graphs) -> list[str]:
    """The call targets of Dynamo's ``graphs`` that are stock compute, not rlk's operators."""
    return sorted(t for t in _targets(graphs) if not t.startswith("rlk.") and STOCK.search(t))


def _compile(model, inductor: bool):
    """``torch.compile(model, fullgraph=True)`` with a backend that keeps Dynamo's graphs and
    hands them to Inductor (or runs them as they are)."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs) if inductor else gm.forward

    return torch.compile(model, fullgraph=True, backend=backend), graphs


def _batch(vocab: int, masked: bool, device: str = "cpu"):
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    if not masked:
        return ids.to(device), {}
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    return ids.to(device), {"attention_mask": mask.to(device)}


def _step(model, fn, ids, kwargs, train: bool):
    """The logits, and with ``train`` every parameter's gradient of a weighted sum of them."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        logits = fn(ids, **kwargs).logits
    if not train:
        return logits, {}
    weights = torch.linspace(-1, 1, logits.numel(), device=logits.device).view(logits.shape)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


#: The MoE models and the router operator each runs (besides ``rlk.moe_experts``).
MOE = {
    "tiny-qwen3-moe": "rlk.moe_route",
    "tiny-qwen2-moe": "rlk.moe_route",
    "tiny-deepseek-v3": "rlk.moe_route_grouped",
}
#: The CPU in the slow stage; a GPU on the GPU machine (``pytest -m gpu``).
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "tiny-qwen3", *MOE])
def test_compiled_model_gives_the_eager_logits(name, masked, device):
    """The logits; for the MoE models also every gradient (their ops' compiled backward)."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    model = patch_model(zoo.load_model(name, device=device))
    ids, kwargs = _batch(model.config.vocab_size, masked, device)
    compiled, graphs = _compile(model, inductor=True)
    train = name in MOE and (device != "cpu" or name == "tiny-qwen3-moe")
    with inductor_config.patch(emulate_precision_casts=True):
        got, got_grads = _step(model, compiled, ids, kwargs, train)  # compiled first
    want, want_grads = _step(model, model, ids, kwargs, train)
    assert torch.equal(want, got)
    changed = [n for n in want_grads if not torch.equal(want_grads[n], got_grads[n])]
    assert not changed, f"gradients that compiling changed: {changed}"
    assert len(graphs) == 1
    want_ops = {"rlk.linear", "rlk.attention", "rlk.rms_norm", "rlk.apply_rotary"}
    if name in MOE:
        want_ops |= {MOE[name], "rlk.moe_experts"}
    assert want_ops <= _targets(graphs)
    assert not stock_compute(graphs)


def test_one_row_compiles_as_one_sequence():
    # B = 1 without a mask: the packed-row path (positions that may restart), without a host
    # read. Dynamo's graph run as it is: the bits are those of the same rlk ops.
    torch._dynamo.reset()
    model = patch_model(zoo.load_model("tiny"))
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator())
    compiled, graphs = _compile(model, inductor=False)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, model(ids).logits)
    assert len(graphs) == 1 and "rlk.attention" in _targets(graphs)


def test_the_check_catches_a_stock_graph():
    # The negative control: an unpatched model's graph runs stock linears and attention.
    torch._dynamo.reset()
    model = zoo.load_model("tiny")
    compiled, graphs = _compile(model, inductor=False)
    with torch.no_grad():
        compiled(*_batch(model.config.vocab_size, masked=False)[:1])
    assert "linear" in " ".join(stock_compute(graphs))
