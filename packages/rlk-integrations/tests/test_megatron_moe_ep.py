"""Megatron-core's MoE layer on rlk at expert parallelism 2 (Megatron's EP group, gloo on CPU,
two spawned processes; slow): each rank holds half of tiny-qwen3-moe's experts and runs its own
sequences, the tokens reach their experts through ``rlk.parallel.expert_parallel_moe_experts``'s
all-to-alls, and every rank's packed log-probs equal rlk's one-device transformers model bit for
bit; the last MoE layer's expert gradients equal that device's for the two ranks' batches
concatenated in rank order."""

from __future__ import annotations

import pytest
import torch

import rlk  # noqa: F401  (first: it picks Triton's CPU interpreter before Megatron imports triton)

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from ep_workers import spawn  # noqa: E402
from test_consistency_megatron import _samples  # noqa: E402

from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

NAME = "tiny-qwen3-moe"
#: (prompt, response) lengths of each rank's sequences: uneven token counts.
LENGTHS = [[(3, 5), (6, 2)], [(2, 4), (5, 3), (4, 4)]]


def _last_experts(name: str, cfg) -> bool:
    return name.startswith(f"decoder.layers.{cfg.num_hidden_layers - 1}.mlp.experts.")


def ep_worker(rank, world):
    """This rank of an EP group of ``world``: (its log-probs, its last MoE layer's expert
    gradients by Megatron name, the experts its tokens were routed to)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    from rlk_integrations.adapters import megatron as rm

    teardown = rm.init_model_parallel(1, world)
    try:
        hf = zoo.load_model(NAME, dtype=torch.bfloat16)  # seeded: the same weights everywhere
        mg = rm.build_gpt_model(hf.config, dtype=torch.bfloat16)
        rm.load_hf_weights(mg, hf.state_dict(), hf.config, ep_rank=rank, ep_world_size=world)
        assert len(mg.decoder.layers[0].mlp.experts.local_experts) == hf.config.num_experts // world
        samples = _samples(LENGTHS[rank], hf.config.vocab_size, seed=10 + rank)
        with rm.RoutingLog(mg) as log:
            lps = rm.packed_logprobs(mg, samples)
        torch.cat(lps).sum().backward()
        grads = {k: p.grad for k, p in mg.named_parameters() if _last_experts(k, hf.config)}
        return [lp.detach() for lp in lps], grads, set(log.calls[0][2].flatten().tolist())
    finally:
        teardown()


@pytest.mark.slow
def test_megatron_moe_ep2_equals_one_device():
    world = 2
    results = spawn(ep_worker, world)
    from rlk_integrations.adapters import megatron as rm

    hf = rt.patch_model(zoo.load_model(NAME, dtype=torch.bfloat16))
    cfg = hf.config
    per_rank = [_samples(LENGTHS[r], cfg.vocab_size, seed=10 + r) for r in range(world)]
    # One device, the ranks' batches concatenated in rank order: each sequence's log-probs
    # (batch-invariant, so those of any batch) and the expert gradients EP must reproduce.
    ref = training.packed_logprobs(hf, per_rank[0] + per_rank[1])
    torch.cat(ref).sum().backward()
    ref = [lp.detach() for lp in ref]
    for r, (lps, _, _) in enumerate(results):
        mine = ref[: len(LENGTHS[0])] if r == 0 else ref[len(LENGTHS[0]) :]
        for a, b in zip(lps, mine, strict=True):
            assert torch.equal(a, b), (r, (a - b).abs().max())
    # Rank 0's tokens reach rank 1's experts (and back): the all-to-all really ran.
    assert any(e >= cfg.num_experts // world for e in results[0][2])
    full = rm.hf_to_megatron({k: p.grad for k, p in hf.named_parameters()}, cfg)
    for r, (_, grads, _) in enumerate(results):
        want = rm.shard_for_ep(full, cfg, rank=r, world_size=world)
        assert len(grads) == 2 * cfg.num_experts // world
        for key, g in grads.items():
            assert torch.equal(g, want[key]), (r, key)
