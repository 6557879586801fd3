"""The portable code of the ascend backend on CPU: its fixed-order primitives, then the whole
conformance kit on a CPU registration of the backend (accuracy vs rlk_reference, batch,
run-to-run, tuning and path invariance, all bitwise)."""

from __future__ import annotations

import types

import pytest
import torch

import rlk
import rlk_reference
from rlk import selection
from rlk.testing import bad_inputs
from rlk_ascend import portable, portable_losses
from rlk_ascend.backend import make_impl

TEST_NAME = "ascend_cpu_test"


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def test_fixed_sum_order_is_the_documented_one():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    got = portable.fixed_sum(x, 8)
    # Written out: zero pad to 304, each chunk of 8 summed pairwise (i + h), chunks added
    # to 0 in ascending order, all in fp32.
    padded = torch.cat((x, x.new_zeros(3, 4)), dim=1)
    want = torch.zeros(3)
    for c in range(38):
        part = padded[:, c * 8 : (c + 1) * 8]
        part = part[:, :4] + part[:, 4:]
        part = part[:, :2] + part[:, 2:]
        want = want + (part[:, 0] + part[:, 1])
    assert torch.equal(_f32_bits(got), _f32_bits(want))
    assert torch.allclose(got.double(), x.double().sum(1), rtol=1e-5, atol=1e-5)


def test_fixed_sum_continues_over_chunk_aligned_ranges():
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    whole = portable.fixed_sum(x, 32)
    part = portable.fixed_sum(x[:, 64:], 32, acc=portable.fixed_sum(x[:, :64], 32))
    assert torch.equal(_f32_bits(whole), _f32_bits(part))


def test_dot_rows_do_not_depend_on_batch_or_blocking():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(37, 70, generator=g).bfloat16()
    b = torch.randn(19, 70, generator=g).bfloat16()
    full = portable.dot(a, b)
    assert torch.allclose(full.double(), a.double() @ b.double().T, rtol=1e-5, atol=1e-4)
    for cfg in portable.CONFIGS:
        with portable.use_config("linear", cfg):
            assert torch.equal(_f32_bits(portable.dot(a, b)), _f32_bits(full))
    for i in (0, 5, 36):
        assert torch.equal(_f32_bits(portable.dot(a[i : i + 1], b)), _f32_bits(full[i : i + 1]))


def test_prefix_sum():
    x = torch.rand(4, 77, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(portable.prefix_sum(x), x.cumsum(-1), rtol=1e-6, atol=1e-6)


def test_exp_log_bits_do_not_depend_on_position():
    """The assumption of portable.py: an elementwise exp/log gives an element the same bits
    wherever it sits (vector body or tail, any offset)."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(4)) * 8
    ref_exp, ref_log = torch.exp(x), torch.log(x.abs() + 1e-3)
    for n in (1, 3, 7, 15, 17, 33):
        for s in range(0, 64, 5):
            piece = x[s : s + n].clone()
            assert torch.equal(_f32_bits(torch.exp(piece)), _f32_bits(ref_exp[s : s + n]))
            assert torch.equal(
                _f32_bits(torch.log(piece.abs() + 1e-3)), _f32_bits(ref_log[s : s + n])
            )


def test_fused_logprobs_gradients_equal_unfused():
    """Beyond the forward contract: linear_logprobs' gradients are the bits of linear's
    backward fed by logprobs' backward (same rounding of dlogits, same dW row chunks)."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(70, 48, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(300, 48, generator=g) * 0.2).bfloat16().requires_grad_()
    bias = torch.randn(300, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, 300, (70,), generator=g)
    glp, gent = torch.randn(70, generator=g), torch.randn(70, generator=g)
    with portable.use_config("linear_logprobs", {"max_elements": 1 << 14}):  # 32-row blocks
        lp, ent = portable.linear_logprobs(h, w, t, bias, 0.8, True)
    fused = torch.autograd.grad((lp, ent), (h, w, bias), (glp, gent))
    logits = portable.linear(h, w, bias)
    lp2, ent2 = portable.logprobs(logits, t, 0.8, True)
    unfused = torch.autograd.grad((lp2, ent2), (h, w, bias), (glp, gent))
    assert torch.equal(_f32_bits(lp), _f32_bits(lp2))
    assert torch.equal(_f32_bits(ent), _f32_bits(ent2))
    for a, b in zip(fused, unfused):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_attention_decode_equals_training_with_odd_lengths():
    g = torch.Generator().manual_seed(6)
    n, hq, hk, d = 71, 4, 1, 24  # several KV tiles and query blocks, MQA, head dim not 2^k
    q = torch.randn(n, hq, d, generator=g).half()
    k = torch.randn(n, hk, d, generator=g).half()
    v = torch.randn(n, hk, d, generator=g).half()
    cu = torch.tensor([0, n], dtype=torch.int32)
    train = portable.attention(q, k, v, cu, cu, True, 0.3)
    for pos in (0, 31, 32, 63, 64, 70):
        cq = torch.tensor([0, 1], dtype=torch.int32)
        ck = torch.tensor([0, pos + 1], dtype=torch.int32)
        out = portable.attention(q[pos : pos + 1], k[: pos + 1], v[: pos + 1], cq, ck, True, 0.3)
        assert torch.equal(out.view(torch.int16), train[pos : pos + 1].view(torch.int16)), pos


@pytest.fixture
def ascend_on_cpu():
    """The ascend backend (portable code, no torch_npu) registered for CPU under a test name."""
    spec = rlk.BackendSpec(
        name=TEST_NAME,
        priority=-1,
        device_types=("cpu",),
        is_available=lambda: (True, ""),
        load=lambda: make_impl(fused=()),
        distribution="rlk-ascend (test registration)",
    )
    plugin = types.SimpleNamespace(rlk_backends=rlk.hookimpl(lambda: [spec]))
    selection.reset_registry(extra_plugins=[plugin])
    yield TEST_NAME
    selection.reset_registry()


def test_public_ops_run_on_the_cpu_registration(ascend_on_cpu):
    x = torch.randn(2, 3, 64)
    w = torch.randn(32, 64)
    with rlk.use_backend(ascend_on_cpu):
        y = rlk.linear(x, w)
    with rlk.use_backend("reference"):
        want = rlk.linear(x, w)
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4)


