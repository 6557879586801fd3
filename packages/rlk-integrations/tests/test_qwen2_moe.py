"""Qwen2-MoE on rlk (tiny-qwen2-moe): its sigmoid-gated shared expert, the gate's row-wise
sigmoid, gradients against transformers', and the paged rollout = the padded one = training.
What it shares with Qwen3-MoE (the block against transformers', refusals, the routing log,
``rlk consistency``) is tested in test_moe.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rlk  # noqa: E402
from rlk_integrations.engine import paged, rollout, training  # noqa: E402
from rlk_integrations.models import moe as rmoe  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import consistency, zoo  # noqa: E402

MODEL = "tiny-qwen2-moe"


def _ids(b, s, seed=0):
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__ == "Qwen2MoeSparseMoeBlock"]


def test_shared_expert_is_gated_and_counted():
    """The shared expert and its gate are patched; the block's output is the routed experts
    plus sigmoid(gate) * shared expert: zeroing
    the gate's weight halves the shared term (sigmoid(0) = 1/2), zeroing the shared expert's
    down projection leaves the routed experts alone."""
    model = rt.patch_model(zoo.load_model(MODEL, dtype=torch.float32))
    block = _blocks(model)[0]
    # The shared expert and its gate run on rlk (patched like any MLP and linear).
    assert block.shared_expert.forward.__func__ is rt._mlp_forward
    assert block.shared_expert_gate.forward.__func__ is rt._linear_forward
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), rlk.use_backend("reference"):
        full = block(x[None])[0]
        shared = block.shared_expert(x)
        block.shared_expert_gate.weight.zero_()
        half = rmoe.shared_expert(block, x)
        block.shared_expert.down_proj.weight.zero_()
        routed = block(x[None])[0]
    torch.testing.assert_close(half, 0.5 * shared, rtol=0, atol=0)
    gate = torch.sigmoid(x @ _blocks(zoo.load_model(MODEL, dtype=torch.float32))[0]
                         .shared_expert_gate.weight.T)  # fmt: skip
    torch.testing.assert_close(full, routed + gate * shared, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_rows_independent_and_differentiable(dtype):
    """rmoe.sigmoid: each row's bits are the same alone as in a batch of any size (the
    contract torch.sigmoid breaks on a CPU between its vectorised loop and scalar tail), its
    values sigmoid's, and its gradient sigmoid's."""
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(203, 1, generator=g) * 4).to(dtype)
    whole = rmoe.sigmoid(z)
    assert whole.dtype == torch.float32 and whole.shape == (203, 1)
    for start, n in ((0, 1), (5, 17), (100, 103), (201, 2)):
        assert torch.equal(rmoe.sigmoid(z[start : start + n]), whole[start : start + n])
    torch.testing.assert_close(whole, torch.sigmoid(z.float()), rtol=1e-6, atol=1e-7)
    zz = z.float().detach().requires_grad_()
    rmoe.sigmoid(zz).sum().backward()
    s = torch.sigmoid(z.float())
    torch.testing.assert_close(zz.grad, s * (1 - s), rtol=1e-5, atol=1e-7)


def test_gradients_match_transformers():
    """fp32 on the float64 backend: the patched block's gradients (router, experts, shared
    expert and its gate) are transformers' to rounding."""
    ids = _ids(2, 6, seed=3)
    grads = []
    for patched in (False, True):
        model = zoo.load_model(MODEL, dtype=torch.float32)
        if patched:
            rt.patch_model(model)
        with rlk.use_backend("reference"):
            model(ids).logits.float().logsumexp(-1).mean().backward()
        block = _blocks(model)[0]
        grads.append([block.gate.weight.grad, block.experts.gate_up_proj.grad,
                      block.shared_expert.up_proj.weight.grad,
                      block.shared_expert_gate.weight.grad])  # fmt: skip
    for stock, ours in zip(*grads):
        torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-6)


def test_paged_rollout_equals_padded_and_training():
    """bf16 on the auto backend: the paged rollout (2 slots, chunked prompts sharing steps with
    decodes, fused q/k/v and gate/up projections) samples the padded rollout's tokens with its
    log-probabilities, and the packed training recompute gives the same bits."""
    model = rt.patch_model(zoo.load_model(MODEL, dtype=torch.bfloat16))
    prompts = consistency.random_prompts(3, 512, 3, 7, seed=4)
    seeds = [7, 8, 9]
    ro = paged.generate_paged(
        model, prompts, 4, seeds=seeds, page_size=4, max_batch=2, max_step_tokens=6,
        prefill_chunk=4,
    )  # fmt: skip
    assert ro.extra["mixed_steps"] > 0
    padded = rollout.generate(model, prompts, 4, seeds=seeds)
    train = training.recompute_logprobs(model, ro.samples, 2, order=[2, 0, 1])
    for a, b, lp in zip(padded.samples, ro.samples, train):
        assert a.response == b.response
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(b.logprobs, lp)
