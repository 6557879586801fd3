"""Worker of the FSDP2 tests in test_fsdp.py (importable by name for torch.multiprocessing).

Each rank loads the reference file the test wrote (initial weights, samples, the unsharded
model's log-probs, gradients and updated weights), shards the model with
``training.shard_model`` and checks its own packed micro-batch and one GRPO step against it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlk_integrations.engine import training
from rlk_integrations.models import transformers as rt
from rlk_integrations.tools import zoo

MODEL = "tiny"
LR = 0.5
GROUP = 2


def build(state: dict, device: str) -> torch.nn.Module:
    model = zoo.load_model(MODEL, dtype=torch.float32, device=device)
    model.load_state_dict(state)
    return rt.patch_model(model).train()


def step(model, samples, rewards, micro_batch_size):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = training.grpo_step(model, opt, samples, rewards, GROUP, micro_batch_size)
    return out


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _sharded_step(ref, rank, world, device, mesh):
    from torch.distributed.tensor import DTensor

    model = training.shard_model(build(ref["init"], device), mesh=mesh)
    assert isinstance(model.lm_head.weight, DTensor), "lm_head not sharded"
    assert isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor), "layer not sharded"
    mine = ref["samples"][rank::world]
    rewards = ref["rewards"][rank::world].contiguous().to(device)
    with torch.no_grad():
        lps = training.packed_logprobs(model, mine)  # this rank's samples, packed in one row
    out = step(model, mine, rewards, micro_batch_size=len(mine))
    grads = {n: _full(p.grad).cpu() for n, p in model.named_parameters()}
    params = {n: _full(p.detach()).cpu() for n, p in model.named_parameters()}
    return lps, out, grads, params


def worker(rank, world, init_file, ref_file, device_type):
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        device = "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        mesh = init_device_mesh(device_type, (world,))
        ref = torch.load(ref_file, weights_only=False)
        tag = f"rank {rank}/{world}"
        runs = [_sharded_step(ref, rank, world, device, mesh) for _ in range(2)]
        lps, out, grads, params = runs[0]
        # Log-probs of a sequence depend only on the sequence: the sharded model's packed
        # micro-batch gives the unsharded model's bits for each sequence (recomputed alone).
        for i, lp in zip(range(rank, len(ref["samples"]), world), lps):
            assert torch.equal(lp.cpu(), ref["logprobs"][i]), f"{tag}: sample {i} log-probs"
        assert out["max_abs_dlogp"] == 0.0, f"{tag}: {out}"
        # The step is deterministic: a second run from the same weights gives the same bits.
        for n in params:
            assert torch.equal(runs[1][2][n], grads[n]), f"{tag}: {n} grad not deterministic"
            assert torch.equal(runs[1][3][n], params[n]), f"{tag}: {n} step not deterministic"
        # Gradients: the reduce-scatter sums the ranks' gradients in the collective's order, and
        # a weight gradient sums over the tokens of its micro-batch (the reference packs other
        # micro-batches), so they match the one-process step to fp32 rounding, not bitwise.
        assert set(grads) == set(ref["grads"]), f"{tag}: parameter names differ"
        for n, g in grads.items():
            torch.testing.assert_close(g, ref["grads"][n], rtol=1e-5, atol=1e-7, msg=n)
            torch.testing.assert_close(params[n], ref["params"][n], rtol=1e-5, atol=1e-7, msg=n)
            assert not torch.equal(params[n], ref["init"][n]), f"{tag}: {n} did not move"
    finally:
        dist.destroy_process_group()
