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

from ep_workers import megatron_ep_worker, spawn  # noqa: E402
from test_consistency_megatron import _samples  # noqa: E402

from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

NAME = "tiny-qwen3-moe"
#: (prompt, response) lengths of each rank's sequences: uneven token counts.
LENGTHS = [[(3, 5), (6, 2)], [(2, 4), (5, 3), (4, 4)]]


@pytest.mark.slow
def test_megatron_moe_ep2_equals_one_device():
    world = 2
    # (the worker lives in ep_workers: spawned children import it by name, never this file)
    results = spawn(megatron_ep_worker, world, NAME, LENGTHS)
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
