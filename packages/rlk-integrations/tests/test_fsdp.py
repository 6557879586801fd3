"""FSDP2 data-parallel training on rlk (training.shard_model).

Two spawned processes (gloo on CPU; NCCL on two GPUs) shard the tiny patched model with
``fully_shard`` per decoder layer and at the root. Each rank recomputes its own packed
micro-batch: the log-probs must equal, bit for bit, the unsharded model's for the same sequences
(each recomputed alone, in one process). Then one GRPO step: deterministic (two runs, same
bits), and its gradients and weights match the unsharded step on the whole batch to fp32
tolerance -- not bitwise, since the reduce-scatter sums the ranks' gradients in its own order.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # spawned gloo processes

from fsdp_workers import MODEL, build, step, worker  # noqa: E402

from rlk_integrations.engine import training  # noqa: E402
from rlk_integrations.engine.engines import Sample  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

WORLD = 2
VOCAB = 512


def _reference(path, device):
    """Samples, and the unsharded model's log-probs / GRPO gradients / updated weights."""
    g = torch.Generator().manual_seed(11)
    init = zoo.load_model(MODEL, dtype=torch.float32, seed=3).state_dict()
    model = build(init, device)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    # Same response length everywhere: each rank's token mean then averages to the global one.
    samples = [Sample(rand(n), rand(3), torch.empty(0)) for n in (5, 3, 4, 6)]
    with torch.no_grad():
        lps = training.recompute_logprobs(model, samples, 1)  # each sequence alone
    for s, lp in zip(samples, lps):
        s.logprobs = lp.cpu()
    # Rank r gets samples r::WORLD; GRPO groups (pairs) must live on one rank.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])[: len(samples)]
    order = [r + WORLD * i for r in range(WORLD) for i in range(len(samples) // WORLD)]
    samples_by_rank = [samples[i] for i in order]
    rewards_by_rank = rewards[order]
    out = step(model, samples_by_rank, rewards_by_rank.to(device), micro_batch_size=1)
    assert out["max_abs_dlogp"] == 0.0
    ref = dict(
        init=init,
        samples=samples,
        rewards=rewards,
        logprobs=[s.logprobs for s in samples],
        grads={n: p.grad.cpu() for n, p in model.named_parameters()},
        params={n: p.detach().cpu() for n, p in model.named_parameters()},
    )
    torch.save(ref, path)


def _run(tmp_path, device_type):
    ref_file = tmp_path / "ref.pt"
    _reference(ref_file, "cuda:0" if device_type == "cuda" else "cpu")
    args = (WORLD, str(tmp_path / "pg"), str(ref_file), device_type)
    mp.spawn(worker, args=args, nprocs=WORLD, join=True)


def test_fsdp2_cpu_gloo(tmp_path):
    _run(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
def test_fsdp2_gpus_nccl(tmp_path):
    _run(tmp_path, "cuda")
