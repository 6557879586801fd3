"""Fused q/k/v and gate/up projections (:mod:`rlk_integrations.engine.fused`): the parameters view
one buffer per group, the fused products are the separate products' bits, a moved parameter turns
its group off until it is fused again, and the paged rollout gives the same bits either way."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from rlk_integrations.engine import fused, paged  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402


def _model(name="tiny"):
    return rt.patch_model(zoo.load_model(name, dtype=torch.bfloat16))


def _x(model, rows=5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, rows, model.config.hidden_size, generator=g).to(torch.bfloat16)


def test_fuse_moves_the_weights_into_one_buffer_per_group():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = model.model.layers
    assert fused.fused(layers[0].self_attn) is None
    assert fused.fuse_projections(model) == 2 * len(layers)
    for k, v in model.state_dict().items():  # the values and the state dict's keys unchanged
        assert torch.equal(v, before[k]), k
    attn, mlp = layers[0].self_attn, layers[0].mlp
    f = fused.fused(attn)
    assert f.splits == (attn.q_proj.out_features, attn.k_proj.out_features,
                        attn.v_proj.out_features)  # fmt: skip
    rows = f.weight.shape[1] * f.weight.element_size()
    assert attn.q_proj.weight.data_ptr() == f.weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == f.weight.data_ptr() + f.splits[0] * rows
    assert fused.fused(mlp).weight.shape[0] == 2 * mlp.up_proj.out_features
    assert fused.fuse_projections(model) == 2 * len(layers)  # current groups are kept
    assert fused.fused(attn) is f


def test_a_fused_model_saves_and_loads(tmp_path):
    """save_pretrained handles the groups' shared storage (disjoint views of one buffer)."""
    model = _model()
    fused.fuse_projections(model)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = model.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_fused_products_are_the_separate_products_bits():
    model = _model()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = _x(model)
    with torch.no_grad():
        want_qkv = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        want_mlp = mlp(x)
        fused.fuse_projections(model)
        for got, want in zip(fused.qkv(attn, x), want_qkv):
            assert torch.equal(got, want)
        assert torch.equal(fused.mlp(mlp, x), want_mlp)
        # An in-place update (an optimizer step, load_state_dict) reaches the fused product.
        attn.k_proj.weight.mul_(0.5)
        assert torch.equal(fused.qkv(attn, x)[1], attn.k_proj(x))


def test_a_moved_parameter_unfuses_its_group_until_fused_again():
    model = _model()
    attn = model.model.layers[0].self_attn
    x = _x(model)
    fused.fuse_projections(model)
    with torch.no_grad():
        attn.v_proj.weight.data = attn.v_proj.weight.data * 2  # replaced, not updated in place
        assert fused.fused(attn) is None
        q, k, v = fused.qkv(attn, x)  # the separate projections, the new weight
        assert torch.equal(v, attn.v_proj(x))
        assert fused.fuse_projections(model) == 2 * len(model.model.layers)
        f = fused.fused(attn)
        assert f is not None and attn.v_proj.weight.data_ptr() > f.weight.data_ptr()
        assert torch.equal(fused.qkv(attn, x)[2], v)
    rt.unpatch_model(model)
    assert not hasattr(attn, "_rlk_fused")


def test_fuse_needs_a_patched_model_and_skips_other_projections():
    with pytest.raises(ValueError, match="patched"):
        fused.fuse_projections(zoo.load_model("tiny", dtype=torch.bfloat16))
    model = _model()
    attn = model.model.layers[0].self_attn
    del attn.k_proj.forward  # not run by rlk.linear: its group stays as it is
    assert fused.fuse_projections(model) == 2 * len(model.model.layers) - 1
    assert fused.fused(attn) is None


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_paged_rollout_fused_equals_unfused(name):
    # tiny-qwen3: its q/k norms read the heads of the fused product in place.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 11, 3, 8)]
    kw = dict(seeds=[1, 2, 3, 4], page_size=4, max_batch=2, max_step_tokens=6, prefill_chunk=4)
    model = _model(name)
    plain = paged.generate_paged(model, prompts, 6, fuse_projections=False, **kw)
    assert fused.fused(model.model.layers[0].self_attn) is None
    ro = paged.generate_paged(model, prompts, 6, **kw)
    assert fused.fused(model.model.layers[0].self_attn) is not None
    for a, b in zip(plain.samples, ro.samples):
        assert a.response == b.response
        assert torch.equal(a.logprobs, b.logprobs)
    # An engine that does not fuse runs the separate products on a fused model too.
    assert not paged.PagedEngine(model, max_len=8, fuse_projections=False).cache.fuse_projections
    with pytest.raises(TypeError, match="fuse_projections"):
        paged.PagedEngine(model, max_len=8, fuse_projections=1)