def test_conformance_quick_on_cpu(ascend_on_cpu):
    from rlk import testing

    report = testing.run_conformance(backend=ascend_on_cpu, ops=rlk.OPS, device="cpu", quick=True)
    assert report.ok, testing.format_table(report)
    status = {(r.op, r.check): r.status for r in report.rows}
    # Every op passes accuracy, determinism and (where it has meaning) batch invariance ...
    for op in rlk.OPS:
        assert status[(op, "accuracy")] == "pass", op
        assert status[(op, "determinism")] == "pass", op
        if op not in ("policy_loss", "value_loss"):  # losses of the whole batch
            assert status[(op, "batch_invariance")] == "pass", op
    # ... the tunable ops prove their configs give the same bits, and every second path is
    # bitwise equal (attention: training/prefill/chunked/decode; paged; fused logprobs).
    for op in portable.TUNABLE:
        assert status[(op, "tuning_invariance")] == "pass", op
    for op in ("attention", "paged_attention", "linear_logprobs", "rms_norm"):
        assert status[(op, "path_invariance")] == "pass", op


def test_logprobs_with_masked_logits_are_finite():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 50, generator=g)
    logits[:, 10:20] = -torch.inf
    logits = logits.requires_grad_()
    t = torch.tensor([0, 5, 30, 49])
    lp, ent = portable.logprobs(logits, t, 1.3, True)
    lp_ref, ent_ref = rlk_reference.logprobs(logits.detach(), t, 1.3, True)
    assert torch.allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ent, ent_ref, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad((lp.sum() + ent.sum(),), (logits,))
    assert torch.isfinite(grad).all()
    assert (grad[:, 10:20] == 0).all()


@pytest.mark.parametrize("name", list(bad_inputs.VALUE_CASES))
def test_bad_per_row_value_gives_the_required_outcome(ascend_on_cpu, name):
    # With the host's value checks off (as on an NPU without RLK_VALIDATE): a row with an
    # invalid sampling parameter draws -1, a loss mask value other than 0 or 1 gives NaN.
    with rlk.use_backend(ascend_on_cpu):
        got, detail = bad_inputs.run(name, "cpu")
    assert got == bad_inputs.CASES[name][1], f"{name}: {detail}"


@pytest.mark.parametrize("value", [0.5, float("nan"), 2.0])
def test_a_loss_mask_value_not_0_or_1_is_a_nan_log_prob(value):
    g = torch.Generator().manual_seed(3)
    lp = (torch.randn(3, 7, generator=g) - 1).requires_grad_()
    old, adv = torch.randn(3, 7, generator=g) - 1, torch.randn(3, generator=g)
    mask = torch.ones(3, 7)
    mask[1, 2] = value
    loss, _ = portable_losses.policy_loss(lp, old, adv, mask)
    loss.backward()
    want = lp.detach().double().requires_grad_()
    want_loss, _ = rlk_reference.policy_loss(want, old, adv, mask)
    want_loss.backward()
    assert loss.isnan() and want_loss.isnan()
    assert torch.equal(lp.grad.isnan(), want.grad.isnan()) and lp.grad[1, 2].isnan()
