"""Expert parallelism (``rlk.parallel.expert_parallel_moe_experts``, ``models.ep.shard_ep``) is
bitwise one device.

Spawned gloo processes (``ep_workers``; slow stage) run the op at EP 2, 4 and 8 on uneven
shares of a batch (EP 8 leaves rank 0 without tokens) and tiny-qwen3-moe at EP 2 and 4 (a
padded rollout of each rank's prompts, then the recompute's forward and backward): every
token's output, d(x), d(weights), every sample's tokens and log-probabilities, and every
expert's weight gradient (the rank's shard) must equal the one-device run's bits. The negative
control swaps in a combine that adds a token's expert outputs in arrival order and must be
caught. In-process (fast): EP = 1 runs the same code path to ``moe_experts``' bits, the float64
oracle agrees with its own ``moe_experts``, and bad arguments are refused by name.
"""

from __future__ import annotations

import pytest
import torch

import rlk
import rlk.parallel as P

pytest.importorskip("transformers")

from ep_workers import bounds, cases_worker, model_worker, op_worker, spawn  # noqa: E402

from rlk_integrations.engine import rollout, training  # noqa: E402
from rlk_integrations.models import ep  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

#: tiny-qwen3-moe's expert shapes: 16 experts, 4 per token, H = 64, I = 32.
T, H, E, I, K = 12, 64, 16, 32, 4


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    weights, indices = rlk.moe_route(torch.randn(T, E, generator=g), K)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    return x, indices, weights, gate_up, down, torch.randn(T, H, generator=g)


def _one_device(inputs, fn=rlk.moe_experts):
    """``(out, dx, dweights, dgate_up, ddown)`` of the whole batch on one device."""
    x, indices, weights, gate_up, down, grad = (t.clone() for t in inputs)
    for t in (x, weights, gate_up, down):
        t.requires_grad_()
    out = fn(x, indices, weights, gate_up, down)
    (out.float() * grad).sum().backward()
    return out.detach(), x.grad, weights.grad, gate_up.grad, down.grad


def _differing_tokens(ranks, want, world) -> dict[str, int]:
    """Per result, how many tokens (rows) or experts differ in any bit from one device's."""
    b = bounds(T, world)
    bad = {}
    for i, name in enumerate(("out", "dx", "dweights")):
        got = torch.cat([r[i] for r in ranks])
        bad[name] = int((got.view(T, -1) != want[i].view(T, -1)).any(1).sum())
        assert got.shape[0] == b[-1]
    for i, name in ((3, "dgate_up"), (4, "ddown")):
        got = torch.cat([r[i] for r in ranks])
        bad[name] = int((got.view(E, -1) != want[i].view(E, -1)).any(1).sum())
    return bad


NONE_DIFFER = {"out": 0, "dx": 0, "dweights": 0, "dgate_up": 0, "ddown": 0}


def test_one_rank_runs_the_ep_path_to_moe_experts_bits():
    # No process group: the exchange has one rank and the EP code path still runs (dispatch,
    # per-pair outputs, combine), giving moe_experts' bits forward and backward.
    inputs = _inputs(torch.bfloat16)
    assert P.group_info() == (0, 1)
    want = _one_device(inputs)
    got = _one_device(inputs, P.expert_parallel_moe_experts)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_reference_one_rank_is_its_moe_experts():
    inputs = _inputs(torch.float32, seed=1)
    with rlk.use_backend("reference"):
        want = _one_device(inputs)
        got = _one_device(inputs, P.expert_parallel_moe_experts)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_refused_by_name():
    x, indices, weights, gate_up, down, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="indices"):
        P.expert_parallel_moe_experts(x, indices + E, weights, gate_up, down)
    with pytest.raises(ValueError, match="down"):
        P.expert_parallel_moe_experts(x, indices, weights, gate_up, down[:, :, :-1])
    with pytest.raises(TypeError, match="gate_up"):
        P.expert_parallel_moe_experts(x, indices, weights, None, down)
    dense = zoo.load_model("tiny", dtype=torch.float32)
    with pytest.raises(ValueError, match="patch_model"):
        ep.shard_ep(dense)
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        ep.shard_ep(rt.patch_model(dense))


def _prompts(vocab, n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (3 + i % 3,), generator=g).tolist() for i in range(n)]


