"""Default mode (no host value checks, as for a CUDA tensor without RLK_VALIDATE) on the Triton
kernels, under the interpreter: every bad index input of rlk.testing.bad_inputs is reported
(ValueError on CPU) and touches no memory out of range; the rows it leaves without a value are
NaN (rlk_triton._bounds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import rlk
from rlk.testing import bad_inputs
from rlk_triton import _bounds

I32 = torch.int32


@pytest.fixture(autouse=True)
def triton_backend():
    with rlk.use_backend("triton"):
        yield


@pytest.mark.parametrize("name", list(bad_inputs.CASES))
def test_bad_input_gives_the_required_outcome(name):
    want = bad_inputs.CASES[name][1]
    got, detail = bad_inputs.run(name, "cpu")
    assert got == want, f"{name}: {detail}"


@pytest.fixture
def unreported(monkeypatch):
    """The flags the kernels clear, kept instead of raised, to look at the outputs."""
    flags = []
    monkeypatch.setattr(_bounds, "report", lambda ok, message: flags.append(int(ok.item())))
    return flags


def _ref_attention(q, k, v, cu_q, cu_k):
    with rlk.use_backend("reference"):
        return rlk.attention(q, k, v, cu_q, cu_k)


def test_bad_sequence_rows_are_nan_and_good_ones_exact(unreported):
    q, k, v = (torch.randn(n, h, 16) for n, h in ((6, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=I32), torch.tensor([0, 3, 9], dtype=I32)
    good = rlk.attention(q, k, v, cu_q, cu_k)
    assert unreported == [1]
    unreported.clear()
    # The second sequence claims 3 more keys than k has: its rows are NaN, the first's intact.
    with bad_inputs.default_mode():
        o = rlk.attention(q, k, v, cu_q, torch.tensor([0, 3, 12], dtype=I32))
    assert unreported == [0]
    assert torch.equal(o[:2], good[:2]) and o[2:].isnan().all()
    # Offsets ending before q does: the rows no sequence covers are NaN.
    with bad_inputs.default_mode():
        o = rlk.attention(q, k, v, torch.tensor([0, 2, 4], dtype=I32), cu_k)
    assert unreported == [0, 0] and o[4:].isnan().all()


def test_a_sequence_beyond_its_length_bound_is_nan_to_its_end(unreported):
    # The grid covers max_seqlen_q = 20 queries of each sequence: the 150-token sequence's rows
    # past them have no program of their own, and must still be NaN, not left unwritten.
    q, k, v = (torch.randn(160, h, 16) for h in (4, 2, 2))
    cu = torch.tensor([0, 150, 160], dtype=I32)
    good = rlk.attention(q, k, v, cu, cu)
    loose = rlk.attention(q, k, v, cu, cu, max_seqlen_q=400, max_seqlen_k=160)
    assert unreported == [1, 1] and torch.equal(loose, good)  # a loose bound: the same bits
    unreported.clear()
    with bad_inputs.default_mode():
        o = rlk.attention(q, k, v, cu, cu, max_seqlen_q=20, max_seqlen_k=160)
    assert unreported == [0]
    assert o[:150].isnan().all() and torch.equal(o[150:], good[150:])
    with pytest.raises(ValueError, match="max_seqlen_q = 20 but a sequence has 150 tokens"):
        rlk.attention(q, k, v, cu, cu, max_seqlen_q=20, max_seqlen_k=160)


def test_rows_that_see_a_bad_page_are_nan(unreported):
    kc, vc = torch.randn(4, 16, 2, 16), torch.randn(4, 16, 2, 16)
    q = torch.randn(40, 4, 16)
    lens = torch.tensor([40], dtype=I32)
    cu_q = torch.tensor([0, 40], dtype=I32)
    good = rlk.paged_attention(q, kc, vc, torch.tensor([[0, 1, 2]], dtype=I32), lens, cu_q)
    unreported.clear()
    with bad_inputs.default_mode():
        o = rlk.paged_attention(q, kc, vc, torch.tensor([[0, 1, 9]], dtype=I32), lens, cu_q)
    # Keys 32..39 are on page 9 of 4: queries at positions 32.. see it, the others do not.
    assert unreported == [0]
    assert torch.equal(o[:32], good[:32]) and o[32:].isnan().all()


def test_out_of_range_targets_give_nan_values_and_gradients(unreported):
    logits = torch.randn(3, 50, requires_grad=True)
    with bad_inputs.default_mode():
        lp = rlk.logprobs(logits, torch.tensor([4, 50, -1]))
    lp.sum().backward()
    assert unreported == [0]
    assert lp[0].isfinite() and lp[1:].isnan().all()
    assert logits.grad[0].isfinite().all() and logits.grad[1:].isnan().all()


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bad_inputs.py"
    spec = importlib.util.spec_from_file_location("bad_inputs_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_script_summary_reads_case_and_sanitizer_logs(tmp_path):
    script = _script()
    names = list(bad_inputs.CASES)[:5]
    assert all(bad_inputs.CASES[n][1] == "error" for n in names[1:])
    logs = {
        names[0]: "RESULT ok: returned (5, 4, 16), 0 NaN\n========= ERROR SUMMARY: 0 errors\n",
        names[1]: (
            "========= Invalid __global__ write of size 2 bytes\n"
            "RESULT error: RuntimeError: CUDA error: device-side assert triggered\n"
            "========= ERROR SUMMARY: 1 error\n"
        ),
        names[2]: "",  # the process died before printing anything
        # The bad input reported by a device-side assertion, which the sanitizer counts as an
        # error; the process aborted before its RESULT line.
        names[3]: (
            "========= Warp assert\n========= ERROR SUMMARY: 1 error\n"
            "TensorCompare.cu:109: block: [0,0,0] Assertion `attention: out of range` failed.\n"
        ),
        # An assertion and an access error: fails.
        names[4]: (
            "========= Warp assert\n========= Invalid __global__ read of size 4 bytes\n"
            "RESULT error: AcceleratorError: device-side assert triggered\n"
            "========= ERROR SUMMARY: 2 errors\n"
        ),
    }
    for i, name in enumerate(names):
        (tmp_path / f"{i:02d}.log").write_text(f"CASE {name}\n" + logs[name])
    rows = script.summarize(tmp_path)
    assert [r["case"] for r in rows] == names
    assert rows[0]["verdict"] == "pass" and rows[0]["memcheck"] == "0"
    assert rows[1]["verdict"] == "FAIL" and rows[1]["memcheck"] == "1"
    assert rows[2]["verdict"] == "FAIL" and rows[2]["outcome"] == "no result"
    assert rows[3]["verdict"] == "pass" and rows[3]["outcome"] == "error"
    assert rows[3]["asserts"] == 1 and "attention: out of range" in rows[3]["detail"]
    assert rows[4]["verdict"] == "FAIL" and rows[4]["access_errors"] == 1
    assert script.table(rows).splitlines()[-1] == "2 passed, 3 failed"


def test_script_runs_every_case_on_cpu(tmp_path):
    script = _script()
    assert script.main(["--device", "cpu", "--logs", str(tmp_path)]) == 0
    rows = script.summarize(tmp_path)
    assert len(rows) == len(bad_inputs.CASES)
    assert all(r["verdict"] == "pass" for r in rows), script.table(rows)


def _loss_and_grad(backend, lp, old, adv, mask):
    lp = lp.detach().requires_grad_()
    with rlk.use_backend(backend):
        loss, metrics = rlk.policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean")
    loss.backward()
    return loss, lp.grad


@pytest.mark.parametrize("value", [0.5, float("nan"), 2.0, -1.0])
def test_a_loss_mask_value_not_0_or_1_counts_as_a_nan_log_prob(value):
    # As in the reference: the loss is NaN, the gradient NaN at that token (and where a NaN
    # log-prob there would make it NaN), the rest of the gradient as with a valid mask.
    g = torch.Generator().manual_seed(3)
    lp, old = torch.randn(3, 7, generator=g) - 1, torch.randn(3, 7, generator=g) - 1
    adv = torch.randn(3, generator=g)
    mask = torch.ones(3, 7)
    mask[:, 5:] = 0
    mask[1, 2] = value
    with bad_inputs.default_mode():
        loss, grad = _loss_and_grad("triton", lp, old, adv, mask)
        want_loss, want_grad = _loss_and_grad("reference", lp, old, adv, mask)
    assert loss.isnan() and want_loss.isnan()
    assert torch.equal(grad.isnan(), want_grad.isnan()) and grad[1, 2].isnan()
    finite = ~want_grad.isnan()
    torch.testing.assert_close(grad[finite], want_grad[finite].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("name", list(bad_inputs.VALUE_CASES))
def test_gpu_bad_value_gives_the_required_outcome(name, backend):
    # Default mode on the GPU (no host read of the values): each in this process, since none
    # of them ends the CUDA context.
    want = bad_inputs.CASES[name][1]
    with rlk.use_backend(backend):
        got, detail = bad_inputs.run(name, "cuda")
    assert got == want, f"{name}: {detail}"