#: The op's cases: name -> (EP size, dtype, seed, ``op_worker``'s mode).
OP_CASES = {
    "op2": (2, torch.float32, 2, "exact"),
    "op4": (4, torch.bfloat16, 4, "exact"),
    "op8": (8, torch.float32, 8, "exact"),
    "fake4": (4, torch.float32, 4, "arrival"),
    "ref2": (2, torch.float32, 3, "reference"),
}
MODEL, MODEL_SIZES = "tiny-qwen3-moe", (2, 4)
PROMPTS, NEW_TOKENS = 4, 2


@pytest.fixture(scope="module")
def runs():
    """One spawn of 8 gloo processes runs every case (a process's start costs more than a
    case); returns ``(op inputs, model, prompts, {case: [each rank's result]})``."""
    model = rt.patch_model(zoo.load_model(MODEL, dtype=torch.float32).eval())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = _prompts(model.config.vocab_size, PROMPTS)
    inputs = {name: _inputs(dtype, seed) for name, (_, dtype, seed, _) in OP_CASES.items()}
    cases = {name: (size, op_worker, (inputs[name], mode))
             for name, (size, _, _, mode) in OP_CASES.items()}  # fmt: skip
    for size in MODEL_SIZES:
        cases[f"model{size}"] = (size, model_worker, (MODEL, state, prompts, NEW_TOKENS))
    ranks = spawn(cases_worker, 8, cases)
    by_case = {name: [ranks[r][name] for r in range(size)]
               for name, (size, _, _) in cases.items()}  # fmt: skip
    return inputs, model, prompts, by_case


@pytest.mark.slow
@pytest.mark.parametrize("case", ["op2", "op4", "op8"])
def test_ep_op_is_one_device(runs, case):
    # EP 2 (fp32), 4 (bf16), 8 (fp32, rank 0 without tokens), uneven shares of 12 tokens.
    inputs, _, _, by_case = runs
    got = _differing_tokens(by_case[case], _one_device(inputs[case]), OP_CASES[case][0])
    assert got == NONE_DIFFER


@pytest.mark.slow
def test_a_combine_in_arrival_order_is_caught(runs):
    # The negative control: each token's terms added as they arrive (grouped by the rank that
    # holds the expert) differ from one device for some tokens, forward and backward (the
    # experts' own gradients do not go through the combine).
    inputs, _, _, by_case = runs
    bad = _differing_tokens(by_case["fake4"], _one_device(inputs["fake4"]), 4)
    assert bad["out"] > 0 and bad["dx"] > 0, bad


@pytest.mark.slow
def test_reference_ep_is_its_one_device(runs):
    # The float64 oracle's exchanges (differentiable all-to-alls) at EP 2: its own one-device
    # output bits (each pair's float64 value, a token's terms added by ascending expert), and
    # gradients to float64 rounding (autograd sums a row's gradient in another order).
    inputs, _, _, by_case = runs
    with rlk.use_backend("reference"):
        want = _one_device(inputs["ref2"])
    got = [torch.cat([r[i] for r in by_case["ref2"]]) for i in range(5)]
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def one_device(runs):
    """tiny-qwen3-moe on one device: every prompt in one rollout, then every sample in one
    packed recompute (the ranks' shares are consecutive, so this is their concatenation in
    rank order: the order an expert's rank adds its slots in)."""
    _, model, prompts, _ = runs
    ro = rollout.generate(model, prompts, NEW_TOKENS, seeds=list(range(len(prompts))))
    lps = training.packed_logprobs(model, ro.samples)
    (-torch.cat(lps).sum()).backward()
    return ro.samples, lps, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("world", MODEL_SIZES)
def test_ep_rollout_and_recompute_are_one_device(runs, one_device, world):
    samples, lps, grads = one_device
    ranks = runs[3][f"model{world}"]
    got = [s for r in ranks for s in r[0]]
    assert [s.response for s in got] == [s.response for s in samples]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(got, samples))
    assert all(torch.equal(a, b) for a, b in zip([lp for r in ranks for lp in r[1]], lps))
    layers = runs[1].config.num_hidden_layers
    for r, (_, _, got_grads) in enumerate(ranks):
        assert len(got_grads) == 2 * layers
        for name, g in got_grads.items():
            assert torch.equal(g, P.shard(grads[name], 0, rank=r, world_size=world)), (r, name)
